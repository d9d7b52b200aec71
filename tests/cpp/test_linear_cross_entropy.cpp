// kernmap::linear_cross_entropy at every instruction-set level this machine runs, against the reference
// (transformers' eager math), per dtype: odd sizes, several chunks of rows, ignored rows, bias; and the
// cross-entropy row kernel itself against float64 math, non-finite rows included. (tests/python adds
// transformers itself, gradcheck, opcheck and torch.compile.)
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdlib>
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

// Largest |got - want| over the largest |want|.
double rel_err(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  return (g - w).abs().max().item<double>() / std::max(w.abs().max().item<double>(), 1e-30);
}

// Relative tolerances of loss and gradients against the reference (see
// tests/python/test_linear_cross_entropy.py for why the weight gradient of bf16 and fp16 gets more).
struct Tol {
  double loss, grad, weight_grad;
};
Tol tol(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return {1e-12, 1e-12, 1e-12};
    case at::kFloat:
      return {1e-5, 1e-5, 1e-5};
    case at::kBFloat16:
      return {1e-3, 8e-3, 2e-2};
    default:
      return {1e-3, 2e-3, 4e-3};
  }
}

// Sets the rows per chunk for the test's lifetime.
class ChunkRows {
 public:
  explicit ChunkRows(int64_t rows) { setenv("KERNMAP_LCE_CHUNK_ROWS", std::to_string(rows).c_str(), 1); }
  ~ChunkRows() { unsetenv("KERNMAP_LCE_CHUNK_ROWS"); }
};

class LinearCrossEntropy : public kernmap::testing::LevelDtypeTest {};

TEST_P(LinearCrossEntropy, MatchesReferenceForwardAndBackward) {
  struct Shape {
    int64_t N, H, V, chunk;
  };
  for (const Shape& s :
       std::vector<Shape>{{1, 1, 1, 256}, {37, 19, 101, 256}, {203, 33, 517, 16}, {64, 8, 7, 5}}) {
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE("N=" + std::to_string(s.N) + " H=" + std::to_string(s.H) + " V=" + std::to_string(s.V) +
                   " chunk=" + std::to_string(s.chunk) + (with_bias ? " bias" : ""));
      ChunkRows rows(s.chunk);
      const at::Tensor h0 = at::randn({s.N, s.H}, at::kDouble).to(dtype());
      const at::Tensor w0 = (at::randn({s.V, s.H}, at::kDouble) * (2 / std::sqrt(double(s.H)))).to(dtype());
      const at::Tensor b0 = at::randn({s.V}, at::kDouble).to(dtype());
      at::Tensor labels = at::randint(s.V, {s.N}, at::TensorOptions().dtype(at::kLong));
      if (s.N > 3) labels.narrow(0, 1, s.N / 3).fill_(-100);
      std::vector<at::Tensor> loss, gh, gw, gb;
      for (int k = 0; k < 2; ++k) {
        at::Tensor h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
        at::Tensor b = b0.clone().requires_grad_(true);
        std::optional<at::Tensor> bias = with_bias ? std::optional<at::Tensor>(b) : std::nullopt;
        at::Tensor l = k == 0 ? kernmap::linear_cross_entropy(h, w, labels, bias)
                              : kernmap::reference::linear_cross_entropy(h, w, labels, bias);
        torch::autograd::backward({l});
        loss.push_back(l);
        gh.push_back(h.grad());
        gw.push_back(w.grad());
        gb.push_back(with_bias ? b.grad() : at::Tensor());
      }
      const Tol t = tol(dtype());
      EXPECT_EQ(loss[0].scalar_type(), dtype() == at::kDouble ? at::kDouble : at::kFloat);
      EXPECT_LE(rel_err(loss[0], loss[1]), t.loss)
          << loss[0].item<double>() << " vs " << loss[1].item<double>();
      EXPECT_LE(rel_err(gh[0], gh[1]), t.grad);
      EXPECT_LE(rel_err(gw[0], gw[1]), t.weight_grad);
      if (with_bias) {
        EXPECT_LE(rel_err(gb[0], gb[1]), t.grad);
      }
    }
  }
}

// The row kernel against float64 math on the widened logits: log-sum-exp loss and the gradient written in
// place, including -inf logits (0 probability) and rows with a NaN or an infinite maximum (all NaN).
TEST_P(LinearCrossEntropy, RowKernelMatchesFloat64Math) {
  const int64_t V = 203;  // not a multiple of any block width
  at::Tensor z = (at::randn({6, V}, at::kDouble) * 4).to(dtype());
  z[1][7] = -std::numeric_limits<double>::infinity();
  z[3][100] = std::numeric_limits<double>::quiet_NaN();
  z[4][0] = std::numeric_limits<double>::infinity();
  z[5].fill_(-std::numeric_limits<double>::infinity());
  const std::vector<int64_t> target = {0, 8, 202, 5, 9, 1};
  const at::Tensor zd = z.to(at::kDouble);
  const double scale = 0.25;
  const bool is_double = dtype() == at::kDouble;
  at::Tensor loss = at::empty({6}, is_double ? at::kDouble : at::kFloat);
  at::Tensor g = z.clone();
  kernmap::cpu::kernel_table().cross_entropy_rows(kernmap::ops::cpu_dtype(dtype()), g.data_ptr(), V, V,
                                                  target.data(), scale, loss.data_ptr(), true, 0, 6);
  const at::Tensor lse = at::logsumexp(zd, 1);
  const at::Tensor p = at::softmax(zd, 1);
  const double lt = is_double ? 1e-13 : 1e-6;
  const double gt = is_double ? 1e-13 : dtype() == at::kFloat ? 1e-6 : dtype() == at::kBFloat16 ? 8e-3 : 1e-3;
  for (int64_t r = 0; r < 6; ++r) {
    SCOPED_TRACE("row " + std::to_string(r));
    const double got = loss[r].item<double>();
    if (r >= 3) {
      EXPECT_TRUE(std::isnan(got));
      EXPECT_TRUE(g[r].to(at::kDouble).isnan().all().item<bool>());
      continue;
    }
    const double want = lse[r].item<double>() - zd[r][target[r]].item<double>();
    EXPECT_NEAR(got, want, lt * std::abs(want));
    at::Tensor want_g = p[r] * scale;
    want_g[target[r]] -= scale;
    EXPECT_LE(rel_err(g[r], want_g), gt);
    if (r == 1) {
      EXPECT_EQ(g[r][7].item<double>(), 0.0);  // e^-inf
    }
  }
  // Without grad the logits stay as they were and the losses are the same.
  at::Tensor z2 = z.clone();
  at::Tensor loss2 = at::empty_like(loss);
  kernmap::cpu::kernel_table().cross_entropy_rows(kernmap::ops::cpu_dtype(dtype()), z2.data_ptr(), V, V,
                                                  target.data(), scale, loss2.data_ptr(), false, 0, 6);
  EXPECT_TRUE(at::equal(z2.to(at::kDouble).nan_to_num(), z.to(at::kDouble).nan_to_num()));
  EXPECT_TRUE(at::equal(loss2.nan_to_num(), loss.nan_to_num()));
}

std::vector<std::tuple<Level, at::ScalarType>> params() {
  std::vector<std::tuple<Level, at::ScalarType>> out;
  for (Level l : kernmap::cpu::supported_levels())
    for (at::ScalarType t : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) out.emplace_back(l, t);
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllLevels, LinearCrossEntropy, ::testing::ValuesIn(params()), [](const auto& info) {
  return std::string(kernmap::cpu::level_name(std::get<0>(info.param))) + "_" +
         std::string(c10::toString(std::get<1>(info.param)));
});

}  // namespace
