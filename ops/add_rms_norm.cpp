// The FusedAddRMSNorm layer: kernmap::add_rms_norm, the residual add in front of a pre-norm fused with the
// RMSNorm (checks, the CPU implementation over kernels/cpu/rms_norm.cpp's row math, Meta shapes, autograd),
// its reference kernel, and the layer record.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "kernels/cpu/isa.h"
#include "kernmap/ops.h"
#include "ops/checks.h"
#include "ops/rms_norm.h"

namespace kernmap::ops {
namespace {

using Tensor = at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kOp = "add_rms_norm";

// Returns the normed output's dtype: RMSNorm's, promote(x, weight).
at::ScalarType check_add_rms_norm(const char* op, const Tensor& x, const Tensor& residual,
                                  const Tensor& weight, double eps) {
  const at::ScalarType out_t = check_rms_norm(op, x, weight, eps);
  check_floating(op, "residual", residual);
  check_same_shape(op, "x", x, "residual", residual);
  check_same_dtype(op, "x", x, "residual", residual);
  check_same_device(op, "x", x, "residual", residual);
  return out_t;
}

std::tuple<Tensor, Tensor, Tensor> forward_cpu(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                               double eps) {
  const at::ScalarType out_t = check_add_rms_norm(kOp, x, residual, weight, eps);
  const at::ScalarType acc_t = acc_dtype(x.scalar_type());
  Tensor y = at::empty(x.sizes(), x.options().dtype(out_t));
  Tensor sum = at::empty(x.sizes(), x.options());
  Tensor rstd = at::empty(row_shape(x), x.options().dtype(acc_t));
  const Rows xr = as_rows(x);
  if (xr.rows == 0) return {y, sum, rstd};
  const Rows rr = as_rows(residual);
  const Tensor w = weight.to(acc_t).contiguous();
  const auto& k = cpu::kernel_table();
  const auto xt = cpu_dtype(x.scalar_type());
  const auto yt = cpu_dtype(out_t);
  const bool stream = stream_outputs(x.numel() * (3 * x.element_size() + y.element_size()));
  at::parallel_for(0, xr.rows, row_grain(xr.cols), [&](int64_t r0, int64_t r1) {
    k.add_rms_norm_fwd(xt, yt, xr.data(), xr.stride, rr.data(), rr.stride, w.const_data_ptr(), y.data_ptr(),
                       sum.data_ptr(), rstd.data_ptr(), r0, r1, xr.cols, eps, stream);
  });
  return {y, sum, rstd};
}

std::tuple<Tensor, Tensor> backward_cpu(const Tensor& grad_normed, const Tensor& grad_sum, const Tensor& sum,
                                        const Tensor& weight, const Tensor& rstd) {
  return rms_norm_backward_cpu("add_rms_norm_backward", grad_normed, grad_sum, sum, weight, rstd);
}

std::tuple<Tensor, Tensor, Tensor> forward_meta(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                                double eps) {
  const at::ScalarType out_t = check_add_rms_norm(kOp, x, residual, weight, eps);
  return {at::empty(x.sizes(), x.options().dtype(out_t)), at::empty(x.sizes(), x.options()),
          at::empty(row_shape(x), x.options().dtype(acc_dtype(x.scalar_type())))};
}

std::tuple<Tensor, Tensor> backward_meta(const Tensor& grad_normed, const Tensor& grad_sum, const Tensor& sum,
                                         const Tensor& weight, const Tensor& rstd) {
  const char* op = "add_rms_norm_backward";
  check_rms_norm_backward(op, grad_normed, sum, weight, rstd);
  check_same_shape(op, "x", sum, "grad_sum", grad_sum);
  check_same_dtype(op, "x", sum, "grad_sum", grad_sum);
  return {at::empty(sum.sizes(), sum.options()), at::empty(weight.sizes(), weight.options())};
}

std::tuple<Tensor, Tensor> add_rms_norm_cpu(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                            double eps) {
  auto [y, sum, rstd] = forward_cpu(x, residual, weight, eps);
  return {y, sum};
}
std::tuple<Tensor, Tensor> add_rms_norm_meta(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                             double eps) {
  auto [y, sum, rstd] = forward_meta(x, residual, weight, eps);
  return {y, sum};
}

class AddRmsNormFunction : public torch::autograd::Function<AddRmsNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& residual,
                               const Tensor& weight, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op =
        op_handle<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>(
            "kernmap::add_rms_norm_forward");
    auto [y, sum, rstd] = op.call(x, residual, weight, eps);
    ctx->save_for_backward({sum, weight, rstd});
    return {y, sum};
  }
  // Undefined output gradients arrive as zeros (materialize_grads). x and residual get the same gradient, the
  // sum's: dx is one tensor handed to both.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op =
        op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                             const Tensor&)>("kernmap::add_rms_norm_backward");
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = op.call(grads[0], grads[1], saved[0], saved[1], saved[2]);
    return {dx, dx, dw, Tensor()};
  }
};

std::tuple<Tensor, Tensor> add_rms_norm_autograd(const Tensor& x, const Tensor& residual,
                                                 const Tensor& weight, double eps) {
  const variable_list out = AddRmsNormFunction::apply(x, residual, weight, eps);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(kernmap, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm_cpu);
  m.impl("add_rms_norm_forward", &forward_cpu);
  m.impl("add_rms_norm_backward", &backward_cpu);
}
TORCH_LIBRARY_IMPL(kernmap, Meta, m) {
  m.impl("add_rms_norm", &add_rms_norm_meta);
  m.impl("add_rms_norm_forward", &forward_meta);
  m.impl("add_rms_norm_backward", &backward_meta);
}
TORCH_LIBRARY_IMPL(kernmap, Autograd, m) {
  m.impl("add_rms_norm", &add_rms_norm_autograd);
}

}  // namespace kernmap::ops

// ---- reference kernel: the transformers eager math in ATen ops (any device, autograd through ATen) ----

namespace kernmap::reference {

// The pre-norm decoder layer's `hidden_states = residual + hidden_states` followed by its RMSNorm.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  ops::check_same_shape("reference_add_rms_norm", "x", x, "residual", residual);
  at::Tensor sum = residual + x;
  return {rms_norm(sum, weight, eps), sum};
}

}  // namespace kernmap::reference

namespace kernmap::float64 {

// The reference's math from float64, rounded where it rounds (the sum to x's dtype, then RMSNorm's
// roundings): align's noise run binds it (docs/training.md, "The verdict").
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  ops::check_same_shape("float64_add_rms_norm", "x", x, "residual", residual);
  const at::Tensor sum = (residual.to(at::kDouble) + x.to(at::kDouble))
                             .to(at::promote_types(residual.scalar_type(), x.scalar_type()));
  return {rms_norm(sum, weight, eps), sum};
}

}  // namespace kernmap::float64

namespace kernmap::ops {

TORCH_LIBRARY_IMPL(kernmap, CompositeImplicitAutograd, m) {
  m.impl("reference_add_rms_norm", &kernmap::reference::add_rms_norm);
  m.impl("float64_add_rms_norm", &kernmap::float64::add_rms_norm);
}

// The layer record (DESIGN §2).
const LayerRegistrar kFusedAddRMSNormLayer(
    "FusedAddRMSNorm",
    KernelDescriptor{.name = "reference/add_rms_norm",
                     .devices = {"*"},
                     .dtypes = floating_dtypes(),
                     .has_backward = true,
                     .compile_safe = true,
                     .op = "kernmap::reference_add_rms_norm",
                     .description = "residual add, then transformers eager RMSNorm (ATen ops)"},
    {{KernelDescriptor{.name = "kernmap/add_rms_norm",
                       .devices = {"cpu"},
                       .dtypes = floating_dtypes(),
                       .has_backward = true,
                       .compile_safe = true,
                       .op = "kernmap::add_rms_norm",
                       .description = "residual add fused with RMSNorm, one pass forward and one backward",
                       .supports = needs_rank_at_least_1},
      /*default_on=*/{"cpu"}},
     {KernelDescriptor{.name = "float64/add_rms_norm",
                       .devices = {"*"},
                       .dtypes = floating_dtypes(),
                       .has_backward = true,
                       .compile_safe = true,
                       .op = "kernmap::float64_add_rms_norm",
                       .description = "the reference's math from float64, rounded where it rounds (align's "
                                      "noise run)"},
      /*default_on=*/{}}});

}  // namespace kernmap::ops

namespace kernmap {
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  static auto op = ops::op_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>("kernmap::add_rms_norm");
  return op.call(x, residual, weight, eps);
}
}  // namespace kernmap
