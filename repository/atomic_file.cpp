// Whole-or-nothing file writes (repository/atomic_file.h): write to a temporary file, fsync it, rename it
// over the target, fsync the folder. Each step's errno is reported; nothing partial is left behind.
#include "repository/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>
#include <utility>

namespace kernmap::repository {
namespace {

// The folder a path lies in, "." for a bare name.
std::string folder_of(const std::string& path) {
  const std::string parent = std::filesystem::path(path).parent_path().string();
  return parent.empty() ? "." : parent;
}

}  // namespace

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), temp_(path_ + ".tmp") {
  // O_NOFOLLOW: a symlink planted under the temporary name must not redirect the write elsewhere.
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0666);
  if (fd_ < 0) {
    const int error = errno;
    throw WriteError("cannot write " + path_ + ": cannot create " + temp_ + ": " + std::strerror(error));
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(temp_.c_str());
  }
}

void AtomicFile::fail(const std::string& step, int error) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(temp_.c_str());
  throw WriteError("cannot write " + path_ + ": " + step + ": " + std::strerror(error) + " (the partial " +
                   temp_ + " was removed; " + path_ + " is unchanged)");
}

void AtomicFile::write(const void* data, size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, bytes, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("write failed", errno);
    bytes += n;
    size -= static_cast<size_t>(n);
  }
}

void AtomicFile::commit() {
  // A full disk may surface only here (delayed allocation, network file systems): fsync and close count.
  if (::fsync(fd_) != 0) fail("flushing to disk failed", errno);
  const int closed = ::close(fd_);
  const int error = errno;
  fd_ = -1;
  if (closed != 0) fail("closing failed", error);
  if (const char* pause = std::getenv("KERNMAP_TEST_SAVE_PAUSE_S"); pause != nullptr)
    std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(pause)));
  if (std::rename(temp_.c_str(), path_.c_str()) != 0) fail("renaming " + temp_ + " failed", errno);
  // The rename itself is durable only once the folder's entry is on disk.
  const std::string folder = folder_of(path_);
  const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0 || ::fsync(dir) != 0) {
    const int error = errno;
    if (dir >= 0) ::close(dir);
    throw WriteError(path_ + " was written, but flushing its folder " + folder +
                     " to disk failed: " + std::strerror(error));
  }
  ::close(dir);
}

void write_file_atomically(const std::string& path, std::string_view bytes) {
  AtomicFile file(path);
  file.write(bytes);
  file.commit();
}

}  // namespace kernmap::repository
