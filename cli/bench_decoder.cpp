// The decoder layer's other memory-bound cases of `kernmap bench ops`, at Qwen2-7B sizes: the rotary
// embedding of q and k (28 query heads, 4 key/value heads, head_dim 128, 4096 tokens, in the attention's
// layout: [B, heads, S, D] views of [B, S, heads, D] projections) and the residual add fused with RMSNorm
// ([4096, 3584]), against the reference and, for the fused add, against the add followed by kernmap's
// RMSNorm.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "cli/bench.h"
#include "kernmap/ops.h"

namespace kernmap::cli {
namespace {

using Tensor = at::Tensor;
using Pair = std::tuple<Tensor, Tensor>;
using PairOp = std::function<Pair(const std::vector<Tensor>&)>;

// A forward without autograd, and a forward+backward with fixed gradients for both outputs (the inputs'
// gradients returned, so no accumulation pass is timed).
Impl forward_impl(const std::string& name, std::vector<Tensor> in, PairOp f) {
  return {name, [in, f] {
            at::NoGradGuard g;
            f(in);
          }};
}
Impl fwd_bwd_impl(const std::string& name, std::vector<Tensor> in, size_t n_grad, Tensor g0, Tensor g1,
                  PairOp f) {
  std::vector<Tensor> leaves;
  for (size_t i = 0; i < in.size(); ++i) {
    in[i] = in[i].detach();
    if (i < n_grad) leaves.push_back(in[i].requires_grad_(true));
  }
  // The gradients are returned, not accumulated into the leaves: in a model these inputs are other layers'
  // outputs, and a leaf's AccumulateGrad would copy a gradient that reaches two leaves (the residual add's,
  // which x and the residual share), a copy no decoder layer makes.
  return {name, [in, leaves, g0, g1, f] {
            auto [a, b] = f(in);
            torch::autograd::grad({a, b}, leaves, {g0, g1});
          }};
}

}  // namespace

std::vector<CaseBuilder> rotary_cases(const std::string& dtype, const ShapeFilter&) {
  return builders_of([dtype] {
    const at::ScalarType dt = dtype_of(dtype);
    const int64_t B = 1, S = 4096, Hq = 28, Hkv = 4, D = 128;  // Qwen2-7B attention
    const Tensor q = at::randn({B, S, Hq, D}).to(dt).transpose(1, 2);
    const Tensor k = at::randn({B, S, Hkv, D}).to(dt).transpose(1, 2);
    const Tensor cos = at::randn({B, S, D}).to(dt), sin = at::randn({B, S, D}).to(dt);
    const Tensor gq = at::randn(q.sizes()).to(dt), gk = at::randn(k.sizes()).to(dt);
    const double e = q.element_size();
    // q and k read, q_embed and k_embed written, cos and sin read once; the backward likewise.
    const double pass = e * (2.0 * (q.numel() + k.numel()) + 2.0 * S * D);
    const std::string shape = "q " + shape_string(q.sizes()) + " k " + shape_string(k.sizes()) + " (views)";
    const PairOp kern = [](const std::vector<Tensor>& in) {
      return kernmap::apply_rotary(in[0], in[1], in[2], in[3]);
    };
    const PairOp ref = [](const std::vector<Tensor>& in) {
      return kernmap::reference::apply_rotary(in[0], in[1], in[2], in[3]);
    };
    const std::vector<Tensor> in = {q, k, cos, sin};
    Case fwd{"apply_rotary",
             "fwd",
             dtype,
             shape,
             pass,
             0,
             0,
             {forward_impl("kernmap", in, kern), forward_impl("reference", in, ref)}};
    Case both{"apply_rotary",
              "fwd+bwd",
              dtype,
              shape,
              2 * pass,
              0,
              0,
              {fwd_bwd_impl("kernmap", in, 2, gq, gk, kern), fwd_bwd_impl("reference", in, 2, gq, gk, ref)}};
    fwd.written = e * (q.numel() + k.numel());  // q_embed and k_embed; the backward's two gradients
    both.written = 2 * fwd.written;
    return std::vector<Case>{fwd, both};
  });
}

std::vector<CaseBuilder> add_rms_norm_cases(const std::string& dtype, const ShapeFilter&) {
  return builders_of([dtype] {
    const at::ScalarType dt = dtype_of(dtype);
    const int64_t T = 4096, H = 3584;  // Qwen2-7B hidden size
    const Tensor x = at::randn({T, H}).to(dt), r = at::randn({T, H}).to(dt);
    const Tensor w = (1 + 0.1 * at::randn({H})).to(dt);
    const Tensor gy = at::randn({T, H}).to(dt), gs = at::randn({T, H}).to(dt);
    const double n = double(T) * H * x.element_size();
    // Forward: x and residual read, normed and sum written. Backward: both gradients and the sum read, one
    // gradient written.
    const double fwd_bytes = 4 * n, bwd_bytes = 4 * n;
    const PairOp kern = [](const std::vector<Tensor>& in) {
      return kernmap::add_rms_norm(in[0], in[1], in[2], 1e-6);
    };
    const PairOp separate = [](const std::vector<Tensor>& in) {
      Tensor sum = in[1] + in[0];
      return Pair{kernmap::rms_norm(sum, in[2], 1e-6), sum};
    };
    const PairOp ref = [](const std::vector<Tensor>& in) {
      return kernmap::reference::add_rms_norm(in[0], in[1], in[2], 1e-6);
    };
    const std::vector<Tensor> in = {x, r, w};
    const std::string name = "add + kernmap rms_norm";
    Case fwd{"add_rms_norm",
             "fwd",
             dtype,
             shape_string(x.sizes()),
             fwd_bytes,
             0,
             0,
             {forward_impl("kernmap", in, kern), forward_impl(name, in, separate),
              forward_impl("reference", in, ref)}};
    Case both{"add_rms_norm",
              "fwd+bwd",
              dtype,
              shape_string(x.sizes()),
              fwd_bytes + bwd_bytes,
              0,
              0,
              {fwd_bwd_impl("kernmap", in, 3, gy, gs, kern), fwd_bwd_impl(name, in, 3, gy, gs, separate),
               fwd_bwd_impl("reference", in, 3, gy, gs, ref)}};
    fwd.written = 2 * n;  // normed and sum; the backward's one gradient
    both.written = 3 * n;
    return std::vector<Case>{fwd, both};
  });
}

}  // namespace kernmap::cli
