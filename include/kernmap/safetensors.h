// safetensors files as named at::Tensors. The reader treats the file as untrusted: the header is validated in
// full (offsets, sizes, dtypes, shapes against the file) before any tensor is read; errors are
// CheckpointError naming the file, the tensor and the problem.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernmap/export.h"

namespace kernmap {

/// A checkpoint that cannot be read or written: the message names the file, the tensor and the problem.
class KERNMAP_API CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The safetensors name of a dtype ("F32", "BF16", "I64", ...); throws CheckpointError for a dtype the format
/// has no name for.
KERNMAP_API std::string safetensors_dtype_name(at::ScalarType dtype);

/// Every tensor of a safetensors file, in data order, as CPU tensors.
KERNMAP_API std::vector<std::pair<std::string, at::Tensor>> read_safetensors(const std::string& path);

/// Writes tensors (any device, any layout; read as contiguous CPU data) to a safetensors file. Throws
/// CheckpointError for a dtype the format has no name for, or when the file cannot be written.
KERNMAP_API void write_safetensors(const std::string& path,
                                   const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                   const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace kernmap
