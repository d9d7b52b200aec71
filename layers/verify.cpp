// kernelize's verify and tune's check: capture a sample step's kernel arguments, run a kernel and the
// reference on them, compare (layers/verify.h).
#include "layers/verify.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "layers/verify_tolerances.h"

namespace kernmap::verify {
namespace {

using Tensor = at::Tensor;

constexpr uint64_t kSeed = 0;  // of the upstream gradients, as Python's _verify.SEED

const nlohmann::json& table() {
  static const nlohmann::json parsed = nlohmann::json::parse(kTolerancesJson);
  return parsed;
}

std::string shape_text(at::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

// What Python calls the exception a kernel raised: a torch op's c10::Error reaches Python as RuntimeError (or
// the Python error its subclass maps to), so one failure reads alike from both languages.
std::string error_type(const std::exception& e) {
  if (dynamic_cast<const c10::ValueError*>(&e)) return "ValueError";
  if (dynamic_cast<const c10::TypeError*>(&e)) return "TypeError";
  if (dynamic_cast<const c10::IndexError*>(&e)) return "IndexError";
  if (dynamic_cast<const c10::NotImplementedError*>(&e)) return "NotImplementedError";
  if (dynamic_cast<const std::invalid_argument*>(&e)) return "ValueError";
  return "RuntimeError";
}

std::string message(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

// The argument names of the layer's reference op, to name a gradient ("grad_weight").
std::vector<std::string> argument_names(const std::string& layer) {
  std::vector<std::string> names;
  const KernelDescriptor* reference = reference_kernel(layer);
  if (reference == nullptr) return names;
  try {
    for (const c10::Argument& a : op_of(*reference).schema().arguments()) names.push_back(a.name());
  } catch (const std::invalid_argument&) {
    // A reference without an op names its gradients by position.
  }
  return names;
}

// (|got - want|, atol + rtol * |want|) at the element where the first is largest relative to the second;
// equal non-finite values agree, any other non-finite difference is an infinite error (Python's compare).
std::pair<double, double> compare(const Tensor& got, const Tensor& want, double rtol, double atol) {
  if (got.numel() == 0) return {0.0, atol};
  const at::ScalarType dtype =
      got.scalar_type() == at::kDouble || want.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const Tensor g = got.detach().reshape(-1).to(dtype), w = want.detach().reshape(-1).to(dtype);
  Tensor ratio = (g - w).abs_().div_(w.abs().mul_(rtol).add_(atol));
  if (!std::isfinite(ratio.max().item<double>())) {  // max propagates NaN: some value is not finite
    const Tensor same = g.eq(w).logical_or_(g.isnan().logical_and_(w.isnan()));
    const double inf = std::numeric_limits<double>::infinity();
    ratio = ratio.nan_to_num_(inf, inf).masked_fill_(same, 0.0);
  }
  const int64_t worst = ratio.argmax().item<int64_t>();
  const double gw = g[worst].item<double>(), ww = w[worst].item<double>();
  if (gw == ww || (std::isnan(gw) && std::isnan(ww)))
    return {0.0, std::isfinite(ww) ? atol + rtol * std::abs(ww) : atol};
  const double diff = std::abs(gw - ww);
  return {std::isfinite(diff) ? diff : std::numeric_limits<double>::infinity(),
          atol + rtol * (std::isfinite(ww) ? std::abs(ww) : 0.0)};
}

Results results_of(const Call& call, const Prepared& p, const std::vector<Tensor>& outs, bool training) {
  Results results;
  for (size_t i = 0; i < outs.size(); ++i)
    results.emplace_back(outs.size() == 1 ? "output" : "output[" + std::to_string(i) + "]", outs[i].detach());
  std::vector<Tensor> differentiable;
  for (const Tensor& o : outs)
    if (o.requires_grad()) differentiable.push_back(o);
  if (!training || p.leaves.empty() || differentiable.empty()) return results;
  const std::vector<Tensor> grads = torch::autograd::grad(differentiable, p.leaves, upstream(differentiable),
                                                          /*retain_graph=*/false, /*create_graph=*/false,
                                                          /*allow_unused=*/true);
  const std::vector<std::string> names = argument_names(call.layer);
  for (size_t j = 0; j < p.leaves.size(); ++j) {
    const size_t i = p.positions[j];
    const std::string name = i < names.size() ? "grad_" + names[i] : "grad_arg" + std::to_string(i);
    results.emplace_back(name, grads[j].defined() ? grads[j] : at::zeros_like(p.leaves[j]));
  }
  return results;
}

}  // namespace

std::vector<std::vector<int64_t>> Call::shapes() const {
  std::vector<std::vector<int64_t>> out;
  for (const c10::IValue& a : args)
    if (a.isTensor()) out.push_back(a.toTensor().sizes().vec());
  return out;
}

at::ScalarType Call::dtype() const {
  for (const c10::IValue& a : args)
    if (a.isTensor() && a.toTensor().is_floating_point()) return a.toTensor().scalar_type();
  throw std::invalid_argument("verify: a " + layer + " call has no floating-point tensor argument");
}

std::string Check::reason() const {
  if (failure) return "verify: " + *failure;
  char text[160];
  std::snprintf(text, sizeof text, " max error %.3g > tolerance %.3g", error, tolerance);
  return "verify: " + what + text;
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    case at::kDouble:
      return "float64";
    default:
      return c10::toString(t);
  }
}

std::pair<double, double> tolerance(at::ScalarType dtype, int64_t terms) {
  const std::string name = dtype_name(dtype);
  const nlohmann::json& elementwise = table().at("elementwise");
  if (!elementwise.contains(name))
    throw std::invalid_argument("verify: no tolerance for dtype " + name +
                                " (verify_tolerances.json has float64, float32, bfloat16, float16)");
  const double exponent = table().at("sum").at("atol_exponent").get<double>();
  return {elementwise[name].at("rtol").get<double>(),
          elementwise[name].at("atol").get<double>() *
              std::pow(static_cast<double>(std::max<int64_t>(terms, 1)), exponent)};
}

int64_t terms(const Call& call) {
  auto tensor = [&](size_t i) { return call.args.at(i).toTensor(); };
  if (call.layer == "RMSNorm" || call.layer == "FusedAddRMSNorm") {  // rsqrt of a mean over H; dW over rows
    const Tensor x = tensor(0);
    if (x.dim() == 0) return 1;
    const int64_t h = x.size(-1);
    return std::max(h, x.numel() / std::max<int64_t>(h, 1));
  }
  if (call.layer == "Experts")  // down over I, gate_up's gradient over H, the weights' gradients over tokens
    return std::max({tensor(0).size(-1), tensor(3).size(-2), tensor(0).size(0)});
  if (call.layer == "ForCausalLMLoss")  // logits over H, hidden's gradient over V, weight's over rows
    return std::max({tensor(0).size(-1), tensor(1).size(0), tensor(0).size(0)});
  if (call.layer == "rotary_pos_emb" && (call.needs_grad.at(2) || call.needs_grad.at(3)))
    return std::max<int64_t>(tensor(0).numel() / std::max<int64_t>(tensor(2).numel(), 1), 1);
  return 1;  // elementwise
}

c10::OperatorHandle op_of(const KernelDescriptor& kernel) {
  if (kernel.op.empty()) throw std::invalid_argument(kernel.name + " has no torch op");
  const auto sep = kernel.op.find("::");
  const auto dot = sep == std::string::npos ? std::string::npos : kernel.op.find('.', sep);
  const std::optional<c10::OperatorHandle> op = c10::Dispatcher::singleton().findSchema(
      {kernel.op.substr(0, dot), dot == std::string::npos ? "" : kernel.op.substr(dot + 1)});
  if (!op) throw std::invalid_argument(kernel.name + ": torch op " + kernel.op + " is not registered");
  return *op;
}

std::map<const KernelLayer*, Call> capture(torch::nn::Module& module, const std::vector<KernelLayer*>& all,
                                           const std::vector<KernelLayer*>& recorded, const Verify& verify,
                                           bool training) {
  std::map<const KernelLayer*, Call> calls;
  std::vector<const KernelDescriptor*> bound;
  for (KernelLayer* layer : all) bound.push_back(&layer->kernel());
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, bool>> flags;
  for (const auto& m : module.modules(/*include_self=*/false)) flags.emplace_back(m, m->is_training());
  const bool root_flag = module.is_training();
  std::vector<std::pair<Tensor, Tensor>> grads;  // parameter, its gradient (undefined: none)
  for (const Tensor& p : module.parameters()) grads.emplace_back(p, p.grad());
  at::CPUGeneratorImpl* generator =
      at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
  c10::intrusive_ptr<c10::TensorImpl> rng_state;
  {
    std::lock_guard<std::mutex> lock(generator->mutex_);
    rng_state = generator->get_state();
  }
  auto restore = [&] {
    for (size_t i = 0; i < all.size(); ++i) {
      all[i]->set_recorder({});
      all[i]->bind(*bound[i]);
    }
    module.train(root_flag);
    for (const auto& [m, flag] : flags) m->train(flag);  // pre-order: a child's own flag is set last
    for (auto& [p, g] : grads) p.mutable_grad() = g;
    std::lock_guard<std::mutex> lock(generator->mutex_);
    generator->set_state(*rng_state);
  };
  try {
    for (KernelLayer* layer : all) layer->bind(*reference_kernel(layer->layer_name()));
    for (KernelLayer* layer : recorded)
      layer->set_recorder([&calls, layer](const std::vector<c10::IValue>& args) {
        if (calls.count(layer)) return;  // the first call is the one checked; later calls only compute
        // Detached views, not copies (a weight is not copied): nothing writes the step's tensors once they
        // are made.
        Call call{layer->layer_name(), {}, {}, std::nullopt};
        for (const c10::IValue& a : args) {
          const bool tensor = a.isTensor();
          call.needs_grad.push_back(tensor && a.toTensor().requires_grad());
          call.args.push_back(tensor ? c10::IValue(a.toTensor().detach()) : a);
        }
        calls.emplace(layer, std::move(call));
      });
    if (training) module.train(true);
    const at::AutoGradMode grad_mode(training);
    (void)verify.step();
  } catch (...) {
    restore();
    throw;
  }
  restore();
  return calls;
}

Prepared prepare(const Call& call, bool training) {
  Prepared p;
  for (size_t i = 0; i < call.args.size(); ++i) {
    const c10::IValue& a = call.args[i];
    if (!a.isTensor()) {
      p.args.push_back(a);
      continue;
    }
    const bool leaf = training && call.needs_grad[i];
    Tensor t = a.toTensor().detach().requires_grad_(leaf);
    if (leaf) {
      p.positions.push_back(i);
      p.leaves.push_back(t);
    }
    p.args.emplace_back(std::move(t));
  }
  return p;
}

std::vector<Tensor> upstream(const std::vector<Tensor>& outputs) {
  std::vector<Tensor> out;
  for (size_t i = 0; i < outputs.size(); ++i) {
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(kSeed + i);
    const Tensor g = at::randn(outputs[i].sizes(), generator, at::TensorOptions().dtype(at::kFloat));
    out.push_back(g.to(outputs[i].device(), outputs[i].scalar_type()));
  }
  return out;
}

std::vector<Tensor> outputs_of(const std::vector<c10::IValue>& stack) {
  std::vector<Tensor> out;
  for (const c10::IValue& v : stack) {
    if (v.isTensor()) out.push_back(v.toTensor());
    if (v.isTuple())
      for (const c10::IValue& e : v.toTupleRef().elements())
        if (e.isTensor()) out.push_back(e.toTensor());
  }
  return out;
}

Results run(const c10::OperatorHandle& op, const Call& call, bool training) {
  Prepared p = prepare(call, training);
  const at::AutoGradMode grad_mode(training);
  std::vector<c10::IValue> stack = p.args;
  op.callBoxed(stack);
  return results_of(call, p, outputs_of(stack), training);
}

Check check(const c10::OperatorHandle& kernel, const Call& call, bool training) {
  const double inf = std::numeric_limits<double>::infinity();
  if (!call.reference) {
    try {
      call.reference = run(op_of(*reference_kernel(call.layer)), call, training);
    } catch (const std::exception& e) {
      return {inf, 0.0, "output", "the reference kernel raised " + error_type(e) + ": " + message(e)};
    }
  }
  Results got;
  try {
    got = run(kernel, call, training);
  } catch (const std::exception& e) {
    return {inf, 0.0, "output", "the kernel raised " + error_type(e) + ": " + message(e)};
  }
  const auto [rtol, atol] = tolerance(call.dtype(), terms(call));
  Check worst{0.0, atol, "output", std::nullopt};
  for (const auto& [name, want] : *call.reference) {
    const Tensor* g = nullptr;
    for (const auto& [n, t] : got)
      if (n == name) g = &t;
    if (g == nullptr || !g->sizes().equals(want.sizes()))
      return {inf, 0.0, name,
              name + " has shape " + (g == nullptr ? "missing" : shape_text(g->sizes())) +
                  ", the reference's " + shape_text(want.sizes())};
    const auto [error, allowed] = compare(*g, want, rtol, atol);
    if (error / allowed > worst.error / worst.tolerance) worst = {error, allowed, name, std::nullopt};
  }
  return worst;
}

}  // namespace kernmap::verify
