// The safetensors file format, without torch: parsing and validating a header from untrusted bytes, and
// building one for writing. Kept torch-free so that the libFuzzer target (tests/fuzz/) links it alone.
//
// A file is: 8 bytes little-endian header length N, N bytes of UTF-8 JSON (an object: tensor name ->
// {"dtype", "shape", "data_offsets": [begin, end]}, plus an optional "__metadata__" string map), then the
// data buffer. Offsets are relative to the data buffer. As in the reference implementation, the tensors must
// tile the buffer exactly: sorted by offset, each begins where the previous ends, and the last ends at the
// end of the file.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace kernmap::safetensors {

/// Every error in a safetensors file: the message names the tensor (when there is one) and the problem.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Largest header accepted (the reference implementation's limit).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

/// The dtypes of the format. Names as in the file ("F32", "BF16", ...).
enum class Dtype {
  kBool,
  kU8,
  kI8,
  kF8E5M2,
  kF8E4M3,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64
};
/// Bytes per element.
size_t dtype_size(Dtype dtype);
/// "F32", ...
std::string_view dtype_name(Dtype dtype);

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  ///< byte offset of the first element, relative to the data buffer
  uint64_t end = 0;    ///< one past the last byte
  uint64_t numel() const;
};

struct Header {
  uint64_t data_start = 0;                      ///< file offset of the data buffer (8 + N)
  std::vector<TensorInfo> tensors;              ///< in file order of their offsets
  std::map<std::string, std::string> metadata;  ///< "__metadata__"
  /// The tensor of that name, or nullptr.
  const TensorInfo* find(std::string_view name) const;
};

/// The header length N read from the first 8 bytes of a file of file_size bytes. Throws FormatError when the
/// file is shorter than 8 bytes, N is 0, N exceeds kMaxHeaderBytes, or 8 + N exceeds the file.
uint64_t header_length(const unsigned char* first8, uint64_t file_size);

/// Parses and validates the header JSON (the N bytes after the length) of a file of file_size bytes: UTF-8,
/// nesting depth, no duplicate keys, each tensor's dtype known, shape non-negative and its byte count equal
/// to its offsets' span, offsets inside the data buffer, and tensors tiling the buffer without overlap or
/// holes.
Header parse_header(std::string_view json, uint64_t file_size);

/// Both steps on a whole file held in memory.
Header parse_file(const unsigned char* data, uint64_t size);

/// What a writer knows about one tensor: its data is written in the given order, back to back.
struct TensorToWrite {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
};
/// The 8-byte length plus the header JSON, padded with spaces to a multiple of 8 bytes so the data buffer is
/// aligned. Tensors' data follows in the order given. Throws FormatError for an empty or duplicate name.
std::string build_header(const std::vector<TensorToWrite>& tensors,
                         const std::map<std::string, std::string>& metadata);

}  // namespace kernmap::safetensors
