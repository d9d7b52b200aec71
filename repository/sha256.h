// SHA-256 (FIPS 180-4) without torch or OpenSSL: the loader verifies plugin libraries with it, and the lock
// pins its digests. Streaming, so a large library is hashed without reading it into memory whole.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kernmap {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  /// The digest as 64 lowercase hex digits. The object must not be updated afterwards.
  std::string hex_digest();

 private:
  void compress(const uint8_t* block);
  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_{};
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

/// SHA-256 of a byte string, as 64 lowercase hex digits.
std::string sha256_hex(std::string_view bytes);
/// SHA-256 of a file's contents. Throws std::runtime_error naming the path when it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace kernmap
