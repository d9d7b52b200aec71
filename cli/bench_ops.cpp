// `kernmap bench ops`: each kernel against the reference, side by side in one run. Repetitions of the
// implementations of one case are interleaved so machine drift hits them alike; medians after warm-up. The
// machine's limits are measured in the same run: the copy bandwidth (bytes read + bytes written by a large
// buffer copy, again among each case's repetitions, whose rows it floors) and the dense GEMM rate of each
// dtype a case with FLOPs uses, and of fp32. Each row's floor is the larger of its bytes at the copy
// bandwidth and its FLOPs at the fastest dense rate its level can use (fp32, or the case's dtype where the
// level has that dtype's product instructions: kernels may compute a bf16 case in fp32); the row names the
// limit its floor came from. A level below the CPU's own is held to the dense fp32 rate of a CPU of that
// level (bench_limit.h: OpenBLAS's kernels for it, measured in child processes), not to the machine's. With
// --levels, kernmap's implementations are timed at each level in the same process (set_cpu_level switches
// every thread's kernel table between repetitions), interleaved with the other implementations, which run
// once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/csrc/autograd/autograd.h>
#include <CLI/CLI.hpp>

#include <immintrin.h>
#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <stdexcept>
#include <string>

#include "cli/bench.h"
#include "cli/bench_alloc.h"
#include "cli/bench_limit.h"
#include "cli/commands.h"
#include "cli/json_output.h"
#include "cli/options.h"
#include "cli/table.h"
#include "kernmap/cpu.h"
#include "kernmap/memory.h"
#include "kernmap/ops.h"

namespace kernmap::cli {
namespace {

struct Options {
  bool json = false;
  std::string filter;
  std::string shape;   // regex over the case's shape ("E128 k8 H2048 I768 T256", "[4096, 3584]")
  std::string impl;    // regex over "op/pass/implementation" ("experts/fwd+bwd/reference")
  std::string levels;  // "all" or a comma list; empty: the level in use only
  int warmup = 3;
  int reps = 11;
  bool warm = false;          // --warm-caches: no empty_caches before each run
  bool system_pages = false;  // --system-pages: the cases' tensors on glibc's pages, not huge pages
};

// The vector width a kernmap level and a torch (ATen) capability have in common, to compare the two: 0 for
// kernmap's baseline and ATen's DEFAULT, 1 for AVX2, 2 for AVX-512 (with or without BF16).
int level_rank(const std::string& level) {
  return level == "baseline" ? 0 : level == "avx2" ? 1 : 2;
}
int torch_rank(const std::string& capability) {
  return capability == "AVX512" ? 2 : capability == "AVX2" ? 1 : 0;
}

// The levels --levels names, lowest first, checked against those this process can run: the CPU's supported
// levels up to the one in use at start (KERNMAP_CPU_ISA caps it). Throws UsageError naming the level and the
// runnable ones.
std::vector<std::string> levels_to_run(const std::string& text) {
  const std::string active = cpu_level();
  const std::vector<std::string> supported = supported_cpu_levels();
  std::vector<std::string> runnable;
  for (const std::string& l : supported) {
    runnable.push_back(l);
    if (l == active) break;
  }
  if (text.empty()) return {active};
  if (text == "all") return runnable;
  const std::vector<std::string> known = {"baseline", "avx2", "avx512", "avx512bf16", "amx"};
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string name = text.substr(start, comma - start);
    start = comma + 1;
    if (std::find(known.begin(), known.end(), name) == known.end())
      throw UsageError("--levels: unknown level '" + name + "' (expected all or a comma list of " +
                       join(known) + ")");
    if (std::find(runnable.begin(), runnable.end(), name) == runnable.end()) {
      const char* cap = std::getenv("KERNMAP_CPU_ISA");
      const bool capped = cap != nullptr && active != supported.back();
      throw UsageError("--levels: level '" + name + "' cannot run in this process (it runs " +
                       join(runnable) +
                       (capped ? std::string("; KERNMAP_CPU_ISA=") + cap + " caps it" : std::string()) + ")");
    }
    out.push_back(name);
  }
  // Lowest first, each once (the highest is the level of the rows of implementations outside kernmap).
  std::vector<std::string> ordered;
  for (const std::string& l : runnable)
    if (std::find(out.begin(), out.end(), l) != out.end()) ordered.push_back(l);
  return ordered;
}

// Whether kernels at `level` have the product instructions of `dtype` (else they compute it in fp32, whose
// dense rate is then the only honest compute limit). fp32 everywhere; bf16 at avx512bf16 (vdpbf16ps) and amx
// (the tiles). On a CPU with AMX, torch's bf16 product runs on the tiles, so the avx512bf16 rows are held to
// the tiles' rate too: the machine's limit, which that level does not reach.
bool level_computes_in(const std::string& level, const std::string& dtype) {
  return dtype == "float32" || (dtype == "bfloat16" && (level == "avx512bf16" || level == "amx"));
}

// An implementation timed at each level: its name says it runs kernmap's kernels (bench.h).
bool runs_kernmap(const Impl& im) {
  return im.name.find("kernmap") != std::string::npos;
}

// Floats in a 64-byte line: the byte probes' unit of work.
constexpr int64_t kLine = 16;

// The byte probes' loads and stores: 32 bytes at a time (AVX) where the CPU has AVX, else 16 (SSE2, every
// x86-64 CPU). On zen3-vm (AMD EPYC Zen 3, 2026-12-07) a C++ copy of 256 MiB by SSE2's streamed stores ran
// 28.5-33.9 GB/s (medians of 12, five rounds) against 34.7-38.4 by AVX's, and the same read loop 19 against
// 25-26: a 16-byte probe there states a looser floor than the memory allows. kernmap's fp32 rows stream 32
// bytes at a time from avx2 up (kernels/cpu/vec.h). GCC's check includes the OS's saving of the AVX
// registers.
bool probe_avx() {
  static const bool avx = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") != 0;
  }();
  return avx;
}

// Lines [begin, end) of src (16 floats each) summed into eight accumulators (each piece's loads independent
// of the last's sums), returned as one float.
float sum_lines_sse2(const float* src, int64_t begin, int64_t end) {
  __m128 acc[8];
  for (auto& a : acc) a = _mm_setzero_ps();
  int64_t l = begin;
  for (; l + 1 < end; l += 2)
    for (int k = 0; k < 8; ++k) acc[k] = _mm_add_ps(acc[k], _mm_loadu_ps(src + l * kLine + 4 * k));
  for (; l < end; ++l)
    for (int k = 0; k < 4; ++k) acc[k] = _mm_add_ps(acc[k], _mm_loadu_ps(src + l * kLine + 4 * k));
  alignas(16) float lanes[4];
  __m128 s = _mm_setzero_ps();
  for (const auto& a : acc) s = _mm_add_ps(s, a);
  _mm_store_ps(lanes, s);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}
__attribute__((target("avx"))) float sum_lines_avx(const float* src, int64_t begin, int64_t end) {
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  int64_t l = begin;
  for (; l + 3 < end; l += 4)
    for (int k = 0; k < 8; ++k) acc[k] = _mm256_add_ps(acc[k], _mm256_loadu_ps(src + l * kLine + 8 * k));
  for (; l < end; ++l)
    for (int k = 0; k < 2; ++k) acc[k] = _mm256_add_ps(acc[k], _mm256_loadu_ps(src + l * kLine + 8 * k));
  alignas(32) float lanes[8];
  __m256 s = _mm256_setzero_ps();
  for (const auto& a : acc) s = _mm256_add_ps(s, a);
  _mm256_store_ps(lanes, s);
  float t = 0;
  for (float v : lanes) t += v;
  return t;
}

// A read of n floats, 64-byte lines split among the threads (sum_lines_*): the memory's read rate, which a
// case that mostly reads is held to (Case::written). The sum goes to read_sum, so that the reads are not
// dropped.
volatile float read_sum = 0;
void read_streamed(const float* src, int64_t n) {
  const int64_t lines = n / kLine;
  std::atomic<float> total{0};
  const bool avx = probe_avx();
  at::parallel_for(0, lines, 4096, [&](int64_t begin, int64_t end) {
    const float part = avx ? sum_lines_avx(src, begin, end) : sum_lines_sse2(src, begin, end);
    total.fetch_add(part, std::memory_order_relaxed);
  });
  float tail = 0;
  for (int64_t i = lines * kLine; i < n; ++i) tail += src[i];
  read_sum = total.load() + tail;
}

// The caches emptied of what the last run left: a read of twice the last-level cache (cpu_caches: one
// instance's, or what the system lists; at most 1 GiB, at least 64 MiB), before every run of every
// implementation, the byte probes included (not the dense GEMM probes: Impl::keep_caches). Without it the
// implementations of a case that fits a large last-level cache read their inputs from it, the later ones more
// than the first (kernmap's levels run back to back on the same tensors) and more than the probes: on
// xeon-amx-vm (sysfs L3 480 MiB, 2026-12-06) fp32 rms_norm fwd [4096, 3584] read 52 GB/s against a 45 GB/s
// streamed copy, 0.75x "its floor". Every row is then timed from memory, the floor's terms.
void empty_caches() {
  static const at::Tensor buf = [] {
    const int64_t bytes = std::clamp<int64_t>(2 * cpu_caches().l3_bytes, int64_t(64) << 20, int64_t(1) << 30);
    at::Tensor t = at::ones({bytes / 4});
    (void)advise_huge_pages(t);
    return t;
  }();
  read_streamed(buf.const_data_ptr<float>(), buf.numel());
}

struct Timing {
  double median_ms, min_ms, max_ms;
  double peak_bytes = 0;      ///< the most CPU memory one run allocated above what was live before it
  double faults_per_run = 0;  ///< minor page faults of the process during a timed run, on average
};

Timing stats(std::vector<double> ms, double peak_bytes, double faults) {
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front(), ms.back(), peak_bytes, faults / static_cast<double>(ms.size())};
}

// Page faults of this process so far (minor: memory the kernel maps in, zeroed).
int64_t minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// Times every implementation of a case; repetition i of each runs before repetition i+1 of any. Each run's
// peak memory is counted too (kernmap/memory.h: c10's CPU allocator and the large-block cache).
//
// The warm-up lasts until the allocator is in its steady state: while a warm-up round has an implementation
// page-faulting in more than 1 MiB, one more round (at most 10 more, and none once the extra rounds have
// taken 10 s). glibc hands a freed large block back only after a few calls: a 155 MB output (bf16 silu at
// [4096, 18944]) came from fresh memory, 37,888 page faults and 3x the time, on the 2nd to 8th call of a
// process, and on none after (xeon-avx512-vm, 2026-12-03; glibc's settings alone). Three warm-ups left 5 of
// 11 timed runs in that state, and a row's median jumped between runs. Large blocks now come from the keeping
// allocator (cli/bench_alloc.cpp), which reuses them from the second call; the rule stays for what it does
// not keep.
std::vector<Timing> time_interleaved(const std::vector<Impl>& impls, const Options& o) {
  constexpr int64_t kSteadyFaults = 256;  // 1 MiB of 4 KiB pages
  constexpr int kMaxExtraRounds = 10;
  constexpr double kMaxExtraMs = 10000;
  count_cpu_memory();
  std::vector<std::vector<double>> ms(impls.size());
  std::vector<double> peak(impls.size(), 0), timed_faults(impls.size(), 0);
  int warmup = o.warmup;
  double extra_ms = 0;
  for (int r = 0; r < warmup + o.reps; ++r) {
    bool faulted = false;
    const double round_start = now_ms();
    for (size_t i = 0; i < impls.size(); ++i) {
      const int cap = impls[i].reps_cap;
      if (cap > 0 && (r < warmup || static_cast<int>(ms[i].size()) >= cap)) continue;
      if (!o.warm && !impls[i].keep_caches) empty_caches();
      reset_cpu_memory_peak();
      const int64_t before = cpu_memory().in_use;
      const int64_t faults = minor_faults();
      const double t0 = now_ms();
      impls[i].run();
      const double t1 = now_ms();
      const int64_t run_faults = minor_faults() - faults;
      faulted = faulted || run_faults > kSteadyFaults;
      peak[i] = std::max(peak[i], static_cast<double>(cpu_memory().peak - before));
      if (r >= warmup) {
        ms[i].push_back(t1 - t0);
        timed_faults[i] += static_cast<double>(run_faults);
      }
    }
    if (r >= o.warmup && r < warmup) extra_ms += now_ms() - round_start;  // an extra warm-up round
    if (r == warmup - 1 && faulted && warmup < o.warmup + kMaxExtraRounds && extra_ms < kMaxExtraMs) ++warmup;
  }
  std::vector<Timing> out;
  for (size_t i = 0; i < ms.size(); ++i) out.push_back(stats(ms[i], peak[i], timed_faults[i]));
  return out;
}

// Lines [begin, end) of src (16 floats each) copied to dst by non-temporal stores (dst aligned to their
// width).
void copy_lines_sse2(const float* src, float* dst, int64_t begin, int64_t end) {
  for (int64_t l = begin; l < end; ++l) {
    const auto* s = reinterpret_cast<const __m128i*>(src + l * kLine);
    auto* d = reinterpret_cast<__m128i*>(dst + l * kLine);
    for (int k = 0; k < 4; ++k) _mm_stream_si128(d + k, _mm_loadu_si128(s + k));
  }
}
__attribute__((target("avx"))) void copy_lines_avx(const float* src, float* dst, int64_t begin, int64_t end) {
  for (int64_t l = begin; l < end; ++l)
    for (int k = 0; k < 2; ++k)
      _mm256_stream_ps(dst + l * kLine + 8 * k, _mm256_loadu_ps(src + l * kLine + 8 * k));
}

// A copy whose stores bypass the caches (non-temporal, 32 or 16 bytes: probe_avx), 64-byte lines split among
// the threads: plain stores first read each line they write (a copy of n bytes moves 3n), and kernmap's
// kernels stream their large outputs (kernels/cpu/vec.h), so a plain copy alone understates what the memory
// does. Tail floats go by plain stores; so does everything when dst is not aligned to the stores' width.
void copy_streamed(const float* src, float* dst, int64_t n) {
  const int64_t lines = reinterpret_cast<uintptr_t>(dst) % 32 == 0 ? n / kLine : 0;
  const bool avx = probe_avx();
  at::parallel_for(0, lines, 4096, [&](int64_t begin, int64_t end) {
    if (avx)
      copy_lines_avx(src, dst, begin, end);
    else
      copy_lines_sse2(src, dst, begin, end);
    _mm_sfence();
  });
  std::copy(src + lines * kLine, src + n, dst + lines * kLine);
}

// The byte-rate probe: a float32 buffer copied into another by plain stores and by streamed ones (bytes read
// + bytes written; the copy rate is the faster's), and read alone (the read rate). Measured once at the start
// on 256 MiB (far beyond the caches: the run's `limits` line) and again inside every case, its
// repetitions interleaved with the case's implementations, so that a row's copy floor comes from the same
// moments as its own times: on a shared machine the bandwidth moves by tens of percent within a run, and one
// figure from the start misstates later rows either way.
//
// Inside a case the probe moves as many bytes as the case (up to 256 MiB a buffer), so that it meets the
// caches as the case's implementations do (from memory, empty_caches, unless --warm-caches). With warm caches
// and one plain copy of 256 MiB the fp32 rms_norm fwd [4096, 3584] case (117 MB) ran at 36 GB/s against 24:
// 0.70x "its floor" (xeon-amx-vm, 2026-12-06; sysfs L3 480 MiB).
//
// Its buffers are on huge pages where the system grants them, as the large blocks kernmap's kernels write and
// the MoE cases' weights are (kernmap/memory.h): on 4 KiB pages the probe read 14-17 GB/s inside the MoE
// fwd+bwd cases (3-8 in the fused loss's) against 23-26 at the start, with no page fault, while the cases'
// kernels ran at their usual speed — the page walks of a copy in a process holding GBs, not the machine —
// and the rows read 0.90x "their floor" (xeon-amx-vm, 2026-12-06). On huge pages the same cases' probes read
// 22-26. `huge_pages` says whether both buffers got them (no THP, buffers under 16 MiB, KERNMAP_HUGE_PAGES=0:
// 4 KiB pages, as the kernels' memory then).
struct CopyProbe {
  static constexpr int64_t kMaxFloats = int64_t(1) << 26;
  int64_t floats;
  at::Tensor src, dst;
  bool huge_pages;
  explicit CopyProbe(int64_t n = kMaxFloats)
      : floats(n),
        src(at::rand({n})),
        dst(at::zeros({n})),  // faulted in, so that its pages can be collapsed now
        huge_pages(advise_huge_pages(src) && advise_huge_pages(dst)) {
    // A streamed copy that missed a piece would report a rate it did not move: checked once.
    copy_streamed(src.data_ptr<float>(), dst.data_ptr<float>(), floats);
    if (!at::equal(src, dst))
      throw std::runtime_error("bench: the streamed copy probe of " + std::to_string(n) +
                               " floats did not copy its source");
  }
  /// The floats of a probe that moves `bytes` (read + written), within 1 and kMaxFloats.
  static int64_t floats_for(double bytes) {
    return std::clamp(static_cast<int64_t>(bytes / 8), int64_t(1), kMaxFloats);
  }
  /// The copy by plain stores (torch's), the streamed one (the copy rate: the faster's), and a read of the
  /// source (the read rate).
  std::vector<Impl> impls() {
    return {
        {"copy", [this] { dst.copy_(src); }},
        {"copy streamed", [this] { copy_streamed(src.data_ptr<float>(), dst.data_ptr<float>(), floats); }},
        {"read", [this] { read_streamed(src.data_ptr<float>(), floats); }}};
  }
  static constexpr size_t kImpls = 3;
  double gbps(const Timing& t) const { return 2.0 * static_cast<double>(floats) * 4 / (t.median_ms * 1e6); }
  double read_gbps(const Timing& t) const { return static_cast<double>(floats) * 4 / (t.median_ms * 1e6); }
};

/// A probe's rates, GB/s: the copy by plain and by streamed stores (read + written), the read.
struct CopyRate {
  double plain = 0, streamed = 0, read = 0;
  double best() const { return std::max(plain, streamed); }
  const char* by() const { return streamed > plain ? "streamed" : "plain"; }
};

/// Pops the probe's timings off the back of `timings` (pushed as probe.impls() in that order).
CopyRate pop_copy_rate(const CopyProbe& probe, std::vector<Timing>& timings) {
  CopyRate r;
  r.read = probe.read_gbps(timings.back());
  timings.pop_back();
  r.streamed = probe.gbps(timings.back());
  timings.pop_back();
  r.plain = probe.gbps(timings.back());
  timings.pop_back();
  return r;
}

CopyRate copy_rate(CopyProbe& probe, const Options& o) {
  Options copy_opts = o;
  copy_opts.reps = std::max(o.reps, 5);
  std::vector<Timing> t = time_interleaved(probe.impls(), copy_opts);
  return pop_copy_rate(probe, t);
}

// A square product of n x n in a dtype, timed for a dense rate.
struct DenseProbe {
  int64_t n = 0;
  at::Tensor a, b;
  DenseProbe() = default;
  DenseProbe(at::ScalarType dt, int64_t side)
      : n(side), a(at::randn({side, side}).to(dt)), b(at::randn({side, side}).to(dt)) {}
  Impl impl() const {
    return {"dense probe",
            [this] {
              at::NoGradGuard g;
              at::mm(a, b);
            },
            0, /*keep_caches=*/true};
  }
  double gflops(const Timing& t) const { return 2.0 * static_cast<double>(n * n * n) / (t.median_ms * 1e6); }
};

// The machine's practical GEMM throughput for a dtype: the median of repetitions of a square product, 2048 on
// a side, or 1024 or 512 where one product at 2048 would take over half a second. A CPU without instructions
// for the dtype can run it far below the fp32 rate (bf16 through torch on an AVX2 EPYC: 0.7 GFLOP/s, 25 s a
// product at 2048), and a rate that low floors nothing (the fp32 rate floors the low-precision rows, which
// may compute in fp32), so it is measured on the smaller product in a second instead of minutes. The size is
// chosen from the second of two 512-sided products (the first pays the library's set-up). The product it was
// measured on goes to `*probe` where given.
//
// fp32's product is timed again among each product case's repetitions, as the copy probe: one measurement at
// the start floors every product row of the run, and on a shared machine that moment can be slow — a run on
// zen3-vm measured 66.9 GFLOP/s at its start (188 in the next run) and read its product rows at 0.41-0.64x
// their floors. The run's fp32 rate is the fastest of all its measurements (a slow one would flatter every
// row); each row also reports its case's own.
double dense_gflops(const std::string& dtype, const Options& o, DenseProbe* probe = nullptr) {
  const at::ScalarType dt = dtype_of(dtype);
  const auto timed = [](const DenseProbe& p, int warmup, int reps) {
    Options opts;
    opts.warmup = warmup;
    opts.reps = reps;
    return time_interleaved({p.impl()}, opts)[0];
  };
  const DenseProbe small(dt, 512);
  DenseProbe p(dt, dense_product_side(timed(small, 1, 1).median_ms));
  const double gflops = p.gflops(timed(p, o.warmup, std::max(3, std::min(o.reps, 7))));
  if (probe) *probe = std::move(p);
  return gflops;
}

struct Row {
  Case c;
  std::string impl;
  std::string level;  ///< the level kernmap's kernels ran at; empty for an implementation that runs none
  Timing t;
  CopyRate copy;                ///< the copy bandwidths measured among the case's repetitions (CopyProbe)
  double dense_gflops = 0;      ///< the fp32 dense rate measured among them (DenseProbe; 0: no FLOPs)
  double copy_probe_bytes = 0;  ///< the bytes (read + written) of that copy: the case's, up to 512 MiB
};

struct Floor {
  double ms;
  std::string source;  ///< the limit it came from: "copy", "gemm fp32", "gemm bf16"
};

std::string short_dtype(const std::string& dtype) {
  return dtype == "float32" ? "fp32" : dtype == "bfloat16" ? "bf16" : dtype;
}

Json limit_json(const LevelLimit& l) {
  Json cores = Json::array();
  for (const CoreRate& c : l.cores)
    cores.push_back({{"core", c.core},
                     {"gflops", c.gflops > 0 ? Json(c.gflops) : Json(nullptr)},
                     {"error", c.error.empty() ? Json(nullptr) : Json(c.error)}});
  return {{"float32", l.gflops > 0 ? Json(l.gflops) : Json(nullptr)},
          {"source", l.gflops > 0 ? Json("OpenBLAS " + l.core) : Json(nullptr)},
          {"library", l.library.empty() ? Json(nullptr) : Json(l.library)},
          {"error", l.error.empty() ? Json(nullptr) : Json(l.error)},
          {"cores", cores},
          {"bfloat16", l.bf16_gflops > 0 ? Json(l.bf16_gflops) : Json(nullptr)},
          {"bfloat16_source", l.bf16_source.empty() ? Json(nullptr) : Json(l.bf16_source)},
          {"bfloat16_error", l.bf16_error.empty() ? Json(nullptr) : Json(l.bf16_error)}};
}

struct LimitOptions {
  bool json = false;
  std::string level;       // empty: every level the CPU runs
  std::string core;        // the child's: one OpenBLAS core kind, measured in this process
  std::string onednn_isa;  // the child's: torch's bf16 product with oneDNN held to this ISA
  int threads = 0;         // 0: torch's
};

// `kernmap bench limit`: each level's dense fp32 GEMM rate as a CPU of that level would reach it; with
// --openblas-core (the child measure_level_limit runs) one core kind's rate, as one JSON line.
int limit_command(const LimitOptions& o) {
  const int threads = o.threads > 0 ? o.threads : at::get_num_threads();
  if (!o.core.empty()) {
    if (setenv("OPENBLAS_NUM_THREADS", std::to_string(threads).c_str(), 1) != 0)
      throw std::runtime_error("cannot set OPENBLAS_NUM_THREADS");
    const CoreRate r = measure_openblas_core(o.core);
    std::printf("%s\n",
                Json({{"core", r.core}, {"gflops", r.gflops}, {"library", r.library}}).dump().c_str());
    return 0;
  }
  if (!o.onednn_isa.empty()) {
    // oneDNN reads both once, at its first primitive: nothing in this process has run one yet. The verbose
    // lines (stdout) name the implementation each product ran, which the parent checks
    // (onednn_implementation).
    if (setenv("ONEDNN_MAX_CPU_ISA", o.onednn_isa.c_str(), 1) != 0 || setenv("ONEDNN_VERBOSE", "1", 1) != 0)
      throw std::runtime_error("cannot set ONEDNN_MAX_CPU_ISA");
    at::set_num_threads(threads);
    Options opts;
    const double g = dense_gflops("bfloat16", opts);
    std::fflush(stdout);
    std::printf("%s\n", Json({{"isa", o.onednn_isa}, {"gflops", g}}).dump().c_str());
    return 0;
  }
  const std::vector<std::string> levels =
      o.level.empty() ? supported_cpu_levels() : std::vector<std::string>{o.level};
  std::vector<LevelLimit> limits;
  const std::string top = supported_cpu_levels().back();
  for (const std::string& level : levels) {
    limits.push_back(measure_level_limit(level, threads));
    if (level != top) measure_level_bf16(limits.back(), threads);
  }
  const bool all_measured =
      std::all_of(limits.begin(), limits.end(), [](const LevelLimit& l) { return l.gflops > 0; });
  if (o.json) {
    Json doc = {{"cpu_model", cpu_model()}, {"threads", threads}, {"levels", Json::object()}};
    for (const LevelLimit& l : limits) doc["levels"][l.level] = limit_json(l);
    print_json(doc);
    return all_measured ? 0 : 1;
  }
  std::printf(
      "dense fp32 GEMM of a CPU of each level (OpenBLAS's kernels for that level; bf16: oneDNN held to the "
      "level's instructions, where the machine has more), %d threads:\n",
      threads);
  for (const LevelLimit& l : limits) {
    if (l.gflops > 0)
      std::printf("%s: %.1f GFLOP/s (OpenBLAS %s)", l.level.c_str(), l.gflops, l.core.c_str());
    else
      std::printf("%s: not measured (%s)", l.level.c_str(), l.error.c_str());
    std::string each;
    for (const CoreRate& c : l.cores)
      each += (each.empty() ? "" : ", ") + c.core + " " + (c.gflops > 0 ? fixed(c.gflops, 1) : "failed");
    std::printf("; %s", each.c_str());
    if (l.bf16_gflops > 0)
      std::printf("; bf16 %.1f GFLOP/s (%s)", l.bf16_gflops, l.bf16_source.c_str());
    else if (!l.bf16_error.empty())
      std::printf("; bf16 not measured (%s)", l.bf16_error.c_str());
    std::printf("\n");
  }
  if (!limits.empty() && !limits.front().library.empty())
    std::printf("library: %s\n", limits.front().library.c_str());
  return all_measured ? 0 : 1;
}

std::string bytes_text(int64_t b) {
  if (b <= 0) return "?";
  if (b % (int64_t(1) << 20) == 0) return std::to_string(b >> 20) + " MiB";
  return std::to_string(b >> 10) + " KiB";
}

int bench_command(const Options& o) {
  const bool tensors_huge = keep_freed_memory(!o.system_pages);
  auto regex_of = [](const char* flag, const std::string& text) {
    try {
      return std::regex(text.empty() ? ".*" : text);
    } catch (const std::regex_error& e) {
      throw std::invalid_argument(std::string(flag) + " '" + text +
                                  "' is not a valid regular expression: " + e.what());
    }
  };
  const std::regex filter = regex_of("--filter", o.filter);
  const std::regex shape_filter = regex_of("--shape", o.shape);
  const std::regex impl_filter = regex_of("--impl", o.impl);
  const ShapeFilter wanted = [&](const std::string& shape) { return std::regex_search(shape, shape_filter); };
  const bool progress = !o.json && isatty(STDERR_FILENO);

  const std::vector<std::pair<std::string, CaseFactory>> families = {
      {"rms_norm", rms_norm_cases},
      {"add_rms_norm", add_rms_norm_cases},
      {"apply_rotary", rotary_cases},
      {"silu", silu_cases},
      {"silu_and_mul", silu_and_mul_cases},
      {"swiglu", swiglu_cases},
      {"grouped_mm", grouped_mm_cases},
      {"experts", experts_cases},
      {"linear_cross_entropy", linear_cross_entropy_cases}};
  const std::vector<std::string> dtypes = {"float32", "bfloat16"};
  std::vector<std::pair<const CaseFactory*, std::string>> planned;
  for (const auto& [op, factory] : families)
    for (const auto& dt : dtypes)
      if (std::regex_search(op + "/" + dt, filter)) planned.push_back({&factory, dt});

  const std::string start_level = cpu_level();
  // torch's own kernels dispatch on their own level (ATEN_CPU_CAPABILITY caps it, read once per process):
  // KERNMAP_CPU_ISA and --levels change kernmap's only.
  const std::string torch_level = at::get_cpu_capability();
  const std::vector<std::string> levels = levels_to_run(o.levels);
  CopyProbe probe;
  const CopyRate start_copy = copy_rate(probe, o);
  const double copy = start_copy.best();
  // Dense GFLOP/s per dtype, measured when a case does FLOPs: its dtype's and fp32's (the honest limit of a
  // low-precision case computed in fp32); both again in every product case (their DenseProbes), the fastest
  // kept. The case dtype's too: a bf16 rate measured once at a slow moment flattered every bf16 product row
  // (xeon-amx-vm, 2026-12-06: 2045 GFLOP/s at a run's start against 2360-2435 in the runs around it, and the
  // fused loss's bf16 fwd read 0.97x "its floor").
  std::map<std::string, double> peak;
  std::map<std::string, DenseProbe> dense_probes;
  // The levels run below the CPU's own (its highest supported level: torch's products run there whatever
  // KERNMAP_CPU_ISA says): their kernels' products are held to a CPU of that level's dense fp32 rate,
  // measured when the first case with level-bound FLOPs comes.
  const std::string cpu_top = supported_cpu_levels().back();
  std::map<std::string, LevelLimit> level_limits;
  std::vector<Row> rows;
  for (size_t i = 0; i < planned.size(); ++i) {
    const auto& [factory, dt] = planned[i];
    for (const CaseBuilder& build : (*factory)(dt, wanted)) {
      Case c = build();
      if (!wanted(c.shape)) continue;
      std::vector<Impl> impls;
      std::vector<std::string> impl_levels;
      for (Impl& im : c.impls) {
        if (!std::regex_search(c.op + "/" + c.pass + "/" + im.name, impl_filter)) continue;
        if (!runs_kernmap(im)) {
          impls.push_back(std::move(im));
          impl_levels.emplace_back();
          continue;
        }
        for (const std::string& level : levels) {
          impls.push_back({im.name,
                           [run = im.run, level] {
                             set_cpu_level(level);
                             run();
                           },
                           im.reps_cap});
          impl_levels.push_back(level);
        }
      }
      c.impls = std::move(impls);
      if (c.impls.empty()) continue;
      if (progress)
        std::fprintf(stderr, "\r[%zu/%zu] %s %s %s %s...          ", i + 1, planned.size(), c.op.c_str(),
                     c.pass.c_str(), dt.c_str(), c.shape.c_str());
      for (const std::string& d : {dt, std::string("float32")})
        if (c.flops > 0 && !peak.count(d)) peak[d] = dense_gflops(d, o, &dense_probes[d]);
      if (c.flops > 0 && c.level_bound_flops)
        for (const std::string& level : levels)
          if (level != cpu_top && !level_limits.count(level)) {
            level_limits[level] = measure_level_limit(level, at::get_num_threads());
            measure_level_bf16(level_limits[level], at::get_num_threads());
          }
      Options co = o;
      if (c.max_reps > 0) {
        co.reps = std::min(o.reps, c.max_reps);
        co.warmup = std::min(o.warmup, 1);
      }
      // The case's own copy bandwidth, on its bytes (the start's probe where the case moves 256 MiB or more).
      const int64_t probe_floats = CopyProbe::floats_for(c.bytes);
      std::unique_ptr<CopyProbe> sized;
      if (probe_floats < probe.floats) sized = std::make_unique<CopyProbe>(probe_floats);
      CopyProbe& case_probe = sized ? *sized : probe;
      for (Impl& im : case_probe.impls()) c.impls.push_back(std::move(im));
      // and the dense rates of fp32 and of the case's dtype
      std::vector<std::string> dense_dtypes;
      if (c.flops > 0)
        dense_dtypes =
            dt == "float32" ? std::vector<std::string>{dt} : std::vector<std::string>{"float32", dt};
      for (const std::string& d : dense_dtypes) c.impls.push_back(dense_probes.at(d).impl());
      std::vector<Timing> timings = time_interleaved(c.impls, co);
      double case_dense = 0;
      for (auto d = dense_dtypes.rbegin(); d != dense_dtypes.rend(); ++d) {
        c.impls.pop_back();
        const double rate = dense_probes.at(*d).gflops(timings.back());
        timings.pop_back();
        peak[*d] = std::max(peak[*d], rate);
        if (*d == "float32") case_dense = rate;
      }
      c.impls.resize(c.impls.size() - CopyProbe::kImpls);
      const CopyRate case_copy = pop_copy_rate(case_probe, timings);
      sized.reset();
      set_cpu_level(start_level);
      std::vector<std::string> names;
      for (const Impl& im : c.impls) names.push_back(im.name);
      // The closures hold the case's tensors (GBs of expert weights): drop them before the next case is
      // built, or every case stays alive through its rows (the whole MoE set ran out of 24 GiB). The memory
      // this case's runs freed goes back too — the large-block cache's blocks and what glibc kept
      // (keep_freed_memory): the next case's sizes differ, and holding both next to an eager reference's peak
      // also ran out of 24 GiB.
      c.impls.clear();
      kernmap::release_cached_memory();
      release_freed_memory();
      malloc_trim(0);
      for (size_t k = 0; k < names.size(); ++k) {
        rows.push_back({c, names[k], impl_levels[k], timings[k], case_copy, case_dense, 8.0 * probe_floats});
        // The dense row of a case measures the same peak again: the floor uses the better of the two
        // measurements (one slow calibration, e.g. a first MKL call, would otherwise flatter every row).
        if (names[k] == "dense" && c.flops > 0)
          peak[dt] = std::max(peak[dt], c.flops / (timings[k].median_ms * 1e6));
      }
    }
  }
  if (progress) std::fprintf(stderr, "\r%100s\r", "");

  auto gbps = [](const Row& r) { return r.c.bytes / (r.t.median_ms * 1e6); };
  auto gflops = [](const Row& r) { return r.c.flops / (r.t.median_ms * 1e6); };
  // The floor: the larger of the bytes at the copy bandwidth and the FLOPs at the fastest dense rate the
  // row's level can use (an implementation outside kernmap, or whose products go through BLAS: the faster of
  // the machine's fp32 and case-dtype rates).
  auto floor_of = [&](const Row& r) {
    Floor f{r.c.bytes / (r.copy.best() * 1e6), "copy"};
    // The bytes read alone at the read rate, where the case states what it writes (Case::written).
    if (r.c.written >= 0 && r.copy.read > 0) {
      const double read_ms = (r.c.bytes - r.c.written) / (r.copy.read * 1e6);
      if (read_ms > f.ms) f = {read_ms, "read"};
    }
    if (r.c.flops <= 0) return f;
    const bool level_bound = !r.level.empty() && r.c.level_bound_flops;
    double compute = 0;
    std::string source;
    for (const std::string& d : {std::string("float32"), r.c.dtype}) {
      if (!peak.count(d) || (level_bound && !level_computes_in(r.level, d))) continue;
      double rate = peak.at(d);
      std::string from = "gemm " + short_dtype(d);
      // A lower level's products: the rate of a CPU of that level, fp32 (OpenBLAS's kernels for it) and,
      // where the level computes in bf16 below the machine's best (avx512bf16 on a CPU with AMX tiles), bf16
      // by oneDNN held to the level's instructions; held to the machine's rates where not measured.
      const auto limit = level_limits.find(r.level);
      if (level_bound && limit != level_limits.end()) {
        const double at_level = d == "float32" ? limit->second.gflops : limit->second.bf16_gflops;
        if (at_level > 0 && (d == "float32" || d == "bfloat16")) {
          rate = at_level;
          from = "gemm " + short_dtype(d) + " at " + r.level;
        }
      }
      const double ms = r.c.flops / (rate * 1e6);
      if (source.empty() || ms < compute) {
        compute = ms;
        source = from;
      }
    }
    if (compute > f.ms) f = {compute, source};
    return f;
  };
  auto floor_ms = [&](const Row& r) { return floor_of(r).ms; };
  auto reference_ms = [&](const Row& r) {
    for (const Row& o2 : rows)
      if (o2.c.op == r.c.op && o2.c.pass == r.c.pass && o2.c.dtype == r.c.dtype && o2.c.shape == r.c.shape &&
          o2.impl == "reference")
        return o2.t.median_ms;
    return r.t.median_ms;
  };
  const std::string model = cpu_model();
  const CpuCaches caches = cpu_caches();
  if (o.json) {
    Json results = Json::array();
    for (const Row& r : rows) {
      Json row = {{"op", r.c.op},
                  {"pass", r.c.pass},
                  {"dtype", r.c.dtype},
                  {"shape", r.c.shape},
                  {"impl", r.impl},
                  {"level", r.level.empty() ? Json(nullptr) : Json(r.level)},
                  {"bytes", r.c.bytes},
                  {"flops", r.c.flops},
                  {"median_ms", r.t.median_ms},
                  {"min_ms", r.t.min_ms},
                  {"max_ms", r.t.max_ms},
                  {"gbps", gbps(r)},
                  {"copy_gbps", r.copy.best()},
                  {"copy_by", r.copy.by()},
                  {"copy_plain_gbps", r.copy.plain},
                  {"copy_streamed_gbps", r.copy.streamed},
                  {"read_gbps", r.copy.read},
                  {"bytes_written", r.c.written >= 0 ? Json(r.c.written) : Json(nullptr)},
                  {"copy_probe_bytes", r.copy_probe_bytes},
                  {"dense_gflops", r.dense_gflops > 0 ? Json(r.dense_gflops) : Json(nullptr)},
                  {"pct_of_copy", 100 * gbps(r) / r.copy.best()},
                  {"speedup_vs_reference", reference_ms(r) / r.t.median_ms},
                  {"floor_ms", floor_ms(r)},
                  {"floor_source", floor_of(r).source},
                  {"x_floor", r.t.median_ms / floor_ms(r)},
                  {"peak_bytes", r.t.peak_bytes},
                  {"faults_per_run", r.t.faults_per_run}};
      if (r.c.flops > 0) row["gflops"] = gflops(r);
      results.push_back(std::move(row));
    }
    Json dense = Json::object();
    for (const auto& [dt, g] : peak) dense[dt] = g;
    Json level_dense = Json::object();
    for (const auto& [level, limit] : level_limits) level_dense[level] = limit_json(limit);
    print_json(
        {{"machine",
          {{"cpu_model", model},
           {"cpu_level", start_level},
           {"cpu_levels_supported", supported_cpu_levels()},
           {"levels_run", levels},
           {"torch_cpu_capability", torch_level},
           {"caches",
            {{"l1d_bytes", caches.l1d_bytes}, {"l2_bytes", caches.l2_bytes}, {"l3_bytes", caches.l3_bytes}}},
           {"copy_gbps", copy},
           {"copy_plain_gbps", start_copy.plain},
           {"copy_streamed_gbps", start_copy.streamed},
           {"read_gbps", start_copy.read},
           {"copy_huge_pages", probe.huge_pages},
           {"tensors_huge_pages", tensors_huge},
           {"dense_gflops", dense},
           {"level_dense_gflops", level_dense},
           {"threads", at::get_num_threads()},
           {"caches_emptied", !o.warm}}},
         {"results", results}});
    return 0;
  }
  std::printf(
      "machine: %s; CPU level %s (supported: %s; run: %s); torch's ops at %s; caches L1d %s, L2 %s, L3 %s "
      "(one core's)\n",
      model.c_str(), start_level.c_str(), join(supported_cpu_levels()).c_str(), join(levels).c_str(),
      torch_level.c_str(), bytes_text(caches.l1d_bytes).c_str(), bytes_text(caches.l2_bytes).c_str(),
      bytes_text(caches.l3_bytes).c_str());
  // levels_to_run lists the levels lowest first.
  if (!levels.empty() && level_rank(levels.front()) < torch_rank(torch_level))
    std::printf(
        "note: torch's own ops (the reference, a separate add) run at %s, above level %s: to time a CPU of "
        "that level, set ATEN_CPU_CAPABILITY too (avx2, or default for baseline; docs/performance.md, "
        "\"Emulating another CPU\")\n",
        torch_level.c_str(), levels.front().c_str());
  double case_min = copy, case_max = copy;
  for (const Row& r : rows) {
    case_min = std::min(case_min, r.copy.best());
    case_max = std::max(case_max, r.copy.best());
  }
  std::printf(
      "limits: copy bandwidth %.1f GB/s (read + write; plain stores %.1f, streamed %.1f; %s; %.1f..%.1f "
      "measured among the cases' own repetitions on each case's bytes, each row's floor from its case's), "
      "read %.1f GB/s",
      copy, start_copy.plain, start_copy.streamed, probe.huge_pages ? "huge pages" : "4 KiB pages", case_min,
      case_max, start_copy.read);
  for (const auto& [dt, g] : peak) std::printf(", dense %s GEMM %.1f GFLOP/s", dt.c_str(), g);
  for (const auto& [level, limit] : level_limits) {
    if (limit.gflops > 0)
      std::printf(", at %s %.1f (fp32, OpenBLAS %s)", level.c_str(), limit.gflops, limit.core.c_str());
    if (limit.bf16_gflops > 0)
      std::printf(" and %.1f (bf16, %s)", limit.bf16_gflops, limit.bf16_source.c_str());
  }
  std::printf(
      "; %d threads; %d warm-up + %d timed reps (MoE cases: at most 1 + 5, fwd+bwd 3), medians%s; the cases' "
      "tensors of 16 MiB and more %s\n\n",
      at::get_num_threads(), o.warmup, o.reps,
      o.warm ? ", warm caches" : ", every run from memory (caches emptied before it)",
      tensors_huge ? "on huge pages"
                   : "on the system allocator's pages (--system-pages or KERNMAP_HUGE_PAGES=0)");
  for (const auto& [level, limit] : level_limits) {
    if (limit.gflops <= 0)
      std::printf(
          "note: no dense rate for a CPU of level %s (%s): its product rows are held to the machine's\n",
          level.c_str(), limit.error.c_str());
    if (!limit.bf16_error.empty())
      std::printf(
          "note: no dense bf16 rate for a CPU of level %s (%s): its bf16 product rows are held to the "
          "machine's\n",
          level.c_str(), limit.bf16_error.c_str());
  }
  Table t{{"op", "pass", "dtype", "shape", "impl", "level", "median ms", "min..max ms", "GB/s", "% copy",
           "GFLOP/s", "floor ms", "floor by", "x floor", "speedup", "peak MB"},
          {}};
  for (const Row& r : rows)
    t.rows.push_back({r.c.op, r.c.pass, r.c.dtype, r.c.shape, r.impl, r.level.empty() ? "-" : r.level,
                      fixed(r.t.median_ms, 3), fixed(r.t.min_ms, 2) + ".." + fixed(r.t.max_ms, 2),
                      fixed(gbps(r), 1), fixed(100 * gbps(r) / r.copy.best(), 1) + "%",
                      r.c.flops > 0 ? fixed(gflops(r), 1) : "-", fixed(floor_ms(r), 2), floor_of(r).source,
                      fixed(r.t.median_ms / floor_ms(r), 2) + "x",
                      fixed(reference_ms(r) / r.t.median_ms, 2) + "x", fixed(r.t.peak_bytes / 1e6, 1)});
  std::printf("%s", t.render().c_str());
  return 0;
}

}  // namespace

Command add_bench_command(CLI::App& parent) {
  CLI::App* bench = parent.add_subcommand(
      "bench", "kernel benchmarks (kernmap bench ops --help, kernmap bench limit --help)");
  bench->require_subcommand(0, 1);
  CLI::App* ops = bench->add_subcommand(
      "ops",
      "kernmap kernels against the reference, with GB/s and % of the machine's measured copy bandwidth");
  ops->group("Commands")->fallthrough();
  auto o = std::make_shared<Options>();
  ops->add_flag("--json", o->json, "one JSON document instead of the table");
  add_text(*ops, "--filter", o->filter, "REGEX", "a regular expression",
           "the op/dtype pairs to run (a regular expression over \"rms_norm/bfloat16\" and the like)");
  add_text(*ops, "--shape", o->shape, "REGEX", "a regular expression",
           "the shapes to run (over \"[4096, 3584]\", \"E128 k8 H2048 I768 T256\" and the like)");
  add_text(*ops, "--impl", o->impl, "REGEX", "a regular expression",
           "the implementations to time (over \"experts/fwd+bwd/reference\" and the like)");
  add_text(
      *ops, "--levels", o->levels, "all|LIST", "all or a comma list of CPU levels",
      "time kernmap's implementations at each of these CPU levels (all: every level this CPU runs, up to "
      "KERNMAP_CPU_ISA's cap; default: the level in use)");
  // Every repetition runs the op once more and keeps its time: a hundred thousand of the fastest case take
  // minutes, of the MoE cases hours.
  add_integer(*ops, "--warmup", o->warmup, 0, 100000, "untimed runs of each implementation first");
  ops->add_flag("--warm-caches", o->warm,
                "do not empty the caches before each run (by default every run starts from memory, as the "
                "floors assume)");
  ops->add_flag(
      "--system-pages", o->system_pages,
      "leave the cases' tensors on the pages the system's allocator gives (4 KiB where transparent "
      "huge pages are `madvise`) instead of huge pages, where the copy probes' buffers and kernmap's "
      "large outputs are");
  add_integer(*ops, "--reps", o->reps, 1, 100000,
              "timed runs of each implementation, whose median is reported");
  CLI::App* limit = bench->add_subcommand(
      "limit",
      "the dense fp32 GEMM rate of a CPU of each level this one runs (OpenBLAS's kernels for that level), "
      "and bf16 for avx512bf16 below AMX (oneDNN held to its instructions): what `bench ops` holds a lower "
      "level's product rows to");
  limit->group("Commands")->fallthrough();
  auto lo = std::make_shared<LimitOptions>();
  limit->add_flag("--json", lo->json, "one JSON document instead of the lines");
  add_choice(*limit, "--level", lo->level, {"baseline", "avx2", "avx512", "avx512bf16", "amx"},
             "one level (default: every level this CPU runs)");
  add_integer(*limit, "--threads", lo->threads, 1, 4096, "threads of the product (default: torch's)");
  add_text(*limit, "--openblas-core", lo->core, "CORE", "an OpenBLAS core kind",
           "measure one OpenBLAS core kind in this process (what --level runs once per kind)")
      ->group("");
  add_choice(*limit, "--onednn-isa", lo->onednn_isa, {"AVX512_CORE_BF16"},
             "measure torch's bf16 product with oneDNN held to this instruction set, in this process (what "
             "--level runs for avx512bf16 below AMX)")
      ->group("");
  auto check = [ops, limit, o, lo] {
    if (limit->parsed()) {
      const std::vector<std::string> supported = supported_cpu_levels();
      if (!lo->level.empty() && std::find(supported.begin(), supported.end(), lo->level) == supported.end())
        throw UsageError("--level: this CPU does not run level '" + lo->level + "' (it runs " +
                         join(supported) + ")");
      return;
    }
    if (!ops->parsed()) throw UsageError("expected 'bench ops' or 'bench limit', got 'bench'");
    (void)levels_to_run(o->levels);  // a bad --levels is refused before anything is measured
  };
  return {bench, check, [limit, o, lo] { return limit->parsed() ? limit_command(*lo) : bench_command(*o); }};
}

}  // namespace kernmap::cli
