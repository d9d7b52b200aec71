// A local kernel repository's folder (repository/folder.h).
#include "repository/folder.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <system_error>

namespace kernmap::repository {

namespace fs = std::filesystem;

std::string read_small_file(const fs::path& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) throw FormatError(path.string() + ": cannot read: " + ec.message());
  if (size > kMaxMetadataBytes) {
    throw FormatError(path.string() + ": " + std::to_string(size) + " bytes (expected at most " +
                      std::to_string(kMaxMetadataBytes) + ")");
  }
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) throw FormatError(path.string() + ": cannot read");
  return text;
}

RepositoryFiles scan_repository(const std::string& path) {
  RepositoryFiles r;
  r.report.path = path;
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    r.report.error = "not a folder: '" + path + "'";
    return r;
  }
  const fs::path lock_path = fs::path(path) / kLockFile;
  if (fs::exists(lock_path, ec)) {
    r.report.has_lock = true;
    try {
      r.lock = parse_lock(read_small_file(lock_path), lock_path.string());
    } catch (const std::exception& e) {
      r.lock_ok = false;
      r.report.error = e.what();
    }
  }
  for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    if (it->is_directory(ec)) r.package_dirs.push_back(it->path());
  }
  if (ec) r.report.error = "cannot list '" + path + "': " + ec.message();
  std::sort(r.package_dirs.begin(), r.package_dirs.end());
  return r;
}

}  // namespace kernmap::repository
