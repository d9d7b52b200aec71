// CPU kernels, compiled once per instruction-set level. No torch headers here: plain C++ over pointers.
#pragma once

#include <cstdint>

#include "kernels/cpu/entry_points.h"

namespace kernmap::cpu {

/// Element types the CPU kernels compute on.
enum class DType : uint8_t { kFloat32, kBFloat16, kFloat16, kFloat64 };

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
#undef KERNMAP_CPU_DECLARE

}  // namespace kernmap::cpu
