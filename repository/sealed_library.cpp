// The sealed copy of a plugin library (repository/sealed_library.h).
#include "repository/sealed_library.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "repository/sha256.h"

namespace kernmap::repository {
namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
}

// Closes a descriptor when the copy is abandoned half-way.
struct Descriptor {
  int fd;
  ~Descriptor() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

SealedLibrary::SealedLibrary(const std::string& path) {
  const Descriptor in{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY)};
  if (in.fd < 0) fail("cannot open '" + path + "'");
  struct stat st {};
  if (::fstat(in.fd, &st) != 0) fail("cannot stat '" + path + "'");
  if (!S_ISREG(st.st_mode)) throw std::runtime_error("'" + path + "' is not a regular file");
  // Named for /proc/PID/maps: "/memfd:kernmap-plugin:libx.so (deleted)".
  const std::string name = "kernmap-plugin:" + std::filesystem::path(path).filename().string().substr(0, 200);
  Descriptor copy{::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING)};
  if (copy.fd < 0) fail("cannot copy '" + path + "' into memory: memfd_create");

  Sha256 hash;
  char chunk[1 << 16];
  for (;;) {
    const ssize_t n = ::read(in.fd, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("cannot read '" + path + "'");
    if (n == 0) break;
    hash.update(chunk, static_cast<size_t>(n));
    for (ssize_t done = 0; done < n;) {
      const ssize_t w = ::write(copy.fd, chunk + done, static_cast<size_t>(n - done));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) fail("cannot copy '" + path + "' into memory");
      done += w;
    }
    size_ += static_cast<size_t>(n);
  }
  if (::fcntl(copy.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0)
    fail("cannot seal the copy of '" + path + "'");
  if (size_ > 0) {
    map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, copy.fd, 0);
    if (map_ == MAP_FAILED) {
      map_ = nullptr;
      fail("cannot map the copy of '" + path + "'");
    }
  }
  sha256_ = hash.hex_digest();
  fd_ = copy.fd;
  copy.fd = -1;
  fd_path_ = "/proc/self/fd/" + std::to_string(fd_);
}

SealedLibrary::~SealedLibrary() {
  if (map_ != nullptr) ::munmap(map_, size_);
  if (!keep_open_) ::close(fd_);
}

}  // namespace kernmap::repository
