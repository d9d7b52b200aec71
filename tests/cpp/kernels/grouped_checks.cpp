// grouped_mm beyond the reference comparison: the forward's small-group kernel against float64 with an error
// bound per element, non-finite inputs, thread-count invariance, and the backward against float64.
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/isa.h"
#include "kernmap/ops.h"
#include "ops/checks.h"
#include "tests/cpp/kernels/checks.h"
#include "tests/cpp/kernels/guarded.h"

namespace kernmap::testing {
namespace {

// The forward against float64 math, with an error bound per element: the output's rounding plus fp32
// accumulation over K terms (K * 2^-23 * sum_k |a_k b_k|; fp64 for float64).
::testing::AssertionResult within_bound(const at::Tensor& got, const at::Tensor& a, const at::Tensor& b,
                                        const at::Tensor& offs) {
  const at::Tensor ad = a.to(at::kDouble), bd = b.to(at::kDouble);
  const at::Tensor ref = at::empty({a.size(0), b.size(2)}, at::kDouble), mag = at::empty_like(ref);
  int64_t start = 0;
  for (int64_t e = 0; e < offs.size(0); ++e) {
    const int64_t end = offs[e].item<int64_t>();
    ref.slice(0, start, end).copy_(at::mm(ad.slice(0, start, end), bd[e]));
    mag.slice(0, start, end).copy_(at::mm(ad.slice(0, start, end).abs(), bd[e].abs()));
    start = end;
  }
  const double unit = got.scalar_type() == at::kBFloat16 ? std::ldexp(1.0, -8)
                      : got.scalar_type() == at::kHalf   ? std::ldexp(1.0, -11)
                                                         : 0.0;
  const double acc = got.scalar_type() == at::kDouble ? std::ldexp(1.0, -52) : std::ldexp(1.0, -23);
  // Plus half the spacing of the output's subnormals (fp16), or the smallest normal float where subnormals
  // are flushed (avx512bf16's bf16 rounding).
  const double tiny =
      got.scalar_type() == at::kHalf ? std::ldexp(1.0, -25) : std::numeric_limits<float>::min();
  const at::Tensor bound = unit * ref.abs() + double(a.size(1)) * acc * mag + tiny;
  const at::Tensor err = (got.to(at::kDouble) - ref).abs();
  const at::Tensor over = err > bound;
  if (!over.any().item<bool>() && !got.to(at::kDouble).isnan().any().item<bool>())
    return ::testing::AssertionSuccess();
  const int64_t i = (err - bound).argmax().item<int64_t>();
  const int64_t r = i / ref.size(1), col = i % ref.size(1);
  return ::testing::AssertionFailure()
         << over.sum().item<int64_t>() << " elements over the bound; worst at [" << r << ", " << col
         << "]: got " << got.to(at::kDouble)[r][col].item<double>() << ", want " << ref[r][col].item<double>()
         << ", bound " << bound[r][col].item<double>();
}

}  // namespace

// The forward's small-group path (groups under 64 rows, b in nn.Linear layout: the "NT" kernel). Group sizes
// straddle the kernels' 8-row groups, 32-row passes and dot-product rows; K is odd (bf16 pairs, 16-step
// loops) and N leaves every column-block remainder; "strided": b's rows K + 5 apart, a's K + 3.
void grouped_mm_small_groups_within_float64_bound(const Case& c) {
  const at::Tensor offs = offsets(c.groups());
  const int64_t E = static_cast<int64_t>(c.groups().size()), T = offs[-1].item<int64_t>();
  const int64_t K = c["K"], N = c["N"];
  const bool strided = c.layout == "strided";
  // b[e] = W[e]^T with W [E, N, K] rows K-contiguous.
  const at::Tensor W = randn({E, N, strided ? K + 5 : K}, c.dtype).narrow(2, 0, K);
  const at::Tensor a = randn({T, strided ? K + 3 : K}, c.dtype).narrow(1, 0, K);
  const at::Tensor y = kernmap::grouped_mm(a, W.transpose(1, 2), offs);
  ASSERT_EQ(y.sizes(), (at::IntArrayRef{T, N}));
  EXPECT_TRUE(within_bound(y, a, W.transpose(1, 2), offs));
}

// A non-finite input reaches only its own row (a) or column (b): rows share registers in the kernels. Three
// groups, the middle one empty; the first group's row 3 (a lane row) and its last row (a dot-product row
// where the group leaves 1 to 3 rows past its 8-row groups) hold an infinity, the last group's column 5 NaN.
void grouped_mm_non_finite_stays_in_its_row_and_column(const Case& c) {
  const at::Tensor offs = offsets(c.groups());
  const int64_t first = c.groups()[0], T = c["T"];
  ASSERT_EQ(offs[-1].item<int64_t>(), T) << "the shape's T is its groups' rows";
  at::Tensor a = randn({T, 67}, c.dtype);
  at::Tensor W = randn({3, 29, 67}, c.dtype);
  a[3][10] = std::numeric_limits<double>::infinity();
  a[first - 1][0] = -std::numeric_limits<double>::infinity();
  W[2][5][66] = std::numeric_limits<double>::quiet_NaN();
  const at::Tensor y = kernmap::grouped_mm(a, W.transpose(1, 2), offs).to(at::kDouble);
  const at::Tensor bad = ~y.isfinite();
  at::Tensor expected = at::zeros({T, 29}, at::kBool);
  expected[3].fill_(true);  // rows 3 and first - 1 (group 0) times every column
  expected[first - 1].fill_(true);
  // Column 5 of the last group's rows.
  expected.slice(0, offs[1].item<int64_t>(), T).select(1, 5).fill_(true);
  EXPECT_TRUE(at::equal(bad, expected)) << bad.nonzero();
}

// gemm_nt's quads form (the AVX-512 levels: fp32, and bf16 below avx512bf16) sums each row in one order
// whatever the group's size, its pass or its register block: every row of an M-row product has the bits of
// the same row computed alone. M runs around every quad, pass and block boundary; N leaves every column-block
// remainder. At every level, each product is also checked against at::mm.
void gemm_nt_row_bits_independent_of_group_size(const Case& c) {
  using kernmap::cpu::Level;
  const auto& kern = kernmap::cpu::kernel_table();
  const Level level = kernmap::cpu::active_level();
  const bool quads = level >= Level::kAvx512 && (c.dtype == at::kFloat || level == Level::kAvx512);
  const int64_t K = c["K"], N = c["N"];
  const auto dt = kernmap::ops::cpu_dtype(c.dtype);
  const at::Tensor a = randn({70, K}, c.dtype), b = randn({N, K}, c.dtype);
  auto product = [&](const at::Tensor& rows) {
    at::Tensor y = at::empty({rows.size(0), N}, c.dtype);
    kern.gemm_nt(dt, rows.size(0), N, K, rows.const_data_ptr(), K, b.const_data_ptr(), K, y.data_ptr(), N);
    return y;
  };
  std::vector<at::Tensor> alone;
  for (int64_t r = 0; r < a.size(0); ++r) alone.push_back(product(a.slice(0, r, r + 1)));
  const double tol = c.dtype == at::kFloat ? 1e-4 : 2e-2;
  for (int64_t M : {1,  2,  3,  4,  5,  8,  9,  11, 12, 13, 16, 17, 18, 19, 20,
                    21, 24, 25, 27, 28, 31, 32, 33, 34, 35, 40, 48, 49, 63, 70}) {
    const at::Tensor y = product(a.slice(0, 0, M));
    EXPECT_TRUE(at::allclose(y.to(at::kFloat), at::mm(a.slice(0, 0, M).to(at::kFloat), b.to(at::kFloat).t()),
                             tol, tol))
        << "M = " << M;
    if (!quads) continue;
    for (int64_t r = 0; r < M; ++r)
      ASSERT_TRUE(at::equal(y.slice(0, r, r + 1), alone[r])) << "M = " << M << ", row " << r;
  }
}

// Nothing read past the operands: A [M, K] and B [N, K], rows K apart, each copied to end where a page the
// process may not touch begins (a read past it faults), at sizes around every form's blocks: the tiles' 16
// rows (N 16 and 48: whole blocks read from B itself) and 32-element steps (K 50: a last step more than half
// past K), the quads' 4, the lanes' 8 and 16, the dot blocks' 3 and 4; the result against at::mm in float64.
void gemm_nt_reads_nothing_past_its_operands(const Case& c) {
  const int64_t M = c["M"], N = c["N"], K = c["K"];
  const auto dt = kernmap::ops::cpu_dtype(c.dtype);
  const at::Tensor a = randn({M, K}, c.dtype), b = randn({N, K}, c.dtype);
  const auto es = static_cast<size_t>(a.element_size());
  const GuardedCopy ga(a, M * K * es), gb(b, N * K * es);
  at::Tensor y = at::empty({M, N}, c.dtype);
  kernmap::cpu::kernel_table().gemm_nt(dt, M, N, K, ga.data(), K, gb.data(), K, y.data_ptr(), N);
  const double tol = c.dtype == at::kDouble ? 1e-12 : c.dtype == at::kFloat ? 1e-4 : 2e-2;
  EXPECT_TRUE(at::allclose(y.to(at::kDouble), at::mm(a.to(at::kDouble), b.to(at::kDouble).t()), tol, tol));
}

// Each output element is summed in one order whatever the thread count (the column tiles per task change with
// it): the same bits at 1, 2 and 3 threads.
void grouped_mm_same_bits_at_any_thread_count(const Case& c) {
  const at::Tensor offs = offsets(c.groups());
  const at::Tensor a = randn({offs[-1].item<int64_t>(), c["K"]}, c.dtype);
  const at::Tensor W = randn({static_cast<int64_t>(c.groups().size()), c["N"], c["K"]}, c.dtype);
  const int previous = at::get_num_threads();
  std::vector<at::Tensor> out;
  for (int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    out.push_back(kernmap::grouped_mm(a, W.transpose(1, 2), offs));
  }
  at::set_num_threads(previous);
  EXPECT_TRUE(at::equal(out[0], out[1]));
  EXPECT_TRUE(at::equal(out[0], out[2]));
  // With and without the software fetch of the next block of weight rows (KERNMAP_PREFETCH_STREAMS 0:
  // fetched).
  const ScopedEnv env("KERNMAP_PREFETCH_STREAMS", "0");
  EXPECT_TRUE(at::equal(out[0], kernmap::grouped_mm(a, W.transpose(1, 2), offs)));
  env.set("32");
  EXPECT_TRUE(at::equal(out[0], kernmap::grouped_mm(a, W.transpose(1, 2), offs)));
}

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

}  // namespace

// grouped_mm's gradients, group sizes around every block and the bf16 BLAS threshold (64 rows), an empty
// group; both weight layouts ([E, K, N], and [E, N, K] viewed transposed: the Experts layer's), a a column
// slice and grad a slice of wider tensors: against a float64 per-group reference on the same (rounded)
// inputs, and bit-identical at 1 and 2 threads.
void grouped_mm_backward_within_float64_bound_and_thread_count_free(const Case& c) {
  const at::ScalarType dt = c.dtype;
  const std::vector<int64_t>& sizes = c.groups();
  const at::Tensor offs = offsets(sizes);
  const int64_t E = static_cast<int64_t>(sizes.size()), T = offs[-1].item<int64_t>(), K = c["K"], N = c["N"];
  const bool transposed = c.layout == "b_ENK_transposed";
  const at::Tensor a0 = randn({T, K + 9}, dt).slice(1, 4, 4 + K);
  const at::Tensor b0 = transposed ? randn({E, N, K}, dt).transpose(1, 2) : randn({E, K, N}, dt);
  const at::Tensor grad = randn({T, N + 3}, dt).slice(1, 0, N);
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
  // The L2 streamer's streams (KERNMAP_PREFETCH_STREAMS) cap the reduction blocks and, where the weight
  // gradient's stores are plain, its tasks' rows: none (0) and 8 give the same bits.
  {
    const ScopedEnv env("KERNMAP_PREFETCH_STREAMS", "0");
    for (const char* streams : {"0", "8"}) {
      env.set(streams);
      const auto [ga, gb] = gradients(2);
      EXPECT_TRUE(at::equal(ga1, ga)) << "KERNMAP_PREFETCH_STREAMS=" << streams;
      EXPECT_TRUE(at::equal(gb1, gb)) << "KERNMAP_PREFETCH_STREAMS=" << streams;
    }
  }
  const at::Tensor ad = a0.to(at::kDouble), bd = b0.to(at::kDouble), gd = grad.to(at::kDouble);
  at::Tensor want_a = at::zeros({T, K}, at::kDouble), want_b = at::zeros({E, K, N}, at::kDouble);
  at::Tensor scale_a = at::zeros({T, K}, at::kDouble), scale_b = at::zeros({E, K, N}, at::kDouble);
  int64_t longest = 0;
  for (int64_t e = 0, r = 0; e < E; r += sizes[e], ++e) {
    const at::Tensor g = gd.slice(0, r, r + sizes[e]), x = ad.slice(0, r, r + sizes[e]);
    want_a.slice(0, r, r + sizes[e]).copy_(at::mm(g, bd[e].t()));
    scale_a.slice(0, r, r + sizes[e]).copy_(at::mm(g.abs(), bd[e].t().abs()));
    want_b[e].copy_(at::mm(x.t(), g));
    scale_b[e].copy_(at::mm(x.t().abs(), g.abs()));
    longest = std::max(longest, sizes[e]);
  }
  const double u = out_roundoff(dt), acc = acc_roundoff(dt);
  auto check = [&](const at::Tensor& got, const at::Tensor& want, const at::Tensor& scale, int64_t len) {
    ASSERT_EQ(got.sizes(), want.sizes());
    const at::Tensor err = (got.to(at::kDouble) - want).abs();
    const at::Tensor bound = want.abs() * u * 1.01 + scale * (len + 1) * acc + 1e-300;
    EXPECT_TRUE(err.le(bound).all().item<bool>()) << "max error " << err.max().item<double>();
  };
  check(ga1, want_a, scale_a, N);
  check(gb1, want_b, scale_b, longest);
  for (int64_t e = 0; e < E; ++e)
    if (sizes[e] == 0) {
      EXPECT_EQ(gb1[e].abs().sum().item<double>(), 0.0) << "the empty group " << e;
    }
}

}  // namespace kernmap::testing
