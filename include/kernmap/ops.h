// kernmap ops for LibTorch users: thin calls through the torch dispatcher (torch.ops.kernmap.* in Python), so
// autograd, Meta/fake tensors and device dispatch behave as for any torch op.
#pragma once

#include <ATen/core/Tensor.h>

#include "kernmap/export.h"

namespace kernmap {

/// RMSNorm with the transformers eager math: weight * to(x.dtype)(x_fp32 * rsqrt(mean(x_fp32^2, -1) + eps)).
/// x: [..., H] floating; weight: [H]. Output dtype: promote(x.dtype, weight.dtype).
KERNMAP_API at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
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
KERNMAP_API at::Tensor experts(const at::Tensor& hidden, const at::Tensor& topk_ids,
                               const at::Tensor& topk_weights, const at::Tensor& gate_up_proj,
                               const at::Tensor& down_proj);

/// The reference kernels (transformers eager math composed of ATen ops).
namespace reference {
KERNMAP_API at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
KERNMAP_API at::Tensor silu(const at::Tensor& x);
KERNMAP_API at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up);
KERNMAP_API at::Tensor swiglu(const at::Tensor& gate_up);
KERNMAP_API at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs);
KERNMAP_API at::Tensor experts(const at::Tensor& hidden, const at::Tensor& topk_ids,
                               const at::Tensor& topk_weights, const at::Tensor& gate_up_proj,
                               const at::Tensor& down_proj);
}  // namespace reference

}  // namespace kernmap
