// The SiLU and SiluAndMul layers: kernmap::silu, kernmap::silu_and_mul and its packed form kernmap::swiglu
// (checks, CPU implementations over kernels/cpu, Meta shapes, autograd), their reference kernels, and the two
// layer records.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "kernels/cpu/isa.h"
#include "kernmap/ops.h"
#include "ops/checks.h"
#include "ops/memory.h"

namespace kernmap::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- silu -------------------------------------------------------------------------------------------------

at::Tensor silu_cpu(const at::Tensor& x) {
  check_floating("silu", "x", x);
  at::Tensor y = at::empty(x.sizes(), x.options());
  const Rows xr = as_rows(x);
  const auto& k = cpu::kernel_table();
  const bool stream = stream_outputs(2 * x.numel() * x.element_size());
  at::parallel_for(0, xr.rows, row_grain(xr.cols), [&](int64_t r0, int64_t r1) {
    k.silu_fwd(cpu_dtype(x.scalar_type()), xr.data(), xr.stride, y.data_ptr(), r0, r1, xr.cols, stream);
  });
  return y;
}

at::Tensor silu_backward_cpu(const at::Tensor& grad_y, const at::Tensor& x) {
  check_floating("silu_backward", "x", x);
  check_same_shape("silu_backward", "x", x, "grad_y", grad_y);
  check_same_dtype("silu_backward", "x", x, "grad_y", grad_y);
  check_same_device("silu_backward", "x", x, "grad_y", grad_y);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  const Rows xr = as_rows(x);
  const Rows gr = as_rows(grad_y);
  const auto& k = cpu::kernel_table();
  const bool stream = stream_outputs(3 * x.numel() * x.element_size());
  at::parallel_for(0, xr.rows, row_grain(xr.cols), [&](int64_t r0, int64_t r1) {
    k.silu_bwd(cpu_dtype(x.scalar_type()), gr.data(), gr.stride, xr.data(), xr.stride, dx.data_ptr(), r0, r1,
               xr.cols, stream);
  });
  return dx;
}

at::Tensor silu_meta(const at::Tensor& x) {
  check_floating("silu", "x", x);
  return at::empty(x.sizes(), x.options());
}
at::Tensor silu_backward_meta(const at::Tensor& grad_y, const at::Tensor& x) {
  check_same_shape("silu_backward", "x", x, "grad_y", grad_y);
  return at::empty(x.sizes(), x.options());
}

class SiluFunction : public torch::autograd::Function<SiluFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = op_handle<at::Tensor(const at::Tensor&)>("kernmap::silu");
    ctx->save_for_backward({x});
    return op.call(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&)>("kernmap::silu_backward");
    return {op.call(grads[0], ctx->get_saved_variables()[0])};
  }
};
at::Tensor silu_autograd(const at::Tensor& x) {
  return SiluFunction::apply(x);
}

// ---- silu_and_mul ---------------------------------------------------------------------------------------

void check_gate_up(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  check_floating(op, "gate", gate);
  check_same_dtype(op, "gate", gate, "up", up);
  check_same_device(op, "gate", gate, "up", up);
  check_same_shape(op, "gate", gate, "up", up);
  TORCH_CHECK(gate.dim() >= 1, "kernmap.", op,
              ": gate must have at least 1 dimension [..., I], got a 0-d tensor");
}

at::Tensor silu_and_mul_cpu(const at::Tensor& gate, const at::Tensor& up) {
  check_gate_up("silu_and_mul", gate, up);
  at::Tensor y = at::empty(gate.sizes(), gate.options());
  const Rows g = as_rows(gate);
  const Rows u = as_rows(up);
  const auto& k = cpu::kernel_table();
  const bool stream = stream_outputs(3 * gate.numel() * gate.element_size());
  at::parallel_for(0, g.rows, row_grain(g.cols), [&](int64_t r0, int64_t r1) {
    k.silu_and_mul_fwd(cpu_dtype(gate.scalar_type()), g.data(), g.stride, u.data(), u.stride, y.data_ptr(),
                       r0, r1, g.cols, stream);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> silu_and_mul_backward_cpu(const at::Tensor& grad_y, const at::Tensor& gate,
                                                             const at::Tensor& up) {
  check_gate_up("silu_and_mul_backward", gate, up);
  check_same_shape("silu_and_mul_backward", "gate", gate, "grad_y", grad_y);
  check_same_dtype("silu_and_mul_backward", "gate", gate, "grad_y", grad_y);
  check_same_device("silu_and_mul_backward", "gate", gate, "grad_y", grad_y);
  at::Tensor dg = at::empty(gate.sizes(), gate.options());
  at::Tensor du = at::empty(up.sizes(), up.options());
  const Rows d = as_rows(grad_y);
  const Rows g = as_rows(gate);
  const Rows u = as_rows(up);
  const auto& k = cpu::kernel_table();
  const bool stream = stream_outputs(5 * gate.numel() * gate.element_size());
  at::parallel_for(0, g.rows, row_grain(g.cols), [&](int64_t r0, int64_t r1) {
    k.silu_and_mul_bwd(cpu_dtype(gate.scalar_type()), d.data(), d.stride, g.data(), g.stride, u.data(),
                       u.stride, dg.data_ptr(), g.cols, du.data_ptr(), g.cols, r0, r1, g.cols, stream);
  });
  return {dg, du};
}

at::Tensor silu_and_mul_meta(const at::Tensor& gate, const at::Tensor& up) {
  check_gate_up("silu_and_mul", gate, up);
  return at::empty(gate.sizes(), gate.options());
}
std::tuple<at::Tensor, at::Tensor> silu_and_mul_backward_meta(const at::Tensor& grad_y,
                                                              const at::Tensor& gate, const at::Tensor& up) {
  check_gate_up("silu_and_mul_backward", gate, up);
  return {at::empty(gate.sizes(), gate.options()), at::empty(up.sizes(), up.options())};
}

class SiluAndMulFunction : public torch::autograd::Function<SiluAndMulFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&)>("kernmap::silu_and_mul");
    ctx->save_for_backward({gate, up});
    return op.call(gate, up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = op_handle<std::tuple<at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const at::Tensor&)>("kernmap::silu_and_mul_backward");
    const auto saved = ctx->get_saved_variables();
    auto [dg, du] = op.call(grads[0], saved[0], saved[1]);
    return {dg, du};
  }
};
at::Tensor silu_and_mul_autograd(const at::Tensor& gate, const at::Tensor& up) {
  return SiluAndMulFunction::apply(gate, up);
}

// ---- swiglu (packed gate_up, gate first) ------------------------------------------------------------------

int64_t check_gate_up_packed(const char* op, const at::Tensor& gate_up) {
  check_floating(op, "gate_up", gate_up);
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "kernmap.", op,
              ": gate_up must be [..., 2I] with an even last dimension, got ", gate_up.sizes());
  return gate_up.size(-1) / 2;
}

std::vector<int64_t> half_last(const at::Tensor& t) {
  auto s = t.sizes().vec();
  s.back() /= 2;
  return s;
}

at::Tensor swiglu_cpu(const at::Tensor& gate_up) {
  const int64_t I = check_gate_up_packed("swiglu", gate_up);
  at::Tensor y = empty_large(half_last(gate_up), gate_up.options());
  const Rows gu = as_rows(gate_up);
  const int64_t elem = gate_up.element_size();
  const char* base = static_cast<const char*>(gu.data());
  const auto& k = cpu::kernel_table();
  const bool stream = stream_outputs(3 * y.numel() * elem);
  at::parallel_for(0, gu.rows, row_grain(I), [&](int64_t r0, int64_t r1) {
    k.silu_and_mul_fwd(cpu_dtype(gate_up.scalar_type()), base, gu.stride, base + I * elem, gu.stride,
                       y.data_ptr(), r0, r1, I, stream);
  });
  return y;
}

at::Tensor swiglu_backward_cpu(const at::Tensor& grad_y, const at::Tensor& gate_up) {
  const int64_t I = check_gate_up_packed("swiglu_backward", gate_up);
  TORCH_CHECK(grad_y.sizes() == at::IntArrayRef(half_last(gate_up)),
              "kernmap.swiglu_backward: grad_y must have shape ", half_last(gate_up), ", got ",
              grad_y.sizes());
  check_same_dtype("swiglu_backward", "gate_up", gate_up, "grad_y", grad_y);
  check_same_device("swiglu_backward", "gate_up", gate_up, "grad_y", grad_y);
  at::Tensor dgu = empty_large(gate_up.sizes(), gate_up.options());
  const Rows gu = as_rows(gate_up);
  const Rows d = as_rows(grad_y);
  const int64_t elem = gate_up.element_size();
  const char* base = static_cast<const char*>(gu.data());
  char* dbase = static_cast<char*>(dgu.data_ptr());
  const auto& k = cpu::kernel_table();
  const bool stream = stream_outputs(5 * grad_y.numel() * elem);
  at::parallel_for(0, gu.rows, row_grain(I), [&](int64_t r0, int64_t r1) {
    k.silu_and_mul_bwd(cpu_dtype(gate_up.scalar_type()), d.data(), d.stride, base, gu.stride, base + I * elem,
                       gu.stride, dbase, 2 * I, dbase + I * elem, 2 * I, r0, r1, I, stream);
  });
  return dgu;
}

at::Tensor swiglu_meta(const at::Tensor& gate_up) {
  check_gate_up_packed("swiglu", gate_up);
  return at::empty(half_last(gate_up), gate_up.options());
}
at::Tensor swiglu_backward_meta(const at::Tensor& grad_y, const at::Tensor& gate_up) {
  check_gate_up_packed("swiglu_backward", gate_up);
  return at::empty(gate_up.sizes(), gate_up.options());
}

class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = op_handle<at::Tensor(const at::Tensor&)>("kernmap::swiglu");
    ctx->save_for_backward({gate_up});
    return op.call(gate_up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&)>("kernmap::swiglu_backward");
    return {op.call(grads[0], ctx->get_saved_variables()[0])};
  }
};
at::Tensor swiglu_autograd(const at::Tensor& gate_up) {
  return SwigluFunction::apply(gate_up);
}

}  // namespace

TORCH_LIBRARY_IMPL(kernmap, CPU, m) {
  m.impl("silu", &silu_cpu);
  m.impl("silu_backward", &silu_backward_cpu);
  m.impl("silu_and_mul", &silu_and_mul_cpu);
  m.impl("silu_and_mul_backward", &silu_and_mul_backward_cpu);
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
}
TORCH_LIBRARY_IMPL(kernmap, Meta, m) {
  m.impl("silu", &silu_meta);
  m.impl("silu_backward", &silu_backward_meta);
  m.impl("silu_and_mul", &silu_and_mul_meta);
  m.impl("silu_and_mul_backward", &silu_and_mul_backward_meta);
  m.impl("swiglu", &swiglu_meta);
  m.impl("swiglu_backward", &swiglu_backward_meta);
}
TORCH_LIBRARY_IMPL(kernmap, Autograd, m) {
  m.impl("silu", &silu_autograd);
  m.impl("silu_and_mul", &silu_and_mul_autograd);
  m.impl("swiglu", &swiglu_autograd);
}

}  // namespace kernmap::ops

// ---- reference kernels: the transformers eager math in ATen ops (any device, autograd through ATen) ----

namespace kernmap::reference {

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

}  // namespace kernmap::reference

namespace kernmap::float64 {

// The references' math from float64, rounded where they round (SiLU's result; then the product) and nowhere
// else: the most accurate kernels of the layers, what align's noise run binds (docs/training.md, "The
// verdict").
at::Tensor silu(const at::Tensor& x) {
  return at::silu(x.to(at::kDouble)).to(x.scalar_type());
}

at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  ops::check_same_shape("float64_silu_and_mul", "gate", gate, "up", up);
  const at::Tensor act = at::silu(gate.to(at::kDouble)).to(gate.scalar_type());
  return (act.to(at::kDouble) * up.to(at::kDouble))
      .to(at::promote_types(gate.scalar_type(), up.scalar_type()));
}

}  // namespace kernmap::float64

namespace kernmap::ops {

TORCH_LIBRARY_IMPL(kernmap, CompositeImplicitAutograd, m) {
  m.impl("reference_silu", &kernmap::reference::silu);
  m.impl("reference_silu_and_mul", &kernmap::reference::silu_and_mul);
  m.impl("reference_swiglu", &kernmap::reference::swiglu);
  m.impl("float64_silu", &kernmap::float64::silu);
  m.impl("float64_silu_and_mul", &kernmap::float64::silu_and_mul);
}

// The layer record: every kernel of the layer and where it is the default (DESIGN §2), registered at
// load.
const LayerRegistrar kSiLULayer("SiLU",
                                KernelDescriptor{.name = "reference/silu",
                                                 .devices = {"*"},
                                                 .dtypes = floating_dtypes(),
                                                 .has_backward = true,
                                                 .compile_safe = true,
                                                 .op = "kernmap::reference_silu",
                                                 .description = "torch.nn.functional.silu"},
                                {{KernelDescriptor{
                                      .name = "kernmap/silu",
                                      .devices = {"cpu"},
                                      .dtypes = floating_dtypes(),
                                      .has_backward = true,
                                      .compile_safe = true,
                                      .op = "kernmap::silu",
                                      .description = "one-pass SiLU, SIMD level chosen at run time",
                                      .supports = needs_rank_at_least_1},
                                  /*default_on=*/{"cpu"}},
                                 {KernelDescriptor{.name = "float64/silu",
                                                   .devices = {"*"},
                                                   .dtypes = floating_dtypes(),
                                                   .has_backward = true,
                                                   .compile_safe = true,
                                                   .op = "kernmap::float64_silu",
                                                   .description = "SiLU from float64, rounded once (align's "
                                                                  "noise run)"},
                                  /*default_on=*/{}}});

const LayerRegistrar kSiluAndMulLayer("SiluAndMul",
                                      KernelDescriptor{.name = "reference/silu_and_mul",
                                                       .devices = {"*"},
                                                       .dtypes = floating_dtypes(),
                                                       .has_backward = true,
                                                       .compile_safe = true,
                                                       .op = "kernmap::reference_silu_and_mul",
                                                       .description = "silu(gate) * up (ATen ops)"},
                                      {{KernelDescriptor{
                                            .name = "kernmap/silu_and_mul",
                                            .devices = {"cpu"},
                                            .dtypes = floating_dtypes(),
                                            .has_backward = true,
                                            .compile_safe = true,
                                            .op = "kernmap::silu_and_mul",
                                            .description = "fused silu(gate) * up, one pass each way",
                                            .supports = needs_rank_at_least_1},
                                        /*default_on=*/{"cpu"}},
                                       {KernelDescriptor{.name = "float64/silu_and_mul",
                                                         .devices = {"*"},
                                                         .dtypes = floating_dtypes(),
                                                         .has_backward = true,
                                                         .compile_safe = true,
                                                         .op = "kernmap::float64_silu_and_mul",
                                                         .description = "silu(gate) * up from float64, "
                                                                        "rounded where the reference rounds "
                                                                        "(align's noise run)"},
                                        /*default_on=*/{}}});

}  // namespace kernmap::ops

namespace kernmap {
at::Tensor silu(const at::Tensor& x) {
  static auto op = ops::op_handle<at::Tensor(const at::Tensor&)>("kernmap::silu");
  return op.call(x);
}
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  static auto op = ops::op_handle<at::Tensor(const at::Tensor&, const at::Tensor&)>("kernmap::silu_and_mul");
  return op.call(gate, up);
}
at::Tensor swiglu(const at::Tensor& gate_up) {
  static auto op = ops::op_handle<at::Tensor(const at::Tensor&)>("kernmap::swiglu");
  return op.call(gate_up);
}
}  // namespace kernmap
