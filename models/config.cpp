// ModelConfig from and to a transformers config.json, and the built-in tiny presets.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "kernmap/models.h"
#include "models/json_document.h"

namespace kernmap {
namespace {

using nlohmann::json;

// Sizes beyond these are not a model this library can build on one machine; they are rejected before any
// allocation is attempted (config.json is input like any other).
constexpr int64_t kMaxDim = int64_t{1} << 24;
constexpr int64_t kMaxLayers = 4096;

[[noreturn]] void fail(const std::string& what) {
  throw ConfigError("config.json: " + what);
}

bool has(const json& j, const char* key) {
  return j.contains(key) && !j[key].is_null();
}

int64_t get_int(const json& j, const char* key, std::optional<int64_t> fallback, int64_t lo, int64_t hi) {
  if (!has(j, key)) {
    if (fallback) return *fallback;
    fail("missing '" + std::string(key) + "'");
  }
  const json& v = j[key];
  if (!v.is_number_integer()) fail("'" + std::string(key) + "' must be an integer, got " + v.dump());
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi)
    fail("'" + std::string(key) + "' = " + std::to_string(x) + " is outside [" + std::to_string(lo) + ", " +
         std::to_string(hi) + "]");
  return x;
}

double get_double(const json& j, const char* key, double fallback) {
  if (!has(j, key)) return fallback;
  const json& v = j[key];
  if (!v.is_number() || !(v.get<double>() > 0) || !std::isfinite(v.get<double>()))
    fail("'" + std::string(key) + "' must be a positive number, got " + v.dump());
  return v.get<double>();
}

bool get_bool(const json& j, const char* key, bool fallback) {
  if (!has(j, key)) return fallback;
  if (!j[key].is_boolean()) fail("'" + std::string(key) + "' must be true or false, got " + j[key].dump());
  return j[key].get<bool>();
}

// Bytes in binary units ("1.0 PiB").
std::string human_bytes(double bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"};
  int u = 0;
  while (bytes >= 1024 && u < 8) {
    bytes /= 1024;
    ++u;
  }
  char out[64];
  std::snprintf(out, sizeof out, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return out;
}

std::string architecture(const std::string& model_type) {
  if (model_type == "qwen2") return "Qwen2ForCausalLM";
  if (model_type == "qwen2_moe") return "Qwen2MoeForCausalLM";
  return "Qwen3MoeForCausalLM";
}

}  // namespace

bool ModelConfig::is_moe_layer(int64_t i) const {
  return std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) == mlp_only_layers.end() &&
         num_experts > 0 && (i + 1) % decoder_sparse_step == 0;
}

ModelConfig ModelConfig::from_json(const std::string& text) {
  json j;
  try {
    j = json_document::parse(text);
  } catch (const json_document::Error& e) {
    fail(std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) fail("must be a JSON object");
  ModelConfig c;
  if (!has(j, "model_type") || !j["model_type"].is_string()) fail("missing 'model_type'");
  c.model_type = j["model_type"].get<std::string>();
  if (c.model_type != "qwen2" && c.model_type != "qwen2_moe" && c.model_type != "qwen3_moe")
    fail("model_type '" + c.model_type + "' is not supported (expected qwen2, qwen2_moe or qwen3_moe)");
  const bool moe = c.model_type != "qwen2";

  c.vocab_size = get_int(j, "vocab_size", std::nullopt, 1, kMaxDim);
  c.hidden_size = get_int(j, "hidden_size", std::nullopt, 1, kMaxDim);
  c.intermediate_size = get_int(j, "intermediate_size", std::nullopt, 1, kMaxDim);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", std::nullopt, 1, kMaxLayers);
  c.num_attention_heads = get_int(j, "num_attention_heads", std::nullopt, 1, kMaxDim);
  c.num_key_value_heads = get_int(j, "num_key_value_heads", c.num_attention_heads, 1, c.num_attention_heads);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    fail("num_attention_heads = " + std::to_string(c.num_attention_heads) +
         " is not a multiple of num_key_value_heads = " + std::to_string(c.num_key_value_heads));
  if (!has(j, "head_dim") && c.hidden_size % c.num_attention_heads != 0)
    fail("hidden_size = " + std::to_string(c.hidden_size) + " is not a multiple of num_attention_heads = " +
         std::to_string(c.num_attention_heads) + " and head_dim is not given");
  c.head_dim = get_int(j, "head_dim", c.hidden_size / c.num_attention_heads, 2, kMaxDim);
  if (c.head_dim % 2 != 0)
    fail("head_dim = " + std::to_string(c.head_dim) + " must be even (rotary embeddings)");
  c.max_position_embeddings =
      get_int(j, "max_position_embeddings", 32768, 1, std::numeric_limits<int32_t>::max());
  c.pad_token_id = get_int(j, "pad_token_id", -1, -1, c.vocab_size - 1);
  c.rms_norm_eps = get_double(j, "rms_norm_eps", 1e-6);
  c.initializer_range = get_double(j, "initializer_range", 0.02);
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", false);

  if (has(j, "hidden_act") && j["hidden_act"] != "silu")
    fail("hidden_act " + j["hidden_act"].dump() + " is not supported (expected \"silu\")");
  // Rotary embeddings: transformers 5 writes rope_parameters {rope_theta, rope_type}; 4.x wrote rope_theta
  // and rope_scaling at the top level.
  c.rope_theta = get_double(j, "rope_theta", 10000.0);
  std::string rope_type = "default";
  if (has(j, "rope_parameters")) {
    const json& rp = j["rope_parameters"];
    if (!rp.is_object()) fail("'rope_parameters' must be an object, got " + rp.dump());
    c.rope_theta = get_double(rp, "rope_theta", c.rope_theta);
    if (has(rp, "rope_type"))
      rope_type = rp["rope_type"].is_string() ? rp["rope_type"].get<std::string>() : "?";
  } else if (has(j, "rope_scaling")) {
    const json& rs = j["rope_scaling"];
    rope_type = rs.is_object() && rs.contains("rope_type") && rs["rope_type"].is_string()
                    ? rs["rope_type"].get<std::string>()
                    : rs.dump();
  }
  if (rope_type != "default") fail("rope_type '" + rope_type + "' is not supported (only \"default\")");
  if (get_bool(j, "use_sliding_window", false)) fail("use_sliding_window = true is not supported");
  if (has(j, "layer_types")) {
    const json& lt = j["layer_types"];
    if (!lt.is_array()) fail("'layer_types' must be a list");
    for (const json& t : lt)
      if (t != "full_attention")
        fail("layer_types entry " + t.dump() + " is not supported (only full_attention)");
  }

  if (c.model_type == "qwen2") {
    c.qkv_bias = true;
  } else if (c.model_type == "qwen2_moe") {
    c.qkv_bias = get_bool(j, "qkv_bias", true);
  } else {
    c.qkv_bias = c.o_bias = get_bool(j, "attention_bias", false);
    c.qk_norm = true;
  }
  if (moe) {
    // Qwen3-MoE configs name the expert count num_local_experts (transformers' attribute_map) or num_experts.
    const char* experts_key = has(j, "num_experts") ? "num_experts" : "num_local_experts";
    c.num_experts = get_int(j, experts_key, std::nullopt, 0, kMaxDim);
    c.num_experts_per_tok =
        get_int(j, "num_experts_per_tok", std::nullopt, 1, std::max<int64_t>(c.num_experts, 1));
    c.moe_intermediate_size = get_int(j, "moe_intermediate_size", std::nullopt, 1, kMaxDim);
    if (c.model_type == "qwen2_moe")
      c.shared_expert_intermediate_size =
          get_int(j, "shared_expert_intermediate_size", std::nullopt, 1, kMaxDim);
    c.decoder_sparse_step = get_int(j, "decoder_sparse_step", 1, 1, kMaxLayers);
    c.norm_topk_prob = get_bool(j, "norm_topk_prob", false);
    if (has(j, "mlp_only_layers")) {
      const json& m = j["mlp_only_layers"];
      if (!m.is_array()) fail("'mlp_only_layers' must be a list of layer indices, got " + m.dump());
      for (const json& i : m) {
        if (!i.is_number_integer()) fail("'mlp_only_layers' must hold integers, got " + i.dump());
        c.mlp_only_layers.push_back(i.get<int64_t>());
      }
    }
  }
  for (const char* key : {"dtype", "torch_dtype"})
    if (has(j, key) && j[key].is_string()) {
      c.dtype = j[key].get<std::string>();
      break;
    }
  return c;
}

ModelConfig ModelConfig::from_dir(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path + ": cannot open");
  std::stringstream text;
  text << in.rdbuf();
  try {
    return from_json(text.str());
  } catch (const ConfigError& e) {
    throw ConfigError(dir + "/" + e.what());
  }
}

double ModelConfig::parameter_count() const {
  // As models/qwen.cpp builds them. Doubles: a product of capped sizes can still pass 2^64.
  const double H = hidden_size, V = vocab_size, D = head_dim;
  const double q = num_attention_heads * D, kv = num_key_value_heads * D;
  double layer = H * q + 2 * H * kv + q * H + 2 * H;  // q, k, v, o projections; the two norms
  if (qkv_bias) layer += q + 2 * kv;
  if (o_bias) layer += H;
  if (qk_norm) layer += 2 * D;
  double total = V * H * (tie_word_embeddings ? 1 : 2) + H;  // embeddings, lm_head, final norm
  for (int64_t i = 0; i < num_hidden_layers; ++i) {
    total += layer;
    if (is_moe_layer(i)) {
      total += static_cast<double>(num_experts) * H + 3.0 * num_experts * H * moe_intermediate_size;
      if (shared_expert_intermediate_size > 0) total += 3 * H * shared_expert_intermediate_size + H;
    } else {
      total += 3 * H * intermediate_size;
    }
  }
  return total;
}

void ModelConfig::check_fits_in_memory(size_t bytes_per_parameter) const {
  // Physical memory, not a fixed cap: the parameters alone must fit for the model to be built at all
  // (training needs about four times as much, with gradients and AdamW's two states), and a cap relative to
  // the machine neither refuses a real model on a large machine nor lets a config ask a small one for a
  // petabyte.
  const double cap =
      static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGE_SIZE));
  const double count = parameter_count(), bytes = count * static_cast<double>(bytes_per_parameter);
  if (bytes <= cap) return;
  char params[32];
  std::snprintf(params, sizeof params, "%.3g", count);
  fail(std::string("the model would have ") + params + " parameters, " + human_bytes(bytes) + " at " +
       std::to_string(bytes_per_parameter) + " bytes each" + ", more than this machine's " +
       human_bytes(cap) + " of physical memory (vocab_size " + std::to_string(vocab_size) + ", hidden_size " +
       std::to_string(hidden_size) + ", num_hidden_layers " + std::to_string(num_hidden_layers) +
       (num_experts > 0 ? ", num_experts " + std::to_string(num_experts) : std::string()) + ")");
}

std::string ModelConfig::to_json() const {
  nlohmann::ordered_json j;
  j["architectures"] = {architecture(model_type)};
  j["model_type"] = model_type;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = max_position_embeddings;
  j["initializer_range"] = initializer_range;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_parameters"] = {{"rope_theta", rope_theta}, {"rope_type", "default"}};
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["use_sliding_window"] = false;
  j["pad_token_id"] = pad_token_id < 0 ? json(nullptr) : json(pad_token_id);
  j["dtype"] = dtype;
  if (model_type == "qwen2_moe") j["qkv_bias"] = qkv_bias;
  if (model_type == "qwen3_moe") j["attention_bias"] = qkv_bias;
  if (model_type != "qwen2") {
    j["num_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["moe_intermediate_size"] = moe_intermediate_size;
    if (model_type == "qwen2_moe") j["shared_expert_intermediate_size"] = shared_expert_intermediate_size;
    j["decoder_sparse_step"] = decoder_sparse_step;
    j["norm_topk_prob"] = norm_topk_prob;
    j["mlp_only_layers"] = mlp_only_layers;
  }
  return j.dump(2) + "\n";
}

std::vector<std::string> preset_names() {
  return {"qwen2-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny"};
}

ModelConfig preset_config(const std::string& name) {
  ModelConfig c;
  c.vocab_size = 256;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.rope_theta = 1000000.0;
  if (name == "qwen2-tiny") {
    c.model_type = "qwen2";
    c.num_hidden_layers = 2;
    c.qkv_bias = true;
    c.tie_word_embeddings = true;
  } else if (name == "qwen2-moe-tiny") {
    c.model_type = "qwen2_moe";
    c.num_hidden_layers = 3;
    c.qkv_bias = true;
    // Many small experts, as in the MoE models whose expert loop the Experts kernel replaces.
    c.num_experts = 32;
    c.num_experts_per_tok = 4;
    c.moe_intermediate_size = 32;
    c.shared_expert_intermediate_size = 64;
    c.mlp_only_layers = {2};
  } else if (name == "qwen3-moe-tiny") {
    c.model_type = "qwen3_moe";
    c.num_hidden_layers = 2;
    c.qk_norm = true;
    c.num_experts = 32;
    c.num_experts_per_tok = 4;
    c.moe_intermediate_size = 32;
    c.norm_topk_prob = true;
  } else {
    throw std::invalid_argument("unknown preset '" + name +
                                "' (expected qwen2-tiny, qwen2-moe-tiny or qwen3-moe-tiny)");
  }
  return c;
}

}  // namespace kernmap
