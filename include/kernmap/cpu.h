// The instruction-set level of kernmap's CPU kernels (docs/ops.md, "CPU kernels"). Each kernel is compiled
// once per level; the process runs one level at a time, chosen at the first kernel call as the best this CPU
// runs, capped by KERNMAP_CPU_ISA. Levels are named "baseline", "avx2", "avx512", "avx512bf16" and "amx",
// each including the instructions of the levels before it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernmap/export.h"

namespace kernmap {

/// The name of the level the CPU kernels run at now (chosen first if no kernel has run yet).
KERNMAP_API std::string cpu_level();

/// The levels compiled into kernmap that this CPU can run, lowest first ("baseline" is always one).
KERNMAP_API std::vector<std::string> supported_cpu_levels();

/// Makes `level` the level of the whole process, every thread, from the next kernel call on (tests and
/// benchmarks compare levels this way). Throws std::invalid_argument naming the level and the supported ones
/// when it is not a level name or this CPU cannot run it.
KERNMAP_API void set_cpu_level(const std::string& level);

/// Bytes of each data-cache level one core uses (its own instance of the level, as cpu0 sees it in sysfs,
/// else sysconf); 0 where unknown. The CPU kernels' blocking and task sizes are derived from these.
struct CpuCaches {
  int64_t l1d_bytes = 0, l2_bytes = 0, l3_bytes = 0;
};
KERNMAP_API CpuCaches cpu_caches();

/// The CPU's model name (/proc/cpuinfo "model name"), or "unknown".
KERNMAP_API std::string cpu_model();

}  // namespace kernmap
