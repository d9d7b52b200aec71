// kernmap plugins: loading kernel packages from local kernel repositories (docs/plugins.md).
//
// A repository is a folder of package folders, each with a manifest.json, and optionally a kernmap.lock.
// Repositories come from KERNMAP_PATH (':'-separated) and from LoadOptions::paths; nothing is ever
// downloaded. For each package the loader picks the manifest variant that matches this process, verifies the
// library's sha256 (against the manifest, and against the lock when the repository has one), checks that the
// file is an ELF shared object, opens it (never closes it), checks the plugin ABI, asks its score, and lets
// it register its kernels (staged: committed only when registration succeeds and every kernel name is new).
// See include/kernmap/plugin.h for the plugin's side.
//
// A bad package never throws out of load_plugins: it lands in the report as "refused" with the reason, and
// the process keeps working (other packages still load, the registry still resolves). LoadOptions::strict
// turns refusals into a PluginError after the whole load ran.
//
// Thread safety: every function may be called from any thread; loads are serialized.
#pragma once

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernmap/export.h"

namespace kernmap {

/// What this process offers to a plugin variant.
struct KERNMAP_API ProcessInfo {
  std::string torch;  ///< major.minor of the torch kernmap was built against, "2.15"
  bool cxx11_abi = true;
  std::string arch;                             ///< uname -m
  std::string os;                               ///< "linux"
  std::map<std::string, std::string> toolkits;  ///< from KERNMAP_TOOLKITS and LoadOptions::toolkits
};

enum class PackageState { kLoaded, kSkipped, kRefused };
/// "loaded", "skipped", "refused".
KERNMAP_API std::string to_string(PackageState state);

/// One attempt to load one package folder.
struct KERNMAP_API PackageReport {
  std::string repository;  ///< the repository folder as given
  std::string folder;      ///< the package folder's name in the repository
  std::string name;        ///< the manifest's name ("" when the manifest could not be read)
  std::string version;
  std::string description;
  PackageState state = PackageState::kRefused;
  /// Why it was skipped or refused; for a loaded package, notes such as "already loaded".
  std::string reason;
  std::string variant;                ///< the chosen variant's library (relative), "" when none matched
  std::vector<std::string> offered;   ///< every variant, as "lib/x.so (torch 2.15, cxx11_abi, x86_64, linux)"
  int score = 0;                      ///< the plugin's score, when it was asked
  std::vector<std::string> kernels;   ///< kernels it registered
  std::vector<std::string> defaults;  ///< what became of each (layer, device) default it brought
};

struct KERNMAP_API RepositoryReport {
  std::string path;
  bool has_lock = false;
  std::string error;  ///< "" unless the repository could not be read (missing folder, malformed lock)
};

struct KERNMAP_API LoadReport {
  ProcessInfo process;
  std::vector<RepositoryReport> repositories;
  std::vector<PackageReport> packages;
  /// The report as JSON text ({"process", "repositories", "packages"}; fields as in the structs).
  std::string to_json() const;
  /// The packages that were refused.
  size_t refused() const;
};

struct KERNMAP_API LoadOptions {
  std::vector<std::string> paths;  ///< repositories to search (after KERNMAP_PATH when use_env_path)
  bool use_env_path = false;       ///< also search KERNMAP_PATH
  /// Toolkit versions of this process (e.g. {"cuda", "12.8"}), added to those KERNMAP_TOOLKITS names.
  std::map<std::string, std::string> toolkits;
  bool strict = false;  ///< throw PluginError when any package was refused (after loading the others)
};

/// Thrown by load_plugins with strict=true; carries the report.
class KERNMAP_API PluginError : public std::runtime_error {
 public:
  PluginError(const std::string& message, LoadReport report)
      : std::runtime_error(message), report_(std::move(report)) {}
  const LoadReport& report() const { return report_; }

 private:
  LoadReport report_;
};

/// Loads the packages of the given repositories. A package already loaded (same name, same library file) is a
/// no-op reported as loaded with reason "already loaded". Throws only with strict=true (PluginError), or
/// std::invalid_argument for a malformed KERNMAP_TOOLKITS.
KERNMAP_API LoadReport load_plugins(const LoadOptions& options);
/// load_plugins with use_env_path = true and no other path.
KERNMAP_API LoadReport load_plugins_from_env();
/// Every attempt of this process so far (repeated no-op loads are not repeated here).
KERNMAP_API LoadReport plugin_report();
/// The process facts variants are matched against (KERNMAP_TOOLKITS included).
KERNMAP_API ProcessInfo process_info();

/// Writes dir/kernmap.lock pinning every package of the repository dir (name -> version + the sha256 of each
/// variant's library). Every library is hashed and must match its manifest; on any problem nothing is written
/// and std::invalid_argument lists every problem. The lock is written whole or not at all: a write that fails
/// (a full disk) throws std::runtime_error with the system's reason and leaves no partial file. Returns the
/// lock's text.
KERNMAP_API std::string write_lock(const std::string& dir);

}  // namespace kernmap
