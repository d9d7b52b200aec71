// The outer-product kernel of the grouped backward (gemm_bcast) against float64 math on the same inputs: edge
// sizes of its register blocks, reductions long enough to be blocked, strided operands, streaming stores.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include <sys/mman.h>
#include <unistd.h>

#include "kernels/cpu/cache.h"
#include "kernels/cpu/isa.h"
#include "ops/checks.h"
#include "tests/cpp/kernels/checks.h"
#include "tests/cpp/kernels/guarded.h"

namespace kernmap::testing {
namespace {

// Unit roundoff of the output type (one rounding of an fp32 sum) and of the fp32 accumulation.
double out_roundoff(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return std::ldexp(1.0, -8);
    case at::kHalf:
      return std::ldexp(1.0, -11);
    case at::kFloat:
      return std::ldexp(1.0, -24);
    default:
      return std::ldexp(1.0, -53);
  }
}
double acc_roundoff(at::ScalarType t) {
  return t == at::kDouble ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
}

// A case's operands: A(m, p) at A[p * lda + m] for layout "At" (the weight gradients' x^T), else at
// A[m * lda + p]; B's rows the least multiple of 4 KiB apart that holds N for "_B4k" (the kernel copies such
// panels), else N + 5 apart; C [M, ldc] NaN beyond what the kernel must write.
struct Operands {
  int64_t M, N, P;
  bool a_transposed;
  at::Tensor a_store, b_store, c_store;  // the padded buffers
  at::Tensor A, B;                       // the logical [M, P] and [P, N] operands (views)
  int64_t lda, ldb, ldc;
};

Operands make_run(const Case& c, int64_t c_pad) {
  Operands r;
  r.M = c["M"], r.N = c["N"], r.P = c["P"];
  r.a_transposed = c.layout.rfind("At", 0) == 0;
  const bool b_rows_4k = c.layout.find("_B4k") != std::string::npos;
  r.lda = (r.a_transposed ? r.M : r.P) + 3;
  const int64_t es = static_cast<int64_t>(c10::elementSize(c.dtype));
  r.ldb = b_rows_4k ? std::max<int64_t>(1, (r.N * es + 4095) / 4096) * 4096 / es : r.N + 5;
  r.ldc = r.N + c_pad;
  const int64_t a_rows = r.a_transposed ? r.P : r.M;
  r.a_store = randn({std::max<int64_t>(a_rows, 1), r.lda}, c.dtype);
  r.b_store = randn({std::max<int64_t>(r.P, 1), r.ldb}, c.dtype);
  r.c_store = at::full({r.M, r.ldc}, std::numeric_limits<double>::quiet_NaN(), at::TensorOptions(c.dtype));
  const at::Tensor a_rows_view = r.a_store.slice(0, 0, a_rows).slice(1, 0, r.a_transposed ? r.M : r.P);
  r.A = r.a_transposed ? a_rows_view.t() : a_rows_view;
  r.B = r.b_store.slice(0, 0, r.P).slice(1, 0, r.N);
  return r;
}

// Rows [m0, m1) of C through the kernel, A and B read from `a` and `b` (the padded buffers unless named).
void call(Operands& r, at::ScalarType dt, int64_t m0, int64_t m1, bool stream, const void* a_data = nullptr,
          const void* b_data = nullptr) {
  const int64_t es = r.a_store.element_size();
  const char* a = static_cast<const char*>(a_data ? a_data : r.a_store.const_data_ptr());
  const int64_t a_m = r.a_transposed ? 1 : r.lda, a_p = r.a_transposed ? r.lda : 1;
  kernmap::cpu::kernel_table().gemm_bcast(kernmap::ops::cpu_dtype(dt), m1 - m0, r.N, r.P, a + m0 * a_m * es,
                                          a_m, a_p, b_data ? b_data : r.b_store.const_data_ptr(), r.ldb,
                                          static_cast<char*>(r.c_store.data_ptr()) + m0 * r.ldc * es, r.ldc,
                                          stream);
}

// Each element: fp32 sums of exact products (P roundings at most), then one rounding to the dtype; plus
// `floor`.
at::Tensor bound_of(const Operands& r, at::ScalarType dt, double floor = 0.0) {
  const at::Tensor A = r.A.to(at::kDouble), B = r.B.to(at::kDouble);
  return at::mm(A, B).abs() * out_roundoff(dt) * 1.01 +
         at::mm(A.abs(), B.abs()) * (r.P + 1) * acc_roundoff(dt) + floor;
}

at::Tensor written(const Operands& r) {
  return r.c_store.slice(1, 0, r.N);
}

}  // namespace

void gemm_bcast_within_float64_bound(const Case& c) {
  Operands r = make_run(c, 7);
  call(r, c.dtype, 0, r.M, /*stream=*/false);
  const at::Tensor want = at::mm(r.A.to(at::kDouble), r.B.to(at::kDouble));
  const at::Tensor err = (written(r).to(at::kDouble) - want).abs(), bound = bound_of(r, c.dtype);
  EXPECT_TRUE(err.le(bound).all().item<bool>())
      << "max error " << err.max().item<double>() << ", bound there "
      << bound.flatten()[err.argmax()].item<double>();
  // Nothing written past column N (the padding keeps its NaN).
  EXPECT_TRUE(r.c_store.slice(1, r.N).isnan().all().item<bool>());
}

void gemm_bcast_independent_of_row_split_and_streaming(const Case& c) {
  // ldc a multiple of 64 elements, so rows can be streamed at every level that streams.
  Operands whole = make_run(c, 64 - c["N"] % 64);
  call(whole, c.dtype, 0, whole.M, /*stream=*/false);
  Operands split = whole;
  split.c_store = at::full_like(whole.c_store, std::numeric_limits<double>::quiet_NaN());
  call(split, c.dtype, 0, 5, /*stream=*/true);  // 5 rows: a full and a one-row block
  call(split, c.dtype, 5, 6, /*stream=*/false);
  call(split, c.dtype, 6, split.M, /*stream=*/true);
  EXPECT_TRUE(at::equal(written(whole), written(split)));
}

// bf16 short reductions read by 8 or more row blocks (the weight gradients of small groups) go through a
// panel interleaved once instead of unpacked in each row block: the same products in the same order, so every
// row matches a call over 4 rows (one row block, which unpacks) bit for bit, and float64 within the bound.
void gemm_bcast_short_reductions_match_small_calls(const Case& c) {
  Operands whole = make_run(c, 3);
  call(whole, c.dtype, 0, whole.M, /*stream=*/false);
  Operands small = whole;
  small.c_store = at::full_like(whole.c_store, std::numeric_limits<double>::quiet_NaN());
  for (int64_t m = 0; m < whole.M; m += 4)
    call(small, c.dtype, m, std::min(m + 4, whole.M), /*stream=*/false);
  EXPECT_TRUE(at::equal(written(whole), written(small)));
  EXPECT_TRUE(whole.c_store.slice(1, whole.N).isnan().all().item<bool>());
  // Plus half the least fp16 subnormal: single products of two normal samples land there (P = 1).
  const double subnormal = c.dtype == at::kHalf ? std::ldexp(1.0, -25) : 0.0;
  const at::Tensor want = at::mm(whole.A.to(at::kDouble), whole.B.to(at::kDouble));
  const at::Tensor err = (written(whole).to(at::kDouble) - want).abs();
  EXPECT_TRUE(err.le(bound_of(whole, c.dtype, subnormal)).all().item<bool>())
      << "max error " << err.max().item<double>();
}

// Reduction blocks of any length give the same bits: KERNMAP_PREFETCH_STREAMS caps a block's steps (8, 16,
// 24, 32 rows of B) or lifts the cap (0: the level-2 rule alone), which only moves where partial sums are
// parked between blocks; each run within the float64 bound and nothing written past column N.
void gemm_bcast_independent_of_block_length(const Case& c) {
  const char* name = "KERNMAP_PREFETCH_STREAMS";
  const ScopedEnv env(name, "0");
  const Operands operands = make_run(c, 7);
  auto run = [&](const char* streams) {
    env.set(streams);
    Operands r = operands;
    r.c_store = at::full_like(operands.c_store, std::numeric_limits<double>::quiet_NaN());
    call(r, c.dtype, 0, r.M, /*stream=*/false);
    return r;
  };
  const Operands uncapped = run("0");
  for (const char* streams : {"8", "16", "24", "32"}) {
    Operands capped = run(streams);
    EXPECT_TRUE(at::equal(written(uncapped), written(capped))) << name << "=" << streams;
    const at::Tensor want = at::mm(capped.A.to(at::kDouble), capped.B.to(at::kDouble));
    const at::Tensor err = (written(capped).to(at::kDouble) - want).abs();
    EXPECT_TRUE(err.le(bound_of(capped, c.dtype)).all().item<bool>())
        << name << "=" << streams << ": max error " << err.max().item<double>();
    EXPECT_TRUE(capped.c_store.slice(1, capped.N).isnan().all().item<bool>());
  }
}

// Nothing read past the operands: A and B copied so that each ends with its last element (the last row
// holds only its M or P, and N, elements) where a page the process may not touch begins, at sizes that leave
// partial tiles, vectors, pairs and steps. A read past the end faults; the results within the float64 bound.
void gemm_bcast_reads_nothing_past_its_operands(const Case& c) {
  Operands r = make_run(c, 7);
  const auto es = static_cast<size_t>(r.a_store.element_size());
  const int64_t a_rows = r.a_transposed ? r.P : r.M, a_cols = r.a_transposed ? r.M : r.P;
  const GuardedCopy a(r.a_store, ((a_rows - 1) * r.lda + a_cols) * es);
  const GuardedCopy b(r.b_store, ((r.P - 1) * r.ldb + r.N) * es);
  call(r, c.dtype, 0, r.M, /*stream=*/false, a.data(), b.data());
  const at::Tensor want = at::mm(r.A.to(at::kDouble), r.B.to(at::kDouble));
  const at::Tensor err = (written(r).to(at::kDouble) - want).abs();
  EXPECT_TRUE(err.le(bound_of(r, c.dtype)).all().item<bool>()) << "max error " << err.max().item<double>();
}

// The weight gradients' task sizes (gemm_bcast_task_rows) at this level: at least one row of C, at most 512
// or as many as fit the level-2 rule in fp32 partial sums, and each task's scratch bounded — its copy of A
// (rows x steps, elements of at most max(size, 4) bytes: bf16 may be widened) within 8 MiB, or its partial
// sums (rows x cols, fp32) within the level-2 rule, or the fewest rows the row order takes (64).
void gemm_bcast_task_rows_bound_their_scratch(const Case& c) {
  const auto dt = kernmap::ops::cpu_dtype(c.dtype);
  const int64_t copy_es = std::max<int64_t>(4, static_cast<int64_t>(c10::elementSize(c.dtype)));
  for (int64_t steps : {0, 1, 16, 300, 1100, 12000, 100000, 10000000})
    for (int64_t cols : {1, 40, 1536, 100000}) {
      const int64_t rows = kernmap::cpu::kernel_table().gemm_bcast_task_rows(dt, steps, cols);
      EXPECT_GE(rows, 1) << steps << " steps, " << cols << " columns";
      EXPECT_LE(rows, std::max<int64_t>(512, kernmap::cpu::l2_block_bytes() / 4 / cols))
          << steps << " steps, " << cols << " columns";
      EXPECT_TRUE(rows <= 64 || rows * steps * copy_es <= (int64_t(8) << 20) ||
                  rows * cols * 4 <= kernmap::cpu::l2_block_bytes())
          << rows << " rows at " << steps << " steps, " << cols << " columns";
    }
  // Capped by the L2 streamer's streams (here 8: 32 KiB of pages), a task takes no more rows than without,
  // and where the cap applies (the levels' plain-store orders) its rows cross at most 8 pages or are one
  // register block.
  const ScopedEnv env("KERNMAP_PREFETCH_STREAMS", "0");
  const int64_t es = static_cast<int64_t>(c10::elementSize(c.dtype));
  for (int64_t steps : {16, 1100})
    for (int64_t cols : {40, 1536, 3000}) {
      env.set("0");
      const int64_t uncapped = kernmap::cpu::kernel_table().gemm_bcast_task_rows(dt, steps, cols);
      env.set("8");
      const int64_t capped = kernmap::cpu::kernel_table().gemm_bcast_task_rows(dt, steps, cols);
      EXPECT_GE(capped, 1);
      EXPECT_LE(capped, uncapped) << steps << " steps, " << cols << " columns";
      EXPECT_TRUE(capped == uncapped || capped * std::min<int64_t>(cols * es, 4096) <= 8 * 4096 ||
                  capped <= 6)
          << capped << " rows at " << steps << " steps, " << cols << " columns";
    }
}

}  // namespace kernmap::testing
