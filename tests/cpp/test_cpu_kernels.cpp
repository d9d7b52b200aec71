// The CPU kernels at every instruction-set level this machine runs, against the reference kernels, forward
// and backward, per dtype, on odd sizes and strided inputs. (Python tests add gradcheck, opcheck and
// transformers.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/isa.h"
#include "kernmap/cpu.h"
#include "kernmap/ops.h"
#include "ops/checks.h"
#include "tests/cpp/level_fixture.h"

namespace {

using kernmap::cpu::Level;

struct Tol {
  double rtol, atol;
};
Tol tol(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return {1e-10, 1e-12};
    case at::kFloat:
      return {1e-5, 1e-5};
    case at::kBFloat16:
      return {2e-2, 2e-2};
    default:
      return {2e-3, 2e-3};
  }
}

::testing::AssertionResult close(const at::Tensor& got, const at::Tensor& want, Tol t) {
  if (got.scalar_type() != want.scalar_type())
    return ::testing::AssertionFailure() << "dtype " << got.scalar_type() << " != " << want.scalar_type();
  if (got.sizes() != want.sizes())
    return ::testing::AssertionFailure() << "shape " << got.sizes() << " != " << want.sizes();
  if (got.numel() == 0) return ::testing::AssertionSuccess();
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  if (at::allclose(g, w, t.rtol, t.atol)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max abs diff " << (g - w).abs().max().item<double>();
}

// Poisons freshly allocated memory so a kernel that skips an element cannot pass by luck.
void poison_allocator() {
  at::empty({1 << 20}).fill_(std::numeric_limits<float>::quiet_NaN());
}

class CpuKernels : public kernmap::testing::LevelDtypeTest {};

// Inputs of several layouts holding the same values: contiguous 2-D, 3-D, a column slice of a wider tensor,
// and a transposed copy viewed back.
std::vector<at::Tensor> layouts(int64_t rows, int64_t H, at::ScalarType dt) {
  at::Tensor base = at::randn({rows, H}, at::kDouble).to(dt);
  at::Tensor wide = at::randn({rows, H + 5}, at::kDouble).to(dt);
  wide.narrow(1, 2, H).copy_(base);
  at::Tensor transposed = base.t().contiguous().t();
  std::vector<at::Tensor> out = {base, wide.narrow(1, 2, H), transposed};
  if (rows % 3 == 0) out.push_back(base.view({3, rows / 3, H}));
  return out;
}

TEST_P(CpuKernels, RmsNormForwardBackwardMatchesReference) {
  for (int64_t H : {1, 7, 769, 5125}) {
    for (const at::Tensor& x0 : layouts(6, H, dtype())) {
      for (at::ScalarType wt : {dtype(), at::kFloat}) {
        if (wt == at::kFloat && dtype() == at::kDouble) continue;
        SCOPED_TRACE("H=" + std::to_string(H) + " strides=" + c10::str(x0.strides()) + " w=" + c10::str(wt));
        at::Tensor w0 = (1 + 0.1 * at::randn({H}, at::kDouble)).to(wt);
        at::Tensor x = x0.detach().requires_grad_(true), w = w0.clone().requires_grad_(true);
        at::Tensor xr = x0.detach().requires_grad_(true), wr = w0.clone().requires_grad_(true);
        poison_allocator();
        at::Tensor y = kernmap::rms_norm(x, w, 1e-6);
        at::Tensor yr = kernmap::reference::rms_norm(xr, wr, 1e-6);
        ASSERT_TRUE(close(y, yr, tol(dtype())));
        at::Tensor dy = at::randn(y.sizes(), at::kDouble).to(y.scalar_type());
        torch::autograd::backward({y}, {dy});
        torch::autograd::backward({yr}, {dy});
        EXPECT_TRUE(close(x.grad(), xr.grad(), tol(dtype())));
        // dW sums over rows; the reference sums in the output dtype, kernmap in fp32.
        Tol tw = tol(dtype());
        EXPECT_TRUE(close(w.grad(), wr.grad(), {tw.rtol * 4, tw.atol * 4}));
      }
    }
  }
}

TEST_P(CpuKernels, SiluAndMulForwardBackwardMatchesReference) {
  for (int64_t I : {1, 7, 769, 5125}) {
    for (const at::Tensor& g0 : layouts(6, I, dtype())) {
      SCOPED_TRACE("I=" + std::to_string(I) + " strides=" + c10::str(g0.strides()));
      at::Tensor u0 = at::randn(g0.sizes(), at::kDouble).to(dtype());
      at::Tensor g = g0.detach().requires_grad_(true), u = u0.clone().requires_grad_(true);
      at::Tensor gr = g0.detach().requires_grad_(true), ur = u0.clone().requires_grad_(true);
      poison_allocator();
      at::Tensor y = kernmap::silu_and_mul(g, u);
      at::Tensor yr = kernmap::reference::silu_and_mul(gr, ur);
      ASSERT_TRUE(close(y, yr, tol(dtype())));
      at::Tensor dy = at::randn(y.sizes(), at::kDouble).to(dtype());
      torch::autograd::backward({y}, {dy});
      torch::autograd::backward({yr}, {dy});
      EXPECT_TRUE(close(g.grad(), gr.grad(), tol(dtype())));
      EXPECT_TRUE(close(u.grad(), ur.grad(), tol(dtype())));
    }
  }
}

// Streaming stores (asked for by the ops when outputs exceed the last-level cache) write the same bits as
// normal stores: on aligned rows (where they are taken), on rows a stride away that breaks the alignment, on
// a misaligned start and on widths with scalar tails (where the kernels fall back to normal stores).
TEST_P(CpuKernels, StreamingStoresWriteTheSameBits) {
  const auto& k = kernmap::cpu::kernel_table();
  const auto dt = kernmap::ops::cpu_dtype(dtype());
  const at::ScalarType acc = dtype() == at::kDouble ? at::kDouble : at::kFloat;
  for (int64_t n : {64, 80, 37}) {
    for (int64_t offset : {0, 1}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " offset=" + std::to_string(offset));
      const int64_t rows = 5;
      auto input = [&] { return at::randn({rows, n}, at::kDouble).to(dtype()); };
      const at::Tensor x = input(), u = input(), dy = input();
      const at::Tensor w = (1 + 0.1 * at::randn({n}, at::kDouble)).to(acc);
      // Output buffers [rows, n] starting `offset` elements into a fresh allocation (64-byte aligned).
      auto out = [&](int64_t cols = -1) {
        cols = cols < 0 ? n : cols;
        return at::full({rows * cols + offset}, 7.0, at::TensorOptions(dtype()))
            .narrow(0, offset, rows * cols);
      };
      auto same = [&](const at::Tensor& a, const at::Tensor& b) {
        EXPECT_TRUE(at::equal(a.view(a.element_size() == 8   ? at::kLong
                                     : a.element_size() == 4 ? at::kInt
                                                             : at::kShort),
                              b.view(b.element_size() == 8   ? at::kLong
                                     : b.element_size() == 4 ? at::kInt
                                                             : at::kShort)));
      };
      std::vector<at::Tensor> results[2];
      for (bool stream : {false, true}) {
        auto& r = results[stream];
        at::Tensor y = out(), rstd = at::empty({rows}, at::TensorOptions(acc));
        k.rms_norm_fwd(dt, dt, x.const_data_ptr(), n, w.const_data_ptr(), y.data_ptr(), rstd.data_ptr(), 0,
                       rows, n, 1e-6, stream);
        at::Tensor dx = out(), dw = at::zeros({n}, at::TensorOptions(acc));
        k.rms_norm_bwd(dt, dt, dy.const_data_ptr(), n, x.const_data_ptr(), n, w.const_data_ptr(),
                       rstd.const_data_ptr(), dx.data_ptr(), dw.data_ptr(), 0, rows, n, stream);
        at::Tensor s = out(), ds = out(), sm = out();
        k.silu_fwd(dt, x.const_data_ptr(), n, s.data_ptr(), 0, rows, n, stream);
        k.silu_bwd(dt, dy.const_data_ptr(), n, x.const_data_ptr(), n, ds.data_ptr(), 0, rows, n, stream);
        k.silu_and_mul_fwd(dt, x.const_data_ptr(), n, u.const_data_ptr(), n, sm.data_ptr(), 0, rows, n,
                           stream);
        // Backward into a packed [rows, 2n] gradient, as swiglu_backward writes it.
        at::Tensor packed = out(2 * n);
        const int64_t half = n * packed.element_size();
        k.silu_and_mul_bwd(dt, dy.const_data_ptr(), n, x.const_data_ptr(), n, u.const_data_ptr(), n,
                           packed.data_ptr(), 2 * n, static_cast<char*>(packed.data_ptr()) + half, 2 * n, 0,
                           rows, n, stream);
        r = {y, rstd, dx, dw, s, ds, sm, packed};
      }
      for (size_t i = 0; i < results[0].size(); ++i) {
        SCOPED_TRACE("output " + std::to_string(i));
        same(results[0][i], results[1][i]);
      }
      // And the values are the kernels' (a skipped block would still hold the 7.0 fill).
      EXPECT_FALSE(at::any(results[1][0] == 7.0).item<bool>());
    }
  }
}

TEST_P(CpuKernels, SwigluAndSiluMatchReference) {
  for (int64_t I : {1, 7, 769}) {
    at::Tensor gu0 = at::randn({2, 3, 2 * I}, at::kDouble).to(dtype());
    at::Tensor gu = gu0.clone().requires_grad_(true), gur = gu0.clone().requires_grad_(true);
    at::Tensor y = kernmap::swiglu(gu), yr = kernmap::reference::swiglu(gur);
    ASSERT_TRUE(close(y, yr, tol(dtype())));
    at::Tensor dy = at::randn(y.sizes(), at::kDouble).to(dtype());
    torch::autograd::backward({y}, {dy});
    torch::autograd::backward({yr}, {dy});
    EXPECT_TRUE(close(gu.grad(), gur.grad(), tol(dtype())));

    at::Tensor x = gu0.clone().requires_grad_(true), xr = gu0.clone().requires_grad_(true);
    at::Tensor s = kernmap::silu(x), sr = kernmap::reference::silu(xr);
    ASSERT_TRUE(close(s, sr, tol(dtype())));
    at::Tensor ds = at::randn(s.sizes(), at::kDouble).to(dtype());
    torch::autograd::backward({s}, {ds});
    torch::autograd::backward({sr}, {ds});
    EXPECT_TRUE(close(x.grad(), xr.grad(), tol(dtype())));
  }
}

// The kernels emulate the eager module's roundings; at::silu in the same dtype evaluates with another exp and
// division, so a few results may land on the other side of a rounding boundary, but no further.
::testing::AssertionResult nearly_bit_exact(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor gb = got.contiguous().view(at::kShort).to(at::kInt);
  const at::Tensor wb = want.contiguous().view(at::kShort).to(at::kInt);
  const at::Tensor same = got.eq(want) | gb.eq(wb);
  const double identical = same.to(at::kDouble).mean().item<double>();
  const int64_t max_ulps = at::where(same, at::zeros_like(gb), (gb - wb).abs()).max().item<int64_t>();
  if (identical >= 0.99 && max_ulps <= 1) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "identical " << identical << ", max ulps apart " << max_ulps;
}

TEST_P(CpuKernels, LowPrecisionSiluMatchesEagerTorchBitForBit) {
  if (dtype() != at::kBFloat16 && dtype() != at::kHalf) GTEST_SKIP() << "only the 16-bit dtypes round";
  at::Tensor g = (3 * at::randn({16, 1031}, at::kDouble)).to(dtype());
  at::Tensor u = at::randn({16, 1031}, at::kDouble).to(dtype());
  EXPECT_TRUE(nearly_bit_exact(kernmap::silu_and_mul(g, u), at::silu(g) * u));
  EXPECT_TRUE(nearly_bit_exact(kernmap::silu(g), at::silu(g)));
}

// The smallest normal and the largest finite value of a floating dtype.
std::pair<double, double> normal_range(at::ScalarType t) {
  std::pair<double, double> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t, "normal_range", [&] {
    out = {static_cast<double>(std::numeric_limits<scalar_t>::min()),
           static_cast<double>(std::numeric_limits<scalar_t>::max())};
  });
  return out;
}

// Eager's value, element by element: NaN where eager gives NaN, the same infinity, a zero of the same sign
// where eager gives a signed zero, and otherwise within rtol of eager's value (plus the dtype's smallest
// normal number: the avx512bf16 level flushes bfloat16 subnormal results to zero, see vec.h).
::testing::AssertionResult eager_values(const at::Tensor& got, const at::Tensor& want, const at::Tensor& x,
                                        double rtol) {
  const at::Tensor g = got.to(at::kDouble).contiguous().view(-1),
                   w = want.to(at::kDouble).contiguous().view(-1);
  const at::Tensor xs = x.to(at::kDouble).contiguous().view(-1);
  const double tiny = normal_range(want.scalar_type()).first;
  std::ostringstream wrong;
  for (int64_t i = 0; i < w.numel(); ++i) {
    const double a = g[i].item<double>(), b = w[i].item<double>();
    const bool same = std::isnan(b)   ? std::isnan(a)
                      : std::isinf(b) ? a == b
                      : b == 0        ? a == 0 && std::signbit(a) == std::signbit(b)
                                      : std::abs(a - b) <= rtol * std::abs(b) + tiny;
    if (!same) wrong << "\n  x = " << xs[i].item<double>() << ": got " << a << ", eager " << b;
  }
  if (!wrong.str().empty()) return ::testing::AssertionFailure() << wrong.str();
  return ::testing::AssertionSuccess();
}

// SiLU's non-finite and huge inputs, where the kernels' exp and reciprocal leave their usual range: eager
// computes x / (1 + exp(-x)), so silu(-inf) is NaN, silu(-1e30) is -0 and silu'(+inf) is NaN. Each value sits
// in several lane positions of full blocks and of the scalar tail.
TEST_P(CpuKernels, SiluFamilyGivesEagerValuesOnNonFiniteAndHugeInputs) {
  const double inf = std::numeric_limits<double>::infinity();
  const auto [smallest, max] = normal_range(dtype());
  const double denormal = smallest / 8;
  const std::vector<double> special = {-inf, inf,   std::nan(""), -1e30, 1e30, -1e4,     1e4,       -88.7,
                                       88.7, -89,   89,           -0.0,  0.0,  denormal, -denormal, max,
                                       -max, -87.5, 17.0,         -17.0, 104,  -104};
  std::vector<double> values;
  for (int shift = 0; shift < 3; ++shift)
    for (size_t i = 0; i < special.size(); ++i) values.push_back(special[(i + shift * 7) % special.size()]);
  const int64_t n = static_cast<int64_t>(values.size());
  const at::Tensor x0 = at::tensor(values, at::kDouble).to(dtype()).view({1, n});
  const at::Tensor u0 = (at::rand({1, n}, at::kDouble) + 0.5).to(dtype());
  const at::Tensor dy = (at::rand({1, n}, at::kDouble) - 0.5).to(dtype());
  const double rtol = tol(dtype()).rtol;
  auto grad_of = [&](auto&& fn, std::vector<at::Tensor> inputs) {
    for (at::Tensor& t : inputs) t = t.clone().requires_grad_(true);
    const at::Tensor y = fn(inputs);
    torch::autograd::backward({y}, {dy});
    std::vector<at::Tensor> out = {y.detach()};
    for (const at::Tensor& t : inputs) out.push_back(t.grad());
    return out;
  };
  const auto silu = grad_of([](const auto& in) { return kernmap::silu(in[0]); }, {x0});
  const auto eager_silu = grad_of([](const auto& in) { return at::silu(in[0]); }, {x0});
  EXPECT_TRUE(eager_values(silu[0], eager_silu[0], x0, rtol)) << "silu forward";
  EXPECT_TRUE(eager_values(silu[1], eager_silu[1], x0, rtol)) << "silu backward";

  const auto mul = grad_of([](const auto& in) { return kernmap::silu_and_mul(in[0], in[1]); }, {x0, u0});
  const auto eager_mul = grad_of([](const auto& in) { return at::silu(in[0]) * in[1]; }, {x0, u0});
  for (size_t i = 0; i < mul.size(); ++i)
    EXPECT_TRUE(eager_values(mul[i], eager_mul[i], x0, rtol)) << "silu_and_mul output " << i;

  const at::Tensor packed = at::cat({x0, u0}, -1);
  const auto sw = grad_of([](const auto& in) { return kernmap::swiglu(in[0]); }, {packed});
  const auto eager_sw = grad_of([](const auto& in) { return kernmap::reference::swiglu(in[0]); }, {packed});
  EXPECT_TRUE(eager_values(sw[0], eager_sw[0], x0, rtol)) << "swiglu forward";
  EXPECT_TRUE(eager_values(sw[1], eager_sw[1], at::cat({x0, x0}, -1), rtol)) << "swiglu backward";
}

TEST_P(CpuKernels, GroupedMmBothLayoutsForwardBackwardMatchReference) {
  // Uneven groups, an empty one, and sizes that leave edge blocks in every dimension; the second shape spans
  // several 64-column blocks and 128-column tiles, and odd group sizes (odd reduction lengths for the paired
  // bf16 steps).
  struct Shape {
    std::vector<int> offs;
    int64_t K, N;
  };
  for (const Shape& shape : {Shape{{5, 5, 23, 40}, 77, 70}, Shape{{0, 33, 33, 70}, 131, 200}})
    for (bool transposed : {false, true}) {
      SCOPED_TRACE(transposed ? "b transposed [E, N, K]" : "b [E, K, N]");
      SCOPED_TRACE("K = " + std::to_string(shape.K) + ", N = " + std::to_string(shape.N));
      const at::Tensor offs = at::tensor(shape.offs, at::kInt);
      const int64_t T = shape.offs.back(), K = shape.K, N = shape.N;
      const int64_t empty_group = shape.offs[0] == 0 ? 0 : 1;
      at::Tensor a0 = at::randn({T, K}, at::kDouble).to(dtype());
      at::Tensor b0 = transposed ? at::randn({4, N, K}, at::kDouble).to(dtype()).transpose(1, 2)
                                 : at::randn({4, K, N}, at::kDouble).to(dtype());
      at::Tensor a = a0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
      at::Tensor ar = a0.clone().requires_grad_(true), br = b0.clone().requires_grad_(true);
      at::Tensor y = kernmap::grouped_mm(a, b, offs), yr = kernmap::reference::grouped_mm(ar, br, offs);
      Tol t = tol(dtype());
      Tol wide{t.rtol * 4, t.atol * 8};  // sums over K = 77 terms in low precision
      ASSERT_TRUE(close(y, yr, wide));
      at::Tensor dy = at::randn(y.sizes(), at::kDouble).to(dtype());
      torch::autograd::backward({y}, {dy});
      torch::autograd::backward({yr}, {dy});
      EXPECT_TRUE(close(a.grad(), ar.grad(), wide));
      EXPECT_TRUE(close(b.grad(), br.grad(), wide));
      EXPECT_EQ(b.grad().select(0, empty_group).abs().sum().item<double>(), 0.0);
    }
}

// The forward's small-group path (groups under 64 rows, b in nn.Linear layout: the "NT" kernel) against
// float64 math, with an error bound per element: the output's rounding plus fp32 accumulation over K terms (K
// * 2^-23 * sum_k |a_k b_k|; fp64 for float64). Group sizes straddle the kernels' 8-row groups, 32-row passes
// and dot-product rows; K is odd (bf16 pairs, 16-step loops) and N leaves every column-block remainder; b and
// a come strided.
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
  const int64_t r = i / ref.size(1), c = i % ref.size(1);
  return ::testing::AssertionFailure()
         << over.sum().item<int64_t>() << " elements over the bound; worst at [" << r << ", " << c
         << "]: got " << got.to(at::kDouble)[r][c].item<double>() << ", want " << ref[r][c].item<double>()
         << ", bound " << bound[r][c].item<double>();
}

TEST_P(CpuKernels, GroupedMmForwardSmallGroupsMatchFloat64) {
  const std::vector<int> sizes = {0,  1,  2,  3,  4,  5,  7,  8,  9,  10, 11, 12, 13, 15, 16, 17, 18,
                                  19, 20, 23, 24, 25, 31, 32, 33, 34, 35, 40, 41, 47, 48, 57, 63, 0};
  std::vector<int> ends;
  int total = 0;
  for (int n : sizes) ends.push_back(total += n);
  const at::Tensor offs = at::tensor(ends, at::kInt);
  const int64_t E = static_cast<int64_t>(sizes.size()), T = total;
  for (int64_t K : {1, 77, 259})
    for (int64_t N : {1, 53, 70})
      for (bool strided : {false, true}) {
        if (K == 1 && N == 70) continue;
        SCOPED_TRACE("K = " + std::to_string(K) + ", N = " + std::to_string(N) +
                     (strided ? ", strided" : ""));
        // b[e] = W[e]^T with W [E, N, K] rows K-contiguous; strided: rows K + 5 apart, a's rows K + 3 apart.
        at::Tensor W = at::randn({E, N, strided ? K + 5 : K}, at::kDouble).to(dtype()).narrow(2, 0, K);
        at::Tensor a = at::randn({T, strided ? K + 3 : K}, at::kDouble).to(dtype()).narrow(1, 0, K);
        poison_allocator();
        const at::Tensor y = kernmap::grouped_mm(a, W.transpose(1, 2), offs);
        ASSERT_EQ(y.sizes(), (at::IntArrayRef{T, N}));
        EXPECT_TRUE(within_bound(y, a, W.transpose(1, 2), offs));
      }
}

// A non-finite input reaches only its own row (a) or column (b): rows share registers in the kernels.
TEST_P(CpuKernels, GroupedMmForwardKeepsNonFiniteValuesInTheirRowAndColumn) {
  const at::Tensor offs = at::tensor({17, 17, 40}, at::kInt);
  at::Tensor a = at::randn({40, 67}, at::kDouble).to(dtype());
  at::Tensor W = at::randn({3, 29, 67}, at::kDouble).to(dtype());
  a[3][10] = std::numeric_limits<double>::infinity();
  W[2][5][66] = std::numeric_limits<double>::quiet_NaN();
  const at::Tensor y = kernmap::grouped_mm(a, W.transpose(1, 2), offs).to(at::kDouble);
  const at::Tensor bad = ~y.isfinite();
  at::Tensor expected = at::zeros({40, 29}, at::kBool);
  expected[3].fill_(true);                             // row 3 (group 0) times every column
  expected.slice(0, 17, 40).select(1, 5).fill_(true);  // column 5 of group 2's rows
  EXPECT_TRUE(at::equal(bad, expected)) << bad.nonzero();
}

// Each output element is summed in one order whatever the thread count (the column tiles per task change with
// it): the same bits at 1, 2 and 3 threads.
TEST_P(CpuKernels, GroupedMmForwardSameBitsAtAnyThreadCount) {
  const at::Tensor offs = at::tensor({9, 9, 26, 59, 60, 100, 122}, at::kInt);
  const at::Tensor a = at::randn({122, 301}, at::kDouble).to(dtype());
  const at::Tensor W = at::randn({7, 250, 301}, at::kDouble).to(dtype());
  const int previous = at::get_num_threads();
  std::vector<at::Tensor> out;
  for (int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    out.push_back(kernmap::grouped_mm(a, W.transpose(1, 2), offs));
  }
  at::set_num_threads(previous);
  EXPECT_TRUE(at::equal(out[0], out[1]));
  EXPECT_TRUE(at::equal(out[0], out[2]));
}

// Whether two tensors hold the same bits (NaN payloads and signed zeros included).
::testing::AssertionResult same_bits(const at::Tensor& got, const at::Tensor& want) {
  if (got.scalar_type() != want.scalar_type() || got.sizes() != want.sizes())
    return ::testing::AssertionFailure()
           << got.scalar_type() << got.sizes() << " vs " << want.scalar_type() << want.sizes();
  const auto as_int = [](const at::Tensor& t) {
    const int64_t size = t.element_size();
    return t.contiguous().view(size == 8 ? at::kLong : size == 4 ? at::kInt : at::kShort);
  };
  const at::Tensor differ = as_int(got).ne(as_int(want));
  if (!differ.any().item<bool>()) return ::testing::AssertionSuccess();
  const int64_t i = differ.reshape(-1).nonzero()[0].item<int64_t>();
  return ::testing::AssertionFailure()
         << differ.sum().item<int64_t>() << " elements differ; first at flat " << i << ": got "
         << got.reshape(-1)[i].item<double>() << ", want " << want.reshape(-1)[i].item<double>();
}

at::ScalarType acc_of(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// The MoE combine kernel against its scalar math written in ATen ops (each an IEEE operation per element):
// acc = +0; per slot in order: acc += round_T(row * w) (round_product), row * w, or row; out = round(acc).
// Rows in a random order (pos a permutation), odd widths around the block sizes, k = 1, 2, 8, output in the
// rows' dtype and in the accumulation type, the tokens split over two calls; element-wise bit-identical.
TEST_P(CpuKernels, MoeCombineHasTheBitsOfTheScalarMath) {
  const auto& kern = kernmap::cpu::kernel_table();
  const at::ScalarType acc = acc_of(dtype());
  const int64_t T = 7;
  for (int64_t H : {1, 15, 16, 17, 33, 2048 + 3})
    for (int64_t k : {1, 2, 8})
      for (int mode = 0; mode < 3; ++mode)
        for (at::ScalarType out_t : {dtype(), acc}) {
          if (out_t == acc && acc == dtype() && mode > 0) continue;  // same case as the first
          const bool weighted = mode > 0, round_product = mode == 2;
          SCOPED_TRACE("H=" + std::to_string(H) + " k=" + std::to_string(k) +
                       (weighted ? (round_product ? " weighted, rounded" : " weighted") : " unweighted") +
                       " out=" + std::string(c10::toString(out_t)));
          const int64_t S = T * k;
          at::Tensor rows = at::randn({S, H}, at::kDouble).to(dtype());
          rows[S - 1].narrow(0, 0, std::min<int64_t>(H, 3)).fill_(-0.0);  // a sum of -0 terms is +0
          const at::Tensor pos = at::randperm(S, at::kLong);
          // Weights away from zero, so no product is subnormal (avx512bf16 flushes those; see vec.h).
          const at::Tensor w = (0.05 + 0.95 * at::rand({S}, at::kDouble)).to(acc);
          at::Tensor want = at::zeros({T, H}, acc);
          const at::Tensor slots = pos.view({T, k});
          for (int64_t s = 0; s < k; ++s) {
            const at::Tensor j = slots.select(1, s).contiguous();
            at::Tensor term = rows.index_select(0, j).to(acc);
            if (weighted) term = term * w.index_select(0, j).unsqueeze(1);
            if (round_product) term = term.to(dtype()).to(acc);
            want = want + term;
          }
          want = want.to(out_t);
          at::Tensor got = at::full({T, H}, std::numeric_limits<double>::quiet_NaN(), out_t);
          for (auto [t0, t1] : {std::pair<int64_t, int64_t>{0, 3}, {3, T}})
            kern.moe_combine(kernmap::ops::cpu_dtype(dtype()), kernmap::ops::cpu_dtype(out_t),
                             rows.const_data_ptr(), pos.const_data_ptr<int64_t>(), k,
                             weighted ? w.const_data_ptr() : nullptr, round_product, got.data_ptr(), t0, t1,
                             H);
          EXPECT_TRUE(same_bits(got, want));
        }
}

// The combine's backward: d_rows[j] = round(grad[order[j] / k] * w[j]) bit for bit; d_w[j] = <grad row, row
// j> against float64 within the bound of an fp32 (fp64) sum of H products in any order: H * 2^-23 * sum |g
// r|.
TEST_P(CpuKernels, MoeCombineBackwardMatchesScalarMathAndFloat64) {
  const auto& kern = kernmap::cpu::kernel_table();
  const at::ScalarType acc = acc_of(dtype());
  const int64_t T = 5;
  for (int64_t H : {1, 15, 16, 17, 33, 2048 + 3})
    for (int64_t k : {1, 2, 8}) {
      SCOPED_TRACE("H=" + std::to_string(H) + " k=" + std::to_string(k));
      const int64_t S = T * k;
      const at::Tensor grad = at::randn({T, H}, at::kDouble).to(dtype());
      const at::Tensor rows = at::randn({S, H}, at::kDouble).to(dtype());
      const at::Tensor order = at::randperm(S, at::kLong);
      const at::Tensor w = (0.05 + 0.95 * at::rand({S}, at::kDouble)).to(acc);
      at::Tensor d_rows = at::full({S, H}, std::numeric_limits<double>::quiet_NaN(), dtype());
      at::Tensor d_w = at::full({S}, std::numeric_limits<double>::quiet_NaN(), acc);
      for (auto [j0, j1] : {std::pair<int64_t, int64_t>{0, S / 2}, {S / 2, S}})
        kern.moe_combine_bwd(kernmap::ops::cpu_dtype(dtype()), grad.const_data_ptr(), rows.const_data_ptr(),
                             w.const_data_ptr(), order.const_data_ptr<int64_t>(), k, d_rows.data_ptr(),
                             d_w.data_ptr(), j0, j1, H);
      const at::Tensor g = grad.index_select(0, order.div(k, "floor"));
      EXPECT_TRUE(same_bits(d_rows, (g.to(acc) * w.unsqueeze(1)).to(dtype())));
      const at::Tensor prod = g.to(at::kDouble) * rows.to(at::kDouble);
      const double unit = dtype() == at::kDouble ? std::ldexp(1.0, -52) : std::ldexp(1.0, -23);
      const at::Tensor bound = double(H) * unit * prod.abs().sum(1);
      const at::Tensor err = (d_w.to(at::kDouble) - prod.sum(1)).abs();
      EXPECT_TRUE((err <= bound).all().item<bool>())
          << "worst error " << (err - bound).max().item<double>() << " over the bound";
    }
}

// The Experts op's outputs do not depend on the thread count (the combine passes split tokens and rows over
// threads; each element and each d_w has one summation order).
TEST_P(CpuKernels, ExpertsSameBitsAtAnyThreadCount) {
  const int64_t T = 37, H = 67, E = 5, I = 24, k = 3;
  const at::Tensor hidden = at::randn({T, H}, at::kDouble).to(dtype());
  const at::Tensor ids =
      at::argsort(at::rand({T, E}), /*dim=*/1, /*descending=*/false).narrow(1, 0, k).contiguous();
  const at::Tensor weights = at::rand({T, k}, at::kDouble).to(dtype());
  const at::Tensor gate_up = (0.2 * at::randn({E, 2 * I, H}, at::kDouble)).to(dtype());
  const at::Tensor down = (0.2 * at::randn({E, H, I}, at::kDouble)).to(dtype());
  const at::Tensor dy = at::randn({T, H}, at::kDouble).to(dtype());
  const int previous = at::get_num_threads();
  std::vector<std::vector<at::Tensor>> runs;
  for (int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    at::Tensor h = hidden.clone().requires_grad_(true), w = weights.clone().requires_grad_(true);
    at::Tensor y = kernmap::experts(h, ids, w, gate_up, down);
    torch::autograd::backward({y}, {dy});
    runs.push_back({y, h.grad(), w.grad()});
  }
  at::set_num_threads(previous);
  for (size_t r = 1; r < runs.size(); ++r)
    for (size_t i = 0; i < runs[0].size(); ++i) {
      SCOPED_TRACE("run " + std::to_string(r) + " output " + std::to_string(i));
      EXPECT_TRUE(same_bits(runs[r][i], runs[0][i]));
    }
}

TEST_P(CpuKernels, EmptyInputs) {
  at::Tensor x = at::empty({0, 16}, dtype());
  at::Tensor w = at::ones({16}, dtype()).requires_grad_(true);
  at::Tensor xg = x.clone().requires_grad_(true);
  at::Tensor y = kernmap::rms_norm(xg, w, 1e-6);
  EXPECT_EQ(y.sizes(), x.sizes());
  torch::autograd::backward({y}, {at::empty_like(y)});
  EXPECT_EQ(w.grad().sizes(), w.sizes());
  EXPECT_EQ(w.grad().abs().sum().item<double>(), 0.0);
  EXPECT_EQ(kernmap::silu_and_mul(x, x).sizes(), x.sizes());
  EXPECT_EQ(kernmap::swiglu(x).sizes(), (at::IntArrayRef{0, 8}));
}

std::vector<std::tuple<Level, at::ScalarType>> params() {
  std::vector<std::tuple<Level, at::ScalarType>> out;
  for (Level l : kernmap::cpu::supported_levels())
    for (at::ScalarType t : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) out.emplace_back(l, t);
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllLevels, CpuKernels, ::testing::ValuesIn(params()), [](const auto& info) {
  return std::string(kernmap::cpu::level_name(std::get<0>(info.param))) + "_" +
         std::string(c10::toString(std::get<1>(info.param)));
});

TEST(CpuLevels, ThisMachineRunsAtLeastBaselineAndTheBestIsActiveByDefault) {
  const auto levels = kernmap::cpu::supported_levels();
  ASSERT_FALSE(levels.empty());
  EXPECT_EQ(levels.front(), Level::kBaseline);
  EXPECT_EQ(kernmap::cpu::parse_level("avx2"), Level::kAvx2);
  EXPECT_FALSE(kernmap::cpu::parse_level("sse9").has_value());
}

TEST(CpuLevels, ThePublicFunctionsNameAndSetLibkernmapsLevel) {
  const std::vector<std::string> levels = kernmap::supported_cpu_levels();
  std::vector<std::string> expected;
  std::string runs;
  for (Level l : kernmap::cpu::supported_levels()) {
    expected.emplace_back(kernmap::cpu::level_name(l));
    runs += (runs.empty() ? "" : ", ") + expected.back();
  }
  EXPECT_EQ(levels, expected);
  const std::string previous = kernmap::cpu_level();
  EXPECT_NE(std::find(levels.begin(), levels.end(), previous), levels.end()) << previous;
  kernmap::set_cpu_level("baseline");
  EXPECT_EQ(kernmap::cpu_level(), "baseline");
  const auto refusal = [](const std::string& level) -> std::string {
    try {
      kernmap::set_cpu_level(level);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(refusal("sse9"), "set_cpu_level: unknown level 'sse9' (this CPU runs: " + runs + ")");
  if (levels.size() < 4) {  // a compiled level this CPU cannot run (none on a CPU with avx512bf16)
    EXPECT_EQ(refusal("avx512bf16"),
              "set_cpu_level: this CPU cannot run level 'avx512bf16' (this CPU runs: " + runs + ")");
  }
  EXPECT_EQ(kernmap::cpu_level(), "baseline");  // a refused level changes nothing
  kernmap::set_cpu_level(previous);
  EXPECT_EQ(kernmap::cpu_level(), previous);
}

TEST(OpErrors, NameTheArgument) {
  at::Tensor x = at::randn({4, 8});
  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  EXPECT_NE(message([&] { kernmap::rms_norm(x, at::ones({7}), 1e-6); }).find("weight must have shape [8]"),
            std::string::npos);
  EXPECT_NE(
      message([&] { kernmap::rms_norm(x.to(at::kLong), at::ones({8}), 1e-6); }).find("x must be float32"),
      std::string::npos);
  EXPECT_NE(message([&] {
              kernmap::silu_and_mul(x, at::randn({4, 9}));
            }).find("up must have the shape of gate"),
            std::string::npos);
  EXPECT_NE(
      message([&] { kernmap::silu_and_mul(x, x.to(at::kBFloat16)); }).find("up must have the dtype of gate"),
      std::string::npos);
  EXPECT_NE(message([&] {
              kernmap::swiglu(at::randn({4, 7}));
            }).find("even last dimension"),
            std::string::npos);
}

}  // namespace
