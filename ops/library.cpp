// Every kernmap op schema, in one place. Implementations register beside their kernels (TORCH_LIBRARY_IMPL in
// ops/rms_norm.cpp, ops/activation.cpp, ops/reference.cpp).
#include <torch/library.h>

TORCH_LIBRARY(kernmap, m) {
  // RMSNorm (DESIGN §3). rms_norm_forward also returns rstd (fp32, fp64 for fp64 x) for the backward.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_forward(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)");
  m.def("rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor rstd) -> (Tensor grad_x, Tensor grad_weight)");
  // SiLU, SiLU-and-mul (silu(gate) * up) and its packed form swiglu(gate_up), gate first.
  m.def("silu(Tensor x) -> Tensor");
  m.def("silu_backward(Tensor grad_y, Tensor x) -> Tensor");
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("silu_and_mul_backward(Tensor grad_y, Tensor gate, Tensor up) -> (Tensor grad_gate, Tensor grad_up)");
  m.def("swiglu(Tensor gate_up) -> Tensor");
  m.def("swiglu_backward(Tensor grad_y, Tensor gate_up) -> Tensor");
  // Reference kernels: the transformers eager math composed of ATen ops (any device, autograd through ATen).
  m.def("reference_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("reference_silu(Tensor x) -> Tensor");
  m.def("reference_silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("reference_swiglu(Tensor gate_up) -> Tensor");
}
