// `kernmap lock`: pinning every package of a repository (write_lock of include/kernmap/plugins.h).
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernmap/plugins.h"
#include "repository/atomic_file.h"
#include "repository/folder.h"
#include "repository/manifest.h"
#include "repository/sha256.h"

namespace kernmap {
namespace {

namespace fs = std::filesystem;
using repository::kLockFile;
using repository::kManifestFile;
using repository::Lock;
using repository::LockedPackage;
using repository::Manifest;
using repository::parse_manifest;
using repository::read_small_file;
using repository::RepositoryFiles;
using repository::resolve_inside;
using repository::scan_repository;
using repository::write_file_atomically;

}  // namespace

std::string write_lock(const std::string& dir) {
  // An existing lock is replaced, even a malformed one: only the manifests and the files count here.
  const RepositoryFiles repo = scan_repository(dir);
  if (!fs::is_directory(dir)) throw std::invalid_argument(repo.report.error);
  std::vector<std::string> problems;
  Lock lock;
  std::map<std::string, std::string> folder_of;
  for (const fs::path& pkg : repo.package_dirs) {
    const fs::path manifest_path = pkg / kManifestFile;
    try {
      const Manifest m = parse_manifest(read_small_file(manifest_path), manifest_path.string());
      if (const auto it = folder_of.find(m.name); it != folder_of.end()) {
        problems.push_back(manifest_path.string() + ": package name '" + m.name + "' is used by folder '" +
                           it->second + "' too");
        continue;
      }
      folder_of[m.name] = pkg.filename().string();
      LockedPackage locked{m.version, {}};
      bool ok = true;
      for (size_t i = 0; i < m.variants.size(); ++i) {
        const auto& v = m.variants[i];
        const std::string field = "variants[" + std::to_string(i) + "]";
        try {
          const std::string library =
              resolve_inside(pkg.string(), v.library, manifest_path.string(), field + ".library");
          const std::string digest = sha256_file(library);
          if (digest != v.sha256) {
            problems.push_back(manifest_path.string() + ": " + field + ".sha256: expected the sha256 of " +
                               library + " (" + digest + "), got " + v.sha256);
            ok = false;
          }
          locked.sha256.insert(digest);
        } catch (const std::exception& e) {
          problems.push_back(e.what());
          ok = false;
        }
      }
      if (ok) lock.packages.emplace(m.name, std::move(locked));
    } catch (const std::exception& e) {
      problems.push_back(e.what());  // names the manifest already
    }
  }
  if (!problems.empty()) {
    std::string message = dir + "/" + kLockFile + " not written:";
    for (const auto& p : problems) message += "\n  " + p;
    throw std::invalid_argument(message);
  }
  const std::string text = lock_to_json(lock);
  write_file_atomically((fs::path(dir) / kLockFile).string(), text);
  return text;
}

}  // namespace kernmap
