// The rest of the decoder layer's memory-bound work at every instruction-set level this machine runs, per
// dtype: the rotary embedding (apply_rotary) and the residual add fused with RMSNorm (add_rms_norm), forward
// and backward, against the reference kernels (the eager math, bit for bit where the kernels promise it) and
// against float64, on odd sizes, the attention's layouts, strided and empty inputs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <functional>
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

double tolerance(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return 1e-12;
    case at::kFloat:
      return 1e-5;
    case at::kBFloat16:
      return 2e-2;
    default:
      return 2e-3;
  }
}

// |got - want| <= tol * (1 + |want|), want in float64.
::testing::AssertionResult near(const at::Tensor& got, const at::Tensor& want, double tol) {
  if (got.sizes() != want.sizes())
    return ::testing::AssertionFailure() << "shape " << got.sizes() << " != " << want.sizes();
  if (got.numel() == 0) return ::testing::AssertionSuccess();
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  const at::Tensor excess = (g - w).abs() - tol * (1 + w.abs());
  if (!g.isnan().any().item<bool>() && excess.max().item<double>() <= 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "max abs diff " << (g - w).abs().max().item<double>() << " (tolerance " << tol << " relative)";
}

// Equal values, dtypes and shapes (signed zeros compare equal: eager's autograd adds the zeros of its slice
// gradients, whose sign the kernels do not reproduce).
::testing::AssertionResult equal_values(const at::Tensor& got, const at::Tensor& want) {
  if (got.scalar_type() != want.scalar_type() || got.sizes() != want.sizes())
    return ::testing::AssertionFailure()
           << got.scalar_type() << got.sizes() << " vs " << want.scalar_type() << want.sizes();
  if (at::equal(got, want)) return ::testing::AssertionSuccess();
  const at::Tensor differ = got.ne(want).reshape(-1);
  const int64_t i = differ.nonzero()[0].item<int64_t>();
  return ::testing::AssertionFailure()
         << differ.sum().item<int64_t>() << " of " << got.numel() << " elements differ; first at flat " << i
         << ": got " << got.reshape(-1)[i].item<double>() << ", want " << want.reshape(-1)[i].item<double>();
}

// Whether two tensors hold the same bits.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  const auto as_int = [](const at::Tensor& t) {
    const int64_t size = t.element_size();
    return t.contiguous().view(size == 8 ? at::kLong : size == 4 ? at::kInt : at::kShort);
  };
  return a.sizes() == b.sizes() && at::equal(as_int(a), as_int(b));
}

// Whether a and b have the same shape and memory layout (the strides of dimensions of size 1 do not matter).
::testing::AssertionResult same_layout(const at::Tensor& a, const at::Tensor& b) {
  bool same = a.sizes() == b.sizes();
  for (int64_t d = 0; same && d < a.dim(); ++d) same = a.size(d) == 1 || a.stride(d) == b.stride(d);
  if (same) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "strides " << a.strides() << " vs " << b.strides() << " (shapes "
                                       << a.sizes() << ", " << b.sizes() << ")";
}

// Fills recently freed memory with NaN so a kernel that skips an output element cannot pass by luck.
void poison_allocator() {
  at::empty({1 << 20}).fill_(std::numeric_limits<float>::quiet_NaN());
}

class DecoderKernels : public kernmap::testing::LevelDtypeTest {};

// ---- rotary embedding ----

// The two halves of the last dimension exchanged.
at::Tensor swap_halves(const at::Tensor& t) {
  const int64_t h = t.size(-1) / 2;
  return at::cat({t.slice(-1, h), t.slice(-1, 0, h)}, -1);
}

// The float64 bound of a rotary result rounded as eager rounds it: two products and their sum, each rounded
// once to the dtype (unit roundoff u), so |got - exact| <= 3u (|x c| + |rotate_half(x)| |s|) elementwise,
// plus the spacing of fp16's subnormals (a product can be one).
at::Tensor rotary_bound(const at::Tensor& x, const at::Tensor& cos_u, const at::Tensor& sin_u,
                        at::ScalarType t) {
  const double u = t == at::kDouble     ? std::ldexp(1.0, -53)
                   : t == at::kFloat    ? std::ldexp(1.0, -24)
                   : t == at::kBFloat16 ? std::ldexp(1.0, -8)
                                        : std::ldexp(1.0, -11);
  const at::Tensor a = x.to(at::kDouble).abs();
  const double tiny = t == at::kHalf ? std::ldexp(1.0, -24) : 0.0;
  return 3 * u * (a * cos_u.to(at::kDouble).abs() + swap_halves(a) * sin_u.to(at::kDouble).abs()) + tiny;
}

::testing::AssertionResult within(const at::Tensor& got, const at::Tensor& exact, const at::Tensor& bound) {
  const at::Tensor err = (got.to(at::kDouble) - exact).abs();
  if (!got.to(at::kDouble).isnan().any().item<bool>() && (err <= bound).all().item<bool>())
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << (err > bound).sum().item<int64_t>() << " elements over the bound; worst "
         << (err - bound).max().item<double>() << " over";
}

// One layout of the attention's operands: q, k and cos, sin, the unsqueeze_dim that broadcasts them.
struct RotaryCase {
  std::string name;
  at::Tensor q, k, cos, sin;
  int64_t dim;
};

// The layouts transformers' attention classes and other callers hand apply_rotary_pos_emb, all holding
// values of `dt`: [B, heads, S, D] views of [B, S, heads, D] projections (the attention's), contiguous [B,
// heads, S, D], [B, S, heads, D] with unsqueeze_dim 2, slices of one fused qkv projection, per-batch
// positions, and [S, D] cos and sin.
std::vector<RotaryCase> rotary_cases(int64_t D, at::ScalarType dt) {
  const int64_t B = 2, S = 5, H = 3, KV = 1;
  auto randn = [&](at::IntArrayRef shape) { return at::randn(shape, at::kDouble).to(dt); };
  const at::Tensor cos = randn({1, S, D}), sin = randn({1, S, D});
  std::vector<RotaryCase> out;
  out.push_back({"attention views", randn({B, S, H, D}).transpose(1, 2), randn({B, S, KV, D}).transpose(1, 2),
                 cos, sin, 1});
  out.push_back({"contiguous", randn({B, H, S, D}), randn({B, KV, S, D}), cos, sin, 1});
  out.push_back(
      {"[B, S, heads, D], unsqueeze_dim 2", randn({B, S, H, D}), randn({B, S, KV, D}), cos, sin, 2});
  const at::Tensor qkv = randn({B, S, (H + 2 * KV) * D});
  out.push_back({"fused qkv slices", qkv.narrow(2, 0, H * D).view({B, S, H, D}).transpose(1, 2),
                 qkv.narrow(2, H * D, KV * D).view({B, S, KV, D}).transpose(1, 2), cos, sin, 1});
  out.push_back({"per-batch positions", randn({B, S, H, D}).transpose(1, 2),
                 randn({B, S, KV, D}).transpose(1, 2), randn({B, S, D}), randn({B, S, D}), 1});
  out.push_back(
      {"[S, D] cos, unsqueeze_dim 0", randn({B, H, S, D}), randn({B, KV, S, D}), cos[0], sin[0], 0});
  out.push_back({"strided cos", randn({B, H, S, D}), randn({B, KV, S, D}),
                 randn({1, S, 2 * D}).narrow(2, 0, D), randn({1, S, 2 * D}).narrow(2, D, D), 1});
  return out;
}

TEST_P(DecoderKernels, RotaryEqualsTheEagerMathAndFloat64ForwardAndBackward) {
  for (int64_t D : {2, 6, 64, 128, 130}) {
    for (const RotaryCase& c : rotary_cases(D, dtype())) {
      SCOPED_TRACE("D=" + std::to_string(D) + " " + c.name);
      at::Tensor q = c.q.detach().requires_grad_(true), k = c.k.detach().requires_grad_(true);
      at::Tensor qr = c.q.detach().requires_grad_(true), kr = c.k.detach().requires_grad_(true);
      poison_allocator();
      auto [qe, ke] = kernmap::apply_rotary(q, k, c.cos, c.sin, c.dim);
      auto [qer, ker] = kernmap::reference::apply_rotary(qr, kr, c.cos, c.sin, c.dim);
      // The eager roundings, one by one: bit for bit in every dtype, and eager's output layout.
      EXPECT_TRUE(same_bits(qe, qer));
      EXPECT_TRUE(same_bits(ke, ker));
      EXPECT_TRUE(same_layout(qe, qer));
      EXPECT_TRUE(same_layout(ke, ker));
      auto [q64, k64] = kernmap::reference::apply_rotary(c.q.to(at::kDouble), c.k.to(at::kDouble),
                                                         c.cos.to(at::kDouble), c.sin.to(at::kDouble), c.dim);
      const at::Tensor cu = c.cos.unsqueeze(c.dim), su = c.sin.unsqueeze(c.dim);
      EXPECT_TRUE(within(qe, q64, rotary_bound(c.q, cu, su, dtype())));
      EXPECT_TRUE(within(ke, k64, rotary_bound(c.k, cu, su, dtype())));

      const at::Tensor gq = at::randn(qe.sizes(), at::kDouble).to(dtype());
      const at::Tensor gk = at::randn(ke.sizes(), at::kDouble).to(dtype());
      torch::autograd::backward({qe, ke}, {gq, gk});
      torch::autograd::backward({qer, ker}, {gq, gk});
      EXPECT_TRUE(equal_values(q.grad(), qr.grad()));
      EXPECT_TRUE(equal_values(k.grad(), kr.grad()));
      EXPECT_TRUE(same_layout(q.grad(), qr.grad()));
      EXPECT_TRUE(same_layout(k.grad(), kr.grad()));
      at::Tensor qd = c.q.to(at::kDouble).requires_grad_(true), kd = c.k.to(at::kDouble).requires_grad_(true);
      auto [qed, ked] =
          kernmap::reference::apply_rotary(qd, kd, c.cos.to(at::kDouble), c.sin.to(at::kDouble), c.dim);
      torch::autograd::backward({qed, ked}, {gq.to(at::kDouble), gk.to(at::kDouble)});
      // The transpose: each half of the gradient meets the other half of sin.
      EXPECT_TRUE(within(q.grad(), qd.grad(), rotary_bound(gq, cu, swap_halves(su), dtype())));
      EXPECT_TRUE(within(k.grad(), kd.grad(), rotary_bound(gk, cu, swap_halves(su), dtype())));
    }
  }
}

// cos and sin that require a gradient (not transformers' case: its rotary embedding runs under no_grad) get
// one through the eager math: every gradient is the reference's.
TEST_P(DecoderKernels, RotaryGivesCosAndSinGradientsWhenTheyRequireThem) {
  const RotaryCase c = rotary_cases(6, dtype())[0];
  std::vector<at::Tensor> grads[2];
  for (int ref = 0; ref < 2; ++ref) {
    at::Tensor q = c.q.detach().requires_grad_(true), k = c.k.detach().requires_grad_(true);
    at::Tensor cos = c.cos.detach().requires_grad_(true), sin = c.sin.detach().requires_grad_(true);
    auto [qe, ke] =
        ref ? kernmap::reference::apply_rotary(q, k, cos, sin, 1) : kernmap::apply_rotary(q, k, cos, sin, 1);
    torch::autograd::backward({qe.sum() + ke.sum()});
    grads[ref] = {q.grad(), k.grad(), cos.grad(), sin.grad()};
  }
  for (size_t i = 0; i < grads[0].size(); ++i) {
    ASSERT_TRUE(grads[0][i].defined()) << i;
    EXPECT_TRUE(equal_values(grads[0][i], grads[1][i])) << i;
  }
}

// Streaming stores (taken when the outputs exceed the last-level cache) write the same bits as normal ones,
// on aligned rows and on a misaligned output.
TEST_P(DecoderKernels, RotaryStreamingStoresWriteTheSameBits) {
  const auto& kern = kernmap::cpu::kernel_table();
  for (int64_t D : {64, 130}) {
    for (int64_t offset : {0, 1}) {
      SCOPED_TRACE("D=" + std::to_string(D) + " offset=" + std::to_string(offset));
      const int64_t rows = 9;
      const at::Tensor x = at::randn({rows, D}, at::kDouble).to(dtype());
      const at::Tensor cos = at::randn({rows, D}, at::kDouble).to(dtype());
      const at::Tensor sin = at::randn({rows, D}, at::kDouble).to(dtype());
      for (bool backward : {false, true}) {
        at::Tensor out[2];
        for (bool stream : {false, true}) {
          out[stream] =
              at::full({rows * D + offset}, 7.0, at::TensorOptions(dtype())).narrow(0, offset, rows * D);
          kernmap::cpu::RotaryRows r;
          r.ndim = 1;
          r.D = D;
          r.sizes[0] = rows;
          r.x_strides[0] = r.cos_strides[0] = r.sin_strides[0] = r.y_strides[0] = D;
          r.x = x.const_data_ptr();
          r.cos = cos.const_data_ptr();
          r.sin = sin.const_data_ptr();
          r.y = out[stream].data_ptr();
          kern.rotary(kernmap::ops::cpu_dtype(dtype()), backward, r, 0, 4, stream);
          kern.rotary(kernmap::ops::cpu_dtype(dtype()), backward, r, 4, rows, stream);
        }
        EXPECT_TRUE(same_bits(out[0], out[1])) << (backward ? "backward" : "forward");
        EXPECT_FALSE(at::any(out[1] == 7.0).item<bool>());
      }
    }
  }
}

TEST_P(DecoderKernels, RotaryEmptyInputs) {
  const at::Tensor cos = at::randn({1, 0, 8}).to(dtype()), sin = at::randn({1, 0, 8}).to(dtype());
  at::Tensor q = at::empty({2, 3, 0, 8}, dtype()).requires_grad_(true);
  at::Tensor k = at::empty({2, 1, 0, 8}, dtype()).requires_grad_(true);
  auto [qe, ke] = kernmap::apply_rotary(q, k, cos, sin, 1);
  EXPECT_EQ(qe.sizes(), q.sizes());
  EXPECT_EQ(ke.sizes(), k.sizes());
  torch::autograd::backward({qe.sum() + ke.sum()});
  EXPECT_EQ(q.grad().sizes(), q.sizes());
}

// ---- residual add + RMSNorm ----

// The same values in several layouts: contiguous, a column slice of a wider tensor, a transposed copy
// viewed back, 3-D.
std::vector<at::Tensor> layouts(int64_t rows, int64_t H, at::ScalarType dt) {
  at::Tensor base = at::randn({rows, H}, at::kDouble).to(dt);
  at::Tensor wide = at::randn({rows, H + 5}, at::kDouble).to(dt);
  wide.narrow(1, 2, H).copy_(base);
  return {base, wide.narrow(1, 2, H), base.t().contiguous().t(), base.view({3, rows / 3, H})};
}

TEST_P(DecoderKernels, AddRmsNormIsTheAddThenRmsNormForwardAndBackward) {
  for (int64_t H : {1, 7, 769, 5125}) {
    const std::vector<at::Tensor> xs = layouts(6, H, dtype()), rs = layouts(6, H, dtype());
    for (size_t li = 0; li < xs.size(); ++li) {
      for (at::ScalarType wt : {dtype(), at::kFloat}) {
        if (wt == at::kFloat && dtype() == at::kDouble) continue;
        SCOPED_TRACE("H=" + std::to_string(H) + " strides=" + c10::str(xs[li].strides()) +
                     " w=" + c10::str(wt));
        const at::Tensor w0 = (1 + 0.1 * at::randn({H}, at::kDouble)).to(wt);
        const at::Tensor x0 = xs[li], r0 = rs[(li + 1) % rs.size()].view(x0.sizes());
        at::Tensor x = x0.detach().requires_grad_(true), r = r0.detach().requires_grad_(true);
        at::Tensor w = w0.clone().requires_grad_(true);
        poison_allocator();
        auto [y, s] = kernmap::add_rms_norm(x, r, w, 1e-6);
        // The sum is eager's add; the normed output has the bits of kernmap's RMSNorm of that sum.
        const at::Tensor eager_sum = r0 + x0;
        EXPECT_TRUE(same_bits(s, eager_sum));
        EXPECT_TRUE(same_bits(y, kernmap::rms_norm(eager_sum, w0, 1e-6)));

        at::Tensor xr = x0.detach().requires_grad_(true), rr = r0.detach().requires_grad_(true);
        at::Tensor wr = w0.clone().requires_grad_(true);
        auto [yr, sr] = kernmap::reference::add_rms_norm(xr, rr, wr, 1e-6);
        EXPECT_TRUE(near(y, yr, tolerance(dtype())));
        const at::Tensor x64 = x0.to(at::kDouble), r64 = r0.to(at::kDouble), w64 = w0.to(at::kDouble);
        auto [y64, s64] = kernmap::reference::add_rms_norm(x64, r64, w64, 1e-6);
        // The sum is rounded once more than in float64 before the norm.
        EXPECT_TRUE(near(y, y64, 2 * tolerance(dtype())));

        const at::Tensor gy = at::randn(y.sizes(), at::kDouble).to(y.scalar_type());
        const at::Tensor gs = at::randn(s.sizes(), at::kDouble).to(s.scalar_type());
        torch::autograd::backward({y, s}, {gy, gs});
        torch::autograd::backward({yr, sr}, {gy, gs});
        EXPECT_TRUE(near(x.grad(), xr.grad(), tolerance(dtype())));
        EXPECT_TRUE(equal_values(x.grad(), r.grad()));
        EXPECT_TRUE(near(r.grad(), rr.grad(), tolerance(dtype())));
        // dW sums over rows; the reference sums in the output dtype, kernmap in fp32.
        EXPECT_TRUE(near(w.grad(), wr.grad(), 4 * tolerance(dtype())));
      }
    }
  }
}

// The fused backward is RMSNorm's backward on the sum plus the residual gradient, rounded as eager's
// autograd rounds the accumulation: bit for bit.
TEST_P(DecoderKernels, AddRmsNormBackwardIsRmsNormBackwardPlusTheResidualGradient) {
  const int64_t rows = 11, H = 259;
  const at::Tensor x = at::randn({rows, H}, at::kDouble).to(dtype());
  const at::Tensor r = at::randn({rows, H}, at::kDouble).to(dtype());
  const at::Tensor w = (1 + 0.1 * at::randn({H}, at::kDouble)).to(dtype());
  const at::Tensor gy = at::randn({rows, H}, at::kDouble).to(dtype());
  const at::Tensor gs = at::randn({rows, H}, at::kDouble).to(dtype());
  static auto fwd = kernmap::ops::op_handle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>("kernmap::add_rms_norm_forward");
  static auto bwd = kernmap::ops::op_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "kernmap::add_rms_norm_backward");
  static auto rms_bwd = kernmap::ops::op_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "kernmap::rms_norm_backward");
  auto [y, s, rstd] = fwd.call(x, r, w, 1e-6);
  auto [dx, dw] = bwd.call(gy, gs, s, w, rstd);
  auto [dn, dwn] = rms_bwd.call(gy, s, w, rstd);
  EXPECT_TRUE(same_bits(dx, dn + gs));
  EXPECT_TRUE(same_bits(dw, dwn));
}

TEST_P(DecoderKernels, AddRmsNormSameBitsAtAnyThreadCount) {
  const at::Tensor x = at::randn({300, 777}, at::kDouble).to(dtype());
  const at::Tensor r = at::randn({300, 777}, at::kDouble).to(dtype());
  const at::Tensor w = at::randn({777}, at::kDouble).to(dtype());
  const int previous = at::get_num_threads();
  std::vector<std::vector<at::Tensor>> runs;
  for (int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    at::Tensor xg = x.clone().requires_grad_(true), wg = w.clone().requires_grad_(true);
    auto [y, s] = kernmap::add_rms_norm(xg, r, wg, 1e-6);
    torch::autograd::backward({y, s}, {at::ones_like(y), at::ones_like(s)});
    runs.push_back({y, s, xg.grad(), wg.grad()});
  }
  at::set_num_threads(previous);
  for (size_t i = 1; i < runs.size(); ++i)
    for (size_t j = 0; j < runs[0].size(); ++j)
      EXPECT_TRUE(same_bits(runs[i][j], runs[0][j])) << i << " " << j;
}

TEST_P(DecoderKernels, AddRmsNormStreamingStoresWriteTheSameBits) {
  const auto& kern = kernmap::cpu::kernel_table();
  const auto dt = kernmap::ops::cpu_dtype(dtype());
  const at::ScalarType acc = dtype() == at::kDouble ? at::kDouble : at::kFloat;
  for (int64_t H : {64, 80, 37}) {
    for (int64_t offset : {0, 1}) {
      SCOPED_TRACE("H=" + std::to_string(H) + " offset=" + std::to_string(offset));
      const int64_t rows = 5;
      auto input = [&] { return at::randn({rows, H}, at::kDouble).to(dtype()); };
      const at::Tensor x = input(), r = input(), gy = input(), gs = input();
      const at::Tensor w = (1 + 0.1 * at::randn({H}, at::kDouble)).to(acc);
      auto out = [&] {
        return at::full({rows * H + offset}, 7.0, at::TensorOptions(dtype())).narrow(0, offset, rows * H);
      };
      std::vector<at::Tensor> results[2];
      for (bool stream : {false, true}) {
        at::Tensor y = out(), s = out(), rstd = at::empty({rows}, at::TensorOptions(acc));
        kern.add_rms_norm_fwd(dt, dt, x.const_data_ptr(), H, r.const_data_ptr(), H, w.const_data_ptr(),
                              y.data_ptr(), s.data_ptr(), rstd.data_ptr(), 0, rows, H, 1e-6, stream);
        at::Tensor dx = out(), dw = at::zeros({H}, at::TensorOptions(acc));
        kern.add_rms_norm_bwd(dt, dt, gy.const_data_ptr(), H, gs.const_data_ptr(), H, s.const_data_ptr(), H,
                              w.const_data_ptr(), rstd.const_data_ptr(), dx.data_ptr(), dw.data_ptr(), 0,
                              rows, H, stream);
        results[stream] = {y, s, rstd, dx, dw};
      }
      for (size_t i = 0; i < results[0].size(); ++i)
        EXPECT_TRUE(same_bits(results[0][i], results[1][i])) << i;
      EXPECT_FALSE(at::any(results[1][0] == 7.0).item<bool>());
      EXPECT_FALSE(at::any(results[1][1] == 7.0).item<bool>());
    }
  }
}

TEST_P(DecoderKernels, AddRmsNormEmptyInputs) {
  at::Tensor x = at::empty({0, 16}, dtype()).requires_grad_(true);
  at::Tensor w = at::ones({16}, dtype()).requires_grad_(true);
  auto [y, s] = kernmap::add_rms_norm(x, at::empty({0, 16}, dtype()), w, 1e-6);
  EXPECT_EQ(y.sizes(), x.sizes());
  EXPECT_EQ(s.sizes(), x.sizes());
  torch::autograd::backward({y.sum() + s.sum()});
  EXPECT_EQ(w.grad().abs().sum().item<double>(), 0.0);
}

std::vector<std::tuple<Level, at::ScalarType>> params() {
  std::vector<std::tuple<Level, at::ScalarType>> out;
  for (Level l : kernmap::cpu::supported_levels())
    for (at::ScalarType t : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) out.emplace_back(l, t);
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllLevels, DecoderKernels, ::testing::ValuesIn(params()), [](const auto& info) {
  return std::string(kernmap::cpu::level_name(std::get<0>(info.param))) + "_" +
         std::string(c10::toString(std::get<1>(info.param)));
});

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

TEST(DecoderOpErrors, NameTheArgumentTheExpectedAndTheActualValue) {
  const at::Tensor q = at::randn({1, 2, 3, 8}), k = at::randn({1, 1, 3, 8}), cos = at::randn({1, 3, 8});
  auto has = [](const std::string& message, const std::string& part) {
    return message.find(part) != std::string::npos ? ::testing::AssertionSuccess()
                                                   : ::testing::AssertionFailure() << message;
  };
  EXPECT_TRUE(has(error_of([&] { kernmap::apply_rotary(q.narrow(3, 0, 7), k, cos, cos); }),
                  "q's last dimension (head_dim) must be even, got 7"));
  EXPECT_TRUE(
      has(error_of([&] {
            kernmap::apply_rotary(q, k, at::randn({1, 4, 8}), at::randn({1, 4, 8}));
          }),
          "cos.unsqueeze(unsqueeze_dim) of shape [1, 1, 4, 8] must broadcast to q's shape [1, 2, 3, 8]"));
  EXPECT_TRUE(has(error_of([&] {
                    kernmap::apply_rotary(q, k, cos, at::randn({1, 3, 6}));
                  }),
                  "sin must have the shape of cos [1, 3, 8], got [1, 3, 6]"));
  EXPECT_TRUE(has(error_of([&] { kernmap::apply_rotary(q, k, cos, cos, 4); }),
                  "unsqueeze_dim must be in [-4, 3] for cos of 3 dimensions, got 4"));
  EXPECT_TRUE(
      has(error_of([&] { kernmap::apply_rotary(q.to(at::kLong), k, cos, cos); }), "q must be float32"));
  const at::Tensor x = at::randn({4, 8});
  EXPECT_TRUE(has(error_of([&] {
                    kernmap::add_rms_norm(x, at::randn({4, 7}), at::ones({8}), 1e-6);
                  }),
                  "residual must have the shape of x [4, 8], got [4, 7]"));
  EXPECT_TRUE(has(error_of([&] { kernmap::add_rms_norm(x, x.to(at::kBFloat16), at::ones({8}), 1e-6); }),
                  "residual must have the dtype of x (Float), got BFloat16"));
  EXPECT_TRUE(has(error_of([&] { kernmap::add_rms_norm(x, x, at::ones({7}), 1e-6); }),
                  "kernmap.add_rms_norm: weight must have shape [8] (x's last dimension), got [7]"));
}

}  // namespace
