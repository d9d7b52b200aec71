// The public CPU functions (include/kernmap/cpu.h) over the run-time level choice of kernels/cpu/isa.h and
// the cache sizes of kernels/cpu/cache.h.
#include "kernmap/cpu.h"

#include <optional>
#include <stdexcept>

#include "kernels/cpu/cache.h"
#include "kernels/cpu/isa.h"

namespace kernmap {

std::string cpu_level() {
  return cpu::level_name(cpu::active_level());
}

std::vector<std::string> supported_cpu_levels() {
  std::vector<std::string> out;
  for (cpu::Level level : cpu::supported_levels()) out.emplace_back(cpu::level_name(level));
  return out;
}

void set_cpu_level(const std::string& level) {
  const std::optional<cpu::Level> parsed = cpu::parse_level(level);
  bool supported = false;
  std::string names;
  for (cpu::Level l : cpu::supported_levels()) {
    supported = supported || (parsed && l == *parsed);
    names += (names.empty() ? "" : ", ") + std::string(cpu::level_name(l));
  }
  if (!supported) {
    throw std::invalid_argument(
        "set_cpu_level: " + std::string(parsed ? "this CPU cannot run level '" : "unknown level '") + level +
        "' (this CPU runs: " + names + ")");
  }
  cpu::set_level(*parsed);
}

CpuCaches cpu_caches() {
  const cpu::CacheSizes& c = cpu::cache_sizes();
  return {c.l1d, c.l2, c.l3};
}

std::string cpu_model() {
  return cpu::cpu_model();
}

}  // namespace kernmap
