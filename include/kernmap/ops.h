// kernmap ops for LibTorch users: thin calls through the torch dispatcher (torch.ops.kernmap.* in Python), so
// autograd, Meta/fake tensors and device dispatch behave as for any torch op.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "kernmap/export.h"

namespace kernmap {

/// RMSNorm with the transformers eager math: weight * to(x.dtype)(x_fp32 * rsqrt(mean(x_fp32^2, -1) + eps)).
/// x: [..., H] floating; weight: [H]. Output dtype: promote(x.dtype, weight.dtype).
KERNMAP_API at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
/// The residual add in front of a pre-norm fused with the RMSNorm: returns (rms_norm(x + residual, weight,
/// eps), x + residual), the sum rounded to x's dtype as eager's add rounds it. x, residual: [..., H], same
/// shape and dtype.
KERNMAP_API std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                            const at::Tensor& weight, double eps);
/// transformers' apply_rotary_pos_emb: (q * c + rotate_half(q) * s, k * c + rotate_half(k) * s) with c, s =
/// cos, sin unsqueezed at unsqueeze_dim; rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]). q, k: [..., D], D
/// even; c and s must broadcast to each. Each product and the sum are rounded to the output dtype as eager
/// rounds them. Outputs keep q's and k's layouts.
KERNMAP_API std::tuple<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& cos, const at::Tensor& sin,
                                                            int64_t unsqueeze_dim = 1);
/// SiLU x * sigmoid(x), evaluated in fp32 (fp64 for fp64) and rounded once.
KERNMAP_API at::Tensor silu(const at::Tensor& x);
/// silu(gate) * up, as the gated MLP computes it. gate and up: same shape and dtype.
KERNMAP_API at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up);
/// The packed form: gate_up[..., 2I], gate first; returns [..., I].
KERNMAP_API at::Tensor swiglu(const at::Tensor& gate_up);

/// Grouped product: rows offs[e-1]..offs[e] of a [T, K] multiply b[e] ([E, K, N]; a transposed view of
/// [E, N, K] is read in place); offs: int32 [E] cumulative row ends, offs[E-1] == T. Returns [T, N].
KERNMAP_API at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs);
/// MoE experts (transformers 5.x layout): hidden [T, H], topk_ids / topk_weights [T, k], gate_up_proj [E, 2I,
/// H] (gate rows first), down_proj [E, H, I]. Returns sum_k topk_weights * down(silu(gate) * up) per token.
/// Ids follow transformers' eager experts: an id of E (the expert-parallel sentinel) is skipped (no
/// contribution, a zero weight gradient); ids outside [0, E] are errors.
KERNMAP_API at::Tensor experts(const at::Tensor& hidden, const at::Tensor& topk_ids,
                               const at::Tensor& topk_weights, const at::Tensor& gate_up_proj,
                               const at::Tensor& down_proj);

/// transformers' ForCausalLMLoss of a linear LM head, computed without holding the [N, V] logits: logits =
/// hidden @ weight^T (+ bias) in the input dtype, then float32; cross-entropy over the rows whose label is
/// not ignore_index; their mean, or their sum / num_items_in_batch (a one-element tensor, as the HF Trainer
/// passes under gradient accumulation). hidden [N, H] and weight [V, H] (and bias [V]) floating of one dtype,
/// labels int64 [N] already shifted (position i holds the token that row i predicts). Returns the float32
/// loss (float64 for float64 inputs); NaN when every row is ignored and there is no num_items_in_batch, as in
/// transformers. Gradients for hidden, weight and bias. docs/ops.md, "Fused linear cross-entropy".
KERNMAP_API at::Tensor linear_cross_entropy(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
    const std::optional<at::Tensor>& bias = std::nullopt, int64_t ignore_index = -100,
    const std::optional<at::Tensor>& num_items_in_batch = std::nullopt);

/// The reference kernels (transformers eager math composed of ATen ops).
namespace reference {
KERNMAP_API at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
KERNMAP_API std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                            const at::Tensor& weight, double eps);
KERNMAP_API std::tuple<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& cos, const at::Tensor& sin,
                                                            int64_t unsqueeze_dim = 1);
KERNMAP_API at::Tensor silu(const at::Tensor& x);
KERNMAP_API at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up);
KERNMAP_API at::Tensor swiglu(const at::Tensor& gate_up);
KERNMAP_API at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs);
KERNMAP_API at::Tensor experts(const at::Tensor& hidden, const at::Tensor& topk_ids,
                               const at::Tensor& topk_weights, const at::Tensor& gate_up_proj,
                               const at::Tensor& down_proj);
KERNMAP_API at::Tensor linear_cross_entropy(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
    const std::optional<at::Tensor>& bias = std::nullopt, int64_t ignore_index = -100,
    const std::optional<at::Tensor>& num_items_in_batch = std::nullopt);
}  // namespace reference

}  // namespace kernmap
