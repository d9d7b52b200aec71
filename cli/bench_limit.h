// The dense fp32 GEMM rate of a lower CPU level: what a CPU of that level's instruction set would reach, for
// the compute floors of kernmap's kernels timed at that level (`kernmap bench ops --levels`, `kernmap bench
// limit`). The machine's own GEMM (torch's MKL) runs at the machine's best instructions whatever the level,
// and MKL's own cap (MKL_ENABLE_INSTRUCTIONS) is not honoured on every CPU (AMD EPYC Zen 3: 186 GFLOP/s
// capped at SSE4.2 as uncapped), so the rate comes from OpenBLAS, whose kernels for each core kind can be
// chosen at load (OPENBLAS_CORETYPE; Debian's libopenblas0 is built for all of them), in a child process per
// core kind (docs/performance.md, "Emulating another CPU").
#pragma once

#include <string>
#include <vector>

namespace kernmap::cli {

/// The benches' clock: steady-clock milliseconds.
double now_ms();

/// The side of the square product a dense rate is measured on, from one 512-sided product's ms: 2048, or 1024
/// or 512 where one product at 2048 would take over half a second (a CPU without instructions for a dtype can
/// run it hundreds of times below the fp32 rate). Both the machine's rates (bench_ops.cpp) and a level's use
/// it.
int dense_product_side(double ms_at_512);

/// One OpenBLAS core kind measured for a level.
struct CoreRate {
  std::string core;     ///< OPENBLAS_CORETYPE ("Core2", "Haswell")
  double gflops = 0;    ///< 0 where it could not be measured
  std::string error;    ///< why not (the child's message), else empty
  std::string library;  ///< the library's configuration string (version, build)
};

/// A level's dense fp32 GEMM limit: the fastest of OpenBLAS's kernels for the core kinds of that level's
/// instruction set.
struct LevelLimit {
  std::string level;
  double gflops = 0;  ///< 0: not measured (error says why)
  std::string core;   ///< the core kind that gave it
  std::string library;
  std::string error;
  std::vector<CoreRate> cores;
  /// The level's dense bf16 rate where the level computes in bf16 but the machine has more (avx512bf16 on a
  /// CPU with AMX tiles): torch's bf16 product with oneDNN held to the level's instructions
  /// (onednn_isa_of). 0: not such a level, or not measured (bf16_error says why).
  double bf16_gflops = 0;
  std::string bf16_source;  ///< "oneDNN brg_matmul:avx512_core_bf16": the implementation oneDNN ran
  std::string bf16_error;
};

/// oneDNN's name for the instructions of a level that computes in bf16 below the machine's best
/// (ONEDNN_MAX_CPU_ISA): "AVX512_CORE_BF16" for avx512bf16; empty for the other levels.
std::string onednn_isa_of(const std::string& level);

/// The dense bf16 rate of a level with oneDNN held to `isa` (onednn_isa_of), in a child process (`bench limit
/// --onednn-isa`, which sets ONEDNN_MAX_CPU_ISA before oneDNN starts and reports the implementations oneDNN
/// ran): fills l.bf16_gflops and bf16_source, or bf16_error where oneDNN ran anything but that ISA's kernels
/// (a torch whose bf16 product is not oneDNN's, a oneDNN that ignores the cap). Never throws.
void measure_level_bf16(LevelLimit& l, int threads);

/// Checks a child's oneDNN verbose lines (`onednn_verbose,...,exec,...`): every product ran an
/// implementation of `isa` (lower case in oneDNN's names, "avx512_core_bf16") and none on AMX tiles. Returns
/// the implementation ("brg_matmul:avx512_core_bf16"), or throws std::runtime_error saying what ran.
std::string onednn_implementation(const std::string& verbose, const std::string& isa);

/// OpenBLAS's core kinds whose kernels use only the instructions of `level` (the pre-AVX cores for
/// baseline, the AVX2 ones for avx2, ...).
std::vector<std::string> openblas_cores_of(const std::string& level);

/// Measures the level's limit with `threads` threads, one child process (this executable, `bench limit
/// --openblas-core`) per core kind. Never throws for a missing or unusable library: the error says why.
LevelLimit measure_level_limit(const std::string& level, int threads);

/// In this process (the child): loads OpenBLAS (KERNMAP_OPENBLAS, else libopenblas.so.0) with the core kind
/// OPENBLAS_CORETYPE names, checks that it runs that kind, and times a square fp32 product. Throws
/// std::runtime_error naming what is missing or wrong.
CoreRate measure_openblas_core(const std::string& core);

}  // namespace kernmap::cli
