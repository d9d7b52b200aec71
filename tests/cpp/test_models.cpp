// Kernel layers, kernelize and the models on the built-in presets: binding, rebinding, fallback, no weight
// copies, kernelized == reference, checkpoint round trips (one file and sharded), config errors. Equality
// with transformers itself is tested in tests/python/test_models.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernmap/models.h"

namespace kernmap {
namespace {

at::Tensor sample_ids(const ModelConfig& c) {
  return at::randint(c.vocab_size, {2, 7}, at::TensorOptions().dtype(at::kLong));
}

std::map<std::string, const void*> data_pointers(torch::nn::Module& m) {
  std::map<std::string, const void*> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().const_data_ptr();
  return out;
}

TEST(Kernelize, Qwen3MoePresetMapsEveryLayerOnCpu) {
  auto model = make_preset("qwen3-moe-tiny");
  const Report report = kernelize(*model, "cpu", Mode::kTraining);
  // 2 layers x (q_norm, k_norm, rotary_pos_emb, experts, input_layernorm, post_attention_layernorm) + final
  // norm + loss; every residual add is fused into the norm after it (all but layer 0's input norm).
  std::map<std::string, std::string> layer_of;
  for (const ReportEntry& e : report.entries) {
    EXPECT_FALSE(e.fallback) << e.path << ": " << e.reason;
    EXPECT_EQ(e.kernel.rfind("kernmap/", 0), 0u) << e.path;
    layer_of[e.path] = e.layer;
  }
  ASSERT_EQ(report.entries.size(), 14u);
  EXPECT_EQ(report.entries.front().path, "model.layers.0.self_attn.q_norm");
  EXPECT_EQ(layer_of["model.layers.0.self_attn.rotary_pos_emb"], "rotary_pos_emb");
  EXPECT_EQ(layer_of["model.layers.0.input_layernorm"], "RMSNorm");
  EXPECT_EQ(layer_of["model.layers.1.input_layernorm"], "FusedAddRMSNorm");
  EXPECT_EQ(layer_of["model.layers.0.post_attention_layernorm"], "FusedAddRMSNorm");
  EXPECT_EQ(layer_of["model.norm"], "FusedAddRMSNorm");
  const std::string table = report.table();
  EXPECT_EQ(table.rfind("module", 0), 0u) << table;
  EXPECT_NE(table.find("model.layers.1.mlp.experts"), std::string::npos) << table;
  EXPECT_NE(table.find("kernmap/experts"), std::string::npos) << table;
  EXPECT_EQ(report.entries.back().path, "loss_function");
  EXPECT_EQ(report.entries.back().kernel, "kernmap/linear_cross_entropy");
}

TEST(Kernelize, BindsWithoutCopyingAndMatchesReferenceBothWays) {
  for (const std::string& name : preset_names()) {
    auto model = make_preset(name);
    const at::Tensor ids = sample_ids(model->config());
    const auto before = data_pointers(*model);
    const at::Tensor reference = model->forward(ids).logits.detach();
    const Report report = kernelize(*model, "", Mode::kInference);
    EXPECT_EQ(report.device, "cpu");
    for (const ReportEntry& e : report.entries) EXPECT_FALSE(e.fallback) << name << " " << e.path;
    EXPECT_EQ(data_pointers(*model), before) << name << ": kernelize must not copy weights";
    const at::Tensor fused = model->forward(ids).logits.detach();
    EXPECT_TRUE(at::allclose(fused, reference, 1e-5, 1e-6)) << name;

    const Report back = restore_reference(*model);
    for (const ReportEntry& e : back.entries) EXPECT_EQ(e.kernel.rfind("reference/", 0), 0u) << e.path;
    EXPECT_TRUE(at::equal(model->forward(ids).logits.detach(), reference)) << name;
    const Report again = kernelize(*model, "cpu", Mode::kTraining);  // and once more, in another mode
    for (const ReportEntry& e : again.entries) EXPECT_FALSE(e.fallback) << e.path;
  }
}

// The loss through the fused kernel equals the reference's, and so does every parameter's gradient — for
// qwen2-tiny that includes the input embedding tied to the head, whose gradient sums the embedding's and the
// loss's (the fused kernel hands autograd the head's share like any other op).
TEST(Kernelize, FusedLossAndGradientsEqualTheReference) {
  for (const std::string& name : preset_names()) {
    auto model = make_preset(name);
    const at::Tensor ids = sample_ids(model->config());
    at::Tensor labels = ids.clone();
    labels.narrow(1, 0, 2).fill_(-100);  // a prompt
    std::vector<std::map<std::string, at::Tensor>> grads;
    std::vector<double> losses;
    for (bool fused : {false, true}) {
      if (fused) {
        kernelize(*model, "cpu", Mode::kTraining);
      } else {
        restore_reference(*model);
      }
      for (auto& p : model->parameters()) p.mutable_grad().reset();
      const CausalLMOutput out = model->forward(ids, labels);
      EXPECT_FALSE(out.logits.defined()) << name << ": labels give the loss only";
      out.loss.backward();
      losses.push_back(out.loss.item<double>());
      std::map<std::string, at::Tensor> g;
      for (const auto& p : model->named_parameters()) g[p.key()] = p.value().grad().clone();
      grads.push_back(g);
    }
    EXPECT_NEAR(losses[1], losses[0], 1e-6 * std::abs(losses[0])) << name;
    for (const auto& [param, g] : grads[0]) {
      ASSERT_TRUE(grads[1].at(param).defined()) << name << " " << param;
      EXPECT_TRUE(at::allclose(grads[1].at(param), g, 1e-4, 1e-7)) << name << " " << param;
    }
    if (model->config().tie_word_embeddings) {
      // Without the loss's share the embedding's gradient would be zero outside the rows of the inputs.
      const at::Tensor unused =
          at::ones({model->config().vocab_size}, at::kBool).index_fill_(0, ids.reshape(-1), false);
      EXPECT_GT(grads[1].at("model.embed_tokens.weight").index({unused}).abs().sum().item<double>(), 0)
          << name;
    }
  }
}

TEST(Kernelize, GatedMlpAndSharedExpertAreSiluAndMulLayers) {
  auto model = make_preset("qwen2-moe-tiny", at::TensorOptions().device(at::kMeta));
  const Report report = kernelize(*model, "cpu", Mode::kTraining);
  std::map<std::string, std::string> layer_of;
  for (const ReportEntry& e : report.entries) layer_of[e.path] = e.layer;
  EXPECT_EQ(layer_of["model.layers.0.mlp.experts"], "Experts");
  EXPECT_EQ(layer_of["model.layers.0.mlp.shared_expert"], "SiluAndMul");
  EXPECT_EQ(layer_of["model.layers.2.mlp"], "SiluAndMul");  // mlp_only_layers = [2]
  EXPECT_EQ(layer_of.count("model.layers.2.mlp.experts"), 0u);
}

TEST(Kernelize, WithoutFallbackAnUnmappedLayerIsAnErrorAndNothingIsRebound) {
  auto model = make_preset("qwen2-tiny");
  ScopedMapping none({{"RMSNorm", {{"cpu", {}}}}});
  try {
    kernelize(*model, "cpu", Mode::kTraining, /*use_fallback=*/false);
    FAIL() << "expected KernelizeError";
  } catch (const KernelizeError& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.0.input_layernorm (RMSNorm)"), std::string::npos)
        << e.what();
    EXPECT_FALSE(e.report.entries.empty());
  }
  for (const ReportEntry& e : restore_reference(*model).entries) EXPECT_EQ(e.source, "reference");
  const Report with_fallback = kernelize(*model, "cpu", Mode::kTraining);
  for (const ReportEntry& e : with_fallback.entries)
    EXPECT_EQ(e.fallback, e.layer == "RMSNorm") << e.path << ": " << e.reason;
}

TEST(Kernelize, AKernelWhoseOpHasAnotherSignatureFallsBackWithTheReason) {
  KernelDescriptor
      wrong;  // an RMSNorm kernel whose torch op is SiLU's: bound, it would compute the wrong thing
  wrong.name = "test/wrong_op";
  wrong.layer = "RMSNorm";
  wrong.devices = {"cpu"};
  wrong.dtypes = {"float32"};
  wrong.has_backward = true;
  wrong.op = "kernmap::silu";
  register_kernel(wrong);
  ScopedMapping scope({{"RMSNorm", {{"cpu", {{Mode::kTraining, "test/wrong_op"}}}}}});
  auto model = make_preset("qwen2-tiny", at::TensorOptions().device(at::kMeta));
  const Report report = kernelize(*model, "cpu", Mode::kTraining);
  for (const ReportEntry& e : report.entries) {
    if (e.layer != "RMSNorm") continue;
    EXPECT_EQ(e.kernel, "reference/rms_norm");
    EXPECT_NE(e.reason.find("kernmap::silu"), std::string::npos) << e.reason;
  }
}

TEST(Checkpoint, SaveAndLoadRoundTripOneFileAndSharded) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("kernmap_test_models_" + std::to_string(::getpid()));
  for (const std::string& name : preset_names()) {
    auto model = make_preset(name);
    const at::Tensor ids = sample_ids(model->config());
    const at::Tensor logits = model->forward(ids).logits;
    for (uint64_t shard : {uint64_t{0}, uint64_t{20000}}) {
      std::filesystem::remove_all(dir);
      model->save_pretrained(dir.string(), shard);
      EXPECT_EQ(std::filesystem::exists(dir / "model.safetensors.index.json"), shard > 0) << name;
      auto loaded = from_pretrained(dir.string());
      EXPECT_TRUE(at::equal(loaded->forward(ids).logits, logits)) << name << " shard " << shard;
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(RoutingTape, ReplaysTheRecordedExpertsAndCountsFlips) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  // Three tokens, four experts, top-2.
  const at::Tensor probs =
      at::tensor({0.4f, 0.3f, 0.2f, 0.1f, 0.1f, 0.2f, 0.3f, 0.4f, 0.24f, 0.26f, 0.3f, 0.2f}, f32)
          .view({3, 4});
  const at::Tensor recorded = at::tensor({0, 1, 3, 2, 2, 0}, i64).view({3, 2});
  RoutingTape tape;
  EXPECT_THROW(tape.replay(), std::logic_error);  // nothing recorded
  tape.record();
  EXPECT_TRUE(tape.route(probs, recorded).is_same(recorded));  // recording returns the router's own
  EXPECT_EQ(tape.size(), 1);
  tape.replay();
  EXPECT_TRUE(tape.replaying());
  // Its own: token 0 the same, token 1 the same experts in another order (no flip), token 2 expert 1 for 0.
  const at::Tensor own = at::tensor({0, 1, 2, 3, 2, 1}, i64).view({3, 2});
  const at::Tensor routed = tape.route(probs, own);
  EXPECT_TRUE(at::equal(routed, recorded));
  EXPECT_EQ(routed.scalar_type(), at::kLong);
  const RoutingTape::Flips f = tape.take_flips();
  EXPECT_EQ(f.calls, 1);
  EXPECT_EQ(f.tokens, 3);
  EXPECT_EQ(f.flipped, 1);
  // Its own k-th probability 0.26 against the recorded experts' least, 0.24.
  EXPECT_FLOAT_EQ(static_cast<float>(f.max_margin), (0.26f - 0.24f) / 0.26f);
  EXPECT_EQ(tape.take_flips().calls, 0);  // a new span
  try {
    tape.route(probs, own);
    ADD_FAILURE() << "a replay past the recording must throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("router call 2 is past the 1 calls recorded"), std::string::npos)
        << e.what();
  }
  tape.replay();
  try {
    tape.route(probs.narrow(0, 0, 2), own.narrow(0, 0, 2));
    ADD_FAILURE() << "another batch must throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("[2, 2], the recorded call [3, 2]"), std::string::npos) << e.what();
  }
  // Replaying the same choices returns the router's own tensor: its arithmetic is the free run's.
  tape.replay();
  EXPECT_TRUE(tape.route(probs, recorded).is_same(recorded));
  EXPECT_EQ(tape.take_flips().flipped, 0);
}

TEST(RoutingTape, ModelsFollowTheRecordedRouting) {
  for (const std::string& name : {std::string("qwen2-moe-tiny"), std::string("qwen3-moe-tiny")}) {
    auto a = make_preset(name);
    ASSERT_TRUE(a->routes_tokens()) << name;
    const at::Tensor ids = sample_ids(a->config());
    auto tape = std::make_shared<RoutingTape>();
    tape->record();
    a->set_routing_tape(tape);
    const at::Tensor loss_a = a->forward(ids, ids).loss;
    const int64_t calls = tape->size();
    EXPECT_GT(calls, 0) << name;
    // The same model replaying its own routing computes what it did, bit for bit, without a flip.
    tape->replay();
    EXPECT_TRUE(at::equal(a->forward(ids, ids).loss, loss_a)) << name;
    RoutingTape::Flips f = tape->take_flips();
    EXPECT_EQ(f.calls, calls) << name;
    EXPECT_EQ(f.tokens, calls * ids.numel()) << name;
    EXPECT_EQ(f.flipped, 0) << name;
    // Routers that prefer the opposite experts: replaying, every token goes where a's routers sent it.
    auto b = make_preset(name);
    {
      at::NoGradGuard no_grad;
      for (const auto& p : b->named_parameters())
        if (p.key().find("mlp.gate.weight") != std::string::npos) p.value().neg_();
    }
    const at::Tensor loss_free = b->forward(ids, ids).loss;
    b->set_routing_tape(tape);
    tape->replay();
    const at::Tensor loss_replayed = b->forward(ids, ids).loss;
    f = tape->take_flips();
    EXPECT_EQ(f.flipped, calls * ids.numel()) << name << ": 4 of 32 experts, the opposite ends";
    EXPECT_GT(f.max_margin, 0.0) << name;
    EXPECT_FALSE(at::equal(loss_replayed, loss_free)) << name;
    b->set_routing_tape(nullptr);
    EXPECT_TRUE(at::equal(b->forward(ids, ids).loss, loss_free)) << name;
  }
  EXPECT_FALSE(make_preset("qwen2-tiny")->routes_tokens());
}

TEST(Config, ErrorsNameTheKey) {
  auto message = [](const std::string& json) {
    try {
      ModelConfig::from_json(json);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(R"({"model_type": "llama"})").find("model_type 'llama' is not supported"),
            std::string::npos);
  EXPECT_NE(message(R"({"model_type": "qwen2"})").find("missing 'vocab_size'"), std::string::npos);
  const std::string base =
      R"({"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2)";
  EXPECT_EQ(message(base + "}"), "no error");
  EXPECT_NE(message(base + R"(, "num_key_value_heads": 3})").find("num_key_value_heads"), std::string::npos);
  EXPECT_NE(message(base + R"(, "rope_parameters": {"rope_type": "yarn"}})").find("rope_type 'yarn'"),
            std::string::npos);
  EXPECT_NE(message(base + R"(, "hidden_size": -1})").find("'hidden_size' = -1"), std::string::npos);
  // nlohmann's parser takes a NUL byte for the end of the text: what follows one must not be ignored.
  const std::string nul_then_more = base + "}" + std::string(1, '\0') + R"(, "hidden_size": -1})";
  EXPECT_NE(
      message(nul_then_more).find("not valid JSON: a NUL byte at offset " + std::to_string(base.size() + 1)),
      std::string::npos)
      << message(nul_then_more);
}

TEST(Config, ParameterCountIsWhatTheModelBuilds) {
  for (const std::string& name : preset_names()) {
    auto model = make_preset(name, at::TensorOptions().device(at::kMeta));
    int64_t numel = 0;
    for (const auto& p : model->parameters()) numel += p.numel();
    EXPECT_EQ(model->config().parameter_count(), static_cast<double>(numel)) << name;
  }
}

TEST(Config, AModelLargerThanPhysicalMemoryIsRefusedBeforeAllocating) {
  // Every field is within its own cap; their product is a petabyte of parameters.
  const std::string huge =
      R"({"model_type": "qwen2", "vocab_size": 16777216, "hidden_size": 16777216, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 2})";
  ASSERT_LT(huge.size(), 1024u);
  const ModelConfig config = ModelConfig::from_json(huge);
  std::string message = "no error";
  try {
    make_model(config);
  } catch (const ConfigError& e) {
    message = e.what();
  }
  EXPECT_NE(
      message.find("config.json: the model would have 5.63e+14 parameters, 2.0 PiB at 4 bytes each, more "
                   "than this machine's "),
      std::string::npos)
      << message;
  EXPECT_NE(message.find("of physical memory (vocab_size 16777216, hidden_size 16777216"), std::string::npos)
      << message;
  // The structure alone (kernmap plan) needs no memory.
  EXPECT_NO_THROW(make_model(config, at::TensorOptions().device(at::kMeta)));
}

}  // namespace
}  // namespace kernmap
