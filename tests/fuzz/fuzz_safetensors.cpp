// libFuzzer target: arbitrary bytes as a whole safetensors file. Parsing must either return a header whose
// tensors all lie inside the file, or throw FormatError; anything else (a crash, a sanitizer report, another
// exception) is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "models/safetensors_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace st = kernmap::safetensors;
  try {
    const st::Header header = st::parse_file(data, size);
    for (const st::TensorInfo& t : header.tensors) {
      if (t.begin > t.end || header.data_start + t.end > size) std::abort();
      if (t.numel() * st::dtype_size(t.dtype) != t.end - t.begin) std::abort();
    }
  } catch (const st::FormatError&) {
  }
  return 0;
}
