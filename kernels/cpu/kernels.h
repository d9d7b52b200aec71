// CPU kernels, compiled once per instruction-set level. No torch headers here: plain C++ over pointers.
#pragma once

#include <cstdint>

namespace kernmap::cpu {

/// Element types the CPU kernels compute on.
enum class DType : uint8_t { kFloat32, kBFloat16, kFloat16, kFloat64 };

namespace baseline {
#include "kernels/cpu/kernel_functions.inc"
}  // namespace baseline
namespace avx2 {
#include "kernels/cpu/kernel_functions.inc"
}  // namespace avx2
namespace avx512 {
#include "kernels/cpu/kernel_functions.inc"
}  // namespace avx512
namespace avx512bf16 {
#include "kernels/cpu/kernel_functions.inc"
}  // namespace avx512bf16

}  // namespace kernmap::cpu
