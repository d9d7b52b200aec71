// Reference kernels: the transformers eager math composed of ATen ops, cast order included (DESIGN §3). They
// run on any device and get autograd from ATen (CompositeImplicitAutograd): the baseline every kernel is
// measured and checked against.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "kernmap/ops.h"
#include "ops/checks.h"
#include "ops/grouped_mm.h"
#include "ops/linear_cross_entropy.h"

namespace kernmap::reference {

// Qwen2RMSNorm.forward. float64 input is kept in float64 (transformers casts it to float32), so float64
// checks measure the kernels rather than the downcast.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::ScalarType compute = at::promote_types(at::kFloat, x.scalar_type());
  at::Tensor h = x.to(compute);
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(x.scalar_type());
}

// ACT2FN["silu"]: torch evaluates it in float32 for reduced-precision inputs and rounds once.
at::Tensor silu(const at::Tensor& x) {
  return at::silu(x);
}

// The gated MLP's act_fn(gate_proj(x)) * up_proj(x): two roundings in x's dtype.
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  ops::check_same_shape("reference_silu_and_mul", "gate", gate, "up", up);
  return at::silu(gate) * up;
}

at::Tensor swiglu(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "kernmap.reference_swiglu: gate_up must be [..., 2I] with an even last dimension, got ",
              gate_up.sizes());
  auto halves = gate_up.chunk(2, -1);
  return at::silu(halves[0]) * halves[1];
}

// transformers.integrations.moe's fallback: one matrix product per group.
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 3,
              "kernmap.reference_grouped_mm: a must be [T, K] and b [E, K, N], got ", a.sizes(), " and ",
              b.sizes());
  ops::check_offs("reference_grouped_mm", offs, b.size(0), a.size(0), a);
  const at::Tensor ends = offs.to(at::kCPU);
  // unbind, not select: its backward stacks the per-group gradients once, as transformers' fallback backward
  // fills one zeros_like(weight); select's would materialize a full-size gradient per group.
  const std::vector<at::Tensor> groups = b.unbind(0);
  std::vector<at::Tensor> pieces;
  int64_t start = 0;
  for (int64_t e = 0; e < b.size(0); ++e) {
    const int64_t end = ends[e].item<int64_t>();
    pieces.push_back(at::mm(a.slice(0, start, end), groups[e]));
    start = end;
  }
  return pieces.empty() ? at::empty({0, b.size(2)}, a.options()) : at::cat(pieces, 0);
}

// The eager experts loop of transformers 5.x (Qwen2MoeExperts.forward): per expert hit, gather its tokens in
// (slot, token) order, gate_up product, act(gate) * up, down product, routing weight, index_add.
at::Tensor experts(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   const at::Tensor& gate_up_proj, const at::Tensor& down_proj) {
  at::Tensor out = at::zeros_like(hidden);
  const at::Tensor ids_by_slot = topk_ids.t();  // [k, T], as expert_mask[e] in transformers
  for (int64_t e = 0; e < gate_up_proj.size(0); ++e) {
    const at::Tensor hit = ids_by_slot.eq(e).nonzero();  // rows of (slot, token)
    if (hit.size(0) == 0) continue;
    const at::Tensor slot = hit.select(1, 0), token = hit.select(1, 1);
    const at::Tensor current = hidden.index_select(0, token);
    const auto gate_up = at::linear(current, gate_up_proj.select(0, e)).chunk(2, -1);
    at::Tensor h = at::silu(gate_up[0]) * gate_up[1];
    h = at::linear(h, down_proj.select(0, e));
    h = h * topk_weights.index({token, slot}).unsqueeze(-1);
    out = out.index_add(0, token, h.to(out.scalar_type()));
  }
  return out;
}

// transformers' ForCausalLMLoss (loss/loss_utils.py) of lm_head(hidden), labels already shifted: the logits
// in the input dtype, .float(), cross_entropy with ignore_index, mean, or sum / num_items_in_batch (cast to
// the loss's dtype, as an integer count is in transformers' division). float64 stays float64 (see rms_norm).
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                const std::optional<at::Tensor>& bias, int64_t ignore_index,
                                const std::optional<at::Tensor>& num_items_in_batch) {
  ops::check_linear_cross_entropy("reference_linear_cross_entropy", hidden, weight, labels, bias,
                                  num_items_in_batch);
  const at::Tensor logits =
      at::linear(hidden, weight, bias).to(at::promote_types(at::kFloat, hidden.scalar_type()));
  if (!num_items_in_batch || !num_items_in_batch->defined())
    return at::cross_entropy_loss(logits, labels, std::nullopt, at::Reduction::Mean, ignore_index);
  const at::Tensor sum =
      at::cross_entropy_loss(logits, labels, std::nullopt, at::Reduction::Sum, ignore_index);
  return sum / num_items_in_batch->reshape({}).to(sum.device(), sum.scalar_type());
}

}  // namespace kernmap::reference

TORCH_LIBRARY_IMPL(kernmap, CompositeImplicitAutograd, m) {
  m.impl("reference_rms_norm", &kernmap::reference::rms_norm);
  m.impl("reference_silu", &kernmap::reference::silu);
  m.impl("reference_silu_and_mul", &kernmap::reference::silu_and_mul);
  m.impl("reference_swiglu", &kernmap::reference::swiglu);
  m.impl("reference_grouped_mm", &kernmap::reference::grouped_mm);
  m.impl("reference_experts", &kernmap::reference::experts);
  m.impl("reference_linear_cross_entropy", &kernmap::reference::linear_cross_entropy);
}
