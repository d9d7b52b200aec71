// Internal: a local kernel repository's folder as the loader and `kernmap lock` read it (docs/plugins.md):
// the package folders, the lock, and the checks on files before they are parsed or opened.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "kernmap/plugins.h"
#include "repository/manifest.h"

namespace kernmap::repository {

constexpr const char* kManifestFile = "manifest.json";
constexpr const char* kLockFile = "kernmap.lock";
constexpr std::uintmax_t kMaxMetadataBytes = 1 << 20;  ///< a manifest or lock larger than this is not one

/// A manifest or lock file's text. Throws FormatError naming the file when it cannot be read or is larger
/// than kMaxMetadataBytes.
std::string read_small_file(const std::filesystem::path& path);

/// A repository folder as listed: its report (an error when it cannot be read, or its lock is malformed), the
/// lock, and the package folders (sorted; hidden ones skipped).
struct RepositoryFiles {
  RepositoryReport report;
  bool lock_ok = true;
  Lock lock;
  std::vector<std::filesystem::path> package_dirs;
};

/// Lists the repository at path; problems land in the report, nothing throws.
RepositoryFiles scan_repository(const std::string& path);

}  // namespace kernmap::repository
