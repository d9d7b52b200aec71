// CPU kernels, compiled once per instruction-set level. No torch headers here: plain C++ over pointers.
#pragma once

#include <cstdint>

#include "kernels/cpu/entry_points.h"

namespace kernmap::cpu {

/// Element types the CPU kernels compute on.
enum class DType : uint8_t { kFloat32, kBFloat16, kFloat16, kFloat64 };

/// The rows of the rotary embedding's operands, walked in step: rows of D contiguous elements of x (q or k,
/// or a gradient), cos, sin (read) and y (written). Row r of the walk has the multi-index of r over
/// sizes[0..ndim) (the last index varying fastest); each tensor's row starts sum_i index_i * stride_i
/// elements after its data pointer. A stride of 0 repeats a row (cos and sin broadcast over heads).
struct RotaryRows {
  static constexpr int kMaxDims = 6;
  int ndim = 0;
  int64_t D = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t x_strides[kMaxDims] = {}, cos_strides[kMaxDims] = {}, sin_strides[kMaxDims] = {},
          y_strides[kMaxDims] = {};
  const void* x = nullptr;
  const void* cos = nullptr;
  const void* sin = nullptr;
  void* y = nullptr;
};

/// How the AVX-512 levels' bf16 SiLU rows get the functions of their gates (kernels/cpu/silu_tables.h): by
/// vector gathers from the bf16 tables, or as without them (computed; `avx512`'s silu_and_mul rows by scalar
/// lookups). kAuto, the default, gathers where a timing at the first such row finds a gather faster than
/// computing SiLU on this CPU. The results have the same bits either way; tests force each.
enum class SiluGathers : uint8_t { kAuto, kAlways, kNever };
void set_silu_gathers(SiluGathers how);
SiluGathers silu_gathers();

// Every entry point of entry_points.h, declared in each level's namespace (kernmap::cpu::<level>).
#define KERNMAP_CPU_DECLARE(name, ret, params) ret name params;
namespace baseline {
KERNMAP_CPU_ENTRY_POINTS(KERNMAP_CPU_DECLARE)
}  // namespace baseline
namespace avx2 {
KERNMAP_CPU_ENTRY_POINTS(KERNMAP_CPU_DECLARE)
}  // namespace avx2
namespace avx512 {
KERNMAP_CPU_ENTRY_POINTS(KERNMAP_CPU_DECLARE)
}  // namespace avx512
namespace avx512bf16 {
KERNMAP_CPU_ENTRY_POINTS(KERNMAP_CPU_DECLARE)
}  // namespace avx512bf16
namespace amx {
KERNMAP_CPU_ENTRY_POINTS(KERNMAP_CPU_DECLARE)
}  // namespace amx
#undef KERNMAP_CPU_DECLARE

}  // namespace kernmap::cpu
