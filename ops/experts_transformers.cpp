// transformers' experts implementations as kernels of layer Experts (provider "transformers"): what a
// transformers 5.23 model runs on CPU with torch 2.15, so that `kernmap ablate` measures against what users
// run. grouped_mm (transformers' default: `config._experts_implementation` is "grouped_mm" unless set) and
// batched_mm, each the ATen ops of transformers.integrations.moe in the same order (autograd through ATen),
// for the layout kernmap's layers have: gate rows first, no bias, not transposed, no expert parallelism.
// Their records are in the layer's (ops/experts.cpp); no device maps them by default.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

#include "ops/experts_transformers.h"

namespace kernmap::transformers_experts {
namespace {

void check_ids(const char* name, const at::Tensor& topk_ids, int64_t E) {
  if (topk_ids.numel() == 0) return;
  const int64_t lo = topk_ids.min().item<int64_t>(), hi = topk_ids.max().item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi < E, "kernmap.", name, ": expert ids must be in [0, ", E,
              ") (transformers' experts without expert parallelism), got ids from ", lo, " to ", hi);
}

// transformers' _default_apply_gate with a SiLU act_fn.
at::Tensor apply_gate(const at::Tensor& gate_up) {
  const auto halves = gate_up.chunk(2, -1);
  return at::silu(halves[0]) * halves[1];
}

// torch.nn.functional.grouped_mm(input.to(weight.dtype), weight, offs=offs), weight [E, N, K] used as
// [E, K, N] (transformers' _grouped_linear, not transposed).
at::Tensor grouped_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& offs) {
  return at::_grouped_mm(input.to(weight.scalar_type()), weight.transpose(-2, -1), offs);
}

}  // namespace

// grouped_mm_experts_forward: the (token, slot) pairs sorted by expert, their rows gathered, offsets from a
// histogram, one grouped product per projection, the routing weight, the pairs back in token order and summed
// over the slots.
at::Tensor grouped_mm(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                      const at::Tensor& gate_up_proj, const at::Tensor& down_proj) {
  const int64_t k = topk_ids.size(-1), T = hidden.size(0), H = hidden.size(-1), E = gate_up_proj.size(0);
  check_ids("transformers_experts_grouped_mm", topk_ids, E);
  const at::Tensor sample_weights = topk_weights.reshape(-1);
  const at::Tensor expert_ids = topk_ids.reshape(-1);
  auto [expert_ids_g, perm] = at::sort(expert_ids);
  const at::Tensor selected = hidden.index({at::floor_divide(perm, k)});
  const at::Tensor sample_weights_g = sample_weights.index({perm});
  const at::Tensor histc_input =
      hidden.device().is_cpu() ? expert_ids_g.to(at::kFloat) : expert_ids_g.to(at::kInt);
  const at::Tensor tokens_per_expert = at::histc(histc_input, E, 0, E - 1);
  const at::Tensor offsets = at::cumsum(tokens_per_expert, 0, at::kInt);
  at::Tensor proj = grouped_linear(selected, gate_up_proj, offsets);
  proj = apply_gate(proj);
  proj = grouped_linear(proj, down_proj, offsets);
  at::Tensor weighted = proj * sample_weights_g.unsqueeze(-1);
  at::Tensor inv_perm = at::empty_like(perm);
  inv_perm.index_put_({perm}, at::arange(perm.size(0), perm.options()));
  weighted = weighted.index({inv_perm});
  return weighted.view({T, k, H}).sum(1).to(hidden.scalar_type());
}

// batched_mm_experts_forward: every (token, slot) pair with its own copy of its expert's weights, one batched
// product per projection.
at::Tensor batched_mm(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                      const at::Tensor& gate_up_proj, const at::Tensor& down_proj) {
  const int64_t k = topk_ids.size(-1), T = hidden.size(0), H = hidden.size(-1), E = gate_up_proj.size(0);
  check_ids("transformers_experts_batched_mm", topk_ids, E);
  const at::Tensor selected = hidden.repeat_interleave(k, 0);
  const at::Tensor sample_weights = topk_weights.reshape(-1);
  const at::Tensor expert_ids = topk_ids.reshape(-1);
  at::Tensor proj = at::bmm(gate_up_proj.index({expert_ids}), selected.unsqueeze(-1)).squeeze(-1);
  proj = apply_gate(proj);
  proj = at::bmm(down_proj.index({expert_ids}), proj.unsqueeze(-1)).squeeze(-1);
  const at::Tensor weighted = proj * sample_weights.unsqueeze(-1);
  return weighted.view({T, k, H}).sum(1).to(hidden.scalar_type());
}

// ATen's CPU grouped product needs every matrix's rows 16-byte aligned: hidden_size and the experts'
// intermediate size times the element size must be multiples of 16 (transformers raises otherwise).
std::optional<std::string> grouped_mm_supports(const KernelInputs& inputs) {
  if (inputs.shapes.size() < 5 || inputs.shapes[3].size() != 3 || inputs.dtype.empty()) return std::nullopt;
  const int64_t es = inputs.dtype == "float32" ? 4 : 2;
  const int64_t H = inputs.shapes[3][2], I = inputs.shapes[3][1] / 2;
  if ((H * es) % 16 != 0 || (I * es) % 16 != 0)
    return "ATen's CPU grouped_mm needs hidden and intermediate rows of a multiple of 16 bytes, got H " +
           std::to_string(H) + ", I " + std::to_string(I) + " in " + inputs.dtype;
  return std::nullopt;
}

}  // namespace kernmap::transformers_experts

TORCH_LIBRARY_IMPL(kernmap, CompositeImplicitAutograd, m) {
  m.impl("transformers_experts_grouped_mm", &kernmap::transformers_experts::grouped_mm);
  m.impl("transformers_experts_batched_mm", &kernmap::transformers_experts::batched_mm);
}
