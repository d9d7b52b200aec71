// kmexample: an out-of-tree kernmap plugin (include/kernmap/plugin.h). It brings two RMSNorm kernels:
//
//   kmexample/rms_norm      CPU, op kmexample::rms_norm: a loop over rows in parallel, fp32 accumulation
//                           (fp64 for fp64); backward in ATen ops. An alternative to kernmap/rms_norm,
//                           chosen when a mapping names it.
//   kmexample/rms_norm_npu  device "npu", op kmexample::npu_rms_norm, registered for torch's PrivateUse1 key
//                           (the key an out-of-tree backend such as torch_npu runs under). Its body is ATen
//                           math standing in for a call into a vendor's kernel library. It is the plugin's
//                           default for RMSNorm on npu.
//
// Both compute the transformers eager RMSNorm: y = weight * to(x.dtype)(h * rsqrt(mean(h^2, -1) + eps)) with
// h = x in fp32 (fp64 for fp64 x), the weight multiply in the promoted dtype of (weight, x).
//
// Nothing runs at load time: the torch ops are registered in kernmap_plugin_register, after kernmap checked
// the ABI version, through torch::Library objects that live in a function-local static until the process
// ends. The plugin does not link libkernmap; it reaches kernmap only through the host struct it is given.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>

#include "kernmap/plugin.h"

namespace {

// ---- the math ----

// The checks both ops share; errors name the op, the argument, what it must be and what it is.
void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), op, ": x must be a floating tensor, got ",
              x.scalar_type());
  TORCH_CHECK(at::isFloatingType(weight.scalar_type()), op, ": weight must be a floating tensor, got ",
              weight.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension [..., H], got a 0-d tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), op, ": weight must have shape [", x.size(-1),
              "] (x's last dimension), got ", weight.sizes());
  TORCH_CHECK(x.device() == weight.device(), op, ": x and weight must be on one device, got ", x.device(),
              " and ", weight.device());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
}

// fp32 for fp32/bf16/fp16, fp64 for fp64.
at::ScalarType accumulation_type(const at::Tensor& x) {
  return at::promote_types(at::kFloat, x.scalar_type());
}

// CPU: each row in one pass over x for the sum of squares and one to scale it, accumulating in fp32.
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_inputs("kmexample::rms_norm", x, weight, eps);
  TORCH_CHECK(x.device().is_cpu(), "kmexample::rms_norm: x must be on the CPU, got ", x.device());
  const at::Tensor in = x.contiguous();
  at::Tensor normalized = at::empty_like(in);
  const int64_t hidden = in.size(-1);
  const int64_t rows = hidden == 0 ? 0 : in.numel() / hidden;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "kmexample::rms_norm", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* src = in.const_data_ptr<scalar_t>();
    scalar_t* dst = normalized.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, /*grain_size=*/std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden, 1)),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t r = begin; r < end; ++r) {
                         const scalar_t* row = src + r * hidden;
                         acc_t sum_squares = 0;
                         for (int64_t i = 0; i < hidden; ++i) sum_squares += acc_t(row[i]) * acc_t(row[i]);
                         const acc_t inv_rms = acc_t(1) / std::sqrt(sum_squares / acc_t(hidden) + acc_t(eps));
                         for (int64_t i = 0; i < hidden; ++i)
                           dst[r * hidden + i] = static_cast<scalar_t>(acc_t(row[i]) * inv_rms);
                       }
                     });
  });
  // After the cast back to x's dtype, in the promoted dtype of (weight, x): transformers' order.
  return weight * normalized;
}

// The same math in ATen ops: on a PrivateUse1 tensor every op runs on that backend. A vendor's plugin would
// call its fused kernel here instead.
at::Tensor rms_norm_privateuse1(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_inputs("kmexample::npu_rms_norm", x, weight, eps);
  const at::Tensor h = x.to(accumulation_type(x));
  const at::Tensor normalized = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normalized.to(x.scalar_type());
}

// Gradients of y = weight * to(x.dtype)(n), n = h * r, r = rsqrt(mean(h^2) + eps), h = x in fp32:
//   dweight = sum over rows of dy * to(x.dtype)(n), accumulated in fp32;
//   dn = fp32(to(x.dtype)(dy * weight));  dh = r * (dn - n * mean(dn * n, -1)).
class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const c10::OperatorHandle* op,
                            const at::Tensor& x, const at::Tensor& weight, double eps) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["eps"] = eps;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return op->typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>().call(x, weight, eps);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const double eps = ctx->saved_data["eps"].toDouble();
    const at::ScalarType acc = accumulation_type(x);
    const at::Tensor& dy = grads[0];

    const at::Tensor h = x.to(acc);
    const at::Tensor r = at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
    const at::Tensor n = h * r;
    at::Tensor dweight;
    if (ctx->needs_input_grad(1)) {  // edges: x, weight (the tensor inputs)
      const at::Tensor per_row = dy.to(acc) * n.to(x.scalar_type()).to(acc);
      dweight = per_row.reshape({-1, weight.size(0)}).sum(0).to(weight.scalar_type());
    }
    at::Tensor dx;
    if (ctx->needs_input_grad(0)) {
      const at::Tensor dn = (dy * weight).to(x.scalar_type()).to(acc);
      dx = (r * (dn - n * (dn * n).mean(-1, /*keepdim=*/true))).to(x.scalar_type());
    }
    return {at::Tensor(), dx, dweight, at::Tensor()};
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kmexample::rms_norm", "");
  return RmsNormFunction::apply(&op, x, weight, eps);
}

at::Tensor npu_rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kmexample::npu_rms_norm", "");
  return RmsNormFunction::apply(&op, x, weight, eps);
}

// ---- registration ----

// The torch ops. Constructed once, on the first successful kernmap_plugin_register, and kept until the
// process ends (kernmap never unloads a plugin). When a registration throws, the members constructed so far
// are destroyed, which takes their registrations back, and the next call tries again.
struct TorchOps {
  torch::Library schemas{torch::Library::DEF, "kmexample", std::nullopt, __FILE__, __LINE__};
  torch::Library cpu{torch::Library::IMPL, "kmexample", c10::DispatchKey::CPU, __FILE__, __LINE__};
  torch::Library privateuse1{torch::Library::IMPL, "kmexample", c10::DispatchKey::PrivateUse1, __FILE__,
                             __LINE__};
  torch::Library autograd{torch::Library::IMPL, "kmexample", c10::DispatchKey::Autograd, __FILE__, __LINE__};

  TorchOps() {
    // The argument list of kernmap's RMSNorm op (docs/ops.md): what a kernel for the RMSNorm layer must take.
    schemas.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    schemas.def("npu_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    cpu.impl("rms_norm", &rms_norm_cpu);
    privateuse1.impl("npu_rms_norm", &rms_norm_privateuse1);
    autograd.impl("rms_norm", &rms_norm_autograd);
    autograd.impl("npu_rms_norm", &npu_rms_norm_autograd);
  }
};

void register_torch_ops() {
  static TorchOps ops;
}

// The descriptors, as kernmap_register_kernel takes them (include/kernmap/c_api.h). No supports() callback:
// the ops check their inputs themselves (TORCH_CHECK, errors naming the argument).
// deterministic: false for the CPU kernel because its backward sums dweight with ATen, whose CPU reduction
// order follows the thread count.
constexpr const char* kKernels[] = {
    R"json({"name": "kmexample/rms_norm", "layer": "RMSNorm", "devices": ["cpu"],
        "dtypes": ["float32", "bfloat16", "float16", "float64"], "has_backward": true, "compile_safe": false,
        "deterministic": false, "op": "kmexample::rms_norm",
        "description": "example plugin: RMSNorm row by row, fp32 accumulation"})json",
    R"json({"name": "kmexample/rms_norm_npu", "layer": "RMSNorm", "devices": ["npu"],
        "dtypes": ["float32", "bfloat16", "float16"], "has_backward": true, "compile_safe": false,
        "deterministic": false, "op": "kmexample::npu_rms_norm",
        "description": "example plugin: RMSNorm for npu (PrivateUse1)"})json",
};
constexpr const char* kDefaultMapping =
    R"json({"RMSNorm": {"npu": {"inference": "kmexample/rms_norm_npu", "training": "kmexample/rms_norm_npu"}}})json";

void write_message(char* out, size_t capacity, const std::string& text) {
  if (out == nullptr || capacity == 0) return;
  std::snprintf(out, capacity, "%s", text.c_str());
}

// The host must have every field this plugin uses (struct_size: fields are only ever appended).
bool host_is_usable(const kernmap_plugin_host* host, std::string& why) {
  if (host == nullptr) {
    why = "kmexample: the host struct is NULL";
    return false;
  }
  const size_t needed = offsetof(kernmap_plugin_host, free_string) + sizeof(host->free_string);
  if (host->struct_size < needed || host->register_kernel == nullptr ||
      host->register_default_mapping == nullptr || host->free_string == nullptr) {
    why = "kmexample: the host struct has " + std::to_string(host->struct_size) + " bytes, needs " +
          std::to_string(needed) + " with register_kernel, register_default_mapping and free_string set";
    return false;
  }
  return true;
}

// Takes the host's error string (and releases it) into a message.
std::string host_error(const kernmap_plugin_host* host, const char* what, char* error) {
  std::string text = std::string("kmexample: ") + what + ": " + (error != nullptr ? error : "(no message)");
  host->free_string(error);
  return text;
}

}  // namespace

KERNMAP_PLUGIN_EXPORT uint32_t kernmap_plugin_abi_version(void) {
  return KERNMAP_PLUGIN_ABI_VERSION;
}

// Suitable when the host runs the torch major.minor this plugin was compiled against: the ops' C++ types are
// torch's, whose ABI is not stable across minor versions.
KERNMAP_PLUGIN_EXPORT int kernmap_plugin_score(const kernmap_plugin_host* host, char* reason,
                                               size_t capacity) {
  const std::string built = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
  const std::string running = host != nullptr && host->torch_version != nullptr ? host->torch_version : "";
  if (running != built && running.rfind(built + ".", 0) != 0) {
    write_message(reason, capacity,
                  "kmexample: built for torch " + built + ", the host runs torch " +
                      (running.empty() ? std::string("(unknown)") : running));
    return 0;
  }
  return 1;
}

KERNMAP_PLUGIN_EXPORT int kernmap_plugin_register(const kernmap_plugin_host* host, char* error,
                                                  size_t capacity) {
  try {
    std::string why;
    if (!host_is_usable(host, why)) {
      write_message(error, capacity, why);
      return 1;
    }
    register_torch_ops();
    for (const char* descriptor : kKernels) {
      char* host_message = nullptr;
      if (host->register_kernel(descriptor, /*supports=*/nullptr, /*user_data=*/nullptr, &host_message) !=
          0) {
        write_message(error, capacity, host_error(host, "registering a kernel", host_message));
        return 1;
      }
    }
    char* host_message = nullptr;
    if (host->register_default_mapping(kDefaultMapping, &host_message) != 0) {
      write_message(error, capacity, host_error(host, "registering the default mapping", host_message));
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    write_message(error, capacity, std::string("kmexample: ") + e.what());
  } catch (...) {
    write_message(error, capacity, "kmexample: an unknown exception");
  }
  return 1;
}
