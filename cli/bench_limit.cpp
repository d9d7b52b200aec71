// A lower level's dense fp32 GEMM limit from OpenBLAS's kernels for that level's core kinds, and its bf16
// one from oneDNN held to the level's instructions (bench_limit.h).
#include "cli/bench_limit.h"

#include <dlfcn.h>
#include <poll.h>
#include <spawn.h>
#include <strings.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

extern char** environ;

namespace kernmap::cli {
namespace {

// cblas_sgemm(order, transA, transB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)
using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                       float*, int);
using Text = char* (*)();
constexpr int kRowMajor = 101, kNoTrans = 111;

// The median of `reps` products of n x n (after `warmup`), in ms.
double product_ms(Sgemm sgemm, int n, int warmup, int reps) {
  std::vector<float> a(size_t(n) * n), b(size_t(n) * n), c(size_t(n) * n);
  uint32_t s = 12345;
  for (float* v : {a.data(), b.data()})
    for (size_t i = 0; i < size_t(n) * n; ++i) {
      s = s * 1664525u + 1013904223u;
      v[i] = float(s >> 8) / float(1 << 24) - 0.5f;
    }
  std::vector<double> ms;
  for (int r = 0; r < warmup + reps; ++r) {
    const double t0 = now_ms();
    sgemm(kRowMajor, kNoTrans, kNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    if (r >= warmup) ms.push_back(now_ms() - t0);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Runs argv with stdout and stderr captured; returns the exit status (-1: not started).
int run_child(const std::vector<std::string>& args, std::string& out, std::string& err) {
  int po[2], pe[2];
  if (pipe(po) != 0) return -1;
  if (pipe(pe) != 0) {
    close(po[0]);
    close(po[1]);
    return -1;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, po[1], 1);
  posix_spawn_file_actions_adddup2(&fa, pe[1], 2);
  posix_spawn_file_actions_addclose(&fa, po[0]);
  posix_spawn_file_actions_addclose(&fa, pe[0]);
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(po[1]);
  close(pe[1]);
  // Both pipes drained together, so that neither fills while the other is read.
  char buf[4096];
  pollfd fds[2] = {{po[0], POLLIN, 0}, {pe[0], POLLIN, 0}};
  std::string* sink[2] = {&out, &err};
  for (int open_fds = 2; open_fds > 0;) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      const ssize_t n = read(fds[i].fd, buf, sizeof buf);
      if (n > 0) {
        sink[i]->append(buf, size_t(n));
      } else {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (const pollfd& f : fds)
    if (f.fd >= 0) close(f.fd);
  if (rc != 0) return -1;
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  if (WIFSIGNALED(status)) {
    err += std::string(err.empty() ? "" : "; ") + "killed by signal " + std::to_string(WTERMSIG(status));
    return 128 + WTERMSIG(status);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The last line of a child's output, without the command's "kernmap bench: " prefix.
std::string last_line(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  const size_t nl = s.rfind('\n');
  if (nl != std::string::npos) s = s.substr(nl + 1);
  const std::string prefix = "kernmap bench: ";
  return s.rfind(prefix, 0) == 0 ? s.substr(prefix.size()) : s;
}

}  // namespace

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int dense_product_side(double ms_at_512) {
  int n = 2048;
  while (n > 512 && ms_at_512 * double(n / 512) * double(n / 512) * double(n / 512) > 500) n /= 2;
  return n;
}

std::vector<std::string> openblas_cores_of(const std::string& level) {
  // Core kinds whose sgemm kernels need no more than the level's instructions: baseline (SSE2) the pre-AVX
  // cores (their kernels use SSE2-SSE4; Prescott's and Atom's are slower than these on every core measured),
  // avx2 the AVX2 + FMA ones (Sandybridge's AVX without FMA is slower), the AVX-512 levels the AVX-512 ones.
  if (level == "baseline") return {"Core2", "Penryn", "Dunnington", "Nehalem"};
  if (level == "avx2") return {"Haswell", "Zen"};
  if (level == "avx512") return {"SkylakeX"};
  if (level == "avx512bf16") return {"Cooperlake"};
  if (level == "amx") return {"SapphireRapids"};
  return {};
}

CoreRate measure_openblas_core(const std::string& core) {
  // OpenBLAS picks its kernels once, when it loads: this process must not have loaded it yet (the kernmap
  // command links none; torch's products are MKL's).
  if (setenv("OPENBLAS_CORETYPE", core.c_str(), 1) != 0)
    throw std::runtime_error("cannot set OPENBLAS_CORETYPE");
  const char* env = std::getenv("KERNMAP_OPENBLAS");
  const std::string path = env != nullptr && *env != '\0' ? env : "libopenblas.so.0";
  // Its own symbols first (RTLD_DEEPBIND): torch's libraries export BLAS names of MKL's.
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (lib == nullptr) {
    const char* why = dlerror();
    throw std::runtime_error("cannot load OpenBLAS from '" + path + "' (" + (why ? why : "unknown error") +
                             "; Debian: libopenblas0-pthread, which scripts/setup installs; KERNMAP_OPENBLAS "
                             "names another file)");
  }
  const auto sgemm = reinterpret_cast<Sgemm>(dlsym(lib, "cblas_sgemm"));
  const auto corename = reinterpret_cast<Text>(dlsym(lib, "openblas_get_corename"));
  const auto config = reinterpret_cast<Text>(dlsym(lib, "openblas_get_config"));
  if (sgemm == nullptr || corename == nullptr || config == nullptr)
    throw std::runtime_error("'" + path +
                             "' is not OpenBLAS: it lacks cblas_sgemm, openblas_get_corename or "
                             "openblas_get_config");
  const char* running = corename();
  if (running == nullptr || strcasecmp(running, core.c_str()) != 0)
    throw std::runtime_error("OpenBLAS from '" + path + "' runs core kind '" + (running ? running : "?") +
                             "', not the requested '" + core +
                             "' (a build without DYNAMIC_ARCH, or one that does not know that kind)");
  CoreRate r;
  r.core = core;
  r.library = config();
  const int n = dense_product_side(product_ms(sgemm, 512, 1, 1));
  r.gflops = 2.0 * double(n) * n * n / (product_ms(sgemm, n, 1, 5) * 1e6);
  return r;
}

LevelLimit measure_level_limit(const std::string& level, int threads) {
  LevelLimit out;
  out.level = level;
  for (const std::string& core : openblas_cores_of(level)) {
    std::string so, se;
    const int rc = run_child(
        {"kernmap", "bench", "limit", "--openblas-core", core, "--threads", std::to_string(threads)}, so, se);
    CoreRate r;
    r.core = core;
    try {
      const nlohmann::json doc = nlohmann::json::parse(last_line(so));
      if (rc != 0 || !doc.is_object()) throw std::runtime_error("");
      r.gflops = doc.at("gflops").get<double>();
      r.library = doc.at("library").get<std::string>();
      if (!(r.gflops > 0)) throw std::runtime_error("");
    } catch (const std::exception&) {
      r.gflops = 0;
      r.error = last_line(se).empty() ? "the measuring process exited with status " + std::to_string(rc)
                                      : last_line(se);
    }
    out.cores.push_back(r);
    if (r.gflops > out.gflops) {
      out.gflops = r.gflops;
      out.core = r.core;
      out.library = r.library;
    }
  }
  if (out.cores.empty()) out.error = "no OpenBLAS core kind is known for level '" + level + "'";
  if (out.gflops <= 0 && out.error.empty()) out.error = out.cores.front().error;
  return out;
}

std::string onednn_isa_of(const std::string& level) {
  return level == "avx512bf16" ? "AVX512_CORE_BF16" : "";
}

std::string onednn_implementation(const std::string& verbose, const std::string& isa) {
  std::string want = isa;
  std::transform(want.begin(), want.end(), want.begin(), [](unsigned char c) { return std::tolower(c); });
  std::string impl;
  size_t start = 0;
  while (start < verbose.size()) {
    size_t end = verbose.find('\n', start);
    if (end == std::string::npos) end = verbose.size();
    const std::string line = verbose.substr(start, end - start);
    start = end + 1;
    if (line.rfind("onednn_verbose", 0) != 0 || line.find(",exec,") == std::string::npos) continue;
    // onednn_verbose,v1,primitive,exec,cpu,matmul,<implementation>,...
    std::vector<std::string> fields;
    for (size_t b = 0, e; b <= line.size(); b = e + 1) {
      e = line.find(',', b);
      if (e == std::string::npos) e = line.size();
      fields.push_back(line.substr(b, e - b));
    }
    const auto kind = std::find(fields.begin(), fields.end(), "matmul");
    const std::string ran = kind != fields.end() && kind + 1 != fields.end() ? *(kind + 1) : line;
    if (ran.find(want) == std::string::npos || ran.find("amx") != std::string::npos)
      throw std::runtime_error("oneDNN ran '" + ran + "', not a " + want + " implementation");
    impl = ran;
  }
  if (impl.empty())
    throw std::runtime_error("torch's bf16 product ran no oneDNN matmul (no oneDNN verbose line)");
  return impl;
}

void measure_level_bf16(LevelLimit& l, int threads) {
  const std::string isa = onednn_isa_of(l.level);
  if (isa.empty()) return;
  std::string so, se;
  const int rc = run_child(
      {"kernmap", "bench", "limit", "--onednn-isa", isa, "--threads", std::to_string(threads)}, so, se);
  double g = 0;
  try {
    g = nlohmann::json::parse(last_line(so)).at("gflops").get<double>();
  } catch (const std::exception&) {
    g = 0;
  }
  if (rc != 0 || !(g > 0)) {
    l.bf16_error = last_line(se).empty() ? "the measuring process exited with status " + std::to_string(rc)
                                         : last_line(se);
    return;
  }
  try {
    l.bf16_source = "oneDNN " + onednn_implementation(so, isa);
    l.bf16_gflops = g;
  } catch (const std::runtime_error& e) {
    l.bf16_error = e.what();
  }
}

}  // namespace kernmap::cli
