// Test helper: temporary local kernel repositories built from the test plugins (tests/plugins), with
// manifests whose sha256 is computed from the copied file.
#pragma once

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "kernmap/plugin.h"
#include "kernmap/plugins.h"
#include "repository/sha256.h"

namespace kernmap::testing {

namespace fs = std::filesystem;

/// A test plugin library of the build: "kmgood" -> .../tests/plugins/libkmgood.so.
inline std::string plugin_library(const std::string& name) {
  return std::string(KERNMAP_TEST_PLUGIN_DIR) + "/lib" + name + ".so";
}

inline void write_file(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

/// A manifest with one variant for this process.
inline nlohmann::json manifest_for(const std::string& name, const std::string& library,
                                   const std::string& sha256) {
  const ProcessInfo p = process_info();
  return {{"name", name},
          {"version", "1.0.0"},
          {"plugin_abi", KERNMAP_PLUGIN_ABI_VERSION},
          {"description", "test package " + name},
          {"variants",
           {{{"library", library},
             {"sha256", sha256},
             {"torch", p.torch},
             {"cxx11_abi", p.cxx11_abi},
             {"arch", p.arch},
             {"os", p.os},
             {"toolkits", nlohmann::json::object()}}}}};
}

/// A repository folder under the system temporary folder, removed at destruction.
class TempRepo {
 public:
  TempRepo() {
    static std::atomic<int> counter{0};
    root_ = fs::temp_directory_path() /
            ("kernmap-repo-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  ~TempRepo() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  TempRepo(const TempRepo&) = delete;
  TempRepo& operator=(const TempRepo&) = delete;

  const fs::path& root() const { return root_; }
  std::string path() const { return root_.string(); }

  /// folder/lib/lib<plugin>.so copied from the build, and a manifest naming it with its sha256. Returns the
  /// manifest, which a test may change and write again with write_manifest.
  nlohmann::json add(const std::string& folder, const std::string& name, const std::string& plugin) {
    const std::string relative = "lib/lib" + plugin + ".so";
    fs::create_directories(root_ / folder / "lib");
    fs::copy_file(plugin_library(plugin), root_ / folder / relative, fs::copy_options::overwrite_existing);
    nlohmann::json m = manifest_for(name, relative, sha256_file((root_ / folder / relative).string()));
    write_manifest(folder, m);
    return m;
  }
  void write_manifest(const std::string& folder, const nlohmann::json& manifest) {
    write_file(root_ / folder / "manifest.json", manifest.dump(2));
  }

 private:
  fs::path root_;
};

/// Loads a test plugin (strictly: a refusal throws) from a temporary repository, once per process; the
/// library stays loaded, its repository copy is removed.
inline void load_test_plugin(const std::string& plugin) {
  static std::set<std::string> loaded;
  if (loaded.count(plugin)) return;
  TempRepo repo;
  repo.add(plugin, plugin, plugin);
  LoadOptions options;
  options.paths = {repo.path()};
  options.strict = true;
  load_plugins(options);
  loaded.insert(plugin);
}

/// The report entry of a package folder; fails the test when absent.
inline const PackageReport& entry(const LoadReport& report, const std::string& folder) {
  for (const PackageReport& p : report.packages)
    if (p.folder == folder) return p;
  throw std::runtime_error("no report entry for folder '" + folder + "' in " + report.to_json());
}

}  // namespace kernmap::testing
