// The rest of the decoder layer's memory-bound work beyond the reference comparison: the rotary embedding
// (apply_rotary) bit for bit against the eager math and within a float64 bound, forward and backward, on the
// attention's layouts; the residual add fused with RMSNorm (add_rms_norm) against the bits of the add and of
// kernmap's RMSNorm, its fused backward against RMSNorm's; both raw kernels' streaming stores, thread-count
// invariance, empty inputs and the ops' errors.
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/cache.h"
#include "kernels/cpu/isa.h"
#include "kernmap/ops.h"
#include "ops/checks.h"
#include "tests/cpp/kernels/checks.h"

namespace kernmap::testing {
namespace {

// Equal values, dtypes and shapes: close with no tolerance (signed zeros compare equal: eager's autograd adds
// the zeros of its slice gradients, whose sign the kernels do not reproduce; NaN equals nothing).
constexpr Tolerance kEqualValues{0, 0};

// Whether a and b have the same shape and memory layout (the strides of dimensions of size 1 do not matter).
::testing::AssertionResult same_layout(const at::Tensor& a, const at::Tensor& b) {
  bool same = a.sizes() == b.sizes();
  for (int64_t d = 0; same && d < a.dim(); ++d) same = a.size(d) == 1 || a.stride(d) == b.stride(d);
  if (same) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "strides " << a.strides() << " vs " << b.strides() << " (shapes "
                                       << a.sizes() << ", " << b.sizes() << ")";
}

// got within `bound` of the float64 `exact`, element by element (NaN is within nothing).
::testing::AssertionResult within(const at::Tensor& got, const at::Tensor& exact, const at::Tensor& bound) {
  const at::Tensor g = got.to(at::kDouble), err = (g - exact).abs();
  if (!g.isnan().any().item<bool>() && (err <= bound).all().item<bool>())
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << (err > bound).sum().item<int64_t>() << " elements over the bound; worst "
         << (err - bound).max().item<double>() << " over";
}

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

// One layout of the attention's operands: q, k and cos, sin, the unsqueeze_dim that broadcasts them.
struct RotaryInputs {
  at::Tensor q, k, cos, sin;
  int64_t dim;
};

// The layouts transformers' attention classes and other callers hand apply_rotary_pos_emb (kRotaryLayouts),
// holding values of `dt`: "attention_views", [B, heads, S, D] views of [B, S, heads, D] projections (the
// attention's); "contiguous" [B, heads, S, D]; "bshd_unsqueeze2", [B, S, heads, D] with unsqueeze_dim 2;
// "fused_qkv", slices of one fused qkv projection; "per_batch_positions", cos and sin [B, S, D]; "sd_cos",
// [S, D] cos and sin with unsqueeze_dim 0; "strided_cos", cos and sin slices of wider rows.
RotaryInputs rotary_inputs(const std::string& layout, int64_t D, at::ScalarType dt, int64_t S = 5) {
  const int64_t B = 2, H = 3, KV = 1;
  const at::Tensor cos = randn({1, S, D}, dt), sin = randn({1, S, D}, dt);
  if (layout == "attention_views")
    return {randn({B, S, H, D}, dt).transpose(1, 2), randn({B, S, KV, D}, dt).transpose(1, 2), cos, sin, 1};
  if (layout == "contiguous") return {randn({B, H, S, D}, dt), randn({B, KV, S, D}, dt), cos, sin, 1};
  if (layout == "bshd_unsqueeze2") return {randn({B, S, H, D}, dt), randn({B, S, KV, D}, dt), cos, sin, 2};
  if (layout == "fused_qkv") {
    const at::Tensor qkv = randn({B, S, (H + 2 * KV) * D}, dt);
    return {qkv.narrow(2, 0, H * D).view({B, S, H, D}).transpose(1, 2),
            qkv.narrow(2, H * D, KV * D).view({B, S, KV, D}).transpose(1, 2), cos, sin, 1};
  }
  if (layout == "per_batch_positions")
    return {randn({B, S, H, D}, dt).transpose(1, 2), randn({B, S, KV, D}, dt).transpose(1, 2),
            randn({B, S, D}, dt), randn({B, S, D}, dt), 1};
  if (layout == "sd_cos") return {randn({B, H, S, D}, dt), randn({B, KV, S, D}, dt), cos[0], sin[0], 0};
  if (layout == "strided_cos")
    return {randn({B, H, S, D}, dt), randn({B, KV, S, D}, dt), randn({1, S, 2 * D}, dt).narrow(2, 0, D),
            randn({1, S, 2 * D}, dt).narrow(2, D, D), 1};
  throw std::invalid_argument("unknown rotary layout '" + layout + "'");
}

}  // namespace

// The forward and backward of `in` against the eager math: bit for bit, eager's layouts, within the float64
// bound, and the backward from gradients in either layout.
void expect_eager_rotary(const Case& c, const RotaryInputs& in) {
  at::Tensor q = in.q.detach().requires_grad_(true), k = in.k.detach().requires_grad_(true);
  at::Tensor qr = in.q.detach().requires_grad_(true), kr = in.k.detach().requires_grad_(true);
  auto [qe, ke] = kernmap::apply_rotary(q, k, in.cos, in.sin, in.dim);
  auto [qer, ker] = kernmap::reference::apply_rotary(qr, kr, in.cos, in.sin, in.dim);
  // The eager roundings, one by one: bit for bit in every dtype, and eager's output layout.
  EXPECT_TRUE(same_bits(qe, qer)) << "q";
  EXPECT_TRUE(same_bits(ke, ker)) << "k";
  EXPECT_TRUE(same_layout(qe, qer)) << "q";
  EXPECT_TRUE(same_layout(ke, ker)) << "k";
  const at::Tensor cos64 = in.cos.to(at::kDouble), sin64 = in.sin.to(at::kDouble);
  auto [q64, k64] =
      kernmap::reference::apply_rotary(in.q.to(at::kDouble), in.k.to(at::kDouble), cos64, sin64, in.dim);
  const at::Tensor cu = in.cos.unsqueeze(in.dim), su = in.sin.unsqueeze(in.dim);
  EXPECT_TRUE(within(qe, q64, rotary_bound(in.q, cu, su, c.dtype))) << "q";
  EXPECT_TRUE(within(ke, k64, rotary_bound(in.k, cu, su, c.dtype))) << "k";

  const at::Tensor gq = randn(qe.sizes(), c.dtype), gk = randn(ke.sizes(), c.dtype);
  torch::autograd::backward({qe, ke}, {gq, gk});
  torch::autograd::backward({qer, ker}, {gq, gk});
  EXPECT_TRUE(close(q.grad(), qr.grad(), kEqualValues)) << "the gradient of q";
  EXPECT_TRUE(close(k.grad(), kr.grad(), kEqualValues)) << "the gradient of k";
  EXPECT_TRUE(same_layout(q.grad(), qr.grad())) << "the gradient of q";
  EXPECT_TRUE(same_layout(k.grad(), kr.grad())) << "the gradient of k";
  at::Tensor qd = in.q.to(at::kDouble).requires_grad_(true), kd = in.k.to(at::kDouble).requires_grad_(true);
  auto [qed, ked] = kernmap::reference::apply_rotary(qd, kd, cos64, sin64, in.dim);
  torch::autograd::backward({qed, ked}, {gq.to(at::kDouble), gk.to(at::kDouble)});
  // The transpose: each half of the gradient meets the other half of sin.
  EXPECT_TRUE(within(q.grad(), qd.grad(), rotary_bound(gq, cu, swap_halves(su), c.dtype)))
      << "the gradient of q";
  EXPECT_TRUE(within(k.grad(), kd.grad(), rotary_bound(gk, cu, swap_halves(su), c.dtype)))
      << "the gradient of k";

  // The incoming gradients in the outputs' layout (as an attention backward may hand them over: the heads of
  // a position side by side in the "attention_views" layout), which the kernels walk in their own memory
  // order: the same bits and layout as from contiguous ones.
  at::Tensor q2 = in.q.detach().requires_grad_(true), k2 = in.k.detach().requires_grad_(true);
  auto [qe2, ke2] = kernmap::apply_rotary(q2, k2, in.cos, in.sin, in.dim);
  torch::autograd::backward({qe2, ke2}, {at::empty_like(qe2).copy_(gq), at::empty_like(ke2).copy_(gk)});
  EXPECT_TRUE(same_bits(q2.grad(), q.grad())) << "the gradient of q, from a gradient in q_embed's layout";
  EXPECT_TRUE(same_bits(k2.grad(), k.grad())) << "the gradient of k, from a gradient in k_embed's layout";
  EXPECT_TRUE(same_layout(q2.grad(), q.grad())) << "the gradient of q";
}

void rotary_has_the_eager_bits_and_float64_bound(const Case& c) {
  expect_eager_rotary(c, rotary_inputs(c.layout, c["D"], c.dtype));
}

void rotary_positions_in_blocks(const Case& c) {
  // Positions a block of cos and sin (both, in the output's dtype) holds by the level-2 rule; three halves of
  // that many positions are more than one block, walked in blocks of three quarters of it.
  const int64_t D = c["D"], block = kernmap::cpu::l2_block_bytes() / (2 * D * at::elementSize(c.dtype));
  expect_eager_rotary(c, rotary_inputs(c.layout, D, c.dtype, 3 * std::max<int64_t>(16, block / 2)));
}

// cos and sin that require a gradient (not transformers' case: its rotary embedding runs under no_grad) get
// one through the eager math: every gradient is the reference's.
void rotary_gives_cos_and_sin_gradients(const Case& c) {
  const RotaryInputs in = rotary_inputs(c.layout, c["D"], c.dtype);
  std::vector<at::Tensor> grads[2];
  for (int ref = 0; ref < 2; ++ref) {
    at::Tensor q = in.q.detach().requires_grad_(true), k = in.k.detach().requires_grad_(true);
    at::Tensor cos = in.cos.detach().requires_grad_(true), sin = in.sin.detach().requires_grad_(true);
    auto [qe, ke] = ref ? kernmap::reference::apply_rotary(q, k, cos, sin, in.dim)
                        : kernmap::apply_rotary(q, k, cos, sin, in.dim);
    torch::autograd::backward({qe.sum() + ke.sum()});
    grads[ref] = {q.grad(), k.grad(), cos.grad(), sin.grad()};
  }
  const char* names[] = {"q", "k", "cos", "sin"};
  for (size_t i = 0; i < grads[0].size(); ++i) {
    ASSERT_TRUE(grads[0][i].defined()) << "the gradient of " << names[i];
    EXPECT_TRUE(close(grads[0][i], grads[1][i], kEqualValues)) << "the gradient of " << names[i];
  }
}

// Streaming stores (taken when the outputs exceed the last-level cache) write the same bits as normal ones,
// forward and backward, on aligned rows and on a misaligned output, each row in two calls. "shared_cos":
// rows of three positions by three heads, each position's cos and sin shared by its heads (widened once for
// them at 16 bits), the second call starting inside a position.
void rotary_streaming_stores_write_the_same_bits(const Case& c) {
  const auto& kern = kernmap::cpu::kernel_table();
  const int64_t D = c["D"], offset = c.layout == "offset1" ? 1 : 0, rows = 9;
  const bool shared = c.layout == "shared_cos";
  const at::Tensor x = randn({rows, D}, c.dtype), cos = randn({rows, D}, c.dtype),
                   sin = randn({rows, D}, c.dtype);
  for (bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "backward" : "forward");
    at::Tensor out[2];
    for (bool stream : {false, true}) {
      // Starting `offset` elements into a fresh (poisoned, 64-byte aligned) block.
      out[stream] = at::empty({rows * D + offset}, at::TensorOptions(c.dtype)).narrow(0, offset, rows * D);
      kernmap::cpu::RotaryRows r;
      r.ndim = 1;
      r.D = D;
      r.sizes[0] = rows;
      r.x_strides[0] = r.cos_strides[0] = r.sin_strides[0] = r.y_strides[0] = D;
      if (shared) {
        r.ndim = 2;
        r.sizes[0] = r.sizes[1] = 3;
        r.x_strides[0] = r.y_strides[0] = r.cos_strides[0] = r.sin_strides[0] = 3 * D;
        r.x_strides[1] = r.y_strides[1] = D;
        r.cos_strides[1] = r.sin_strides[1] = 0;
      }
      r.x = x.const_data_ptr();
      r.cos = cos.const_data_ptr();
      r.sin = sin.const_data_ptr();
      r.y = out[stream].data_ptr();
      kern.rotary(kernmap::ops::cpu_dtype(c.dtype), backward, r, 0, 4, stream);
      kern.rotary(kernmap::ops::cpu_dtype(c.dtype), backward, r, 4, rows, stream);
    }
    EXPECT_TRUE(same_bits(out[1], out[0]));
    // And every element is the kernel's (an unwritten one would still hold the poison).
    EXPECT_FALSE(out[0].isnan().any().item<bool>());
    EXPECT_FALSE(out[1].isnan().any().item<bool>());
    if (shared) {  // and the eager math's values, each position's cos and sin (rows 0, 3, 6) for its heads
      const at::Tensor xr = x.view({3, 3, D}), kr = randn({3, 1, D}, c.dtype);
      const at::Tensor cr = cos.view({3, 3, D}).select(1, 0), sr = sin.view({3, 3, D}).select(1, 0);
      at::Tensor expected;
      if (backward) {  // x as the incoming gradient
        at::Tensor xd = randn({3, 3, D}, c.dtype).requires_grad_(true);
        torch::autograd::backward({std::get<0>(kernmap::reference::apply_rotary(xd, kr, cr, sr, 1))}, {xr});
        expected = xd.grad();
      } else {
        expected = std::get<0>(kernmap::reference::apply_rotary(xr, kr, cr, sr, 1));
      }
      EXPECT_TRUE(close(out[0].view({3, 3, D}), expected, kEqualValues)) << "against the eager math";
    }
  }
}

// Infinities, NaNs, values near the float maximum (whose products overflow) and signed zeros in q, k and
// the incoming gradients, in every part of a row (the 32-element steps, single blocks, the tail): the eager
// math's values, NaN exactly where it has NaN, forward and backward.
void rotary_non_finite_inputs(const Case& c) {
  const RotaryInputs in = rotary_inputs(c.layout, c["D"], c.dtype);
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  const double specials[] = {inf, -inf, nan, 3e38, -3e38, 0.0, -0.0};
  const auto salt = [&](const at::Tensor& t) {
    at::Tensor u = t.detach().clone().reshape(-1);  // contiguous copy, then the input's layout again
    for (int64_t i = 0; i < u.numel(); i += 5) u[i] = specials[(i / 5) % 7];
    return at::empty_like(t).copy_(u.view(t.sizes()));
  };
  const at::Tensor q = salt(in.q), k = salt(in.k);
  const auto same_values = [](const at::Tensor& got, const at::Tensor& want) {
    if (!got.isnan().equal(want.isnan()))
      return ::testing::AssertionFailure() << "NaN where the eager math has none, or the reverse";
    const at::Tensor keep = ~want.isnan();
    return close(got.masked_select(keep), want.masked_select(keep), kEqualValues);
  };
  auto [qe, ke] = kernmap::apply_rotary(q, k, in.cos, in.sin, in.dim);
  auto [qr, kr] = kernmap::reference::apply_rotary(q, k, in.cos, in.sin, in.dim);
  EXPECT_TRUE(same_values(qe, qr)) << "q";
  EXPECT_TRUE(same_values(ke, kr)) << "k";
  const at::Tensor gq = salt(qe), gk = salt(ke);
  at::Tensor grads[2][2];
  for (int ref = 0; ref < 2; ++ref) {
    at::Tensor q2 = in.q.detach().requires_grad_(true), k2 = in.k.detach().requires_grad_(true);
    auto [qe2, ke2] = ref ? kernmap::reference::apply_rotary(q2, k2, in.cos, in.sin, in.dim)
                          : kernmap::apply_rotary(q2, k2, in.cos, in.sin, in.dim);
    torch::autograd::backward({qe2, ke2}, {gq, gk});
    grads[ref][0] = q2.grad();
    grads[ref][1] = k2.grad();
  }
  EXPECT_TRUE(same_values(grads[0][0], grads[1][0])) << "the gradient of q";
  EXPECT_TRUE(same_values(grads[0][1], grads[1][1])) << "the gradient of k";
}

void rotary_empty_inputs(const Case& c) {
  const at::Tensor cos = randn({1, 0, 8}, c.dtype), sin = randn({1, 0, 8}, c.dtype);
  at::Tensor q = at::empty({2, 3, 0, 8}, c.dtype).requires_grad_(true);
  at::Tensor k = at::empty({2, 1, 0, 8}, c.dtype).requires_grad_(true);
  auto [qe, ke] = kernmap::apply_rotary(q, k, cos, sin, 1);
  EXPECT_EQ(qe.sizes(), q.sizes());
  EXPECT_EQ(ke.sizes(), k.sizes());
  torch::autograd::backward({qe.sum() + ke.sum()});
  EXPECT_EQ(q.grad().sizes(), q.sizes());
  EXPECT_EQ(k.grad().sizes(), k.sizes());
}

// ---- residual add + RMSNorm ----

std::vector<at::Tensor> add_rms_norm_inputs(const Case& c, at::ScalarType weight_dtype) {
  const at::Tensor x = laid_out(c.layout, c["rows"], c["H"], c.dtype);
  const at::Tensor residual = laid_out(next_row_layout(c.layout), c["rows"], c["H"], c.dtype).view(x.sizes());
  return {x, residual, norm_weight(c["H"], weight_dtype)};
}

// The sum is eager's add and the normed output has the bits of kernmap's RMSNorm of that sum, with autograd
// and without, for a weight in x's dtype and (16-bit x) an fp32 one; the normed output is within twice the
// tolerance of the float64 math (the sum is rounded to the dtype once more than in float64, before the norm).
void add_rms_norm_has_the_bits_of_the_add_then_rms_norm(const Case& c) {
  std::vector<at::ScalarType> weight_dtypes = {c.dtype};
  if (c.dtype == at::kBFloat16 || c.dtype == at::kHalf) weight_dtypes.push_back(at::kFloat);
  for (at::ScalarType wt : weight_dtypes) {
    const std::vector<at::Tensor> in = add_rms_norm_inputs(c, wt);
    const at::Tensor &x0 = in[0], &r0 = in[1], &w0 = in[2];
    const at::Tensor eager_sum = r0 + x0;
    const at::Tensor eager_normed = kernmap::rms_norm(eager_sum, w0, 1e-6);
    for (bool grad : {true, false}) {
      SCOPED_TRACE(std::string("weight ") + c10::toString(wt) + (grad ? ", autograd" : ", no autograd"));
      at::Tensor x = x0.detach().requires_grad_(grad), r = r0.detach().requires_grad_(grad);
      at::Tensor w = w0.detach().requires_grad_(grad);
      auto [y, s] = kernmap::add_rms_norm(x, r, w, 1e-6);
      EXPECT_TRUE(same_bits(s, eager_sum)) << "the sum";
      EXPECT_TRUE(same_bits(y, eager_normed)) << "the normed output";
      // And rstd: its sum of squares in the same order (a sum taken in another order changes rstd's last bit
      // far more often than the normed output's).
      if (!grad) {
        using Fwd = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                   const at::Tensor&, double);
        using PlainFwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double);
        static const auto fused = kernmap::ops::op_handle<Fwd>("kernmap::add_rms_norm_forward");
        static const auto plain = kernmap::ops::op_handle<PlainFwd>("kernmap::rms_norm_forward");
        const at::Tensor fused_rstd = std::get<2>(fused.call(x0, r0, w0, 1e-6));
        const at::Tensor plain_rstd = std::get<1>(plain.call(eager_sum, w0, 1e-6));
        EXPECT_TRUE(same_bits(fused_rstd, plain_rstd)) << "rstd";
      }
      auto [y64, s64] =
          kernmap::reference::add_rms_norm(x0.to(at::kDouble), r0.to(at::kDouble), w0.to(at::kDouble), 1e-6);
      const Tolerance tol = tolerance(c.dtype);
      EXPECT_TRUE(close(y.to(at::kDouble), y64, {2 * tol.rtol, 2 * tol.atol}))
          << "the normed output, float64";
    }
  }
}

namespace {

// add_rms_norm's forward (normed, sum, rstd) and the backward ops of add_rms_norm and rms_norm, called
// through their schemas.
using AddRmsNormForward = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                         const at::Tensor&, double);
using AddRmsNormBackward = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&);
using RmsNormBackward = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                           const at::Tensor&, const at::Tensor&);
struct NormOps {
  c10::TypedOperatorHandle<AddRmsNormForward> fwd =
      kernmap::ops::op_handle<AddRmsNormForward>("kernmap::add_rms_norm_forward");
  c10::TypedOperatorHandle<AddRmsNormBackward> bwd =
      kernmap::ops::op_handle<AddRmsNormBackward>("kernmap::add_rms_norm_backward");
  c10::TypedOperatorHandle<RmsNormBackward> rms_bwd =
      kernmap::ops::op_handle<RmsNormBackward>("kernmap::rms_norm_backward");
};
const NormOps& norm_ops() {
  static const NormOps ops;
  return ops;
}

}  // namespace

// The fused backward is RMSNorm's backward on the sum plus the residual gradient, rounded as eager's
// autograd rounds the accumulation: bit for bit.
void add_rms_norm_backward_is_rms_norm_backward_plus_the_residual_gradient(const Case& c) {
  const int64_t rows = c["rows"], H = c["H"];
  const at::Tensor x = randn({rows, H}, c.dtype), r = randn({rows, H}, c.dtype);
  const at::Tensor w = norm_weight(H, c.dtype);
  const at::Tensor gy = randn({rows, H}, c.dtype), gs = randn({rows, H}, c.dtype);
  const auto& [fwd, bwd, rms_bwd] = norm_ops();
  auto [y, s, rstd] = fwd.call(x, r, w, 1e-6);
  auto [dx, dw] = bwd.call(gy, gs, s, w, rstd);
  auto [dn, dwn] = rms_bwd.call(gy, s, w, rstd);
  EXPECT_TRUE(same_bits(dx, dn + gs)) << "dx";
  EXPECT_TRUE(same_bits(dw, dwn)) << "dw";
}

// The backward ops take rstd as an input: a NaN in it, whatever its payload (0x7fffffff has the low 16 bits a
// rounding without the NaN select would carry out of), gives its row NaN gradients, dx and the weight
// gradient, with and without the residual's gradient added. The kernels make a NaN rstd the default NaN
// before their roundings of its products.
void rms_norm_backward_rstd_nans(const Case& c) {
  const int64_t rows = 3, H = 37;
  const at::Tensor x = randn({rows, H}, c.dtype), r = randn({rows, H}, c.dtype);
  const at::Tensor w = norm_weight(H, c.dtype);
  const at::Tensor gy = randn({rows, H}, c.dtype), gs = randn({rows, H}, c.dtype);
  const auto& [fwd, bwd, rms_bwd] = norm_ops();
  auto [y, s, rstd] = fwd.call(x, r, w, 1e-6);
  at::Tensor bad = rstd.clone();
  if (bad.scalar_type() == at::kDouble)
    bad.view(at::kLong)[1] = std::numeric_limits<int64_t>::max();
  else
    bad.view(at::kInt)[1] = 0x7fffffff;
  auto [dx, dw] = bwd.call(gy, gs, s, w, bad);
  auto [dn, dwn] = rms_bwd.call(gy, s, w, bad);
  for (const auto& [g, what] : {std::pair{dx, "add_rms_norm dx"}, std::pair{dn, "rms_norm dx"}}) {
    EXPECT_TRUE(g[1].isnan().all().item<bool>()) << what << ": NaN in the NaN rstd's row";
    EXPECT_FALSE(g[0].isnan().any().item<bool>() || g[2].isnan().any().item<bool>())
        << what << ": other rows";
  }
  EXPECT_TRUE(dw.isnan().all().item<bool>()) << "add_rms_norm dw";
  EXPECT_TRUE(dwn.isnan().all().item<bool>()) << "rms_norm dw";
}

// Each row is normed by one task and dW summed in one order whatever the thread count: the same bits at 1, 2
// and 3 threads, forward and backward.
void add_rms_norm_same_bits_at_any_thread_count(const Case& c) {
  const at::Tensor x = randn({c["rows"], c["H"]}, c.dtype), r = randn({c["rows"], c["H"]}, c.dtype);
  const at::Tensor w = randn({c["H"]}, c.dtype);
  const int previous = at::get_num_threads();
  std::vector<std::vector<at::Tensor>> runs;
  for (int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    at::Tensor xg = x.clone().requires_grad_(true), wg = w.clone().requires_grad_(true);
    auto [y, s] = kernmap::add_rms_norm(xg, r, wg, 1e-6);
    torch::autograd::backward({y, s}, {at::ones_like(y), at::ones_like(s)});
    runs.push_back({y.detach(), s.detach(), xg.grad(), wg.grad()});
  }
  at::set_num_threads(previous);
  const char* names[] = {"y", "sum", "dx", "dw"};
  for (size_t i = 1; i < runs.size(); ++i)
    for (size_t j = 0; j < runs[0].size(); ++j)
      EXPECT_TRUE(same_bits(runs[i][j], runs[0][j])) << names[j] << " at " << i + 1 << " threads";
}

// The raw kernels' streaming stores write the same bits as normal stores, forward (y, sum, rstd) and
// backward (dx, dw), on aligned rows, a misaligned start, and widths with scalar tails.
void add_rms_norm_streaming_stores_write_the_same_bits(const Case& c) {
  const auto& kern = kernmap::cpu::kernel_table();
  const auto dt = kernmap::ops::cpu_dtype(c.dtype);
  const at::ScalarType acc = acc_of(c.dtype);
  const int64_t H = c["H"], offset = c.layout == "offset1" ? 1 : 0, rows = 5;
  const at::Tensor x = randn({rows, H}, c.dtype), r = randn({rows, H}, c.dtype),
                   gy = randn({rows, H}, c.dtype), gs = randn({rows, H}, c.dtype);
  const at::Tensor w = norm_weight(H, acc);
  // Outputs starting `offset` elements into a fresh (poisoned, 64-byte aligned) block.
  auto out = [&] {
    return at::empty({rows * H + offset}, at::TensorOptions(c.dtype)).narrow(0, offset, rows * H);
  };
  std::vector<at::Tensor> results[2];
  for (bool stream : {false, true}) {
    at::Tensor y = out(), s = out(), rstd = at::empty({rows}, at::TensorOptions(acc));
    kern.add_rms_norm_fwd(dt, dt, x.const_data_ptr(), H, r.const_data_ptr(), H, w.const_data_ptr(),
                          y.data_ptr(), s.data_ptr(), rstd.data_ptr(), 0, rows, H, 1e-6, stream);
    at::Tensor dx = out(), dw = at::zeros({H}, at::TensorOptions(acc));
    kern.add_rms_norm_bwd(dt, dt, gy.const_data_ptr(), H, gs.const_data_ptr(), H, s.const_data_ptr(), H,
                          w.const_data_ptr(), rstd.const_data_ptr(), dx.data_ptr(), dw.data_ptr(), 0, rows, H,
                          stream);
    results[stream] = {y, s, rstd, dx, dw};
  }
  const char* names[] = {"y", "sum", "rstd", "dx", "dw"};
  for (size_t i = 0; i < results[0].size(); ++i) {
    EXPECT_TRUE(same_bits(results[1][i], results[0][i])) << names[i];
    EXPECT_FALSE(results[0][i].isnan().any().item<bool>()) << names[i] << " left unwritten";
    EXPECT_FALSE(results[1][i].isnan().any().item<bool>()) << names[i] << " left unwritten (streaming)";
  }
}

void add_rms_norm_empty_inputs(const Case& c) {
  at::Tensor x = at::empty({0, 16}, c.dtype).requires_grad_(true);
  at::Tensor w = at::ones({16}, c.dtype).requires_grad_(true);
  auto [y, s] = kernmap::add_rms_norm(x, at::empty({0, 16}, c.dtype), w, 1e-6);
  EXPECT_EQ(y.sizes(), x.sizes());
  EXPECT_EQ(s.sizes(), x.sizes());
  torch::autograd::backward({y.sum() + s.sum()});
  EXPECT_EQ(w.grad().sizes(), w.sizes());
  EXPECT_EQ(w.grad().abs().sum().item<double>(), 0.0);
}

// ---- the ops' errors ----

void decoder_ops_name_the_bad_argument(const Case&) {
  const auto error_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  const auto has = [](const std::string& message, const std::string& part) {
    return message.find(part) != std::string::npos ? ::testing::AssertionSuccess()
                                                   : ::testing::AssertionFailure() << message;
  };
  const at::Tensor q = at::randn({1, 2, 3, 8}), k = at::randn({1, 1, 3, 8}), cos = at::randn({1, 3, 8});
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

}  // namespace kernmap::testing
