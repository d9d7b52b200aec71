// Variants and the process they are matched against (repository/variant.h, process_info of
// include/kernmap/plugins.h).
#include "repository/variant.h"

#include <sys/utsname.h>

#include <cstdlib>
#include <sstream>
#include <stdexcept>

#ifndef KERNMAP_TORCH_VERSION
#error "KERNMAP_TORCH_VERSION must name the torch version kernmap is built against (CMakeLists.txt sets it)"
#endif

namespace kernmap {
namespace repository {
namespace {

std::string major_minor(const std::string& version) {
  const auto first = version.find('.');
  if (first == std::string::npos) return version;
  const auto second = version.find_first_not_of("0123456789", first + 1);
  return version.substr(0, second);
}

// "12" accepts 12.x, "12.8" accepts 12.8 and 12.8.x: the needed version's components must prefix the
// process's.
bool version_accepts(const std::string& needed, const std::string& have) {
  return have == needed || (have.size() > needed.size() && have.compare(0, needed.size(), needed) == 0 &&
                            have[needed.size()] == '.');
}

}  // namespace

std::map<std::string, std::string> parse_toolkits(const char* text) {
  std::map<std::string, std::string> out;
  if (text == nullptr) return out;
  std::stringstream list(text);
  std::string item;
  while (std::getline(list, item, ',')) {
    if (item.empty()) continue;
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
      throw std::invalid_argument(
          "KERNMAP_TOOLKITS: entry '" + item +
          "' is not of the form toolkit=version (expected e.g. \"cuda=12.8,cann=8.0\")");
    }
    out[item.substr(0, eq)] = item.substr(eq + 1);
  }
  return out;
}

std::string mismatch(const Variant& v, const ProcessInfo& p) {
  if (v.torch != p.torch) return "needs torch " + v.torch;
  if (v.cxx11_abi != p.cxx11_abi) return v.cxx11_abi ? "needs the C++11 ABI" : "needs the pre-C++11 ABI";
  if (v.arch != p.arch) return "needs arch " + v.arch;
  if (v.os != p.os) return "needs os " + v.os;
  for (const auto& [name, version] : v.toolkits) {
    const auto it = p.toolkits.find(name);
    if (it == p.toolkits.end())
      return "needs " + name + " " + version + " (this process has no " + name + ")";
    if (!version_accepts(version, it->second))
      return "needs " + name + " " + version + " (have " + it->second + ")";
  }
  return "";
}

const Variant* choose_variant(const Manifest& m, const ProcessInfo& p, std::string& why_not) {
  const Variant* chosen = nullptr;
  for (const Variant& v : m.variants) {
    const std::string miss = mismatch(v, p);
    if (miss.empty()) {
      if (chosen == nullptr || v.toolkits.size() > chosen->toolkits.size()) chosen = &v;
    } else {
      why_not += (why_not.empty() ? "" : "; ") + v.library + " " + miss;
    }
  }
  return chosen;
}

std::string describe(const Variant& v) {
  std::string out = v.library + " (torch " + v.torch + ", " + (v.cxx11_abi ? "cxx11_abi" : "pre-cxx11 abi") +
                    ", " + v.arch + ", " + v.os;
  for (const auto& [name, version] : v.toolkits) out += ", " + name + " " + version;
  return out + ")";
}

std::string describe(const ProcessInfo& p) {
  std::string out = "torch " + p.torch + ", " + (p.cxx11_abi ? "cxx11_abi" : "pre-cxx11 abi") + ", " +
                    p.arch + ", " + p.os + ", toolkits: ";
  if (p.toolkits.empty()) return out + "none";
  bool first = true;
  for (const auto& [name, version] : p.toolkits) {
    out += (first ? "" : ", ") + name + " " + version;
    first = false;
  }
  return out;
}

}  // namespace repository

ProcessInfo process_info() {
  ProcessInfo p;
  p.torch = repository::major_minor(KERNMAP_TORCH_VERSION);
  p.cxx11_abi = _GLIBCXX_USE_CXX11_ABI != 0;
  struct utsname u {};
  p.arch = uname(&u) == 0 ? u.machine : "unknown";
#if defined(__linux__)
  p.os = "linux";
#else
  p.os = "unknown";
#endif
  p.toolkits = repository::parse_toolkits(std::getenv("KERNMAP_TOOLKITS"));
  return p;
}

}  // namespace kernmap
