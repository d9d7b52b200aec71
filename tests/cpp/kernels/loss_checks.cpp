// The fused LM-head product and cross-entropy: linear_cross_entropy against its reference (transformers'
// eager math) forward and backward, over several chunks of rows, ignored rows and a bias; and its row kernel
// (cross_entropy_rows) against float64 math, non-finite rows included; the transposes of its products
// (transpose) word for word. Figures: tests/tolerances.json,
// "linear_cross_entropy" (fractions of the largest |reference|: the mean's gradients are too small for the
// elementwise rule's atol). tests/python adds transformers itself, gradcheck, opcheck and torch.compile.
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
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

namespace kernmap::testing {
namespace {}  // namespace

void linear_cross_entropy_matches_reference(const Case& c) {
  const int64_t N = c["N"], H = c["H"], V = c["V"];
  const bool with_bias = c.layout == "bias";
  const ScopedEnv rows("KERNMAP_LCE_CHUNK_ROWS", std::to_string(c["chunk"]));
  std::optional<ScopedEnv> classes;
  if (c["block"] > 0) classes.emplace("KERNMAP_LCE_VOCAB_BLOCK", std::to_string(c["block"]));
  const at::Tensor h0 = randn({N, H}, c.dtype);
  const at::Tensor w0 = (at::randn({V, H}, at::kDouble) * (2 / std::sqrt(double(H)))).to(c.dtype);
  const at::Tensor b0 = randn({V}, c.dtype);
  at::Tensor labels = at::randint(V, {N}, at::TensorOptions().dtype(at::kLong));
  if (N > 3) labels.narrow(0, 1, N / 3).fill_(-100);  // ignored rows
  std::vector<at::Tensor> loss, gh, gw, gb;
  for (const bool kernel : {true, false}) {
    at::Tensor h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    at::Tensor b = b0.clone().requires_grad_(true);
    const std::optional<at::Tensor> bias = with_bias ? std::optional<at::Tensor>(b) : std::nullopt;
    at::Tensor l = kernel ? kernmap::linear_cross_entropy(h, w, labels, bias)
                          : kernmap::reference::linear_cross_entropy(h, w, labels, bias);
    torch::autograd::backward({l});
    loss.push_back(l.detach());
    gh.push_back(h.grad());
    gw.push_back(w.grad());
    gb.push_back(with_bias ? b.grad() : at::Tensor());
  }
  const LossTolerance t = linear_cross_entropy_tolerance(c.dtype);
  EXPECT_EQ(loss[0].scalar_type(), acc_of(c.dtype));
  EXPECT_TRUE(within_fraction_of_largest(loss[0], loss[1], t.loss)) << "the loss";
  EXPECT_TRUE(within_fraction_of_largest(gh[0], gh[1], t.grad)) << "the gradient of hidden";
  EXPECT_TRUE(within_fraction_of_largest(gw[0], gw[1], t.weight_grad)) << "the gradient of weight";
  if (with_bias) {
    EXPECT_TRUE(within_fraction_of_largest(gb[0], gb[1], t.grad)) << "the gradient of bias";
  }
  // Without gradients the logits go by blocks of classes: 16 (several blocks, the last partial, where V > 16)
  // and the default (one block at these sizes).
  classes.reset();
  for (const int64_t block : {int64_t{16}, int64_t{0}}) {
    SCOPED_TRACE("classes per block " + std::to_string(block));
    std::optional<ScopedEnv> set;
    if (block) set.emplace("KERNMAP_LCE_VOCAB_BLOCK", std::to_string(block));
    const at::Tensor l = kernmap::linear_cross_entropy(
        h0, w0, labels, with_bias ? std::optional<at::Tensor>(b0) : std::nullopt);
    EXPECT_EQ(l.scalar_type(), acc_of(c.dtype));
    EXPECT_TRUE(within_fraction_of_largest(l, loss[1], t.loss)) << "the loss without gradients";
  }
}

void cross_entropy_rows_match_float64_math(const Case& c) {
  const int64_t V = c["V"], R = 6;
  at::Tensor z = (at::randn({R, V}, at::kDouble) * 4).to(c.dtype);
  z[1][7] = -std::numeric_limits<double>::infinity();  // probability 0
  z[3][100] = std::numeric_limits<double>::quiet_NaN();
  z[4][0] = std::numeric_limits<double>::infinity();
  z[5].fill_(-std::numeric_limits<double>::infinity());
  const std::vector<int64_t> target = {0, 8, V - 1, 5, 9, 1};
  const at::Tensor zd = z.to(at::kDouble);
  const double scale = 0.25;
  // Finite, not poisoned: rows 3 to 5 must be written NaN, which a NaN poison would hide.
  at::Tensor loss = at::zeros({R}, acc_of(c.dtype));
  at::Tensor g = z.clone();
  const auto& k = kernmap::cpu::kernel_table();
  const auto dt = kernmap::ops::cpu_dtype(c.dtype);
  k.cross_entropy_rows(dt, g.data_ptr(), V, V, target.data(), scale, loss.data_ptr(), true, 0, R);
  const at::Tensor lse = at::logsumexp(zd, 1), p = at::softmax(zd, 1);
  const LossTolerance t = linear_cross_entropy_tolerance(c.dtype);
  for (int64_t r = 0; r < R; ++r) {
    SCOPED_TRACE("row " + std::to_string(r));
    const double got = loss[r].item<double>();
    if (r >= 3) {  // a NaN or an infinite maximum, or every logit -inf: all NaN
      EXPECT_TRUE(std::isnan(got)) << got;
      EXPECT_TRUE(g[r].to(at::kDouble).isnan().all().item<bool>());
      continue;
    }
    const double want = lse[r].item<double>() - zd[r][target[r]].item<double>();
    EXPECT_NEAR(got, want, t.row_loss * std::abs(want));
    at::Tensor want_g = p[r] * scale;
    want_g[target[r]] -= scale;
    EXPECT_TRUE(within_fraction_of_largest(g[r].to(at::kDouble), want_g, t.row_grad));
    if (r == 1) {
      EXPECT_EQ(g[r][7].item<double>(), 0.0);  // e^-inf
    }
  }
  // Without grad the logits stay as they were and the losses are the same.
  at::Tensor z2 = z.clone();
  at::Tensor loss2 = at::zeros_like(loss);
  k.cross_entropy_rows(dt, z2.data_ptr(), V, V, target.data(), scale, loss2.data_ptr(), false, 0, R);
  EXPECT_TRUE(same_bits(z2, z));
  EXPECT_TRUE(at::equal(loss2.nan_to_num(), loss.nan_to_num()));
  // By blocks of classes (cross_entropy_block): the whole row as one block has the row's maximum and the
  // loss of rows; blocks of 16 (the last of 11) and of 1 the float64 loss within the row tolerance, the
  // label's logit as it is, and no finite maximum in the non-finite rows.
  for (const int64_t B : {V, int64_t{16}, int64_t{1}}) {
    SCOPED_TRACE("classes per block " + std::to_string(B));
    at::Tensor mx = at::full({R}, -std::numeric_limits<double>::infinity(), acc_of(c.dtype));
    at::Tensor sum = at::zeros({R}, acc_of(c.dtype)), zy = at::full({R}, 1e30, acc_of(c.dtype));
    for (int64_t v0 = 0; v0 < V; v0 += B) {
      const int64_t cols = std::min(B, V - v0);
      const at::Tensor zb = z.narrow(1, v0, cols).contiguous();
      k.cross_entropy_block(dt, zb.const_data_ptr(), cols, cols, v0, target.data(), mx.data_ptr(),
                            sum.data_ptr(), zy.data_ptr(), 0, R);
    }
    for (int64_t r = 0; r < R; ++r) {
      SCOPED_TRACE("row " + std::to_string(r));
      const double m = mx[r].item<double>();
      if (r >= 3) {
        EXPECT_FALSE(std::isfinite(m)) << m;
        continue;
      }
      EXPECT_EQ(zy[r].item<double>(), z[r][target[r]].item<double>());
      const double got = -((zy[r].item<double>() - m) - std::log(sum[r].item<double>()));
      if (B == V) {
        EXPECT_NEAR(got, loss[r].item<double>(), t.row_loss * std::abs(loss[r].item<double>()));
        EXPECT_EQ(m, zd[r].max().item<double>());
      }
      const double want = lse[r].item<double>() - zd[r][target[r]].item<double>();
      EXPECT_NEAR(got, want, t.row_loss * std::abs(want));
    }
  }
}

void transpose_moves_every_word(const Case& c) {
  const int64_t rows = c["rows"], cols = c["cols"];
  const bool wide = c.layout == "4_bytes";
  const int64_t bytes = wide ? 4 : 2, line = 64 / bytes;
  const auto& k = kernmap::cpu::kernel_table();
  // Every bit pattern can occur (NaN payloads included): the words are random bits. Rows of src are 5 words
  // longer than a row (strided); dst's rows 3 longer, and their padding must stay as it was.
  const at::TensorOptions words = at::TensorOptions().dtype(wide ? at::kInt : at::kShort);
  const int64_t lo = wide ? std::numeric_limits<int32_t>::min() : -32768;
  const int64_t hi = wide ? std::numeric_limits<int32_t>::max() : 32767;
  const at::Tensor src = at::randint(lo, hi, {rows, cols + 5}, words);
  const at::Tensor want = src.narrow(1, 0, cols).t();
  const int64_t pad = 0x5a5a;
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "stored");
    // Split between two calls at column 3 (inside the first tile), as threads split the columns.
    at::Tensor dst = at::full({cols, rows + 3}, pad, words);
    const int64_t split = std::min<int64_t>(3, cols);
    k.transpose(bytes, src.const_data_ptr(), cols + 5, dst.data_ptr(), rows + 3, rows, 0, split, stream);
    k.transpose(bytes, src.const_data_ptr(), cols + 5, dst.data_ptr(), rows + 3, rows, split, cols, stream);
    EXPECT_TRUE(at::equal(dst.narrow(1, 0, rows), want));
    EXPECT_TRUE((dst.narrow(1, rows, 3) == pad).all().item<bool>()) << "a padding word was written";
  }
  // Streamed whole lines: dst 64-byte aligned, its rows a whole number of lines.
  const int64_t ld = (rows + line - 1) / line * line;
  at::Tensor dst = at::full({cols, ld}, pad, words);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(dst.data_ptr()) % 64, 0u);
  k.transpose(bytes, src.const_data_ptr(), cols + 5, dst.data_ptr(), ld, rows, 0, cols, true);
  EXPECT_TRUE(at::equal(dst.narrow(1, 0, rows), want)) << "aligned, streamed";
  EXPECT_TRUE((dst.narrow(1, rows, ld - rows) == pad).all().item<bool>()) << "a padding word was written";
}

}  // namespace kernmap::testing
