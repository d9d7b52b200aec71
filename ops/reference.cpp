// Reference kernels: the transformers eager math composed of ATen ops, cast order included (DESIGN §3). They
// run on any device and get autograd from ATen (CompositeImplicitAutograd): the baseline every kernel is
// measured and checked against.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "include/kernmap/ops.h"
#include "ops/checks.h"

namespace kernmap::reference {

// Qwen2RMSNorm.forward. float64 input is kept in float64 (transformers casts it to float32), so float64 checks
// measure the kernels rather than the downcast.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::ScalarType compute = at::promote_types(at::kFloat, x.scalar_type());
  at::Tensor h = x.to(compute);
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(x.scalar_type());
}

// ACT2FN["silu"]: torch evaluates it in float32 for reduced-precision inputs and rounds once.
at::Tensor silu(const at::Tensor& x) { return at::silu(x); }

// The gated MLP's act_fn(gate_proj(x)) * up_proj(x): two roundings in x's dtype.
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  ops::check_same_shape("reference_silu_and_mul", "gate", gate, "up", up);
  return at::silu(gate) * up;
}

at::Tensor swiglu(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "kernmap.reference_swiglu: gate_up must be [..., 2I] with an even last dimension, got ", gate_up.sizes());
  auto halves = gate_up.chunk(2, -1);
  return at::silu(halves[0]) * halves[1];
}

}  // namespace kernmap::reference

TORCH_LIBRARY_IMPL(kernmap, CompositeImplicitAutograd, m) {
  m.impl("reference_rms_norm", &kernmap::reference::rms_norm);
  m.impl("reference_silu", &kernmap::reference::silu);
  m.impl("reference_silu_and_mul", &kernmap::reference::silu_and_mul);
  m.impl("reference_swiglu", &kernmap::reference::swiglu);
}
