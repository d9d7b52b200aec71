// The fused LM-head product and cross-entropy: linear_cross_entropy against its reference (transformers'
// eager math) forward and backward, over several chunks of rows, ignored rows and a bias; and its row kernel
// (cross_entropy_rows) against float64 math, non-finite rows included. Figures: tests/tolerances.json,
// "linear_cross_entropy" (fractions of the largest |reference|: the mean's gradients are too small for the
// elementwise rule's atol). tests/python adds transformers itself, gradcheck, opcheck and torch.compile.
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

namespace kernmap::testing {
namespace {

// Sets the rows per chunk (read by every linear_cross_entropy call) for the check's lifetime.
class ChunkRows {
 public:
  explicit ChunkRows(int64_t rows) { setenv("KERNMAP_LCE_CHUNK_ROWS", std::to_string(rows).c_str(), 1); }
  ~ChunkRows() { unsetenv("KERNMAP_LCE_CHUNK_ROWS"); }
  ChunkRows(const ChunkRows&) = delete;
  ChunkRows& operator=(const ChunkRows&) = delete;
};

}  // namespace

void linear_cross_entropy_matches_reference(const Case& c) {
  const int64_t N = c["N"], H = c["H"], V = c["V"];
  const bool with_bias = c.layout == "bias";
  const ChunkRows rows(c["chunk"]);
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
}

}  // namespace kernmap::testing
