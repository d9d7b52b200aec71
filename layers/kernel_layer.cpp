// KernelLayer and the layer modules: each forward calls the bound kernel's torch op through the dispatcher.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

#include "kernmap/layers.h"
#include "kernmap/memory.h"
#include "layers/verify.h"

namespace kernmap {
namespace {

using Tensor = at::Tensor;

// The op named by kernel.op, checked to take n_args arguments and return n_returns tensors. The typed handle
// the caller makes from it checks the C++ signature against the op's kernels as well.
c10::OperatorHandle find_op(const KernelDescriptor& kernel, const std::string& layer, size_t n_args,
                            size_t n_returns) {
  if (kernel.layer != layer)
    throw std::invalid_argument("cannot bind " + kernel.name + " (a " + kernel.layer + " kernel) to a " +
                                layer + " layer");
  if (kernel.op.empty())
    throw std::invalid_argument(kernel.name + " has no torch op; C++ layers run torch ops only");
  const auto sep = kernel.op.find("::");
  if (sep == std::string::npos)
    throw std::invalid_argument(kernel.name + ": op '" + kernel.op + "' is not of the form namespace::name");
  const auto dot = kernel.op.find('.', sep);
  const std::string name = kernel.op.substr(0, dot);
  const std::string overload = dot == std::string::npos ? "" : kernel.op.substr(dot + 1);
  const std::optional<c10::OperatorHandle> op = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!op) throw std::invalid_argument(kernel.name + ": torch op " + kernel.op + " is not registered");
  const c10::FunctionSchema& schema = op->schema();
  if (schema.arguments().size() != n_args || schema.returns().size() != n_returns)
    throw std::invalid_argument(kernel.name + ": torch op " + kernel.op + " has the schema " +
                                c10::toString(schema) + "; a " + layer + " kernel takes " +
                                std::to_string(n_args) + " arguments and returns " +
                                std::to_string(n_returns) + (n_returns == 1 ? " tensor" : " tensors"));
  return *op;
}

// How many tensors an op of signature Sig returns: a tuple's size, else one.
template <class R>
struct ReturnCount : std::integral_constant<size_t, 1> {};
template <class... T>
struct ReturnCount<std::tuple<T...>> : std::integral_constant<size_t, sizeof...(T)> {};

template <class Sig>
c10::TypedOperatorHandle<Sig> typed_op(const std::string& op_name, const std::string& layer) {
  using Traits = c10::guts::infer_function_traits_t<Sig>;
  const KernelDescriptor* kernel = find_kernel(op_name);
  try {
    return find_op(*kernel, layer, Traits::number_of_parameters,
                   ReturnCount<typename Traits::return_type>::value)
        .template typed<Sig>();
  } catch (const c10::Error& e) {
    throw std::invalid_argument(kernel->name + ": torch op " + kernel->op +
                                " does not have the signature of a " + layer +
                                " kernel: " + e.what_without_backtrace());
  }
}

}  // namespace

// ---- KernelLayer ----

KernelLayer::KernelLayer(std::string layer_name) : layer_name_(std::move(layer_name)) {
  kernel_ = reference_kernel(layer_name_);
  if (kernel_ == nullptr)
    throw std::invalid_argument("KernelLayer: no reference kernel for layer " + layer_name_);
}

KernelLayer::~KernelLayer() = default;

void KernelLayer::bind(const KernelDescriptor& kernel) {
  // The op is looked up by kernel name so that bind_op sees the registered descriptor, not a copy.
  const KernelDescriptor* registered = find_kernel(kernel.name);
  if (registered == nullptr) throw std::invalid_argument("cannot bind " + kernel.name + ": not registered");
  bind_op(registered->name);
  kernel_ = registered;
}

std::string KernelLayer::dtype_name(const at::Tensor& t) {
  return dtype_name(t.scalar_type());
}

std::string KernelLayer::dtype_name(at::ScalarType t) {
  return verify::dtype_name(t);
}

// ---- RMSNorm ----

struct RMSNorm::Op {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> handle;
};

RMSNorm::RMSNorm(int64_t hidden_size, double eps, const at::TensorOptions& options)
    : KernelLayer("RMSNorm"), eps_(eps) {
  weight_ = register_parameter("weight", at::ones({hidden_size}, options));
  bind_op(kernel().name);
}

RMSNorm::~RMSNorm() = default;

void RMSNorm::bind_op(const std::string& kernel_name) {
  op_ = std::make_unique<Op>(
      Op{typed_op<Tensor(const Tensor&, const Tensor&, double)>(kernel_name, layer_name())});
}

Tensor RMSNorm::forward(const Tensor& x) {
  if (recording()) record({x, weight_, eps_});
  return op_->handle.call(x, weight_, eps_);
}

KernelInputs RMSNorm::kernel_inputs() const {
  return {dtype_name(weight_), {{weight_.size(0)}, {weight_.size(0)}}};
}

// ---- FusedAddRMSNorm ----

using TensorPair = std::tuple<Tensor, Tensor>;

struct FusedAddRMSNorm::Op {
  c10::TypedOperatorHandle<TensorPair(const Tensor&, const Tensor&, const Tensor&, double)> handle;
};

FusedAddRMSNorm::FusedAddRMSNorm(int64_t hidden_size, double eps, const at::TensorOptions& options)
    : KernelLayer("FusedAddRMSNorm"), eps_(eps) {
  weight_ = register_parameter("weight", at::ones({hidden_size}, options));
  bind_op(kernel().name);
}

FusedAddRMSNorm::~FusedAddRMSNorm() = default;

void FusedAddRMSNorm::bind_op(const std::string& kernel_name) {
  op_ = std::make_unique<Op>(Op{
      typed_op<TensorPair(const Tensor&, const Tensor&, const Tensor&, double)>(kernel_name, layer_name())});
}

TensorPair FusedAddRMSNorm::forward(const Tensor& x, const Tensor& residual) {
  if (recording()) record({x, residual, weight_, eps_});
  return op_->handle.call(x, residual, weight_, eps_);
}

KernelInputs FusedAddRMSNorm::kernel_inputs() const {
  const int64_t H = weight_.size(0);
  return {dtype_name(weight_), {{1, H}, {1, H}, {H}}};
}

// ---- RotaryPosEmb ----

using RotarySig = TensorPair(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t);

struct RotaryPosEmb::Op {
  c10::TypedOperatorHandle<RotarySig> handle;
};

RotaryPosEmb::RotaryPosEmb(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::ScalarType dtype)
    : KernelLayer("rotary_pos_emb"),
      heads_(num_heads),
      kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      dtype_(dtype) {
  bind_op(kernel().name);
}

RotaryPosEmb::~RotaryPosEmb() = default;

void RotaryPosEmb::bind_op(const std::string& kernel_name) {
  op_ = std::make_unique<Op>(Op{typed_op<RotarySig>(kernel_name, layer_name())});
}

TensorPair RotaryPosEmb::forward(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
  if (recording()) record({q, k, cos, sin, int64_t{1}});
  return op_->handle.call(q, k, cos, sin, /*unsqueeze_dim=*/1);
}

KernelInputs RotaryPosEmb::kernel_inputs() const {
  return {dtype_name(dtype_),
          {{1, heads_, 1, head_dim_}, {1, kv_heads_, 1, head_dim_}, {1, 1, head_dim_}, {1, 1, head_dim_}}};
}

// ---- Linear ----

Linear::Linear(int64_t in_features, int64_t out_features, bool with_bias, const at::TensorOptions& options) {
  weight = register_parameter("weight", at::zeros({out_features, in_features}, options));
  if (with_bias) bias = register_parameter("bias", at::zeros({out_features}, options));
}

Tensor Linear::forward(const Tensor& x) {
  return at::linear(x, weight, bias);
}

// ---- GatedMLP ----

struct GatedMLP::Op {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&)> handle;
};

GatedMLP::GatedMLP(int64_t hidden_size, int64_t intermediate_size, const at::TensorOptions& options)
    : KernelLayer("SiluAndMul") {
  gate_proj =
      register_module("gate_proj", std::make_shared<Linear>(hidden_size, intermediate_size, false, options));
  up_proj =
      register_module("up_proj", std::make_shared<Linear>(hidden_size, intermediate_size, false, options));
  down_proj =
      register_module("down_proj", std::make_shared<Linear>(intermediate_size, hidden_size, false, options));
  bind_op(kernel().name);
}

GatedMLP::~GatedMLP() = default;

void GatedMLP::bind_op(const std::string& kernel_name) {
  op_ = std::make_unique<Op>(Op{typed_op<Tensor(const Tensor&, const Tensor&)>(kernel_name, layer_name())});
}

Tensor GatedMLP::forward(const Tensor& x) {
  const Tensor gate = gate_proj->forward(x), up = up_proj->forward(x);
  if (recording()) record({gate, up});
  return down_proj->forward(op_->handle.call(gate, up));
}

KernelInputs GatedMLP::kernel_inputs() const {
  const int64_t inter = gate_proj->weight.size(0);
  return {dtype_name(gate_proj->weight), {{1, inter}, {1, inter}}};
}

// ---- Experts ----

struct Experts::Op {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)>
      handle;
};

Experts::Experts(int64_t num_experts, int64_t hidden_size, int64_t intermediate_size, int64_t top_k,
                 const at::TensorOptions& options)
    : KernelLayer("Experts"), top_k_(top_k) {
  gate_up_proj_ = register_parameter("gate_up_proj",
                                     at::zeros({num_experts, 2 * intermediate_size, hidden_size}, options));
  down_proj_ =
      register_parameter("down_proj", at::zeros({num_experts, hidden_size, intermediate_size}, options));
  bind_op(kernel().name);
}

Experts::~Experts() = default;

void Experts::bind_op(const std::string& kernel_name) {
  op_ = std::make_unique<Op>(
      Op{typed_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)>(
          kernel_name, layer_name())});
  // A mapped kernel streams the expert weights once per pass: 2 MiB pages spare it a TLB miss every few rows
  // (a no-op below 16 MiB, off with KERNMAP_HUGE_PAGES=0; see kernmap/memory.h).
  if (kernel_name.rfind("reference/", 0) != 0)
    for (const Tensor& w : {gate_up_proj_, down_proj_}) (void)advise_huge_pages(w);
}

Tensor Experts::forward(const Tensor& hidden, const Tensor& topk_ids, const Tensor& topk_weights) {
  if (recording()) record({hidden, topk_ids, topk_weights, gate_up_proj_, down_proj_});
  return op_->handle.call(hidden, topk_ids, topk_weights, gate_up_proj_, down_proj_);
}

KernelInputs Experts::kernel_inputs() const {
  const int64_t E = gate_up_proj_.size(0), I2 = gate_up_proj_.size(1), H = gate_up_proj_.size(2);
  return {dtype_name(gate_up_proj_), {{1, H}, {1, top_k_}, {1, top_k_}, {E, I2, H}, {E, H, I2 / 2}}};
}

// ---- CausalLMLoss ----

struct CausalLMLoss::Op {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                  int64_t, const std::optional<Tensor>&)>
      handle;
};

CausalLMLoss::CausalLMLoss(Tensor weight, Tensor bias)
    : KernelLayer("ForCausalLMLoss"), weight_(std::move(weight)), bias_(std::move(bias)) {
  bind_op(kernel().name);
}

CausalLMLoss::~CausalLMLoss() = default;

void CausalLMLoss::bind_op(const std::string& kernel_name) {
  op_ = std::make_unique<Op>(
      Op{typed_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t,
                         const std::optional<Tensor>&)>(kernel_name, layer_name())});
}

Tensor CausalLMLoss::forward(const Tensor& hidden, const Tensor& labels, const Tensor& num_items_in_batch,
                             int64_t ignore_index) {
  auto opt = [](const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; };
  if (recording()) record({hidden, weight_, labels, opt(bias_), ignore_index, opt(num_items_in_batch)});
  return op_->handle.call(hidden, weight_, labels, opt(bias_), ignore_index, opt(num_items_in_batch));
}

KernelInputs CausalLMLoss::kernel_inputs() const {
  const int64_t V = weight_.size(0), H = weight_.size(1);
  return {dtype_name(weight_), {{1, H}, {V, H}, {1}}};
}

}  // namespace kernmap
