// The MoE combine kernels against their scalar math, and the Experts op's thread-count invariance.
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <limits>
#include <string>

#include "kernels/cpu/isa.h"
#include "kernmap/ops.h"
#include "ops/checks.h"
#include "tests/cpp/kernels/checks.h"

namespace kernmap::testing {

// The combine kernel against its scalar math written in ATen ops (each an IEEE operation per element):
// acc = +0; per slot in order: acc += round_T(row * w) ("weighted_rounded"), row * w ("weighted"), or row
// ("unweighted"); out = round(acc), in the rows' dtype ("out_input") or the accumulation type ("out_acc").
// Rows in a random order (pos a permutation), odd widths around the block sizes, the tokens split over two
// calls; element-wise bit-identical.
void moe_combine_has_the_bits_of_the_scalar_math(const Case& c) {
  const auto& kern = kernmap::cpu::kernel_table();
  const at::ScalarType acc = acc_of(c.dtype);
  const at::ScalarType out_t = c.layout.ends_with("out_acc") ? acc : c.dtype;
  const bool weighted = c.layout.rfind("weighted", 0) == 0,
             round_product = c.layout.rfind("weighted_rounded", 0) == 0;
  const int64_t T = 7, H = c["H"], k = c["k"], S = T * k;
  at::Tensor rows = randn({S, H}, c.dtype);
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
    if (round_product) term = term.to(c.dtype).to(acc);
    want = want + term;
  }
  want = want.to(out_t);
  at::Tensor got = at::empty({T, H}, out_t);
  for (auto [t0, t1] : {std::pair<int64_t, int64_t>{0, 3}, {3, T}})
    kern.moe_combine(kernmap::ops::cpu_dtype(c.dtype), kernmap::ops::cpu_dtype(out_t), rows.const_data_ptr(),
                     pos.const_data_ptr<int64_t>(), k, weighted ? w.const_data_ptr() : nullptr, round_product,
                     got.data_ptr(), t0, t1, H);
  EXPECT_TRUE(same_bits(got, want));
}

// The combine's backward: d_rows[j] = round(grad[order[j] / k] * w[j]) bit for bit; d_w[j] = <grad row, row
// j> against float64 within the bound of an fp32 (fp64) sum of H products in any order: H * 2^-23 * sum |g
// r|.
void moe_combine_backward_matches_scalar_math_and_float64(const Case& c) {
  const auto& kern = kernmap::cpu::kernel_table();
  const at::ScalarType acc = acc_of(c.dtype);
  const int64_t T = 5, H = c["H"], k = c["k"], S = T * k;
  const at::Tensor grad = randn({T, H}, c.dtype);
  const at::Tensor rows = randn({S, H}, c.dtype);
  const at::Tensor order = at::randperm(S, at::kLong);
  const at::Tensor w = (0.05 + 0.95 * at::rand({S}, at::kDouble)).to(acc);
  at::Tensor d_rows = at::empty({S, H}, c.dtype);
  at::Tensor d_w = at::empty({S}, acc);
  for (auto [j0, j1] : {std::pair<int64_t, int64_t>{0, S / 2}, {S / 2, S}})
    kern.moe_combine_bwd(kernmap::ops::cpu_dtype(c.dtype), grad.const_data_ptr(), rows.const_data_ptr(),
                         w.const_data_ptr(), order.const_data_ptr<int64_t>(), k, d_rows.data_ptr(),
                         d_w.data_ptr(), j0, j1, H);
  const at::Tensor g = grad.index_select(0, order.div(k, "floor"));
  EXPECT_TRUE(same_bits(d_rows, (g.to(acc) * w.unsqueeze(1)).to(c.dtype)));
  const at::Tensor prod = g.to(at::kDouble) * rows.to(at::kDouble);
  const double unit = c.dtype == at::kDouble ? std::ldexp(1.0, -52) : std::ldexp(1.0, -23);
  const at::Tensor bound = double(H) * unit * prod.abs().sum(1);
  const at::Tensor err = (d_w.to(at::kDouble) - prod.sum(1)).abs();
  EXPECT_TRUE((err <= bound).all().item<bool>())
      << "worst error " << (err - bound).max().item<double>() << " over the bound";
}

// The Experts op's outputs do not depend on the thread count (the combine passes split tokens and rows over
// threads; each element and each d_w has one summation order).
void experts_same_bits_at_any_thread_count(const Case& c) {
  const int64_t T = c["T"], H = c["H"], E = c["E"], I = c["I"], k = c["k"];
  const at::Tensor hidden = randn({T, H}, c.dtype);
  const at::Tensor ids =
      at::argsort(at::rand({T, E}), /*dim=*/1, /*descending=*/false).narrow(1, 0, k).contiguous();
  const at::Tensor weights = at::rand({T, k}, at::kDouble).to(c.dtype);
  const at::Tensor gate_up = (0.2 * at::randn({E, 2 * I, H}, at::kDouble)).to(c.dtype);
  const at::Tensor down = (0.2 * at::randn({E, H, I}, at::kDouble)).to(c.dtype);
  const at::Tensor dy = randn({T, H}, c.dtype);
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

}  // namespace kernmap::testing
