// kernmap ops for LibTorch users: thin calls through the torch dispatcher (torch.ops.kernmap.* in Python), so
// autograd, Meta/fake tensors and device dispatch behave as for any torch op.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace kernmap {

/// RMSNorm with the transformers eager math: weight * to(x.dtype)(x_fp32 * rsqrt(mean(x_fp32^2, -1) + eps)).
/// x: [..., H] floating; weight: [H]. Output dtype: promote(x.dtype, weight.dtype).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
/// SiLU x * sigmoid(x), evaluated in fp32 (fp64 for fp64) and rounded once.
at::Tensor silu(const at::Tensor& x);
/// silu(gate) * up, as the gated MLP computes it. gate and up: same shape and dtype.
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up);
/// The packed form: gate_up[..., 2I], gate first; returns [..., I].
at::Tensor swiglu(const at::Tensor& gate_up);

/// Grouped product: rows offs[e-1]..offs[e] of a [T, K] multiply b[e] ([E, K, N]; a transposed view of
/// [E, N, K] is read in place); offs: int32 [E] cumulative row ends, offs[E-1] == T. Returns [T, N].
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs);
/// MoE experts (transformers 5.x layout): hidden [T, H], topk_ids / topk_weights [T, k], gate_up_proj [E, 2I,
/// H] (gate rows first), down_proj [E, H, I]. Returns sum_k topk_weights * down(silu(gate) * up) per token.
at::Tensor experts(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   const at::Tensor& gate_up_proj, const at::Tensor& down_proj);

/// transformers' ForCausalLMLoss of a linear LM head, computed without holding the [N, V] logits: logits =
/// hidden @ weight^T (+ bias) in the input dtype, then float32; cross-entropy over the rows whose label is
/// not ignore_index; their mean, or their sum / num_items_in_batch (a one-element tensor, as the HF Trainer
/// passes under gradient accumulation). hidden [N, H] and weight [V, H] (and bias [V]) floating of one dtype,
/// labels int64 [N] already shifted (position i holds the token that row i predicts). Returns the float32
/// loss (float64 for float64 inputs); NaN when every row is ignored and there is no num_items_in_batch, as in
/// transformers. Gradients for hidden, weight and bias. docs/ops.md, "Fused linear cross-entropy".
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                const std::optional<at::Tensor>& bias = std::nullopt,
                                int64_t ignore_index = -100,
                                const std::optional<at::Tensor>& num_items_in_batch = std::nullopt);

/// The reference kernels (transformers eager math composed of ATen ops).
namespace reference {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu(const at::Tensor& x);
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up);
at::Tensor swiglu(const at::Tensor& gate_up);
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs);
at::Tensor experts(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   const at::Tensor& gate_up_proj, const at::Tensor& down_proj);
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                const std::optional<at::Tensor>& bias = std::nullopt,
                                int64_t ignore_index = -100,
                                const std::optional<at::Tensor>& num_items_in_batch = std::nullopt);
}  // namespace reference

}  // namespace kernmap
