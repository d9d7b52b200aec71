// Internal: a plugin library copied once into a sealed memory file, so that the bytes the loader hashes are
// the bytes it checks and the bytes dlopen maps. Hashing a path and then opening the path again lets a
// library swapped in between run unverified; a file cut or rewritten while mapped kills the process with
// SIGBUS. A sealed memfd can change neither way.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace kernmap::repository {

class SealedLibrary {
 public:
  /// Reads `path` once (one open, one pass), hashing the bytes as they are copied into a memfd, then seals
  /// the memfd against writing, growing and shrinking. Throws std::runtime_error naming the path and the
  /// reason (cannot open or read, not a regular file, no memory for the copy).
  explicit SealedLibrary(const std::string& path);
  ~SealedLibrary();
  SealedLibrary(const SealedLibrary&) = delete;
  SealedLibrary& operator=(const SealedLibrary&) = delete;

  /// The SHA-256 of the copied bytes, as 64 lowercase hex digits.
  const std::string& sha256() const { return sha256_; }
  /// The copied bytes (a read-only mapping of the sealed memfd).
  std::string_view bytes() const { return {static_cast<const char*>(map_), size_}; }
  /// The name dlopen opens the copy by: /proc/self/fd/N.
  const std::string& fd_path() const { return fd_path_; }
  /// Keeps the memfd open for the life of the process. Called once dlopen has mapped it: the dynamic linker
  /// knows a loaded library by its path, so no later copy may get the same /proc/self/fd/N.
  void keep_open() { keep_open_ = true; }

 private:
  int fd_ = -1;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::string sha256_;
  std::string fd_path_;
  bool keep_open_ = false;
};

}  // namespace kernmap::repository
