#include "kernels/cpu/isa.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include <sys/syscall.h>
#include <unistd.h>

namespace kernmap::cpu {
namespace {

struct LevelTable {
  Level level;
  const char* name;
  const KernelTable* table;
};
// Lowest level first, in the order of Level.
constexpr LevelTable kLevels[] = {{Level::kBaseline, "baseline", &baseline::kTable},
                                  {Level::kAvx2, "avx2", &avx2::kTable},
                                  {Level::kAvx512, "avx512", &avx512::kTable},
                                  {Level::kAvx512Bf16, "avx512bf16", &avx512bf16::kTable},
                                  {Level::kAmx, "amx", &amx::kTable}};

// Linux hands a process the AMX tile registers only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA, kernel 5.16 and later); asked once, for every thread of the process.
bool os_grants_amx() {
  static const bool granted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

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
    case Level::kAmx:
      return cpu_runs(Level::kAvx512Bf16) && __builtin_cpu_supports("amx-tile") &&
             __builtin_cpu_supports("amx-bf16") && os_grants_amx();
  }
  return false;
}

Level best_level() {
  Level best = Level::kBaseline;
  for (const LevelTable& l : kLevels)
    if (cpu_runs(l.level)) best = l.level;
  return best;
}

Level initial_level() {
  Level best = best_level();
  const char* env = std::getenv("KERNMAP_CPU_ISA");
  if (env == nullptr || *env == '\0') return best;
  std::optional<Level> want = parse_level(env);
  if (!want) {
    std::fprintf(stderr,
                 "[kernmap] KERNMAP_CPU_ISA=%s is not a level (expected baseline, avx2, avx512, "
                 "avx512bf16 or amx); using %s\n",
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

std::atomic<const LevelTable*>& active() {
  static std::atomic<const LevelTable*> level{&kLevels[static_cast<int>(initial_level())]};
  return level;
}

}  // namespace

const KernelTable& kernel_table() {
  return *active().load(std::memory_order_acquire)->table;
}

Level active_level() {
  return active().load(std::memory_order_acquire)->level;
}

std::vector<Level> supported_levels() {
  std::vector<Level> out;
  for (const LevelTable& l : kLevels)
    if (cpu_runs(l.level)) out.push_back(l.level);
  return out;
}

void set_level(Level level) {
  if (!cpu_runs(level))
    throw std::invalid_argument(std::string("kernmap: CPU level ") + level_name(level) +
                                " is not supported by this CPU (best: " + level_name(best_level()) + ")");
  active().store(&kLevels[static_cast<int>(level)], std::memory_order_release);
}

namespace {
std::atomic<SiluGathers> silu_gathers_setting{SiluGathers::kAuto};
}  // namespace

void set_silu_gathers(SiluGathers how) {
  silu_gathers_setting.store(how, std::memory_order_relaxed);
}

SiluGathers silu_gathers() {
  return silu_gathers_setting.load(std::memory_order_relaxed);
}

const char* level_name(Level level) {
  return kLevels[static_cast<int>(level)].name;
}

std::optional<Level> parse_level(const std::string& name) {
  for (const LevelTable& l : kLevels)
    if (name == l.name) return l.level;
  return std::nullopt;
}

}  // namespace kernmap::cpu
