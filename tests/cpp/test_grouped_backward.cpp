// The grouped backward products: the outer-product kernel (gemm_bcast) at every instruction-set level against
// float64 math on the same inputs (edge sizes of its register blocks, reductions long enough to be blocked,
// strided operands, streaming stores), and grouped_mm's gradients on uneven groups against a float64
// per-group reference, bit-identical at 1 and 2 threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/isa.h"
#include "kernmap/ops.h"
#include "ops/checks.h"
#include "tests/cpp/level_fixture.h"

namespace {

using kernmap::cpu::Level;

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

class GemmBcast : public kernmap::testing::LevelDtypeTest {};

struct Case {
  int64_t M, N, P;
  bool a_transposed;       // A(m, p) at A[p * lda + m] (the weight gradients' x^T) instead of A[m * lda + p]
  bool b_rows_4k = false;  // B's rows 4 KiB apart (the kernel copies such panels of short reductions)
};

std::string describe(const Case& c) {
  return "M=" + std::to_string(c.M) + " N=" + std::to_string(c.N) + " P=" + std::to_string(c.P) +
         (c.a_transposed ? " A transposed" : "") + (c.b_rows_4k ? " B rows 4 KiB apart" : "");
}

// Runs gemm_bcast on padded (strided) operands; C is [M, ldc] filled with NaN beyond what the kernel must
// write.
struct Operands {
  at::Tensor a_store, b_store, c_store;  // the padded buffers
  at::Tensor A, B;                       // the logical [M, P] and [P, N] operands (views)
  int64_t lda, ldb, ldc;
};

Operands make_run(const Case& c, at::ScalarType dt, int64_t c_pad) {
  Operands r;
  r.lda = (c.a_transposed ? c.M : c.P) + 3;
  r.ldb = c.b_rows_4k ? 4096 / c10::elementSize(dt) : c.N + 5;
  r.ldc = c.N + c_pad;
  const int64_t a_rows = c.a_transposed ? c.P : c.M;
  r.a_store = at::randn({std::max<int64_t>(a_rows, 1), r.lda}, at::kDouble).to(dt);
  r.b_store = at::randn({std::max<int64_t>(c.P, 1), r.ldb}, at::kDouble).to(dt);
  r.c_store = at::full({c.M, r.ldc}, std::numeric_limits<double>::quiet_NaN(), at::TensorOptions().dtype(dt));
  const at::Tensor a_rows_view = r.a_store.slice(0, 0, a_rows).slice(1, 0, c.a_transposed ? c.M : c.P);
  r.A = c.a_transposed ? a_rows_view.t() : a_rows_view;
  r.B = r.b_store.slice(0, 0, c.P).slice(1, 0, c.N);
  return r;
}

void call(const Case& c, Operands& r, at::ScalarType dt, int64_t m0, int64_t m1, bool stream) {
  const int64_t es = r.a_store.element_size();
  const char* a = static_cast<const char*>(r.a_store.const_data_ptr());
  const int64_t a_m = c.a_transposed ? 1 : r.lda, a_p = c.a_transposed ? r.lda : 1;
  kernmap::cpu::kernel_table().gemm_bcast(
      kernmap::ops::cpu_dtype(dt), m1 - m0, c.N, c.P, a + m0 * a_m * es, a_m, a_p, r.b_store.const_data_ptr(),
      r.ldb, static_cast<char*>(r.c_store.data_ptr()) + m0 * r.ldc * es, r.ldc, stream);
}

TEST_P(GemmBcast, MatchesFloat64OnEdgeSizesStridesAndBlockedReductions) {
  std::vector<Case> cases;
  // Rows around the 4-row register block, columns around the 16-lane vector and 64-column block, reduction
  // lengths around the bf16 pairs, and reductions long enough to be split into blocks (2048 columns: blocks
  // of 32 fp32 / 64 bf16 steps; 130 columns: blocks of 256 steps).
  for (int64_t M : {1, 2, 3, 4, 5, 15, 16, 17, 63, 64, 200}) cases.push_back({M, 130, 17, false});
  for (int64_t N : {1, 15, 16, 17, 63, 64, 65, 130, 200}) cases.push_back({17, N, 63, false});
  for (int64_t P : {0, 1, 2, 15, 16, 17, 63, 64, 200}) cases.push_back({5, 200, P, false});
  for (int64_t P : {0, 1, 2, 15, 16, 17, 63, 64, 200}) cases.push_back({17, 130, P, true});
  for (int64_t M : {31, 32, 33, 63}) cases.push_back({M, 130, 17, true, true});
  cases.push_back({40, 200, 64, false, true});
  // bf16 long reductions (more than 64 steps, A's pairs in its rows): interleaved 32-column panels and row
  // blocks of up to 12 rows; rows around the blocks, columns around the 32-column tile, an odd step alone at
  // the end of a reduction split into blocks of 256 steps (257) or not split (65).
  for (int64_t M : {1, 11, 12, 13, 24, 25, 37})
    for (int64_t N : {1, 17, 32, 33, 130})
      for (int64_t P : {65, 257}) cases.push_back({M, N, P, false});
  cases.push_back({13, 1100, 301, false});  // bf16: columns in two chunks of 576 and 524, 128-step blocks
  cases.push_back({6, 2048, 301, false});
  cases.push_back({9, 130, 777, false});
  cases.push_back({9, 130, 777, true});
  for (const Case& c : cases) {
    if (dtype() == at::kDouble && c.P > 300) continue;  // fp64 takes one pass; nothing new, only slow
    SCOPED_TRACE(describe(c));
    Operands r = make_run(c, dtype(), 7);
    call(c, r, dtype(), 0, c.M, /*stream=*/false);
    const at::Tensor got = r.c_store.slice(1, 0, c.N).to(at::kDouble);
    const at::Tensor A = r.A.to(at::kDouble), B = r.B.to(at::kDouble);
    const at::Tensor want = at::mm(A, B);
    const at::Tensor scale = at::mm(A.abs(), B.abs());
    // Each element: fp32 sums of exact products (P roundings at most), then one rounding to the dtype.
    const at::Tensor bound =
        want.abs() * out_roundoff(dtype()) * 1.01 + scale * (c.P + 1) * acc_roundoff(dtype());
    const at::Tensor err = (got - want).abs();
    EXPECT_TRUE(err.le(bound).all().item<bool>())
        << "max error " << err.max().item<double>() << ", bound there "
        << bound.flatten()[err.argmax()].item<double>();
    // Nothing written past column N (the padding keeps its NaN).
    if (c.N < r.ldc) EXPECT_TRUE(r.c_store.slice(1, c.N).isnan().all().item<bool>());
  }
}

TEST_P(GemmBcast, ResultDoesNotDependOnTheRowSplitOrStreaming) {
  for (const Case& c : {Case{23, 200, 77, false}, Case{23, 2048, 150, true}, Case{13, 130, 777, false},
                        Case{41, 130, 16, true, true}}) {
    if (dtype() == at::kDouble && c.P > 300) continue;
    SCOPED_TRACE(describe(c));
    // ldc a multiple of 64 elements, so rows can be streamed at every level that streams.
    Operands whole = make_run(c, dtype(), 64 - c.N % 64);
    call(c, whole, dtype(), 0, c.M, /*stream=*/false);
    Operands split = whole;
    split.c_store = at::full_like(whole.c_store, std::numeric_limits<double>::quiet_NaN());
    call(c, split, dtype(), 0, 5, /*stream=*/true);  // 5 rows: a full and a one-row block
    call(c, split, dtype(), 5, 6, /*stream=*/false);
    call(c, split, dtype(), 6, c.M, /*stream=*/true);
    EXPECT_TRUE(at::equal(whole.c_store.slice(1, 0, c.N), split.c_store.slice(1, 0, c.N)));
  }
}

// bf16 short reductions read by 8 or more row blocks (the weight gradients of small groups) go through a
// panel interleaved once instead of unpacked in each row block: the same products in the same order, so every
// row matches a call over 4 rows (one row block, which unpacks) bit for bit, and float64 within the bound.
// Reduction lengths around the pairs and up to the one-pass limit (256 steps at 128 columns) and past it
// (blocked).
TEST_P(GemmBcast, ShortReductionsOfManyRowBlocksMatchSmallCallsBitForBit) {
  for (int64_t M : {29, 32, 35, 64})
    for (int64_t P : {1, 2, 3, 16, 17, 64, 255, 256, 257})
      for (int64_t N : {64, 131}) {
        if (dtype() == at::kDouble && P > 64) continue;
        for (bool transposed : {false, true}) {
          const Case c{M, N, P, transposed, /*b_rows_4k=*/M == 32};
          SCOPED_TRACE(describe(c));
          Operands whole = make_run(c, dtype(), 3);
          call(c, whole, dtype(), 0, c.M, /*stream=*/false);
          Operands small = whole;
          small.c_store = at::full_like(whole.c_store, std::numeric_limits<double>::quiet_NaN());
          for (int64_t m = 0; m < c.M; m += 4)
            call(c, small, dtype(), m, std::min(m + 4, c.M), /*stream=*/false);
          EXPECT_TRUE(at::equal(whole.c_store.slice(1, 0, c.N), small.c_store.slice(1, 0, c.N)));
          EXPECT_TRUE(whole.c_store.slice(1, c.N).isnan().all().item<bool>());
          const at::Tensor A = whole.A.to(at::kDouble), B = whole.B.to(at::kDouble);
          const at::Tensor want = at::mm(A, B), scale = at::mm(A.abs(), B.abs());
          // Plus half the least fp16 subnormal: single products of two normal samples land there (P = 1).
          const double subnormal = dtype() == at::kHalf ? std::ldexp(1.0, -25) : 0.0;
          const at::Tensor bound = want.abs() * out_roundoff(dtype()) * 1.01 +
                                   scale * (c.P + 1) * acc_roundoff(dtype()) + subnormal;
          const at::Tensor err = (whole.c_store.slice(1, 0, c.N).to(at::kDouble) - want).abs();
          EXPECT_TRUE(err.le(bound).all().item<bool>()) << "max error " << err.max().item<double>();
        }
      }
}

std::vector<std::tuple<Level, at::ScalarType>> params() {
  std::vector<std::tuple<Level, at::ScalarType>> out;
  for (Level l : kernmap::cpu::supported_levels())
    for (at::ScalarType t : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) out.emplace_back(l, t);
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllLevels, GemmBcast, ::testing::ValuesIn(params()), [](const auto& info) {
  return std::string(kernmap::cpu::level_name(std::get<0>(info.param))) + "_" +
         std::string(c10::toString(std::get<1>(info.param)));
});

// grouped_mm's gradients, group sizes around every block and the bf16 BLAS threshold (64 rows), an empty
// group; both weight layouts ([E, K, N], and [E, N, K] viewed transposed: the Experts layer's), a and grad
// strided.
class GroupedBackward : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(GroupedBackward, GradientsMatchFloat64AndAreBitIdenticalAcrossThreadCounts) {
  const at::ScalarType dt = GetParam();
  const std::vector<int64_t> sizes = {0, 1, 2, 15, 16, 17, 63, 64, 200};
  std::vector<int> offs_v;
  int64_t T = 0;
  for (int64_t s : sizes) offs_v.push_back(static_cast<int>(T += s));
  const at::Tensor offs = at::tensor(offs_v, at::kInt);
  const int64_t E = static_cast<int64_t>(sizes.size()), K = 70, N = 131;
  at::manual_seed(1);
  for (bool transposed : {false, true}) {
    SCOPED_TRACE(transposed ? "b [E, N, K] transposed" : "b [E, K, N]");
    // a: a column slice of a wider tensor; grad: a transposed copy (column-major rows).
    const at::Tensor a_wide = at::randn({T, K + 9}, at::kDouble).to(dt);
    const at::Tensor a0 = a_wide.slice(1, 4, 4 + K);
    const at::Tensor b0 = transposed ? at::randn({E, N, K}, at::kDouble).to(dt).transpose(1, 2)
                                     : at::randn({E, K, N}, at::kDouble).to(dt);
    const at::Tensor grad_wide = at::randn({T, N + 3}, at::kDouble).to(dt);
    const at::Tensor grad = grad_wide.slice(1, 0, N);
    auto gradients = [&](int threads) {
      const int previous = at::get_num_threads();
      at::set_num_threads(threads);
      at::Tensor a = a0.detach().requires_grad_(true), b = b0.detach().requires_grad_(true);
      at::Tensor y = kernmap::grouped_mm(a, b, offs);
      torch::autograd::backward({y}, {grad});
      at::set_num_threads(previous);
      return std::make_pair(a.grad(), b.grad());
    };
    const auto [ga2, gb2] = gradients(2);
    const auto [ga1, gb1] = gradients(1);
    EXPECT_TRUE(at::equal(ga1, ga2));
    EXPECT_TRUE(at::equal(gb1, gb2));
    // float64 reference per group on the same (rounded) inputs.
    const at::Tensor ad = a0.to(at::kDouble), bd = b0.to(at::kDouble), gd = grad.to(at::kDouble);
    at::Tensor want_a = at::zeros({T, K}, at::kDouble), want_b = at::zeros({E, K, N}, at::kDouble);
    at::Tensor scale_a = at::zeros({T, K}, at::kDouble), scale_b = at::zeros({E, K, N}, at::kDouble);
    for (int64_t e = 0, r = 0; e < E; r += sizes[e], ++e) {
      const at::Tensor g = gd.slice(0, r, r + sizes[e]), x = ad.slice(0, r, r + sizes[e]);
      want_a.slice(0, r, r + sizes[e]).copy_(at::mm(g, bd[e].t()));
      scale_a.slice(0, r, r + sizes[e]).copy_(at::mm(g.abs(), bd[e].t().abs()));
      want_b[e].copy_(at::mm(x.t(), g));
      scale_b[e].copy_(at::mm(x.t().abs(), g.abs()));
    }
    const double u = out_roundoff(dt), acc = acc_roundoff(dt);
    auto check = [&](const at::Tensor& got, const at::Tensor& want, const at::Tensor& scale, int64_t len) {
      ASSERT_EQ(got.sizes(), want.sizes());
      const at::Tensor err = (got.to(at::kDouble) - want).abs();
      const at::Tensor bound = want.abs() * u * 1.01 + scale * (len + 1) * acc + 1e-300;
      EXPECT_TRUE(err.le(bound).all().item<bool>()) << "max error " << err.max().item<double>();
    };
    check(ga1, want_a, scale_a, N);
    check(gb1, want_b, scale_b, 200);
    EXPECT_EQ(gb1[0].abs().sum().item<double>(), 0.0);  // the empty group
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GroupedBackward,
                         ::testing::Values(at::kFloat, at::kBFloat16, at::kHalf, at::kDouble),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

}  // namespace
