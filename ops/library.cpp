// Every kernmap op schema, in one place. Implementations register beside their kernels: each layer's file in
// ops/ holds its TORCH_LIBRARY_IMPL blocks (CPU, Meta, Autograd, and CompositeImplicitAutograd for the
// reference) and its layer record (docs/adding-a-kernel.md).
#include <torch/library.h>

TORCH_LIBRARY(kernmap, m) {
  // RMSNorm (DESIGN §3). rms_norm_forward also returns rstd (fp32, fp64 for fp64 x) for the backward.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_forward(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)");
  m.def(
      "rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor rstd) -> (Tensor grad_x, Tensor "
      "grad_weight)");
  // FusedAddRMSNorm: RMSNorm(x + residual) and the sum x + residual (the residual stream's next value).
  // add_rms_norm_forward also returns rstd; its backward takes both outputs' gradients and returns the one
  // gradient of x and residual.
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor normed, Tensor sum)");
  m.def(
      "add_rms_norm_forward(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor normed, Tensor "
      "sum, Tensor rstd)");
  m.def(
      "add_rms_norm_backward(Tensor grad_normed, Tensor grad_sum, Tensor sum, Tensor weight, Tensor rstd) -> "
      "(Tensor grad_x, Tensor grad_weight)");
  // rotary_pos_emb: transformers' apply_rotary_pos_emb (rotate-half; cos and sin unsqueezed at unsqueeze_dim
  // and broadcast to q and k). The backward is the transpose, from the output gradients, cos and sin.
  m.def(
      "apply_rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1) -> (Tensor q_embed, "
      "Tensor k_embed)");
  m.def(
      "apply_rotary_backward(Tensor grad_q_embed, Tensor grad_k_embed, Tensor cos, Tensor sin, int "
      "unsqueeze_dim) -> (Tensor grad_q, Tensor grad_k)");
  // SiLU, SiLU-and-mul (silu(gate) * up) and its packed form swiglu(gate_up), gate first.
  m.def("silu(Tensor x) -> Tensor");
  m.def("silu_backward(Tensor grad_y, Tensor x) -> Tensor");
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("silu_and_mul_backward(Tensor grad_y, Tensor gate, Tensor up) -> (Tensor grad_gate, Tensor grad_up)");
  m.def("swiglu(Tensor gate_up) -> Tensor");
  m.def("swiglu_backward(Tensor grad_y, Tensor gate_up) -> Tensor");
  // Grouped matrix product (2D x 3D, torch._grouped_mm semantics): rows offs[e-1]..offs[e] of a multiply
  // b[e]. offs: int32 [E], non-decreasing cumulative row ends, offs[E-1] == T. b may be a transposed view.
  m.def("grouped_mm(Tensor a, Tensor b, Tensor offs) -> Tensor");
  m.def(
      "grouped_mm_backward(Tensor grad_out, Tensor a, Tensor b, Tensor offs, bool[2] output_mask=[True, "
      "True]) -> (Tensor grad_a, Tensor grad_b)");
  // The backwards take output_mask (the gradients autograd needs, in the order of the outputs): a gradient
  // not asked for is not computed and is returned undefined (None) — frozen expert weights (LoRA fine-tuning)
  // skip the weight-gradient products and their [E, N, K] buffers.
  // MoE experts, transformers 5.x layout: gate_up_proj [E, 2I, H] (gate first), down_proj [E, H, I].
  m.def(
      "experts(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor gate_up_proj, Tensor down_proj) "
      "-> Tensor");
  m.def(
      "experts_forward(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor gate_up_proj, Tensor "
      "down_proj) -> (Tensor out, Tensor order, Tensor offs, Tensor gate_up_out, Tensor down_out)");
  m.def(
      "experts_backward(Tensor grad_out, Tensor hidden, Tensor topk_weights, Tensor gate_up_proj, Tensor "
      "down_proj, Tensor order, Tensor offs, Tensor gate_up_out, Tensor down_out, bool[4] "
      "output_mask=[True, True, True, True]) -> (Tensor grad_hidden, Tensor grad_topk_weights, Tensor "
      "grad_gate_up_proj, Tensor grad_down_proj)");
  // transformers' ForCausalLMLoss of a linear LM head, without the [N, V] logits: hidden [N, H], weight [V,
  // H], labels int64 [N] (already shifted), bias [V]; mean over the rows whose label is not ignore_index, or
  // their sum / num_items_in_batch (a one-element tensor). Returns the fp32 loss (fp64 for fp64 inputs).
  // linear_cross_entropy_forward also returns the gradients of the loss (taken as 1) for the inputs that
  // output_mask asks for (hidden, weight, bias; undefined otherwise).
  m.def(
      "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor labels, Tensor? bias=None, int "
      "ignore_index=-100, "
      "Tensor? num_items_in_batch=None) -> Tensor");
  m.def(
      "linear_cross_entropy_forward(Tensor hidden, Tensor weight, Tensor labels, Tensor? bias, int "
      "ignore_index, "
      "Tensor? num_items_in_batch, bool[3] output_mask) -> (Tensor loss, Tensor grad_hidden, Tensor "
      "grad_weight, "
      "Tensor grad_bias)");
  // The cache of large CPU buffers (ops/memory.h): bytes held, and release (returns the bytes released).
  m.def("cached_memory_bytes() -> int");
  m.def("release_cached_memory() -> int");
  // Backs a large CPU tensor's memory with 2 MiB pages (expert weights; ops/memory.h): whether it did.
  m.def("advise_huge_pages(Tensor t) -> bool");
  // The count of CPU memory in tensors (kernmap/memory.h): start counting; [in use, peak] bytes; reset the
  // peak.
  m.def("count_cpu_memory() -> ()");
  m.def("cpu_memory() -> int[]");
  m.def("reset_cpu_memory_peak() -> ()");
  // Reference kernels: the transformers eager math composed of ATen ops (any device, autograd through ATen).
  m.def("reference_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "reference_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor normed, Tensor "
      "sum)");
  m.def(
      "reference_apply_rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1) -> (Tensor "
      "q_embed, Tensor k_embed)");
  m.def("reference_silu(Tensor x) -> Tensor");
  m.def("reference_silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("reference_swiglu(Tensor gate_up) -> Tensor");
  m.def("reference_grouped_mm(Tensor a, Tensor b, Tensor offs) -> Tensor");
  // The float64 kernels: each reference's math from float64, rounded where the reference rounds (align's
  // noise run, docs/training.md).
  m.def("float64_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "float64_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor normed, Tensor "
      "sum)");
  m.def(
      "float64_apply_rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1) -> (Tensor "
      "q_embed, Tensor k_embed)");
  m.def("float64_silu(Tensor x) -> Tensor");
  m.def("float64_silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("float64_grouped_mm(Tensor a, Tensor b, Tensor offs) -> Tensor");
  m.def(
      "float64_experts(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor gate_up_proj, Tensor "
      "down_proj) -> Tensor");
  m.def(
      "float64_linear_cross_entropy(Tensor hidden, Tensor weight, Tensor labels, Tensor? bias=None, int "
      "ignore_index=-100, Tensor? num_items_in_batch=None) -> Tensor");
  // transformers' experts implementations (ops/experts_transformers.cpp): the baselines of `kernmap ablate`.
  m.def(
      "transformers_experts_grouped_mm(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor "
      "gate_up_proj, Tensor down_proj) -> Tensor");
  m.def(
      "transformers_experts_batched_mm(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor "
      "gate_up_proj, Tensor down_proj) -> Tensor");
  m.def(
      "reference_experts(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor gate_up_proj, Tensor "
      "down_proj) -> Tensor");
  m.def(
      "reference_linear_cross_entropy(Tensor hidden, Tensor weight, Tensor labels, Tensor? bias=None, int "
      "ignore_index=-100, Tensor? num_items_in_batch=None) -> Tensor");
}
