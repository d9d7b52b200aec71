// The files of a local kernel repository (docs/plugins.md): a package's manifest.json and the repository's
// kernmap.lock. Parsing and validation only, without torch, so that the fuzz target links this file alone.
// Both files are untrusted input: every error names the file, the field, what was expected and what was
// found.
#pragma once

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace kernmap::repository {

/// A malformed manifest or lock, or a library path that leaves its package folder.
class FormatError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// One build of a package's library and the process it is for.
struct Variant {
  std::string library;                          ///< relative to the package folder
  std::string sha256;                           ///< 64 lowercase hex digits
  std::string torch;                            ///< major.minor, "2.15"
  bool cxx11_abi = true;                        ///< _GLIBCXX_USE_CXX11_ABI of the build
  std::string arch;                             ///< as `uname -m`
  std::string os;                               ///< "linux"
  std::map<std::string, std::string> toolkits;  ///< accelerator toolkit -> version it needs
};

struct Manifest {
  std::string name;
  std::string version;
  long long plugin_abi = 0;
  std::string description;
  std::vector<Variant> variants;
};

struct LockedPackage {
  std::string version;
  std::set<std::string> sha256;
};

struct Lock {
  static constexpr int kVersion = 1;
  std::map<std::string, LockedPackage> packages;
};

/// Parses and validates manifest.json text; `file` names it in errors. Throws FormatError.
Manifest parse_manifest(std::string_view text, const std::string& file);
/// Parses and validates kernmap.lock text; `file` names it in errors. Throws FormatError.
Lock parse_lock(std::string_view text, const std::string& file);
/// The lock as kernmap.lock text (stable order, one trailing newline); parse_lock reads it back unchanged.
std::string lock_to_json(const Lock& lock);

/// Checks a manifest's library path lexically: relative, non-empty, no "." or ".." component, no empty
/// component, no backslash or NUL. Throws FormatError naming `field` (e.g. "variants[0].library").
void check_library_path(const std::string& path, const std::string& file, const std::string& field);

/// The real path of package_dir/relative after resolving every symlink; throws FormatError when it is not
/// inside the real path of package_dir (a symlink that escapes) or does not exist.
std::string resolve_inside(const std::string& package_dir, const std::string& relative,
                           const std::string& file, const std::string& field);

/// True for a valid package name: 1-64 characters of [a-z0-9_.-], starting with a letter or digit.
bool is_package_name(std::string_view name);

}  // namespace kernmap::repository
