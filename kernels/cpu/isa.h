// Run-time choice of the CPU instruction-set level (ATen's CPU_CAPABILITY scheme): every kernel file under
// kernels/cpu/ is compiled once per level; the best level this CPU supports is picked at first use.
// KERNMAP_CPU_ISA=baseline|avx2|avx512|avx512bf16|amx caps the level (a request above what the CPU supports
// is refused with a message on stderr and the best supported level is used).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace kernmap::cpu {

/// Each level's instructions include the previous level's. avx512bf16 rounds bfloat16 in hardware, which
/// flushes subnormal floats to zero (see round_block in vec.h); it is otherwise identical to avx512. amx is
/// avx512bf16 with the bf16 products of gemm_nt on the AMX tiles (which the OS must grant the process).
enum class Level { kBaseline, kAvx2, kAvx512, kAvx512Bf16, kAmx };

/// The entry points of one level: a member per line of entry_points.h.
struct KernelTable {
#define KERNMAP_CPU_MEMBER(name, ret, params) ret(*name) params;
  KERNMAP_CPU_ENTRY_POINTS(KERNMAP_CPU_MEMBER)
#undef KERNMAP_CPU_MEMBER
};

/// Each level's table, defined in table.cpp (compiled once per level).
namespace baseline {
extern const KernelTable kTable;
}
namespace avx2 {
extern const KernelTable kTable;
}
namespace avx512 {
extern const KernelTable kTable;
}
namespace avx512bf16 {
extern const KernelTable kTable;
}
namespace amx {
extern const KernelTable kTable;
}

/// The table of the active level (chosen on first call).
const KernelTable& kernel_table();
/// The active level.
Level active_level();
/// Levels compiled into this library that this CPU can run, lowest first.
std::vector<Level> supported_levels();
/// Makes `level` active for the whole process (tests run every level this way). Throws std::invalid_argument
/// when the CPU cannot run it.
void set_level(Level level);
/// "baseline", "avx2", "avx512", "avx512bf16", "amx".
const char* level_name(Level level);
/// Inverse of level_name; nullopt for an unknown name.
std::optional<Level> parse_level(const std::string& name);

}  // namespace kernmap::cpu
