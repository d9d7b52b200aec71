// libFuzzer target: arbitrary bytes as a manifest.json and as a kernmap.lock. Parsing must either return a
// value that satisfies the documented invariants or throw FormatError; anything else (a crash, a sanitizer
// report, another exception) is a bug. A parsed lock must also survive writing and reading back unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "repository/manifest.h"

namespace {

bool is_sha256(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

// An independent restatement of the path rule: every '/'-separated component is a plain name.
bool stays_inside(const std::string& path) {
  size_t start = 0;
  while (true) {
    const size_t end = path.find('/', start);
    const std::string part = path.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (part.empty() || part == "." || part == ".." || part.find('\\') != std::string::npos) return false;
    if (end == std::string::npos) return true;
    start = end + 1;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace repo = kernmap::repository;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const repo::Manifest m = repo::parse_manifest(text, "manifest.json");
    if (!repo::is_package_name(m.name) || m.version.empty() || m.variants.empty()) std::abort();
    for (const repo::Variant& v : m.variants) {
      if (!is_sha256(v.sha256) || v.library.empty() || v.library[0] == '/') std::abort();
      if (!stays_inside(v.library)) std::abort();
    }
  } catch (const repo::FormatError&) {
  }
  try {
    const repo::Lock lock = repo::parse_lock(text, "kernmap.lock");
    const std::string written = repo::lock_to_json(lock);
    const repo::Lock back = repo::parse_lock(written, "kernmap.lock");
    if (repo::lock_to_json(back) != written || back.packages.size() != lock.packages.size()) std::abort();
    for (const auto& [name, p] : back.packages) {
      if (!repo::is_package_name(name) || p.sha256.empty()) std::abort();
      for (const std::string& h : p.sha256)
        if (!is_sha256(h)) std::abort();
    }
  } catch (const repo::FormatError&) {
  }
  return 0;
}
