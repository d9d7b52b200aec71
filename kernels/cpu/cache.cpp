#include "kernels/cpu/cache.h"

#include <cpuid.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>

namespace kernmap::cpu {
namespace {

bool read_line(const std::string& path, std::string& out) {
  std::ifstream f(path);
  return static_cast<bool>(std::getline(f, out));
}

// "48K", "2048K", "32M" (sysfs writes K; M and a bare byte count are accepted too); 0 when malformed.
int64_t parse_size(const std::string& text) {
  long long n = 0;
  char unit = 0;
  const int got = std::sscanf(text.c_str(), "%lld%c", &n, &unit);
  if (got < 1 || n <= 0) return 0;
  if (got == 1) return n;
  switch (unit) {
    case 'K':
      return n << 10;
    case 'M':
      return n << 20;
    case 'G':
      return n << 30;
    default:
      return 0;
  }
}

// The CPUs of a sysfs CPU list ("0-1", "0-3,8-11", "5"); 0 when malformed.
int64_t count_cpus(const std::string& list) {
  int64_t n = 0;
  size_t at = 0;
  while (at < list.size()) {
    size_t end = list.find(',', at);
    if (end == std::string::npos) end = list.size();
    long long lo = 0, hi = 0;
    char tail = 0;
    const std::string part = list.substr(at, end - at);
    if (std::sscanf(part.c_str(), "%lld-%lld%c", &lo, &hi, &tail) == 2 && hi >= lo && lo >= 0)
      n += hi - lo + 1;
    else if (std::sscanf(part.c_str(), "%lld%c", &lo, &tail) == 1 && lo >= 0)
      n += 1;
    else
      return 0;
    at = end + 1;
  }
  return n;
}

}  // namespace

CacheSizes read_cache_sizes(const std::string& root, bool sysconf_fallback) {
  CacheSizes out;
  // index0..: one folder per cache of the CPU; a gap ends the list (sysfs numbers them densely).
  for (int i = 0;; ++i) {
    const std::string dir = root + "/index" + std::to_string(i) + "/";
    std::string level, type, size;
    if (!read_line(dir + "level", level)) break;
    if (!read_line(dir + "type", type) || !read_line(dir + "size", size) || type == "Instruction") continue;
    const int64_t bytes = parse_size(size);
    if (level == "1") out.l1d = bytes;
    if (level == "2") out.l2 = bytes;
    if (level == "3") {
      out.l3 = bytes;
      std::string shared;
      out.l3_cpus = read_line(dir + "shared_cpu_list", shared) ? count_cpus(shared) : 0;
    }
  }
  if (sysconf_fallback) {
    auto from_sysconf = [](int64_t& field, int name) {
      const long v = sysconf(name);
      if (field <= 0 && v > 0) field = v;
    };
    from_sysconf(out.l1d, _SC_LEVEL1_DCACHE_SIZE);
    from_sysconf(out.l2, _SC_LEVEL2_CACHE_SIZE);
    from_sysconf(out.l3, _SC_LEVEL3_CACHE_SIZE);
  }
  return out;
}

const CacheSizes& cache_sizes() {
  static const CacheSizes sizes = read_cache_sizes("/sys/devices/system/cpu/cpu0/cache");
  return sizes;
}

int64_t usable_l3_bytes(const CacheSizes& sizes) {
  constexpr int64_t kPerCpu = int64_t{4} << 20;
  if (sizes.l3 <= 0) return int64_t{32} << 20;
  return sizes.l3_cpus > 0 ? std::min(sizes.l3, sizes.l3_cpus * kPerCpu) : sizes.l3;
}

int64_t usable_l3_bytes() {
  static const int64_t bytes = usable_l3_bytes(cache_sizes());
  return bytes;
}

int64_t l2_block_bytes() {
  static const int64_t bytes = (cache_sizes().l2 > 0 ? cache_sizes().l2 : int64_t{1} << 20) / 4;
  return bytes;
}

int64_t short_reduction_bytes(int64_t elem_size) {
  return elem_size == 4 ? 2 * l2_block_bytes() : l2_block_bytes();
}

namespace {

bool cpu_has_bf16_gemm() {
  // oneDNN takes torch's bf16 product on any AVX-512 core, but without bf16 instructions it widens every
  // operand in software and runs at a fraction of the fp32 rate; only AVX512-BF16 or AMX-BF16 dot products,
  // or AVX-NE-CONVERT's widening loads, make it at least as fast as fp32 (docs/performance.md, "bf16
  // products without bf16 BLAS").
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = (edx >> 22 & 1u) != 0;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  const bool avx512_bf16 = (eax >> 5 & 1u) != 0, avx_ne_convert = (edx >> 5 & 1u) != 0;
  // __builtin_cpu_supports also checks that the OS saves the vector state (XCR0).
  if (avx_ne_convert && __builtin_cpu_supports("avx2")) return true;
  return (avx512_bf16 || amx_bf16) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

bool cpu_is_intel() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  return ebx == 0x756e6547u && edx == 0x49656e69u && ecx == 0x6c65746eu;  // "Genu" "ineI" "ntel"
}

}  // namespace

int64_t prefetch_streams() {
  static const int64_t cpu = cpu_is_intel() ? 32 : 0;
  if (const char* v = std::getenv("KERNMAP_PREFETCH_STREAMS")) {
    if (*v == '\0') return cpu;
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v, &end, 10);
    if (errno != 0 || *end != '\0' || n < 0 || n > 1000000)
      throw std::invalid_argument(
          std::string("kernmap: KERNMAP_PREFETCH_STREAMS must be a count from 0 to 1000000, got '") + v +
          "'");
    return n;
  }
  return cpu;
}

bool fetch_next_block(int64_t row_bytes) {
  return prefetch_streams() == 0 || row_bytes <= 4096;
}

bool bf16_gemm_native() {
  static const bool cpu = cpu_has_bf16_gemm();
  if (const char* v = std::getenv("KERNMAP_BF16_GEMM")) {
    if (std::strcmp(v, "native") == 0) return true;
    if (std::strcmp(v, "fp32") == 0) return false;
    if (*v != '\0')
      throw std::invalid_argument(
          std::string("kernmap: KERNMAP_BF16_GEMM must be 'native' or 'fp32', got '") + v + "'");
  }
  return cpu;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const size_t start = line.find_first_not_of(" \t", colon + 1);
    if (start != std::string::npos) return line.substr(start);
  }
  return "unknown";
}

}  // namespace kernmap::cpu
