// The RMSNorm layer: kernmap::rms_norm (input checks, the CPU implementation over kernels/cpu, Meta shapes,
// autograd), its reference kernel, and the layer record.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cmath>

#include "ops/rms_norm.h"

#include "kernels/cpu/isa.h"
#include "kernmap/ops.h"
#include "ops/checks.h"

namespace kernmap::ops {

at::ScalarType check_rms_norm(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_floating(op, "x", x);
  check_floating(op, "weight", weight);
  check_same_device(op, "x", x, "weight", weight);
  TORCH_CHECK(x.dim() >= 1, "kernmap.", op, ": x must have at least 1 dimension [..., H], got a 0-d tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "kernmap.", op, ": weight must have shape [",
              x.size(-1), "] (x's last dimension), got ", weight.sizes());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "kernmap.", op, ": eps must be finite and >= 0, got ", eps);
  TORCH_CHECK(weight.scalar_type() != at::kDouble || x.scalar_type() == at::kDouble, "kernmap.", op,
              ": a float64 weight needs float64 x, got x ", x.scalar_type());
  // The HF quirk that fp32 weight with bf16 x yields fp32 is part of the contract.
  return at::promote_types(x.scalar_type(), weight.scalar_type());
}

std::vector<int64_t> row_shape(const at::Tensor& x) {
  auto s = x.sizes().vec();
  s.pop_back();
  return s;
}

void check_rms_norm_backward(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                             const at::Tensor& weight, const at::Tensor& rstd) {
  const at::ScalarType out_t = check_rms_norm(op, x, weight, 0.0);
  check_same_shape(op, "x", x, "grad_y", grad_y);
  TORCH_CHECK(grad_y.scalar_type() == out_t, "kernmap.", op, ": grad_y must have the output dtype ", out_t,
              ", got ", grad_y.scalar_type());
  check_same_device(op, "x", x, "grad_y", grad_y);
  const at::ScalarType acc_t = acc_dtype(x.scalar_type());
  TORCH_CHECK(rstd.scalar_type() == acc_t && rstd.sizes() == at::IntArrayRef(row_shape(x)), "kernmap.", op,
              ": rstd must be ", acc_t, " of shape ", row_shape(x), ", got ", rstd.scalar_type(), " ",
              rstd.sizes());
}

// dW is summed in a fixed number of row blocks, then across blocks in order: the result does not depend on
// the thread count.
constexpr int64_t kWeightGradBlocks = 32;

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const char* op, const at::Tensor& grad_y,
                                                         const at::Tensor& grad_sum, const at::Tensor& x,
                                                         const at::Tensor& weight, const at::Tensor& rstd) {
  check_rms_norm_backward(op, grad_y, x, weight, rstd);
  const bool add = grad_sum.defined();
  if (add) {
    check_same_shape(op, "x", x, "grad_sum", grad_sum);
    check_same_dtype(op, "x", x, "grad_sum", grad_sum);
    check_same_device(op, "x", x, "grad_sum", grad_sum);
  }
  const at::ScalarType out_t = at::promote_types(x.scalar_type(), weight.scalar_type());
  const at::ScalarType acc_t = acc_dtype(x.scalar_type());
  at::Tensor dx = at::empty(x.sizes(), x.options());
  const Rows xr = as_rows(x);
  const int64_t H = xr.cols;
  if (xr.rows == 0) return {dx, at::zeros_like(weight)};
  const Rows gr = as_rows(grad_y);
  const Rows sr = add ? as_rows(grad_sum) : Rows{};
  const at::Tensor w = weight.to(acc_t).contiguous();
  const at::Tensor rs = rstd.contiguous();
  const int64_t blocks = std::min(kWeightGradBlocks, xr.rows);
  at::Tensor partial = at::zeros({blocks, H}, x.options().dtype(acc_t));
  const auto& k = cpu::kernel_table();
  const auto xt = cpu_dtype(x.scalar_type());
  const auto yt = cpu_dtype(out_t);
  const int64_t elem = partial.element_size();
  const int64_t bytes = x.numel() * ((add ? 3 : 2) * x.element_size() + grad_y.element_size());
  const bool stream = stream_outputs(bytes);
  // A task takes whole blocks, at least a row grain's worth of rows: a small call runs on the calling thread
  // instead of waking the pool for a few rows. The blocks, and so the sums, are the same whoever runs them.
  const int64_t grain = std::max<int64_t>(1, row_grain(H) / std::max<int64_t>(1, xr.rows / blocks));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = xr.rows * b / blocks, r1 = xr.rows * (b + 1) / blocks;
      char* dw = static_cast<char*>(partial.data_ptr()) + b * H * elem;
      if (add) {
        k.add_rms_norm_bwd(xt, yt, gr.data(), gr.stride, sr.data(), sr.stride, xr.data(), xr.stride,
                           w.const_data_ptr(), rs.const_data_ptr(), dx.data_ptr(), dw, r0, r1, H, stream);
      } else {
        k.rms_norm_bwd(xt, yt, gr.data(), gr.stride, xr.data(), xr.stride, w.const_data_ptr(),
                       rs.const_data_ptr(), dx.data_ptr(), dw, r0, r1, H, stream);
      }
    }
  });
  // Columns are independent; the block order within each column is fixed.
  at::Tensor dw = partial.sum(0);
  return {dx, dw.to(weight.scalar_type())};
}

namespace {

constexpr const char* kOp = "rms_norm";

std::tuple<at::Tensor, at::Tensor> forward_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::ScalarType out_t = check_rms_norm(kOp, x, weight, eps);
  const at::ScalarType acc_t = acc_dtype(x.scalar_type());
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_t));
  at::Tensor rstd = at::empty(row_shape(x), x.options().dtype(acc_t));
  const Rows xr = as_rows(x);
  if (xr.rows == 0) return {y, rstd};
  const at::Tensor w = weight.to(acc_t).contiguous();
  const auto& k = cpu::kernel_table();
  const auto xt = cpu_dtype(x.scalar_type());
  const auto yt = cpu_dtype(out_t);
  const bool stream = stream_outputs(x.numel() * (x.element_size() + y.element_size()));
  at::parallel_for(0, xr.rows, row_grain(xr.cols), [&](int64_t r0, int64_t r1) {
    k.rms_norm_fwd(xt, yt, xr.data(), xr.stride, w.const_data_ptr(), y.data_ptr(), rstd.data_ptr(), r0, r1,
                   xr.cols, eps, stream);
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> backward_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                const at::Tensor& weight, const at::Tensor& rstd) {
  return rms_norm_backward_cpu("rms_norm_backward", grad_y, at::Tensor(), x, weight, rstd);
}

std::tuple<at::Tensor, at::Tensor> forward_meta(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::ScalarType out_t = check_rms_norm(kOp, x, weight, eps);
  return {at::empty(x.sizes(), x.options().dtype(out_t)),
          at::empty(row_shape(x), x.options().dtype(acc_dtype(x.scalar_type())))};
}

std::tuple<at::Tensor, at::Tensor> backward_meta(const at::Tensor& grad_y, const at::Tensor& x,
                                                 const at::Tensor& weight, const at::Tensor& rstd) {
  check_rms_norm_backward("rms_norm_backward", grad_y, x, weight, rstd);
  return {at::empty(x.sizes(), x.options()), at::empty(weight.sizes(), weight.options())};
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(forward_cpu(x, weight, eps));
}
at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(forward_meta(x, weight, eps));
}

auto& forward_op() {
  static auto op =
      op_handle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double)>(
          "kernmap::rms_norm_forward");
  return op;
}
auto& backward_op() {
  static auto op =
      op_handle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&)>("kernmap::rms_norm_backward");
  return op;
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, rstd] = forward_op().call(x, weight, eps);
    ctx->save_for_backward({x, weight, rstd});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = backward_op().call(grads[0], saved[0], saved[1], saved[2]);
    return {dx, dw, at::Tensor()};
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormFunction::apply(x, weight, eps);
}

}  // namespace

TORCH_LIBRARY_IMPL(kernmap, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rms_norm_forward", &forward_cpu);
  m.impl("rms_norm_backward", &backward_cpu);
}
TORCH_LIBRARY_IMPL(kernmap, Meta, m) {
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("rms_norm_forward", &forward_meta);
  m.impl("rms_norm_backward", &backward_meta);
}
TORCH_LIBRARY_IMPL(kernmap, Autograd, m) {
  m.impl("rms_norm", &rms_norm_autograd);
}

}  // namespace kernmap::ops

// ---- reference kernels: the transformers eager math in ATen ops (any device, autograd through ATen) ----

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

}  // namespace kernmap::reference

namespace kernmap::float64 {

// The contract's math from float64, rounded where the contract rounds (h * r to x's dtype, the weight
// product to the promoted dtype) and nowhere else: the most accurate kernel of the layer, what align's noise
// run binds (docs/training.md, "The verdict").
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor h = x.to(at::kDouble);
  const at::Tensor normed = (h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(x.scalar_type());
  return (weight.to(at::kDouble) * normed.to(at::kDouble))
      .to(at::promote_types(weight.scalar_type(), x.scalar_type()));
}

}  // namespace kernmap::float64

namespace kernmap::ops {

TORCH_LIBRARY_IMPL(kernmap, CompositeImplicitAutograd, m) {
  m.impl("reference_rms_norm", &kernmap::reference::rms_norm);
  m.impl("float64_rms_norm", &kernmap::float64::rms_norm);
}

// The layer record: every kernel of the layer and where it is the default (DESIGN §2), registered at
// load.
const LayerRegistrar kRMSNormLayer(
    "RMSNorm",
    KernelDescriptor{.name = "reference/rms_norm",
                     .devices = {"*"},
                     .dtypes = floating_dtypes(),
                     .has_backward = true,
                     .compile_safe = true,
                     .op = "kernmap::reference_rms_norm",
                     .description = "transformers eager RMSNorm (ATen ops)"},
    {{KernelDescriptor{
          .name = "kernmap/rms_norm",
          .devices = {"cpu"},
          .dtypes = floating_dtypes(),
          .has_backward = true,
          .compile_safe = true,
          .op = "kernmap::rms_norm",
          .description = "fused one-pass RMSNorm, fp32 accumulation, SIMD level chosen at run time",
          .supports = needs_rank_at_least_1},
      /*default_on=*/{"cpu"}},
     {KernelDescriptor{.name = "float64/rms_norm",
                       .devices = {"*"},
                       .dtypes = floating_dtypes(),
                       .has_backward = true,
                       .compile_safe = true,
                       .op = "kernmap::float64_rms_norm",
                       .description = "the reference's math from float64, rounded where it rounds (align's "
                                      "noise run)"},
      /*default_on=*/{}}});

}  // namespace kernmap::ops

namespace kernmap {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static auto op =
      ops::op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("kernmap::rms_norm");
  return op.call(x, weight, eps);
}
}  // namespace kernmap
