// `kernmap bench ops`: each kernel against the reference, side by side in one run. Repetitions of the
// implementations of one case are interleaved so machine drift hits them alike; medians after warm-up. The
// machine's copy bandwidth (bytes read + bytes written by a large buffer copy) is measured in the same run and
// each kernel's GB/s (each input read once, each output written once, over the median) is reported against it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <regex>
#include <stdexcept>
#include <string>
#include <malloc.h>
#include <unistd.h>

#include "cli/commands.h"
#include "cli/table.h"
#include "include/kernmap/ops.h"
#include "kernels/cpu/isa.h"

namespace kernmap::cli {
namespace {

struct Options {
  bool json = false;
  std::string filter;
  int warmup = 3;
  int reps = 11;
};

struct Impl {
  std::string name;
  std::function<void()> run;
};

// One benchmark case: an op, a pass and a dtype, with the implementations timed side by side.
struct Case {
  std::string op, pass, dtype, shape;
  double bytes = 0;
  std::vector<Impl> impls;
};

struct Timing {
  double median_ms, min_ms, max_ms;
};

Timing stats(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front(), ms.back()};
}

double now_ms() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}

// Times every implementation of a case; repetition i of each runs before repetition i+1 of any.
std::vector<Timing> time_interleaved(const std::vector<Impl>& impls, const Options& o) {
  std::vector<std::vector<double>> ms(impls.size());
  for (int r = 0; r < o.warmup + o.reps; ++r)
    for (size_t i = 0; i < impls.size(); ++i) {
      const double t0 = now_ms();
      impls[i].run();
      const double t1 = now_ms();
      if (r >= o.warmup) ms[i].push_back(t1 - t0);
    }
  std::vector<Timing> out;
  for (auto& m : ms) out.push_back(stats(m));
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

at::ScalarType dtype_of(const std::string& name) { return name == "bfloat16" ? at::kBFloat16 : at::kFloat; }

std::string shape_string(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// fwd+bwd of f on inputs that require grad, with a fixed upstream gradient; grads are dropped between runs so
// no accumulation pass is timed.
std::function<void()> fwd_bwd(std::vector<at::Tensor> inputs, at::Tensor grad,
                              std::function<at::Tensor(const std::vector<at::Tensor>&)> f) {
  for (auto& t : inputs) t.requires_grad_(true);
  return [inputs, grad, f] {
    at::Tensor y = f(inputs);
    torch::autograd::backward({y}, {grad});
    for (const auto& t : inputs) t.mutable_grad().reset();
  };
}

std::vector<Case> rms_norm_cases(const std::string& dtype) {
  const at::ScalarType dt = dtype_of(dtype);
  const int64_t T = 4096, H = 3584;  // Qwen2-7B hidden size
  at::Tensor x = at::randn({T, H}).to(dt);
  at::Tensor w = (1 + 0.1 * at::randn({H})).to(dt);
  at::Tensor dy = at::randn({T, H}).to(dt);
  const double e = x.element_size();
  const double fwd_bytes = e * (T * H + H + T * H);
  const double bwd_bytes = fwd_bytes + e * (T * H + T * H + H + T * H + H);
  const double eps = 1e-6;
  auto kern = [eps](const std::vector<at::Tensor>& in) { return kernmap::rms_norm(in[0], in[1], eps); };
  auto ref = [eps](const std::vector<at::Tensor>& in) { return kernmap::reference::rms_norm(in[0], in[1], eps); };
  Case fwd{"rms_norm", "fwd", dtype, shape_string(x.sizes()), fwd_bytes,
           {{"kernmap", [=] { at::NoGradGuard g; kern({x, w}); }}, {"reference", [=] { at::NoGradGuard g; ref({x, w}); }}}};
  Case both{"rms_norm", "fwd+bwd", dtype, shape_string(x.sizes()), bwd_bytes,
            {{"kernmap", fwd_bwd({x.clone(), w.clone()}, dy, kern)},
             {"reference", fwd_bwd({x.clone(), w.clone()}, dy, ref)}}};
  return {fwd, both};
}

std::vector<Case> silu_and_mul_cases(const std::string& dtype) {
  const at::ScalarType dt = dtype_of(dtype);
  const int64_t T = 4096, I = 18944;  // Qwen2-7B intermediate size
  at::Tensor gate = at::randn({T, I}).to(dt);
  at::Tensor up = at::randn({T, I}).to(dt);
  at::Tensor dy = at::randn({T, I}).to(dt);
  const double e = gate.element_size();
  const double n = double(T) * I;
  auto kern = [](const std::vector<at::Tensor>& in) { return kernmap::silu_and_mul(in[0], in[1]); };
  auto ref = [](const std::vector<at::Tensor>& in) { return kernmap::reference::silu_and_mul(in[0], in[1]); };
  Case fwd{"silu_and_mul", "fwd", dtype, shape_string(gate.sizes()), e * 3 * n,
           {{"kernmap", [=] { at::NoGradGuard g; kern({gate, up}); }},
            {"reference", [=] { at::NoGradGuard g; ref({gate, up}); }}}};
  Case both{"silu_and_mul", "fwd+bwd", dtype, shape_string(gate.sizes()), e * 6 * n,
            {{"kernmap", fwd_bwd({gate.clone(), up.clone()}, dy, kern)},
             {"reference", fwd_bwd({gate.clone(), up.clone()}, dy, ref)}}};
  return {fwd, both};
}

Options parse(const std::vector<std::string>& args) {
  if (args.empty() || args[0] != "ops")
    throw std::invalid_argument("expected 'bench ops', got 'bench" + (args.empty() ? "" : " " + args[0]) + "'");
  Options o;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) throw std::invalid_argument(a + " needs a value");
      return args[++i];
    };
    auto count = [&](int lo) {
      const std::string v = value();
      int n = 0;
      try {
        n = std::stoi(v);
      } catch (const std::exception&) {
        throw std::invalid_argument(a + " must be an integer, got '" + v + "'");
      }
      if (n < lo) throw std::invalid_argument(a + " must be >= " + std::to_string(lo) + ", got " + v);
      return n;
    };
    if (a == "--json") {
      o.json = true;
    } else if (a == "--filter") {
      o.filter = value();
    } else if (a == "--warmup") {
      o.warmup = count(0);
    } else if (a == "--reps") {
      o.reps = count(1);
    } else {
      throw std::invalid_argument("unknown option '" + a + "' (expected --json, --filter, --warmup, --reps)");
    }
  }
  return o;
}

}  // namespace

// glibc returns every block over 32 MiB to the OS on free, so each large output would be page-faulted in
// (and zeroed by the kernel) on every call: a cost of the allocator, not of the op. Training frameworks avoid it
// (caching allocators, jemalloc); the benchmark keeps freed memory in the process for every implementation alike.
void keep_freed_memory() {
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

int bench_command(const std::vector<std::string>& args) {
  const Options o = parse(args);
  keep_freed_memory();
  std::regex filter;
  try {
    filter = std::regex(o.filter.empty() ? ".*" : o.filter);
  } catch (const std::regex_error& e) {
    throw std::invalid_argument("--filter '" + o.filter + "' is not a valid regular expression: " + e.what());
  }
  const bool progress = !o.json && isatty(STDERR_FILENO);

  using Factory = std::function<std::vector<Case>(const std::string&)>;
  const std::vector<std::pair<std::string, Factory>> families = {{"rms_norm", rms_norm_cases},
                                                                 {"silu_and_mul", silu_and_mul_cases}};
  const std::vector<std::string> dtypes = {"float32", "bfloat16"};
  std::vector<std::pair<std::string, std::string>> todo;
  for (const auto& [op, f] : families)
    for (const auto& dt : dtypes)
      if (std::regex_search(op + "/" + dt, filter)) todo.push_back({op, dt});

  const double copy = copy_gbps(o);
  struct Row {
    Case c;
    std::string impl;
    Timing t;
  };
  std::vector<Row> rows;
  size_t done = 0;
  for (const auto& [op, dt] : todo) {
    for (const auto& [name, factory] : families) {
      if (name != op) continue;
      for (const Case& c : factory(dt)) {
        if (progress) std::fprintf(stderr, "\r[%zu/%zu] %s %s %s...        ", done + 1, todo.size(), op.c_str(), c.pass.c_str(), dt.c_str());
        const auto timings = time_interleaved(c.impls, o);
        for (size_t i = 0; i < c.impls.size(); ++i) rows.push_back({c, c.impls[i].name, timings[i]});
      }
    }
    ++done;
  }
  if (progress) std::fprintf(stderr, "\r%60s\r", "");

  auto gbps = [](const Row& r) { return r.c.bytes / (r.t.median_ms * 1e6); };
  auto reference_ms = [&](const Row& r) {
    for (const Row& o2 : rows)
      if (o2.c.op == r.c.op && o2.c.pass == r.c.pass && o2.c.dtype == r.c.dtype && o2.impl == "reference")
        return o2.t.median_ms;
    return r.t.median_ms;
  };
  if (o.json) {
    std::string out = "{\"machine\": {\"copy_gbps\": " + fixed(copy, 2) +
                      ", \"threads\": " + std::to_string(at::get_num_threads()) +
                      ", \"cpu_level\": " + json_string(cpu::level_name(cpu::active_level())) + "}, \"results\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      out += std::string(i ? ", " : "") + "{\"op\": " + json_string(r.c.op) + ", \"pass\": " + json_string(r.c.pass) +
             ", \"dtype\": " + json_string(r.c.dtype) + ", \"shape\": " + json_string(r.c.shape) +
             ", \"impl\": " + json_string(r.impl) + ", \"median_ms\": " + fixed(r.t.median_ms, 4) +
             ", \"min_ms\": " + fixed(r.t.min_ms, 4) + ", \"max_ms\": " + fixed(r.t.max_ms, 4) +
             ", \"gbps\": " + fixed(gbps(r), 2) + ", \"pct_of_copy\": " + fixed(100 * gbps(r) / copy, 1) +
             ", \"speedup_vs_reference\": " + fixed(reference_ms(r) / r.t.median_ms, 3) + "}";
    }
    std::printf("%s]}\n", out.c_str());
    return 0;
  }
  std::printf("machine: copy bandwidth %.1f GB/s (read + write), %d threads, CPU level %s; %d warm-up + %d timed reps, medians\n\n",
              copy, at::get_num_threads(), cpu::level_name(cpu::active_level()), o.warmup, o.reps);
  Table t{{"op", "pass", "dtype", "shape", "impl", "median ms", "min..max ms", "GB/s", "% copy", "speedup"}, {}};
  for (const Row& r : rows)
    t.rows.push_back({r.c.op, r.c.pass, r.c.dtype, r.c.shape, r.impl, fixed(r.t.median_ms, 3),
                      fixed(r.t.min_ms, 2) + ".." + fixed(r.t.max_ms, 2), fixed(gbps(r), 1),
                      fixed(100 * gbps(r) / copy, 1) + "%", fixed(reference_ms(r) / r.t.median_ms, 2) + "x"});
  std::printf("%s", t.render().c_str());
  return 0;
}

}  // namespace kernmap::cli
