#include "registry/env.h"

#include <cstdlib>
#include <string_view>

namespace kernmap::detail {
namespace {

std::string_view trim(std::string_view text) {
  constexpr std::string_view kSpace = " \t\r\n";
  const auto first = text.find_first_not_of(kSpace);
  if (first == std::string_view::npos) return {};
  return text.substr(first, text.find_last_not_of(kSpace) - first + 1);
}

}  // namespace

bool disabled_by_env(const std::string& layer) {
  const char* value = std::getenv("KERNMAP_DISABLE");
  if (value == nullptr) return false;
  std::string_view rest = value;
  while (true) {
    const auto comma = rest.find(',');
    const std::string_view item = trim(rest.substr(0, comma));
    if (item == "all" || (!item.empty() && item == layer)) return true;
    if (comma == std::string_view::npos) return false;
    rest.remove_prefix(comma + 1);
  }
}

bool decision_log_enabled() {
  const char* value = std::getenv("KERNMAP_LOG");
  return value != nullptr && *value != '\0' && std::string_view(value) != "0";
}

}  // namespace kernmap::detail
