// RMSNorm and SiLU-family checks beyond the reference comparison: the raw kernels' streaming stores, the
// eager roundings in 16-bit dtypes, extreme and non-finite inputs, empty inputs.
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <limits>
#include <string>

#include "kernels/cpu/isa.h"
#include "kernmap/ops.h"
#include "ops/checks.h"
#include "tests/cpp/kernels/checks.h"

namespace kernmap::testing {

// Streaming stores (asked for by the ops when outputs exceed the last-level cache) write the same bits as
// normal stores: on aligned rows (where they are taken), on rows a stride away that breaks the alignment, on
// a misaligned start and on widths with scalar tails (where the kernels fall back to normal stores).
void streaming_stores_write_the_same_bits(const Case& c) {
  const auto& k = kernmap::cpu::kernel_table();
  const auto dt = kernmap::ops::cpu_dtype(c.dtype);
  const at::ScalarType acc = acc_of(c.dtype);
  const int64_t n = c["n"], offset = c.layout == "offset1" ? 1 : 0, rows = 5;
  const at::Tensor x = randn({rows, n}, c.dtype), u = randn({rows, n}, c.dtype),
                   dy = randn({rows, n}, c.dtype);
  const at::Tensor w = (1 + 0.1 * at::randn({n}, at::kDouble)).to(acc);
  // Output buffers [rows, cols] starting `offset` elements into a fresh (poisoned, 64-byte aligned) block.
  auto out = [&](int64_t cols) {
    return at::empty({rows * cols + offset}, at::TensorOptions(c.dtype)).narrow(0, offset, rows * cols);
  };
  std::vector<at::Tensor> results[2];
  for (bool stream : {false, true}) {
    at::Tensor y = out(n), rstd = at::empty({rows}, at::TensorOptions(acc));
    k.rms_norm_fwd(dt, dt, x.const_data_ptr(), n, w.const_data_ptr(), y.data_ptr(), rstd.data_ptr(), 0, rows,
                   n, 1e-6, stream);
    at::Tensor dx = out(n), dw = at::zeros({n}, at::TensorOptions(acc));
    k.rms_norm_bwd(dt, dt, dy.const_data_ptr(), n, x.const_data_ptr(), n, w.const_data_ptr(),
                   rstd.const_data_ptr(), dx.data_ptr(), dw.data_ptr(), 0, rows, n, stream);
    at::Tensor s = out(n), ds = out(n), sm = out(n);
    k.silu_fwd(dt, x.const_data_ptr(), n, s.data_ptr(), 0, rows, n, stream);
    k.silu_bwd(dt, dy.const_data_ptr(), n, x.const_data_ptr(), n, ds.data_ptr(), 0, rows, n, stream);
    k.silu_and_mul_fwd(dt, x.const_data_ptr(), n, u.const_data_ptr(), n, sm.data_ptr(), 0, rows, n, stream);
    // Backward into a packed [rows, 2n] gradient, as swiglu_backward writes it.
    at::Tensor packed = out(2 * n);
    const int64_t half = n * packed.element_size();
    k.silu_and_mul_bwd(dt, dy.const_data_ptr(), n, x.const_data_ptr(), n, u.const_data_ptr(), n,
                       packed.data_ptr(), 2 * n, static_cast<char*>(packed.data_ptr()) + half, 2 * n, 0, rows,
                       n, stream);
    results[stream] = {y, rstd, dx, dw, s, ds, sm, packed};
  }
  for (size_t i = 0; i < results[0].size(); ++i) {
    SCOPED_TRACE("output " + std::to_string(i));
    EXPECT_TRUE(same_bits(results[1][i], results[0][i]));
    // And every element is the kernels' (a skipped block would still hold the poison).
    EXPECT_FALSE(results[1][i].isnan().any().item<bool>());
  }
}

namespace {

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

}  // namespace

void low_precision_silu_matches_eager_bits(const Case& c) {
  const at::Tensor g = (3 * at::randn({c["rows"], c["n"]}, at::kDouble)).to(c.dtype);
  const at::Tensor u = randn({c["rows"], c["n"]}, c.dtype);
  EXPECT_TRUE(nearly_bit_exact(kernmap::silu_and_mul(g, u), at::silu(g) * u));
  EXPECT_TRUE(nearly_bit_exact(kernmap::silu(g), at::silu(g)));
}

void silu_handles_extreme_inputs(const Case& c) {
  const at::Tensor x =
      at::tensor({-1e4, -100.0, -88.5, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.5, 100.0, 1e4}, at::kDouble)
          .to(c.dtype);
  EXPECT_TRUE(close(kernmap::silu(x), kernmap::reference::silu(x), tolerance(c.dtype)));
  const at::Tensor special =
      at::tensor({std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()},
                 at::kDouble)
          .to(c.dtype);
  const at::Tensor s = kernmap::silu(special);
  EXPECT_TRUE(std::isinf(s[0].item<double>()));
  EXPECT_TRUE(std::isnan(s[1].item<double>()));
}

void empty_inputs(const Case& c) {
  const at::Tensor x = at::empty({0, 16}, c.dtype);
  const at::Tensor w = at::ones({16}, c.dtype).requires_grad_(true);
  const at::Tensor xg = x.clone().requires_grad_(true);
  const at::Tensor y = kernmap::rms_norm(xg, w, 1e-6);
  EXPECT_EQ(y.sizes(), x.sizes());
  torch::autograd::backward({y}, {at::empty_like(y)});
  EXPECT_EQ(w.grad().sizes(), w.sizes());
  EXPECT_EQ(w.grad().abs().sum().item<double>(), 0.0);
  EXPECT_EQ(kernmap::silu_and_mul(x, x).sizes(), x.sizes());
  EXPECT_EQ(kernmap::swiglu(x).sizes(), (at::IntArrayRef{0, 8}));
  EXPECT_EQ(kernmap::silu(at::empty({0}, c.dtype)).sizes(), (at::IntArrayRef{0}));
}

}  // namespace kernmap::testing
