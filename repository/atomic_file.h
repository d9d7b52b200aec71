// Internal: a file written whole or not at all, for everything kernmap writes (kernmap.lock, safetensors
// weights and trainer checkpoints, config.json). Torch-free; linked into each library that writes files.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

namespace kernmap::repository {

/// Why a file could not be written: the file, the step and the system's reason ("No space left on device").
class WriteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The bytes go to `path`.tmp; commit() flushes them to disk, renames the temporary file over `path` and
/// flushes the folder, so that readers (and a crash at any point) see the old file or the new one. A failed
/// open, write, flush or rename throws WriteError and removes the temporary file; so does destroying the
/// object before commit (an exception while the bytes were produced). Test hook: KERNMAP_TEST_SAVE_PAUSE_S
/// (seconds) pauses between the complete temporary file and the rename, for tests that kill the process
/// there.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t size);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
  /// Makes the file visible under its name. Nothing may be written afterwards.
  void commit();

  const std::string& path() const { return path_; }

 private:
  [[noreturn]] void fail(const std::string& step, int error);
  std::string path_;
  std::string temp_;
  int fd_ = -1;
};

/// Writes `bytes` as the whole of `path` through an AtomicFile.
void write_file_atomically(const std::string& path, std::string_view bytes);

}  // namespace kernmap::repository
