// `kernmap bench ops`: each kernel against the reference, side by side in one run. Repetitions of the
// implementations of one case are interleaved so machine drift hits them alike; medians after warm-up. The
// machine's copy bandwidth (bytes read + bytes written by a large buffer copy) is measured in the same run
// and each kernel's GB/s (each input read once, each output written once, over the median) is reported
// against it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>
#include <CLI/CLI.hpp>

#include <malloc.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <stdexcept>
#include <string>

#include "cli/bench.h"
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
  std::string shape;  // regex over the case's shape ("E128 k8 H2048 I768 T256", "[4096, 3584]")
  std::string impl;   // regex over "op/pass/implementation" ("experts/fwd+bwd/reference")
  int warmup = 3;
  int reps = 11;
};

struct Timing {
  double median_ms, min_ms, max_ms;
  double peak_bytes = 0;  ///< the most CPU memory one run allocated above what was live before it
};

Timing stats(std::vector<double> ms, double peak_bytes) {
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front(), ms.back(), peak_bytes};
}

double now_ms() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}

// Times every implementation of a case; repetition i of each runs before repetition i+1 of any. Each run's
// peak memory is counted too (kernmap/memory.h: c10's CPU allocator and the large-block cache).
std::vector<Timing> time_interleaved(const std::vector<Impl>& impls, const Options& o) {
  count_cpu_memory();
  std::vector<std::vector<double>> ms(impls.size());
  std::vector<double> peak(impls.size(), 0);
  for (int r = 0; r < o.warmup + o.reps; ++r)
    for (size_t i = 0; i < impls.size(); ++i) {
      const int cap = impls[i].reps_cap;
      if (cap > 0 && (r < o.warmup || static_cast<int>(ms[i].size()) >= cap)) continue;
      reset_cpu_memory_peak();
      const int64_t before = cpu_memory().in_use;
      const double t0 = now_ms();
      impls[i].run();
      const double t1 = now_ms();
      peak[i] = std::max(peak[i], static_cast<double>(cpu_memory().peak - before));
      if (r >= o.warmup) ms[i].push_back(t1 - t0);
    }
  std::vector<Timing> out;
  for (size_t i = 0; i < ms.size(); ++i) out.push_back(stats(ms[i], peak[i]));
  return out;
}

double copy_gbps(const Options& o) {
  const int64_t n = int64_t(1) << 26;  // 256 MiB of float32 each way: far beyond the caches
  at::Tensor src = at::rand({n});
  at::Tensor dst = at::empty({n});
  Options copy_opts = o;
  copy_opts.reps = std::max(o.reps, 5);
  const Timing t = time_interleaved({Impl{"copy", [&] { dst.copy_(src); }}}, copy_opts)[0];
  return 2.0 * n * 4 / (t.median_ms * 1e6);
}

// glibc returns every block over 32 MiB to the OS on free, so each large output would be page-faulted in
// (and zeroed by the kernel) on every call: a cost of the allocator, not of the op. Training frameworks avoid
// it (caching allocators, jemalloc); the benchmark keeps freed memory in the process for every implementation
// alike.
void keep_freed_memory() {
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

// The machine's practical GEMM throughput for a dtype: a large square-ish product, median of repetitions.
double dense_gflops(const std::string& dtype, const Options& o) {
  const at::ScalarType dt = dtype_of(dtype);
  const at::Tensor a = at::randn({2048, 2048}).to(dt), b = at::randn({2048, 2048}).to(dt);
  Options opts = o;
  opts.reps = std::max(3, std::min(o.reps, 7));
  const Timing t = time_interleaved({Impl{"dense",
                                          [&] {
                                            at::NoGradGuard g;
                                            at::mm(a, b);
                                          }}},
                                    opts)[0];
  return 2.0 * 2048 * 2048 * 2048 / (t.median_ms * 1e6);
}

struct Row {
  Case c;
  std::string impl;
  Timing t;
};

int bench_command(const Options& o) {
  keep_freed_memory();
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
      {"silu_and_mul", silu_and_mul_cases},
      {"grouped_mm", grouped_mm_cases},
      {"experts", experts_cases},
      {"linear_cross_entropy", linear_cross_entropy_cases}};
  const std::vector<std::string> dtypes = {"float32", "bfloat16"};
  std::vector<std::pair<const CaseFactory*, std::string>> planned;
  for (const auto& [op, factory] : families)
    for (const auto& dt : dtypes)
      if (std::regex_search(op + "/" + dt, filter)) planned.push_back({&factory, dt});

  const double copy = copy_gbps(o);
  std::map<std::string, double> peak;  // dense GFLOP/s per dtype, measured when a case does FLOPs
  std::vector<Row> rows;
  for (size_t i = 0; i < planned.size(); ++i) {
    const auto& [factory, dt] = planned[i];
    for (const CaseBuilder& build : (*factory)(dt, wanted)) {
      Case c = build();
      if (!wanted(c.shape)) continue;
      std::vector<Impl> impls;
      for (Impl& im : c.impls)
        if (std::regex_search(c.op + "/" + c.pass + "/" + im.name, impl_filter))
          impls.push_back(std::move(im));
      c.impls = std::move(impls);
      if (c.impls.empty()) continue;
      if (progress)
        std::fprintf(stderr, "\r[%zu/%zu] %s %s %s %s...          ", i + 1, planned.size(), c.op.c_str(),
                     c.pass.c_str(), dt.c_str(), c.shape.c_str());
      if (c.flops > 0 && !peak.count(dt)) peak[dt] = dense_gflops(dt, o);
      Options co = o;
      if (c.max_reps > 0) {
        co.reps = std::min(o.reps, c.max_reps);
        co.warmup = std::min(o.warmup, 1);
      }
      const auto timings = time_interleaved(c.impls, co);
      std::vector<std::string> names;
      for (const Impl& im : c.impls) names.push_back(im.name);
      // The closures hold the case's tensors (GBs of expert weights): drop them before the next case is
      // built, or every case stays alive through its rows (the whole MoE set ran out of 24 GiB). The memory
      // this case's runs freed goes back too — the large-block cache's blocks and what glibc kept
      // (keep_freed_memory): the next case's sizes differ, and holding both next to an eager reference's peak
      // also ran out of 24 GiB.
      c.impls.clear();
      kernmap::release_cached_memory();
      malloc_trim(0);
      for (size_t k = 0; k < names.size(); ++k) {
        rows.push_back({c, names[k], timings[k]});
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
  // The floor: the larger of the FLOPs at the dense peak and the bytes at the copy bandwidth.
  auto floor_ms = [&](const Row& r) {
    const double compute = r.c.flops > 0 ? r.c.flops / (peak.at(r.c.dtype) * 1e6) : 0;
    return std::max(compute, r.c.bytes / (copy * 1e6));
  };
  auto reference_ms = [&](const Row& r) {
    for (const Row& o2 : rows)
      if (o2.c.op == r.c.op && o2.c.pass == r.c.pass && o2.c.dtype == r.c.dtype && o2.c.shape == r.c.shape &&
          o2.impl == "reference")
        return o2.t.median_ms;
    return r.t.median_ms;
  };
  if (o.json) {
    Json results = Json::array();
    for (const Row& r : rows) {
      Json row = {{"op", r.c.op},
                  {"pass", r.c.pass},
                  {"dtype", r.c.dtype},
                  {"shape", r.c.shape},
                  {"impl", r.impl},
                  {"median_ms", r.t.median_ms},
                  {"min_ms", r.t.min_ms},
                  {"max_ms", r.t.max_ms},
                  {"gbps", gbps(r)},
                  {"pct_of_copy", 100 * gbps(r) / copy},
                  {"speedup_vs_reference", reference_ms(r) / r.t.median_ms},
                  {"floor_ms", floor_ms(r)},
                  {"x_floor", r.t.median_ms / floor_ms(r)},
                  {"peak_bytes", r.t.peak_bytes}};
      if (r.c.flops > 0) row["gflops"] = gflops(r);
      results.push_back(std::move(row));
    }
    Json dense = Json::object();
    for (const auto& [dt, g] : peak) dense[dt] = g;
    print_json({{"machine",
                 {{"copy_gbps", copy},
                  {"dense_gflops", dense},
                  {"threads", at::get_num_threads()},
                  {"cpu_level", cpu_level()}}},
                {"results", results}});
    return 0;
  }
  std::printf("machine: copy bandwidth %.1f GB/s (read + write)", copy);
  for (const auto& [dt, g] : peak) std::printf(", dense %s GEMM %.1f GFLOP/s", dt.c_str(), g);
  std::printf(
      "; %d threads, CPU level %s; %d warm-up + %d timed reps (MoE cases: at most 1 + 5, fwd+bwd 3), "
      "medians\n\n",
      at::get_num_threads(), cpu_level().c_str(), o.warmup, o.reps);
  Table t{{"op", "pass", "dtype", "shape", "impl", "median ms", "min..max ms", "GB/s", "% copy", "GFLOP/s",
           "floor ms", "x floor", "speedup", "peak MB"},
          {}};
  for (const Row& r : rows)
    t.rows.push_back({r.c.op, r.c.pass, r.c.dtype, r.c.shape, r.impl, fixed(r.t.median_ms, 3),
                      fixed(r.t.min_ms, 2) + ".." + fixed(r.t.max_ms, 2), fixed(gbps(r), 1),
                      fixed(100 * gbps(r) / copy, 1) + "%", r.c.flops > 0 ? fixed(gflops(r), 1) : "-",
                      fixed(floor_ms(r), 2), fixed(r.t.median_ms / floor_ms(r), 2) + "x",
                      fixed(reference_ms(r) / r.t.median_ms, 2) + "x", fixed(r.t.peak_bytes / 1e6, 1)});
  std::printf("%s", t.render().c_str());
  return 0;
}

}  // namespace

Command add_bench_command(CLI::App& parent) {
  CLI::App* bench = parent.add_subcommand("bench", "kernel benchmarks (kernmap bench ops --help)");
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
  // Every repetition runs the op once more and keeps its time: a hundred thousand of the fastest case take
  // minutes, of the MoE cases hours.
  add_integer(*ops, "--warmup", o->warmup, 0, 100000, "untimed runs of each implementation first");
  add_integer(*ops, "--reps", o->reps, 1, 100000,
              "timed runs of each implementation, whose median is reported");
  auto check = [ops] {
    if (!ops->parsed()) throw UsageError("expected 'bench ops', got 'bench'");
  };
  return {bench, check, [o] { return bench_command(*o); }};
}

}  // namespace kernmap::cli
