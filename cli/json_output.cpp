#include "cli/json_output.h"

#include <cstdio>

namespace kernmap::cli {

void print_json(const Json& doc) {
  const std::string text = doc.dump(2, ' ', false, Json::error_handler_t::replace);
  std::fputs(text.c_str(), stdout);
  std::fputc('\n', stdout);
}

}  // namespace kernmap::cli
