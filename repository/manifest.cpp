// manifest.json and kernmap.lock: strict parsing (unknown fields are errors) and path containment.
#include "repository/manifest.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <system_error>

namespace kernmap::repository {
namespace {

using nlohmann::json;

std::string shown(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text + " (" + value.type_name() + ")";
}

[[noreturn]] void fail(const std::string& file, const std::string& field, const std::string& expected,
                       const std::string& got) {
  throw FormatError(file + ": " + field + ": expected " + expected + ", got " + got);
}

// nlohmann takes a NUL byte for the end of its input, so "{...}\0anything" would parse as "{...}". JSON text
// holds no raw NUL (in a string it is spelled \u0000), so one anywhere is refused before parsing.
json parse_json(std::string_view text, const std::string& file) {
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos)
    throw FormatError(file + ": a NUL byte at offset " + std::to_string(nul) +
                      " (JSON text cannot hold one)");
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    throw FormatError(file + ": not valid JSON: " + e.what());
  }
}

// Checks that `object` is an object whose keys are all in `allowed` and that every key of `required` is
// there.
void check_keys(const json& object, const std::string& file, const std::string& field,
                std::initializer_list<const char*> allowed, std::initializer_list<const char*> required) {
  if (!object.is_object()) fail(file, field.empty() ? "top level" : field, "an object", shown(object));
  std::string names;
  for (const char* a : allowed) names += (names.empty() ? "" : ", ") + std::string(a);
  const std::string prefix = field.empty() ? "" : field + ".";
  for (const auto& [key, value] : object.items()) {
    bool known = false;
    for (const char* a : allowed) known = known || key == a;
    if (!known) fail(file, prefix + key, "no such field (known fields: " + names + ")", "an unknown field");
  }
  for (const char* r : required) {
    if (!object.contains(r)) fail(file, prefix + r, "a required field", "nothing (field missing)");
  }
}

std::string string_field(const json& object, const std::string& file, const std::string& field,
                         const char* key, bool allow_empty = false) {
  const json& value = object.at(key);
  if (!value.is_string()) fail(file, field, "a string", shown(value));
  std::string s = value.get<std::string>();
  if (!allow_empty && s.empty()) fail(file, field, "a non-empty string", "\"\"");
  return s;
}

bool is_sha256_hex(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool is_major_minor(const std::string& s) {
  const auto dot = s.find('.');
  if (dot == std::string::npos || dot == 0 || dot + 1 == s.size() || s.size() > 16) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i != dot && !(s[i] >= '0' && s[i] <= '9')) return false;
  }
  return true;
}

std::string sha256_field(const json& value, const std::string& file, const std::string& field) {
  if (!value.is_string() || !is_sha256_hex(value.get<std::string>())) {
    fail(file, field, "64 lowercase hex digits (a sha256)", shown(value));
  }
  return value.get<std::string>();
}

Variant parse_variant(const json& j, const std::string& file, const std::string& field) {
  check_keys(j, file, field, {"library", "sha256", "torch", "cxx11_abi", "arch", "os", "toolkits"},
             {"library", "sha256", "torch", "cxx11_abi", "arch", "os"});
  Variant v;
  v.library = string_field(j, file, field + ".library", "library");
  check_library_path(v.library, file, field + ".library");
  v.sha256 = sha256_field(j.at("sha256"), file, field + ".sha256");
  v.torch = string_field(j, file, field + ".torch", "torch");
  if (!is_major_minor(v.torch))
    fail(file, field + ".torch", "major.minor such as \"2.15\"", shown(j.at("torch")));
  if (!j.at("cxx11_abi").is_boolean())
    fail(file, field + ".cxx11_abi", "true or false", shown(j.at("cxx11_abi")));
  v.cxx11_abi = j.at("cxx11_abi").get<bool>();
  v.arch = string_field(j, file, field + ".arch", "arch");
  v.os = string_field(j, file, field + ".os", "os");
  if (j.contains("toolkits")) {
    const json& t = j.at("toolkits");
    if (!t.is_object()) fail(file, field + ".toolkits", "an object {toolkit: version}", shown(t));
    for (const auto& [name, version] : t.items()) {
      const std::string where = field + ".toolkits." + name;
      if (name.empty()) fail(file, field + ".toolkits", "non-empty toolkit names", "\"\"");
      if (!version.is_string() || version.get<std::string>().empty())
        fail(file, where, "a non-empty version string such as \"8.0\"", shown(version));
      v.toolkits.emplace(name, version.get<std::string>());
    }
  }
  return v;
}

}  // namespace

bool is_package_name(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  const auto alnum = [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); };
  if (!alnum(name[0])) return false;
  for (char c : name) {
    if (!alnum(c) && c != '_' && c != '.' && c != '-') return false;
  }
  return true;
}

void check_library_path(const std::string& path, const std::string& file, const std::string& field) {
  const std::string got = "\"" + path + "\"";
  if (path.empty()) fail(file, field, "a path relative to the package folder", "\"\"");
  if (path.find('\0') != std::string::npos) fail(file, field, "a path without NUL characters", got);
  if (path.find('\\') != std::string::npos) fail(file, field, "'/' as the separator (no backslash)", got);
  if (path[0] == '/') fail(file, field, "a path relative to the package folder, not an absolute path", got);
  size_t start = 0;
  while (start <= path.size()) {
    const size_t end = std::min(path.find('/', start), path.size());
    const std::string part = path.substr(start, end - start);
    if (part == "..") fail(file, field, "a path inside the package folder (no '..' component)", got);
    if (part == "." || part.empty()) fail(file, field, "a normalized path (no '.' or empty component)", got);
    start = end + 1;
  }
}

std::string resolve_inside(const std::string& package_dir, const std::string& relative,
                           const std::string& file, const std::string& field) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path root = fs::canonical(package_dir, ec);
  if (ec)
    throw FormatError(file + ": package folder '" + package_dir + "' cannot be resolved: " + ec.message());
  const fs::path target = fs::canonical(fs::path(package_dir) / relative, ec);
  if (ec) {
    throw FormatError(file + ": " + field + ": library '" + relative + "' not found in '" + root.string() +
                      "': " + ec.message());
  }
  const auto [root_end, unused] = std::mismatch(root.begin(), root.end(), target.begin(), target.end());
  if (root_end != root.end() || target == root) {
    fail(file, field, "a library inside the package folder '" + root.string() + "'",
         "\"" + relative + "\", which resolves to '" + target.string() +
             "' (a symlink that leaves the folder)");
  }
  return target.string();
}

Manifest parse_manifest(std::string_view text, const std::string& file) {
  const json j = parse_json(text, file);
  check_keys(j, file, "", {"name", "version", "plugin_abi", "description", "variants"},
             {"name", "version", "plugin_abi", "variants"});
  Manifest m;
  m.name = string_field(j, file, "name", "name");
  if (!is_package_name(m.name)) {
    fail(file, "name", "1-64 characters of [a-z0-9_.-] starting with a letter or digit", shown(j.at("name")));
  }
  m.version = string_field(j, file, "version", "version");
  const json& abi = j.at("plugin_abi");
  if (!abi.is_number_integer()) fail(file, "plugin_abi", "an integer", shown(abi));
  m.plugin_abi = abi.get<long long>();
  if (j.contains("description")) m.description = string_field(j, file, "description", "description", true);
  const json& variants = j.at("variants");
  if (!variants.is_array() || variants.empty()) fail(file, "variants", "a non-empty array", shown(variants));
  for (size_t i = 0; i < variants.size(); ++i)
    m.variants.push_back(parse_variant(variants[i], file, "variants[" + std::to_string(i) + "]"));
  return m;
}

Lock parse_lock(std::string_view text, const std::string& file) {
  const json j = parse_json(text, file);
  check_keys(j, file, "", {"lock_version", "packages"}, {"lock_version", "packages"});
  const json& version = j.at("lock_version");
  if (!version.is_number_integer() || version.get<long long>() != Lock::kVersion) {
    fail(file, "lock_version", std::to_string(Lock::kVersion), shown(version));
  }
  const json& packages = j.at("packages");
  if (!packages.is_object()) fail(file, "packages", "an object {name: {version, sha256}}", shown(packages));
  Lock lock;
  for (const auto& [name, entry] : packages.items()) {
    const std::string field = "packages." + name;
    if (!is_package_name(name)) {
      fail(file, "packages", "package names of 1-64 characters of [a-z0-9_.-]", "\"" + name + "\"");
    }
    check_keys(entry, file, field, {"version", "sha256"}, {"version", "sha256"});
    LockedPackage p;
    p.version = string_field(entry, file, field + ".version", "version");
    const json& hashes = entry.at("sha256");
    if (!hashes.is_array() || hashes.empty())
      fail(file, field + ".sha256", "a non-empty array", shown(hashes));
    for (size_t i = 0; i < hashes.size(); ++i)
      p.sha256.insert(sha256_field(hashes[i], file, field + ".sha256[" + std::to_string(i) + "]"));
    lock.packages.emplace(name, std::move(p));
  }
  return lock;
}

std::string lock_to_json(const Lock& lock) {
  json packages = json::object();
  for (const auto& [name, p] : lock.packages) packages[name] = {{"version", p.version}, {"sha256", p.sha256}};
  return json{{"lock_version", Lock::kVersion}, {"packages", packages}}.dump(2) + "\n";
}

}  // namespace kernmap::repository
