// Checking a kernel on the model it is about to change (kernelize(..., Verify), tune): one forward of a
// sample step with the kernel layers recording their kernels' arguments (and computing with their reference
// kernels), then a kernel and the reference on those arguments, forward and backward under one fixed random
// upstream gradient, compared element by element against the layer's tolerance. The C++ twin of
// python/kernmap/_verify.py: the same tolerance table (verify_tolerances.json, compiled in), the same "terms"
// per layer, the same upstream gradients (seed 0, float32 normal, then the output's dtype) and the same
// reasons (docs/mapping.md, "Verified and tuned mappings").
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernmap/layers.h"

namespace kernmap::verify {

/// A kernel's outputs and gradients by name: "output" (or "output[i]"), then "grad_<argument>" in argument
/// order.
using Results = std::vector<std::pair<std::string, at::Tensor>>;

/// One captured kernel call: its arguments (tensors detached) and which of them the step differentiated.
struct Call {
  std::string layer;
  std::vector<c10::IValue> args;
  std::vector<bool> needs_grad;
  /// The reference's results on this call, computed once (tune checks many kernels against them).
  mutable std::optional<Results> reference;

  /// The shapes of the tensor arguments, in order.
  std::vector<std::vector<int64_t>> shapes() const;
  /// The dtype of the first floating tensor argument (the model's dtype at this layer).
  at::ScalarType dtype() const;
};

/// A kernel against the reference on one or more calls: the worst element of every output and gradient.
struct Check {
  double error = 0;                    ///< |got - want| at the worst element (relative to its tolerance)
  double tolerance = 0;                ///< atol + rtol * |want| there
  std::string what = "output";         ///< "output", "grad_x", ... (the worst one)
  std::optional<std::string> failure;  ///< the kernel or the reference raised, or a shape differs

  bool passed() const { return !failure && error <= tolerance; }
  /// "verify: <what> max error X > tolerance Y" (or "verify: <failure>"), as Python's Check.reason.
  std::string reason() const;
};

/// Every kernel layer under module, with its path, in module order (the root first, as "").
std::vector<std::pair<std::string, KernelLayer*>> kernel_layers(torch::nn::Module& module);

/// The device type of the module's first parameter; "cpu" when it has none or is on meta.
std::string device_of(const torch::nn::Module& module);

/// The registry's dtype name ("float32"), as the tolerance table keys it.
std::string dtype_name(at::ScalarType t);

/// (rtol, atol) for results computed from inputs of `dtype` that sum `terms` terms.
std::pair<double, double> tolerance(at::ScalarType dtype, int64_t terms);

/// The longest sum any result of the call's layer computes (the tolerance's "sum" rule widens atol by it).
int64_t terms(const Call& call);

/// The torch op a kernel's descriptor names. Throws std::invalid_argument when it has none or it is not
/// registered.
c10::OperatorHandle op_of(const KernelDescriptor& kernel);

/// Runs verify.step once (gradients on in training, the module in train mode then) with every layer of `all`
/// on its reference kernel and each of `recorded` recording its first call. Returns the calls by layer; a
/// layer the step never called has none. The layers' kernels and recorders, the modules' train flags, every
/// parameter's gradient and the CPU random state are as before afterwards.
std::map<const KernelLayer*, Call> capture(torch::nn::Module& module, const std::vector<KernelLayer*>& all,
                                           const std::vector<KernelLayer*>& recorded, const Verify& verify,
                                           bool training);

/// The call's arguments as fresh autograd leaves (requiring grad where the step differentiated them, in
/// training) and those leaves, in argument order with their positions.
struct Prepared {
  std::vector<c10::IValue> args;
  std::vector<size_t> positions;
  std::vector<at::Tensor> leaves;
};
Prepared prepare(const Call& call, bool training);

/// The fixed random upstream gradient of each output: float32 normal from a generator seeded 0 + i for the
/// i-th output, then the output's dtype and device (Python's _verify._upstream).
std::vector<at::Tensor> upstream(const std::vector<at::Tensor>& outputs);

/// The tensors an op returned (a boxed call's stack).
std::vector<at::Tensor> outputs_of(const std::vector<c10::IValue>& stack);

/// The op's outputs and (in training) its gradients with respect to the differentiated arguments.
Results run(const c10::OperatorHandle& op, const Call& call, bool training);

/// The kernel against the layer's reference on the call.
Check check(const c10::OperatorHandle& kernel, const Call& call, bool training);

}  // namespace kernmap::verify
