// Kernel layers: torch::nn modules whose forward runs a kernel chosen by the registry, and kernelize(), which
// walks a module tree and binds each layer to the kernel that resolution picks (DESIGN §2).
//
// A layer starts bound to its reference kernel (the transformers eager math). kernelize() resolves once per
// layer (not per step) and binds the layer to the kernel's torch op, looked up in the dispatcher, so built-in
// and plugin kernels run the same way. Binding copies no weights: a kernel reads the module's own parameters.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernmap/export.h"
#include "kernmap/registry.h"

namespace kernmap {

/// A module with a layer name ("RMSNorm", "FusedAddRMSNorm", "rotary_pos_emb", "SiluAndMul", "Experts",
/// "ForCausalLMLoss") and a forward that runs the bound kernel.
class KERNMAP_API KernelLayer : public torch::nn::Module {
 public:
  ~KernelLayer() override;
  /// The registry layer this module implements.
  const std::string& layer_name() const { return layer_name_; }
  /// The kernel the forward runs now (the layer's reference until kernelize binds another).
  const KernelDescriptor& kernel() const { return *kernel_; }
  /// What resolution is told about this layer's inputs: the weights' dtype, and the op's argument shapes with
  /// leading (token) dimensions given as 1.
  virtual KernelInputs kernel_inputs() const = 0;
  /// Binds the forward to kernel's torch op. Throws std::invalid_argument when the kernel is for another
  /// layer, has no torch op, or its op is not registered or has another signature than the layer's.
  void bind(const KernelDescriptor& kernel);

  /// Receives a forward's kernel arguments, in the op's order (tensors, floats, ints, None for an absent
  /// optional tensor), before the kernel runs: how kernelize's verify and tune capture a model's live inputs.
  using Recorder = std::function<void(const std::vector<c10::IValue>& args)>;
  /// While set, every forward hands its kernel's arguments to recorder; an empty function stops it.
  void set_recorder(Recorder recorder) { recorder_ = std::move(recorder); }

 protected:
  explicit KernelLayer(std::string layer_name);
  /// Looks up the torch op of the registered kernel of that name, checks it against the layer's signature and
  /// stores it for forward; leaves the layer unchanged when it throws.
  virtual void bind_op(const std::string& kernel_name) = 0;
  /// The dtype name of a tensor, or of a dtype, as the registry spells it ("float32").
  static std::string dtype_name(const at::Tensor& t);
  static std::string dtype_name(at::ScalarType t);
  /// Whether a recorder is set; the forwards call record only then, so that a step pays for nothing else.
  bool recording() const { return static_cast<bool>(recorder_); }
  void record(const std::vector<c10::IValue>& args) const { recorder_(args); }

 private:
  std::string layer_name_;
  const KernelDescriptor* kernel_ = nullptr;
  Recorder recorder_;
};

/// RMSNorm over the last dimension (transformers' Qwen2RMSNorm): parameter `weight` [H], initialised to ones.
class KERNMAP_API RMSNorm : public KernelLayer {
 public:
  RMSNorm(int64_t hidden_size, double eps, const at::TensorOptions& options = {});
  ~RMSNorm() override;
  at::Tensor forward(const at::Tensor& x);
  KernelInputs kernel_inputs() const override;
  const at::Tensor& weight() const { return weight_; }
  double eps() const { return eps_; }

 private:
  void bind_op(const std::string& kernel_name) override;
  struct Op;
  at::Tensor weight_;
  double eps_;
  std::unique_ptr<Op> op_;
};

/// The residual add in front of a pre-norm fused with the norm (layer "FusedAddRMSNorm"): parameter `weight`
/// [H], initialised to ones, as RMSNorm's. forward(x, residual) -> (rms_norm(x + residual), x + residual):
/// the normed input of the next block and the residual stream's next value.
class KERNMAP_API FusedAddRMSNorm : public KernelLayer {
 public:
  FusedAddRMSNorm(int64_t hidden_size, double eps, const at::TensorOptions& options = {});
  ~FusedAddRMSNorm() override;
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& residual);
  KernelInputs kernel_inputs() const override;
  const at::Tensor& weight() const { return weight_; }
  double eps() const { return eps_; }

 private:
  void bind_op(const std::string& kernel_name) override;
  struct Op;
  at::Tensor weight_;
  double eps_;
  std::unique_ptr<Op> op_;
};

/// The rotary embedding of an attention's queries and keys (layer "rotary_pos_emb", transformers'
/// apply_rotary_pos_emb); no parameters. forward(q [B, heads, S, D], k [B, kv_heads, S, D], cos [B, S, D],
/// sin) -> (q_embed, k_embed), cos and sin unsqueezed at dimension 1 (the heads).
class KERNMAP_API RotaryPosEmb : public KernelLayer {
 public:
  /// dtype: what resolution is told (the attention's weights').
  RotaryPosEmb(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::ScalarType dtype);
  ~RotaryPosEmb() override;
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                             const at::Tensor& sin);
  KernelInputs kernel_inputs() const override;

 private:
  void bind_op(const std::string& kernel_name) override;
  struct Op;
  int64_t heads_, kv_heads_, head_dim_;
  at::ScalarType dtype_;
  std::unique_ptr<Op> op_;
};

/// A linear map y = x W^T (+ b) with parameters `weight` [out, in] and optional `bias` [out], created with
/// the given options (a meta device builds a model without memory). Not a kernel layer.
class KERNMAP_API Linear : public torch::nn::Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias, const at::TensorOptions& options = {});
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  at::Tensor bias;  ///< undefined without bias
};

/// The gated MLP: down_proj(act(gate_proj(x)) * up_proj(x)), the activation being the "SiluAndMul" layer.
/// Submodules gate_proj, up_proj, down_proj (no bias), as in transformers' Qwen2MLP.
class KERNMAP_API GatedMLP : public KernelLayer {
 public:
  GatedMLP(int64_t hidden_size, int64_t intermediate_size, const at::TensorOptions& options = {});
  ~GatedMLP() override;
  at::Tensor forward(const at::Tensor& x);
  KernelInputs kernel_inputs() const override;
  std::shared_ptr<Linear> gate_proj, up_proj, down_proj;

 private:
  void bind_op(const std::string& kernel_name) override;
  struct Op;
  std::unique_ptr<Op> op_;
};

/// A MoE layer's experts in the transformers 5.x layout: parameters gate_up_proj [E, 2I, H] (gate rows first)
/// and down_proj [E, H, I]. forward(hidden [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H].
class KERNMAP_API Experts : public KernelLayer {
 public:
  Experts(int64_t num_experts, int64_t hidden_size, int64_t intermediate_size, int64_t top_k,
          const at::TensorOptions& options = {});
  ~Experts() override;
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights);
  KernelInputs kernel_inputs() const override;
  const at::Tensor& gate_up_proj() const { return gate_up_proj_; }
  const at::Tensor& down_proj() const { return down_proj_; }

 private:
  void bind_op(const std::string& kernel_name) override;
  struct Op;
  at::Tensor gate_up_proj_, down_proj_;
  int64_t top_k_;
  std::unique_ptr<Op> op_;
};

/// transformers' ForCausalLMLoss of a linear LM head, the "ForCausalLMLoss" layer: forward(hidden [N, H],
/// labels [N]) is the cross-entropy of hidden @ weight^T (+ bias) against labels already shifted
/// (ignore_index rows excluded; the mean, or the sum / num_items_in_batch), as kernmap::linear_cross_entropy
/// computes it — the mapped kernel without materializing the [N, V] logits. No parameters of its own: weight
/// and bias are the LM head's (or the tied input embedding), shared with the module that owns them.
class KERNMAP_API CausalLMLoss : public KernelLayer {
 public:
  explicit CausalLMLoss(at::Tensor weight, at::Tensor bias = {});
  ~CausalLMLoss() override;
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& labels,
                     const at::Tensor& num_items_in_batch = {}, int64_t ignore_index = -100);
  KernelInputs kernel_inputs() const override;

 private:
  void bind_op(const std::string& kernel_name) override;
  struct Op;
  at::Tensor weight_, bias_;
  std::unique_ptr<Op> op_;
};

/// One row of a kernelize Report.
struct KERNMAP_API ReportEntry {
  std::string path;       ///< module path, e.g. "model.layers.0.input_layernorm"
  std::string layer;      ///< "RMSNorm"
  std::string kernel;     ///< the kernel bound, e.g. "kernmap/rms_norm"
  bool fallback = false;  ///< true when the reference was bound instead of a mapped kernel
  std::string source;     ///< "scoped", "user", "default", "reference"
  std::string reason;     ///< why this kernel
  /// With kernelize(..., Verify): the kernel's largest difference from the reference on the sample step's
  /// inputs, at the element worst relative to its tolerance, and that tolerance (docs/mapping.md, "Verified
  /// and tuned mappings"); nullopt when not verified (or the kernel raised, or the difference is not finite).
  std::optional<double> error{}, tolerance{};
};

/// What kernelize did, one entry per kernel layer in module order.
struct KERNMAP_API Report {
  std::string device;
  Mode mode = Mode::kInference;
  std::vector<ReportEntry> entries;
  /// An aligned text table: path, layer, kernel, (when any entry was verified) error / tolerance, reason.
  std::string table() const;
  /// {"device": ..., "mode": ..., "layers": [{"path", "layer", "kernel", "fallback", "source", "reason",
  /// "error", "tolerance"}]}, error and tolerance null when not verified.
  std::string json() const;
};

/// Thrown by kernelize(use_fallback=false) when a layer has no usable mapped kernel; nothing is rebound.
class KERNMAP_API KernelizeError : public std::runtime_error {
 public:
  KernelizeError(const std::string& what, Report report)
      : std::runtime_error(what), report(std::move(report)) {}
  Report report;
};

/// Resolves every KernelLayer in module (itself included) for device and mode and binds each to its kernel.
/// device "" means the device of the module's first parameter ("cpu" when it has none, or is on meta). With
/// use_fallback=false, a layer that would fall back to its reference raises KernelizeError carrying the
/// report, before anything is rebound. Calling it again re-resolves (after a mapping change, in another
/// mode).
KERNMAP_API Report kernelize(torch::nn::Module& module, const std::string& device, Mode mode,
                             bool use_fallback = true);

/// The sample step kernelize checks kernels on: step runs one forward of a sample batch on the module (a
/// training step's inputs, labels included) and returns the loss. Only the forward: nothing takes its
/// backward. An empty step verifies nothing.
struct KERNMAP_API Verify {
  std::function<at::Tensor()> step;
};

/// kernelize, then every layer whose kernel resolved is checked on the module's live inputs (docs/mapping.md,
/// "Verified and tuned mappings"): verify.step runs once (gradients on in training) with every kernel layer
/// on its reference kernel, each resolved layer recording its first call's arguments; then the kernel and the
/// reference run on them, forward and, in training, backward under a fixed-seed random upstream gradient, and
/// a kernel whose outputs or gradients differ from the reference's by more than the layer's tolerance (the
/// table python/kernmap/verify_tolerances.json) falls back: its entry says "verify: <output|grad_x> max error
/// X > tolerance Y". Entries carry the measured error; a layer the step never called stays bound, its reason
/// ending "; verify: not called by the sample batch". Parameters, their gradients, the modules' train flags
/// and the CPU random state are left as they were; no optimizer step. With use_fallback=false a verify
/// fallback raises KernelizeError as a resolution fallback does.
KERNMAP_API Report kernelize(torch::nn::Module& module, const std::string& device, Mode mode,
                             bool use_fallback, const Verify& verify);

/// Binds every KernelLayer in module back to its reference kernel and reports it.
KERNMAP_API Report restore_reference(torch::nn::Module& module);

}  // namespace kernmap
