// Decoder-only language models on kernel layers: Qwen2, Qwen2-MoE and Qwen3-MoE with the transformers eager
// math, built from a Hugging Face config.json and read from / written to safetensors under the Hugging Face
// tensor names (a checkpoint saved by transformers loads here, one saved here loads in transformers).
//
// Module paths equal the transformers ones ("model.layers.0.self_attn.q_proj", "lm_head"), so
// named_parameters() gives the checkpoint's tensor names and kernelize() reports transformers' module paths.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernmap/export.h"
#include "kernmap/layers.h"
#include "kernmap/safetensors.h"

namespace kernmap {

/// A config.json that cannot be used: the message names the key and the problem.
class KERNMAP_API ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The subset of a transformers config that the three model families use.
struct KERNMAP_API ModelConfig {
  std::string model_type;  ///< "qwen2", "qwen2_moe" or "qwen3_moe"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  ///< dense MLP width
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  ///< config "head_dim", else hidden_size / num_attention_heads
  int64_t max_position_embeddings = 32768;
  int64_t pad_token_id = -1;  ///< -1: none (the embedding then has no padding row)
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  double initializer_range = 0.02;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  ///< q/k/v projections have a bias (Qwen2: always; Qwen2-MoE: qkv_bias; Qwen3-MoE:
                          ///< attention_bias)
  bool o_bias = false;    ///< o_proj has a bias (Qwen3-MoE attention_bias)
  bool qk_norm = false;   ///< RMSNorm on each head of q and k (Qwen3-MoE)
  // Mixture of experts (num_experts == 0: dense model).
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;  ///< 0: no shared expert (Qwen3-MoE)
  int64_t decoder_sparse_step = 1;
  bool norm_topk_prob = false;
  std::vector<int64_t> mlp_only_layers;
  std::string dtype = "float32";  ///< the checkpoint's dtype as config.json names it

  /// Whether decoder layer i has a sparse MoE block (transformers' rule: not in mlp_only_layers, experts
  /// exist, and (i + 1) % decoder_sparse_step == 0).
  bool is_moe_layer(int64_t i) const;
  /// Parses a transformers config.json. Throws ConfigError for a model_type other than the three, a missing
  /// or ill-typed key, inconsistent sizes, or a feature these models do not implement (sliding-window
  /// attention, a rope_type other than "default", an activation other than silu).
  static ModelConfig from_json(const std::string& text);
  /// from_json on DIR/config.json.
  static ModelConfig from_dir(const std::string& dir);
  /// The parameters of a model of this config: every weight, bias and norm, tied embeddings once. A double:
  /// each size of a config.json is capped, their products are not, and a config can describe more than 2^64.
  double parameter_count() const;
  /// Throws ConfigError, saying how many bytes the parameters would take and the cap, when parameter_count()
  /// parameters of bytes_per_parameter bytes each exceed this machine's physical memory: such a model cannot
  /// be built, and allocating it would fail deep inside the allocator (or, with overcommit, in the OOM
  /// killer).
  void check_fits_in_memory(size_t bytes_per_parameter) const;
  /// A config.json that transformers loads (model_type, architectures and every field above).
  std::string to_json() const;
};

class DecoderModel;

/// The routers' expert choices of one run, recorded call by call, for other runs of the same model on the
/// same batches to replay: each router of a replaying model takes the recorded top-k experts for its tokens
/// (their weights from its own probabilities) instead of its own top-k, so a rounding difference that tips a
/// near-tie of a router cannot send a token to another expert and part the runs by a discrete step. `kernmap
/// align` replays the original run's routing in its other runs (docs/training.md, "Routing"). Where a
/// replaying router's own top-k differs from the recorded one (as sets of experts: a flip), it counts the
/// token and the flip's margin: (p_k - p_min) / p_k, p_k its own k-th largest probability and p_min its
/// probability of the least likely recorded expert (0 for a tie). It holds 2 bytes per token, expert slot and
/// router call (k x MoE layers x tokens a step). Not thread-safe: one model's forward at a time.
class KERNMAP_API RoutingTape {
 public:
  /// The flips counted over a span of router calls (take_flips).
  struct Flips {
    int64_t calls = 0;      ///< router calls
    int64_t tokens = 0;     ///< tokens routed
    int64_t flipped = 0;    ///< tokens whose own top-k experts differ from the recorded ones
    double max_margin = 0;  ///< the largest margin among them (0 when none flipped)
    /// Adds another span's counts (the larger margin).
    void add(const Flips& other) {
      calls += other.calls;
      tokens += other.tokens;
      flipped += other.flipped;
      if (other.max_margin > max_margin) max_margin = other.max_margin;
    }
  };
  /// Clears the tape and records from now on.
  void record();
  /// Replays from the first recorded call; throws std::logic_error when nothing was recorded.
  void replay();
  bool replaying() const { return replaying_; }
  /// Router calls recorded.
  int64_t size() const { return static_cast<int64_t>(calls_.size()); }
  /// The flips since the last take_flips (or replay()), and starts a new span.
  Flips take_flips();
  /// Called by a router with its probabilities [T, E] (fp32) and its own top-k experts [T, k] (int64):
  /// recording, stores the experts and returns them; replaying, returns the next recorded call's experts (the
  /// router's own when they are equal) and counts its flips. Throws std::runtime_error naming the call when a
  /// replay runs past the recording or a call's [T, k] differs from the recorded one's.
  at::Tensor route(const at::Tensor& probs, const at::Tensor& ids);

 private:
  std::vector<at::Tensor> calls_;  // [T, k] int16 (int32 past 32768 experts), in call order
  size_t next_ = 0;
  bool replaying_ = false;
  Flips flips_;
};

/// Without labels: the logits [B, S, V]. With labels: the loss (mean next-token cross-entropy in fp32, labels
/// -100 ignored), computed by the model's ForCausalLMLoss layer, and no logits (undefined): the fused kernel
/// never materializes them (forward(input_ids) gives them).
struct KERNMAP_API CausalLMOutput {
  at::Tensor logits;
  at::Tensor loss;
};

/// A causal language model: submodules "model" (embed_tokens, layers.N, norm), "lm_head" (absent when the
/// embeddings are tied) and "loss_function" (the ForCausalLMLoss kernel layer on the LM head's weight, no
/// parameters of its own). Parameters are created with the given options; a meta device builds the structure
/// without memory (enough for kernelize and `kernmap plan`). On any other device the constructor first calls
/// config.check_fits_in_memory for the options' dtype.
class KERNMAP_API CausalLM : public torch::nn::Module {
 public:
  CausalLM(ModelConfig config, const at::TensorOptions& options);
  ~CausalLM() override;
  const ModelConfig& config() const { return config_; }
  /// input_ids [B, S] int64; labels [B, S] int64 or undefined (see CausalLMOutput). Causal attention over all
  /// positions (no padding mask), positions 0..S-1.
  CausalLMOutput forward(const at::Tensor& input_ids, const at::Tensor& labels = {});
  /// transformers' initialisation from a seed: normal(0, initializer_range) for matrices and embeddings, zero
  /// biases, ones for norms.
  void init_weights(uint64_t seed);
  /// Reads the weights from a Hugging Face checkpoint folder (model.safetensors, or the shards listed in
  /// model.safetensors.index.json), converting to the parameters' dtype. Every tensor's header entry is
  /// validated against the file and its shape against this config. Throws CheckpointError.
  void load_weights(const std::string& dir);
  /// Writes config.json and the weights under their transformers names: one model.safetensors, or with
  /// max_shard_bytes > 0 shards model-0000i-of-0000N.safetensors and model.safetensors.index.json.
  void save_pretrained(const std::string& dir, uint64_t max_shard_bytes = 0) const;
  /// Gives every router of the model the tape (nullptr: each routes by its own top-k, as by default).
  void set_routing_tape(std::shared_ptr<RoutingTape> tape);
  /// Whether the model has routers (top-k experts).
  bool routes_tokens() const;

 private:
  ModelConfig config_;
  std::shared_ptr<DecoderModel> model_;
  std::shared_ptr<Linear> lm_head_;
  std::shared_ptr<CausalLMLoss> loss_;
  /// lm_head's weight, or the input embedding's when they are tied.
  const at::Tensor& lm_head_weight() const;
};

/// Qwen2: q/k/v with bias, dense gated MLPs.
class KERNMAP_API Qwen2ForCausalLM : public CausalLM {
 public:
  Qwen2ForCausalLM(ModelConfig config, const at::TensorOptions& options = {});
};
/// Qwen2-MoE: sparse blocks with top-k routed experts plus a shared expert scaled by
/// sigmoid(shared_expert_gate).
class KERNMAP_API Qwen2MoeForCausalLM : public CausalLM {
 public:
  Qwen2MoeForCausalLM(ModelConfig config, const at::TensorOptions& options = {});
};
/// Qwen3-MoE: RMSNorm on q and k heads, sparse blocks without a shared expert.
class KERNMAP_API Qwen3MoeForCausalLM : public CausalLM {
 public:
  Qwen3MoeForCausalLM(ModelConfig config, const at::TensorOptions& options = {});
};

/// The model class of config.model_type, with zero weights.
KERNMAP_API std::shared_ptr<CausalLM> make_model(const ModelConfig& config,
                                                 const at::TensorOptions& options = {});
/// config.json + weights of a Hugging Face checkpoint folder.
KERNMAP_API std::shared_ptr<CausalLM> from_pretrained(const std::string& dir,
                                                      const at::TensorOptions& options = {});

/// Built-in tiny configurations: "qwen2-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny".
KERNMAP_API std::vector<std::string> preset_names();
/// The config of a preset; throws std::invalid_argument naming the presets for an unknown name.
KERNMAP_API ModelConfig preset_config(const std::string& name);
/// A preset model with random weights from a fixed seed (no weights are drawn on a meta device).
KERNMAP_API std::shared_ptr<CausalLM> make_preset(const std::string& name,
                                                  const at::TensorOptions& options = {});

}  // namespace kernmap
