// Run-time choice of the CPU instruction-set level (ATen's CPU_CAPABILITY scheme): every kernel file under
// kernels/cpu/ is compiled once per level; the best level this CPU supports is picked at first use.
// KERNMAP_CPU_ISA=baseline|avx2|avx512|avx512bf16 caps the level (a request above what the CPU supports is
// refused with a message on stderr and the best supported level is used).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace kernmap::cpu {

/// Each level's instructions include the previous level's. avx512bf16 rounds bfloat16 in hardware, which
/// flushes subnormal floats to zero (see round_block in vec.h); it is otherwise identical to avx512.
enum class Level { kBaseline, kAvx2, kAvx512, kAvx512Bf16 };

/// The entry points of one level.
struct KernelTable {
  Level level;
  decltype(&baseline::rms_norm_fwd) rms_norm_fwd;
  decltype(&baseline::rms_norm_bwd) rms_norm_bwd;
  decltype(&baseline::silu_fwd) silu_fwd;
  decltype(&baseline::silu_bwd) silu_bwd;
  decltype(&baseline::silu_and_mul_fwd) silu_and_mul_fwd;
  decltype(&baseline::silu_and_mul_bwd) silu_and_mul_bwd;
  decltype(&baseline::gemm_nt) gemm_nt;
  decltype(&baseline::gemm_bcast) gemm_bcast;
  decltype(&baseline::moe_combine) moe_combine;
  decltype(&baseline::moe_combine_bwd) moe_combine_bwd;
  decltype(&baseline::cross_entropy_rows) cross_entropy_rows;
};

/// The table of the active level (chosen on first call).
const KernelTable& kernel_table();
/// The active level.
Level active_level();
/// Levels compiled into this library that this CPU can run, lowest first.
std::vector<Level> supported_levels();
/// Makes `level` active for the whole process (tests run every level this way). Throws std::invalid_argument
/// when the CPU cannot run it.
void set_level(Level level);
/// "baseline", "avx2", "avx512", "avx512bf16".
const char* level_name(Level level);
/// Inverse of level_name; nullopt for an unknown name.
std::optional<Level> parse_level(const std::string& name);

}  // namespace kernmap::cpu
