// Qwen2, Qwen2-MoE and Qwen3-MoE: one decoder with the families' differences read from the config. Each block
// computes exactly what the transformers eager module does, in the same order (see the comments quoting it).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <string>
#include <tuple>

#include "kernmap/models.h"

namespace kernmap {
namespace {

using Tensor = at::Tensor;

// Qwen2RotaryEmbedding (rope_type "default"): inv_freq = 1 / base^(arange(0, D, 2) / D) in fp32; for
// positions p, emb = cat(p * inv_freq, p * inv_freq); cos and sin cast to the hidden states' dtype.
std::pair<Tensor, Tensor> rotary(int64_t seq_len, int64_t head_dim, double theta, const Tensor& like) {
  const auto f32 = like.options().dtype(at::kFloat);
  const Tensor inv_freq =
      at::pow(theta, at::arange(0, head_dim, 2, f32) / static_cast<double>(head_dim)).reciprocal();
  const Tensor positions = at::arange(seq_len, like.options().dtype(at::kLong)).unsqueeze(0).to(at::kFloat);
  const Tensor freqs = positions.unsqueeze(-1) * inv_freq;  // [1, S, D/2]
  const Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(like.scalar_type()), emb.sin().to(like.scalar_type())};
}

// Modules that hold their children under numeric names ("0", "1", ...), like torch.nn.ModuleList.
template <class M>
class Stack : public torch::nn::Module {
 public:
  void push(std::shared_ptr<M> m) {
    items.push_back(register_module(std::to_string(items.size()), std::move(m)));
  }
  std::vector<std::shared_ptr<M>> items;
};

// torch.nn.Embedding's parameter: "weight" [vocab, hidden].
class Embedding : public torch::nn::Module {
 public:
  Embedding(int64_t vocab, int64_t hidden, const at::TensorOptions& o) {
    weight = register_parameter("weight", at::zeros({vocab, hidden}, o));
  }
  Tensor weight;
};

class Attention : public torch::nn::Module {
 public:
  Attention(const ModelConfig& c, const at::TensorOptions& o)
      : heads_(c.num_attention_heads), kv_heads_(c.num_key_value_heads), head_dim_(c.head_dim) {
    q_proj =
        register_module("q_proj", std::make_shared<Linear>(c.hidden_size, heads_ * head_dim_, c.qkv_bias, o));
    k_proj = register_module("k_proj",
                             std::make_shared<Linear>(c.hidden_size, kv_heads_ * head_dim_, c.qkv_bias, o));
    v_proj = register_module("v_proj",
                             std::make_shared<Linear>(c.hidden_size, kv_heads_ * head_dim_, c.qkv_bias, o));
    o_proj =
        register_module("o_proj", std::make_shared<Linear>(heads_ * head_dim_, c.hidden_size, c.o_bias, o));
    if (c.qk_norm) {
      q_norm = register_module("q_norm", std::make_shared<RMSNorm>(head_dim_, c.rms_norm_eps, o));
      k_norm = register_module("k_norm", std::make_shared<RMSNorm>(head_dim_, c.rms_norm_eps, o));
    }
    // transformers' apply_rotary_pos_emb, a function its attention classes carry
    // (@use_kernelized_func): a parameterless layer here.
    rotary_pos_emb = register_module(
        "rotary_pos_emb",
        std::make_shared<RotaryPosEmb>(heads_, kv_heads_, head_dim_, c10::typeMetaToScalarType(o.dtype())));
  }

  // x [B, S, H]; cos, sin [1, S, D].
  Tensor forward(const Tensor& x, const Tensor& cos, const Tensor& sin) {
    const int64_t B = x.size(0), S = x.size(1);
    Tensor q = q_proj->forward(x).view({B, S, -1, head_dim_});
    Tensor k = k_proj->forward(x).view({B, S, -1, head_dim_});
    const Tensor v = v_proj->forward(x).view({B, S, -1, head_dim_}).transpose(1, 2);
    if (q_norm) {  // Qwen3: norm over each head before the transpose
      q = q_norm->forward(q);
      k = k_norm->forward(k);
    }
    std::tie(q, k) = rotary_pos_emb->forward(q.transpose(1, 2), k.transpose(1, 2), cos, sin);
    // transformers' sdpa path without a padding mask: is_causal for more than one query, enable_gqa for
    // grouped heads, scale head_dim^-0.5.
    const Tensor out = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, /*is_causal=*/S > 1,
                                                        std::pow(static_cast<double>(head_dim_), -0.5),
                                                        /*enable_gqa=*/heads_ != kv_heads_);
    return o_proj->forward(out.transpose(1, 2).contiguous().reshape({B, S, -1}));
  }

  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;
  std::shared_ptr<RMSNorm> q_norm, k_norm;
  std::shared_ptr<RotaryPosEmb> rotary_pos_emb;

 private:
  int64_t heads_, kv_heads_, head_dim_;
};

// The router: softmax over experts in fp32, top-k, optional renormalisation, back to the logits' dtype.
class TopKRouter : public torch::nn::Module {
 public:
  TopKRouter(const ModelConfig& c, const at::TensorOptions& o)
      : top_k_(c.num_experts_per_tok), norm_(c.norm_topk_prob) {
    weight = register_parameter("weight", at::zeros({c.num_experts, c.hidden_size}, o));
  }
  // Returns (topk_weights, topk_ids), both [T, k].
  std::pair<Tensor, Tensor> forward(const Tensor& h) {
    const Tensor logits = at::linear(h, weight);
    const Tensor probs = at::softmax(logits, -1, at::kFloat);
    auto [top, ids] = at::topk(probs, top_k_, -1);
    if (tape) {
      // A replayed routing: the recorded experts, weighted by this router's own probabilities.
      const Tensor routed = tape->route(probs, ids);
      if (!routed.is_same(ids)) {
        ids = routed;
        top = probs.gather(-1, ids);
      }
    }
    if (norm_) top = top / top.sum(-1, /*keepdim=*/true);
    return {top.to(logits.scalar_type()), ids};
  }
  Tensor weight;
  std::shared_ptr<RoutingTape> tape;  // null: its own top-k

 private:
  int64_t top_k_;
  bool norm_;
};

class SparseMoeBlock : public torch::nn::Module {
 public:
  SparseMoeBlock(const ModelConfig& c, const at::TensorOptions& o) {
    gate = register_module("gate", std::make_shared<TopKRouter>(c, o));
    experts = register_module("experts",
                              std::make_shared<Experts>(c.num_experts, c.hidden_size, c.moe_intermediate_size,
                                                        c.num_experts_per_tok, o));
    if (c.shared_expert_intermediate_size > 0) {
      shared_expert = register_module(
          "shared_expert", std::make_shared<GatedMLP>(c.hidden_size, c.shared_expert_intermediate_size, o));
      shared_expert_gate =
          register_module("shared_expert_gate", std::make_shared<Linear>(c.hidden_size, 1, false, o));
    }
  }
  Tensor forward(const Tensor& x) {
    const Tensor h = x.view({-1, x.size(-1)});
    auto [weights, ids] = gate->forward(h);
    Tensor out = experts->forward(h, ids, weights);
    if (shared_expert) out = out + at::sigmoid(shared_expert_gate->forward(h)) * shared_expert->forward(h);
    return out.view(x.sizes());
  }
  std::shared_ptr<TopKRouter> gate;
  std::shared_ptr<Experts> experts;
  std::shared_ptr<GatedMLP> shared_expert;
  std::shared_ptr<Linear> shared_expert_gate;
};

// transformers' pre-norm decoder layer, `residual = h; h = residual + attn(input_layernorm(h)); residual = h;
// h = residual + mlp(post_attention_layernorm(h))`, with each residual add fused into the norm after it
// (FusedAddRMSNorm): forward takes the previous block's output and the residual stream (undefined before the
// first layer, whose input norm is a plain RMSNorm) and returns this layer's MLP output and the residual
// stream, which the next norm adds.
class DecoderLayer : public torch::nn::Module {
 public:
  DecoderLayer(const ModelConfig& c, int64_t index, const at::TensorOptions& o) {
    self_attn = register_module("self_attn", std::make_shared<Attention>(c, o));
    if (c.is_moe_layer(index)) {
      moe = register_module("mlp", std::make_shared<SparseMoeBlock>(c, o));
    } else {
      dense = register_module("mlp", std::make_shared<GatedMLP>(c.hidden_size, c.intermediate_size, o));
    }
    if (index == 0) {
      input_layernorm =
          register_module("input_layernorm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps, o));
    } else {
      input_add_layernorm = register_module(
          "input_layernorm", std::make_shared<FusedAddRMSNorm>(c.hidden_size, c.rms_norm_eps, o));
    }
    post_attention_layernorm = register_module(
        "post_attention_layernorm", std::make_shared<FusedAddRMSNorm>(c.hidden_size, c.rms_norm_eps, o));
  }
  std::pair<Tensor, Tensor> forward(const Tensor& x, const Tensor& residual, const Tensor& cos,
                                    const Tensor& sin) {
    Tensor n, h;
    if (residual.defined()) {
      std::tie(n, h) = input_add_layernorm->forward(x, residual);
    } else {
      h = x;
      n = input_layernorm->forward(x);
    }
    auto [n2, h2] = post_attention_layernorm->forward(self_attn->forward(n, cos, sin), h);
    return {moe ? moe->forward(n2) : dense->forward(n2), h2};
  }
  std::shared_ptr<Attention> self_attn;
  std::shared_ptr<GatedMLP> dense;
  std::shared_ptr<SparseMoeBlock> moe;
  std::shared_ptr<RMSNorm> input_layernorm;              // layer 0
  std::shared_ptr<FusedAddRMSNorm> input_add_layernorm;  // the other layers
  std::shared_ptr<FusedAddRMSNorm> post_attention_layernorm;
};

}  // namespace

// "model": embeddings, decoder layers, final norm.
class DecoderModel : public torch::nn::Module {
 public:
  DecoderModel(const ModelConfig& c, const at::TensorOptions& o) : config_(c) {
    embed_tokens =
        register_module("embed_tokens", std::make_shared<Embedding>(c.vocab_size, c.hidden_size, o));
    layers = register_module("layers", std::make_shared<Stack<DecoderLayer>>());
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push(std::make_shared<DecoderLayer>(c, i, o));
    norm = register_module("norm", std::make_shared<FusedAddRMSNorm>(c.hidden_size, c.rms_norm_eps, o));
  }
  Tensor forward(const Tensor& input_ids) {
    Tensor h = at::embedding(embed_tokens->weight, input_ids, config_.pad_token_id);
    const auto [cos, sin] = rotary(input_ids.size(1), config_.head_dim, config_.rope_theta, h);
    Tensor residual;
    for (const auto& layer : layers->items) std::tie(h, residual) = layer->forward(h, residual, cos, sin);
    // The last layer's residual add, fused into the final norm (configs have at least one layer).
    return std::get<0>(norm->forward(h, residual));
  }
  std::shared_ptr<Embedding> embed_tokens;
  std::shared_ptr<Stack<DecoderLayer>> layers;
  std::shared_ptr<FusedAddRMSNorm> norm;

 private:
  ModelConfig config_;
};

CausalLM::CausalLM(ModelConfig config, const at::TensorOptions& options) : config_(std::move(config)) {
  if (!options.device().is_meta()) config_.check_fits_in_memory(options.dtype().itemsize());
  model_ = register_module("model", std::make_shared<DecoderModel>(config_, options));
  if (!config_.tie_word_embeddings)
    lm_head_ = register_module(
        "lm_head", std::make_shared<Linear>(config_.hidden_size, config_.vocab_size, false, options));
  // transformers keeps ForCausalLMLoss in the model's loss_function; here it is a kernel layer on the head's
  // weight.
  loss_ = register_module("loss_function", std::make_shared<CausalLMLoss>(lm_head_weight()));
}

const Tensor& CausalLM::lm_head_weight() const {
  return lm_head_ ? lm_head_->weight : model_->embed_tokens->weight;
}

CausalLM::~CausalLM() = default;

CausalLMOutput CausalLM::forward(const Tensor& input_ids, const Tensor& labels) {
  TORCH_CHECK(input_ids.dim() == 2 && input_ids.scalar_type() == at::kLong,
              "CausalLM.forward: input_ids must be int64 [B, S], got ", input_ids.scalar_type(), " ",
              input_ids.sizes());
  TORCH_CHECK(!labels.defined() || labels.sizes() == input_ids.sizes(),
              "CausalLM.forward: labels must have the shape of input_ids ", input_ids.sizes(), ", got ",
              labels.sizes());
  const Tensor h = model_->forward(input_ids);
  CausalLMOutput out;
  if (!labels.defined()) {
    out.logits = at::linear(h, lm_head_weight());
    return out;
  }
  // ForCausalLMLoss: labels shifted left with -100 padding, the loss of every position from the LM head's
  // product (the loss layer's kernel; the fused one never holds the logits).
  const Tensor shifted = at::constant_pad_nd(labels, {0, 1}, -100).slice(-1, 1).reshape(-1);
  out.loss = loss_->forward(h.reshape({-1, config_.hidden_size}), shifted);
  return out;
}

void CausalLM::init_weights(uint64_t seed) {
  at::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& item : named_parameters()) {
    Tensor p = item.value();
    const std::string& name = item.key();
    if (p.is_meta()) continue;
    if (name.size() >= 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0) {
      p.fill_(1.0);
    } else if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0) {
      p.zero_();
    } else {
      // Drawn in fp32 on the CPU so that a seed gives the same weights in every dtype and on every device.
      p.copy_(at::empty(p.sizes(), at::kFloat).normal_(0.0, config_.initializer_range, gen));
    }
  }
  if (config_.pad_token_id >= 0) model_->embed_tokens->weight[config_.pad_token_id].zero_();
}

void CausalLM::set_routing_tape(std::shared_ptr<RoutingTape> tape) {
  for (const auto& m : modules())
    if (auto* router = dynamic_cast<TopKRouter*>(m.get())) router->tape = tape;
}

bool CausalLM::routes_tokens() const {
  for (const auto& m : modules())
    if (dynamic_cast<const TopKRouter*>(m.get())) return true;
  return false;
}

namespace {
ModelConfig expect_type(ModelConfig config, const char* model_type, const char* cls) {
  if (config.model_type != model_type)
    throw ConfigError(std::string(cls) + ": model_type is '" + config.model_type + "', expected " +
                      model_type);
  return config;
}
}  // namespace

Qwen2ForCausalLM::Qwen2ForCausalLM(ModelConfig config, const at::TensorOptions& options)
    : CausalLM(expect_type(std::move(config), "qwen2", "Qwen2ForCausalLM"), options) {}
Qwen2MoeForCausalLM::Qwen2MoeForCausalLM(ModelConfig config, const at::TensorOptions& options)
    : CausalLM(expect_type(std::move(config), "qwen2_moe", "Qwen2MoeForCausalLM"), options) {}
Qwen3MoeForCausalLM::Qwen3MoeForCausalLM(ModelConfig config, const at::TensorOptions& options)
    : CausalLM(expect_type(std::move(config), "qwen3_moe", "Qwen3MoeForCausalLM"), options) {}

std::shared_ptr<CausalLM> make_model(const ModelConfig& config, const at::TensorOptions& options) {
  if (config.model_type == "qwen2") return std::make_shared<Qwen2ForCausalLM>(config, options);
  if (config.model_type == "qwen2_moe") return std::make_shared<Qwen2MoeForCausalLM>(config, options);
  if (config.model_type == "qwen3_moe") return std::make_shared<Qwen3MoeForCausalLM>(config, options);
  throw ConfigError("make_model: model_type '" + config.model_type + "' is not supported");
}

std::shared_ptr<CausalLM> from_pretrained(const std::string& dir, const at::TensorOptions& options) {
  const ModelConfig config = ModelConfig::from_dir(dir);
  std::shared_ptr<CausalLM> model;
  try {
    model = make_model(config, options);
  } catch (const ConfigError& e) {
    throw ConfigError(dir + "/" + e.what());  // "config.json: ..." names the folder's file
  }
  model->load_weights(dir);
  return model;
}

std::shared_ptr<CausalLM> make_preset(const std::string& name, const at::TensorOptions& options) {
  std::shared_ptr<CausalLM> model = make_model(preset_config(name), options);
  model->init_weights(0x6b65726e6d6170);  // "kernmap"
  return model;
}

}  // namespace kernmap
