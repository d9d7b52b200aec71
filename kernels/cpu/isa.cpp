#include "kernels/cpu/isa.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace kernmap::cpu {
namespace {

#define KERNMAP_TABLE(ns, lvl)                                                                        \
  KernelTable {                                                                                       \
    lvl, &ns::rms_norm_fwd, &ns::rms_norm_bwd, &ns::silu_fwd, &ns::silu_bwd, &ns::silu_and_mul_fwd,   \
        &ns::silu_and_mul_bwd, &ns::gemm_nt, &ns::gemm_bcast, &ns::moe_combine, &ns::moe_combine_bwd, \
        &ns::cross_entropy_rows                                                                       \
  }
const KernelTable kTables[] = {
    KERNMAP_TABLE(baseline, Level::kBaseline),
    KERNMAP_TABLE(avx2, Level::kAvx2),
    KERNMAP_TABLE(avx512, Level::kAvx512),
    KERNMAP_TABLE(avx512bf16, Level::kAvx512Bf16),
};
#undef KERNMAP_TABLE

// __builtin_cpu_supports also checks that the OS saves the wider registers (XGETBV).
bool cpu_runs(Level level) {
  switch (level) {
    case Level::kBaseline:
      return true;
    case Level::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Level::kAvx512:
      return cpu_runs(Level::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
    case Level::kAvx512Bf16:
      return cpu_runs(Level::kAvx512) && __builtin_cpu_supports("avx512bf16");
  }
  return false;
}

Level best_level() {
  Level best = Level::kBaseline;
  for (Level l : {Level::kAvx2, Level::kAvx512, Level::kAvx512Bf16})
    if (cpu_runs(l)) best = l;
  return best;
}

Level initial_level() {
  Level best = best_level();
  const char* env = std::getenv("KERNMAP_CPU_ISA");
  if (env == nullptr || *env == '\0') return best;
  std::optional<Level> want = parse_level(env);
  if (!want) {
    std::fprintf(stderr,
                 "[kernmap] KERNMAP_CPU_ISA=%s is not a level (expected baseline, avx2, avx512 or "
                 "avx512bf16); using %s\n",
                 env, level_name(best));
    return best;
  }
  if (!cpu_runs(*want)) {
    std::fprintf(stderr, "[kernmap] KERNMAP_CPU_ISA=%s: this CPU cannot run it; using %s\n", env,
                 level_name(best));
    return best;
  }
  return *want;
}

std::atomic<const KernelTable*>& active() {
  static std::atomic<const KernelTable*> table{&kTables[static_cast<int>(initial_level())]};
  return table;
}

}  // namespace

const KernelTable& kernel_table() {
  return *active().load(std::memory_order_acquire);
}

Level active_level() {
  return kernel_table().level;
}

std::vector<Level> supported_levels() {
  std::vector<Level> out;
  for (const KernelTable& t : kTables)
    if (cpu_runs(t.level)) out.push_back(t.level);
  return out;
}

void set_level(Level level) {
  if (!cpu_runs(level))
    throw std::invalid_argument(std::string("kernmap: CPU level ") + level_name(level) +
                                " is not supported by this CPU (best: " + level_name(best_level()) + ")");
  active().store(&kTables[static_cast<int>(level)], std::memory_order_release);
}

const char* level_name(Level level) {
  switch (level) {
    case Level::kBaseline:
      return "baseline";
    case Level::kAvx2:
      return "avx2";
    case Level::kAvx512:
      return "avx512";
    case Level::kAvx512Bf16:
      return "avx512bf16";
  }
  return "unknown";
}

std::optional<Level> parse_level(const std::string& name) {
  for (const KernelTable& t : kTables)
    if (name == level_name(t.level)) return t.level;
  return std::nullopt;
}

}  // namespace kernmap::cpu
