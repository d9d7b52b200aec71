// tune() on the presets with the kmverify and kmgood test plugins loaded: every registered kernel of a layer
// is a candidate; the slow but correct RMSNorm is verified, timed and loses; the wrong ones fail verification
// and are not timed; the winner is the fastest verified candidate; the written mapping file loads back as the
// winners, and the model's kernels and gradients are untouched. No timing thresholds: only which kernel
// loses.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "kernmap/mapping_file.h"
#include "kernmap/models.h"
#include "kernmap/tune.h"
#include "tests/cpp/plugin_repo.h"

namespace kernmap {
namespace {

namespace fs = std::filesystem;

Verify sample_step(CausalLM& model) {
  const at::Tensor ids = at::randint(model.config().vocab_size, {2, 9}, at::TensorOptions().dtype(at::kLong));
  return {[&model, ids] { return model.forward(ids, ids).loss; }};
}

const TuneCandidate& candidate(const TuneResult& r, const std::string& layer, const std::string& kernel) {
  for (const TuneLayer& l : r.layers)
    for (const TuneCandidate& c : l.candidates)
      if (l.layer == layer && c.kernel == kernel) return c;
  throw std::runtime_error("no candidate " + kernel + " of " + layer + " in\n" + r.table());
}

class Tune : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    testing::load_test_plugin("kmverify");
    testing::load_test_plugin("kmgood");
    model_ = make_preset("qwen2-tiny");
    result_ = new TuneResult(tune(*model_, "cpu", sample_step(*model_), {1, 3}));
  }
  static void TearDownTestSuite() {
    delete result_;
    model_.reset();
  }
  static std::shared_ptr<CausalLM> model_;
  static TuneResult* result_;
};

std::shared_ptr<CausalLM> Tune::model_;
TuneResult* Tune::result_ = nullptr;

TEST_F(Tune, EveryRegisteredKernelOfEachCalledLayerIsACandidate) {
  std::map<std::string, TuneLayer> by_layer;
  for (const TuneLayer& l : result_->layers) by_layer[l.layer] = l;
  for (const char* layer : {"RMSNorm", "FusedAddRMSNorm", "rotary_pos_emb", "SiluAndMul", "ForCausalLMLoss"})
    EXPECT_TRUE(by_layer.count(layer)) << layer << "\n" << result_->table();
  EXPECT_FALSE(by_layer.count("SiLU")) << "qwen2 never calls SiLU";
  for (const auto& [layer, l] : by_layer) {
    std::vector<std::string> registered, listed;
    for (const KernelDescriptor* k : registered_kernels())
      if (k->layer == layer) registered.push_back(k->name);
    for (const TuneCandidate& c : l.candidates) listed.push_back(c.kernel);
    EXPECT_EQ(listed, registered) << layer;
  }
  // qwen2-tiny: layer 0's input norm is plain, the final norm and every other pre-norm fuse the residual add.
  EXPECT_EQ(by_layer["RMSNorm"].calls, 1);
  ASSERT_EQ(by_layer["RMSNorm"].shapes.size(), 1u);
  EXPECT_EQ(by_layer["RMSNorm"].shapes[0].rfind("2x9x", 0), 0u) << by_layer["RMSNorm"].shapes[0];
  EXPECT_NE(by_layer["RMSNorm"].shapes[0].find(" float32 (1)"), std::string::npos);
}

TEST_F(Tune, TheSlowCorrectKernelIsVerifiedTimedAndLoses) {
  const TuneCandidate& slow = candidate(*result_, "RMSNorm", "kmverify/rms_norm_slow");
  EXPECT_NE(result_->winners().at("RMSNorm"), "kmverify/rms_norm_slow");
  ASSERT_TRUE(slow.error && slow.tolerance && slow.median_ms);
  EXPECT_LE(*slow.error, *slow.tolerance);
  EXPECT_EQ(slow.verdict.rfind("slower: ", 0), 0u) << slow.verdict;
  EXPECT_NE(slow.verdict.find(result_->winners().at("RMSNorm")), std::string::npos) << slow.verdict;
}

TEST_F(Tune, WrongKernelsFailVerificationAndAreNotTimed) {
  for (const auto& [kernel, what] : std::map<std::string, std::string>{
           {"kmverify/rms_norm_forward_off", "output"}, {"kmverify/rms_norm_backward_off", "grad_x"}}) {
    const TuneCandidate& c = candidate(*result_, "RMSNorm", kernel);
    EXPECT_EQ(c.verdict.rfind("failed verify: " + what + " max error ", 0), 0u) << c.verdict;
    EXPECT_FALSE(c.median_ms);
    ASSERT_TRUE(c.error && c.tolerance);
    EXPECT_GT(*c.error, *c.tolerance);
  }
}

TEST_F(Tune, TheWinnerIsTheFastestVerifiedCandidate) {
  for (const TuneLayer& l : result_->layers) {
    const TuneCandidate* fastest = nullptr;
    int winners = 0;
    for (const TuneCandidate& c : l.candidates) {
      if (c.median_ms && (!fastest || *c.median_ms < *fastest->median_ms)) fastest = &c;
      winners += c.verdict == "winner";
    }
    ASSERT_NE(fastest, nullptr) << l.layer;
    EXPECT_EQ(l.winner, fastest->kernel) << l.layer;
    EXPECT_EQ(winners, 1) << l.layer;
  }
}

TEST_F(Tune, AKernelThatCannotRunHereSaysWhy) {
  const TuneCandidate& npu = candidate(*result_, "RMSNorm", "kmgood/rms_norm_npu");  // an npu-only kernel
  EXPECT_EQ(npu.verdict.rfind("not eligible: ", 0), 0u) << npu.verdict;
  EXPECT_FALSE(npu.median_ms || npu.error) << npu.verdict;
  const TuneCandidate& cpu = candidate(*result_, "RMSNorm", "kmgood/rms_norm");  // its cpu twin runs
  EXPECT_TRUE(cpu.median_ms && cpu.error) << cpu.verdict;
}

TEST_F(Tune, LeavesTheModelsKernelsAsTheyWere) {
  for (const auto& m : model_->modules())
    if (auto* layer = dynamic_cast<KernelLayer*>(m.get())) {
      EXPECT_EQ(layer->kernel().provider(), "reference") << layer->layer_name();
    }
  for (const auto& p : model_->parameters()) EXPECT_FALSE(p.grad().defined());
}

TEST_F(Tune, TheWrittenFilesLoadBackAsTheWinners) {
  const fs::path dir = fs::temp_directory_path() / ("kernmap-tune-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (const char* name : {"tuned.toml", "tuned.json"}) {
    const std::string path = (dir / name).string();
    const std::string side = write_tune_files(*result_, path);
    EXPECT_EQ(side, (dir / "tuned.tune.json").string());
    EXPECT_EQ(load_mapping_file(path), result_->mapping()) << path;
    std::stringstream text;
    text << std::ifstream(path).rdbuf();
    if (std::string(name).ends_with(".toml")) {
      EXPECT_EQ(text.str().rfind("# kernmap tune: ", 0), 0u) << text.str();
      EXPECT_NE(text.str().find("#   kmverify/rms_norm_slow: "), std::string::npos) << text.str();
      EXPECT_NE(text.str().find("ATen CPU level "), std::string::npos) << text.str();
    }
    std::stringstream table;
    table << std::ifstream(side).rdbuf();
    const nlohmann::json doc = nlohmann::json::parse(table.str());
    EXPECT_EQ(doc["kernmap_tune"], 1);
    EXPECT_EQ(doc["mapping"]["RMSNorm"]["cpu"]["training"], result_->winners().at("RMSNorm"));
    EXPECT_EQ(doc["layers"].size(), result_->layers.size());
  }
  EXPECT_THROW(write_tune_files(*result_, (dir / "tuned.yaml").string()), std::invalid_argument);
  EXPECT_THROW(write_tune_files(*result_, (dir / "missing" / "tuned.toml").string()), std::runtime_error);
  fs::remove_all(dir);
}

TEST(TuneOptions, AreChecked) {
  auto model = make_preset("qwen2-tiny");
  EXPECT_THROW(tune(*model, "cpu", sample_step(*model), {-1, 3}), std::invalid_argument);
  EXPECT_THROW(tune(*model, "cpu", sample_step(*model), {1, 0}), std::invalid_argument);
  EXPECT_THROW(tune(*model, "cpu", Verify{}, {}), std::invalid_argument);
}

TEST(MappingFileText, WritesWhatTheReadersTakeBack) {
  const std::vector<MappingFileSection> sections = {
      {{"a comment", "with\na line break"}, "RMSNorm", "cpu", {{Mode::kTraining, "kernmap/rms_norm"}}},
      {{},
       "SiluAndMul",
       "cpu",
       {{Mode::kInference, "kernmap/silu_and_mul"},
        {Mode::kTraining | Mode::kCompile, "kernmap/silu_and_mul"}}}};
  const std::string toml = mapping_file_text("x.toml", {"header"}, sections);
  EXPECT_EQ(
      toml,
      "# header\nkernmap_mapping = 1\n\n# a comment\n# with a line break\n[RMSNorm.cpu]\ntraining = "
      "\"kernmap/rms_norm\"\n\n[SiluAndMul.cpu]\ninference = \"kernmap/silu_and_mul\"\n\"training+compile\" "
      "= \"kernmap/silu_and_mul\"\n\n");
  const std::string json = mapping_file_text("x.JSON", {"header"}, sections);
  EXPECT_EQ(
      nlohmann::json::parse(json),
      nlohmann::json::parse(R"({"kernmap_mapping": 1, "RMSNorm": {"cpu": {"training": "kernmap/rms_norm"}},
              "SiluAndMul": {"cpu": {"inference": "kernmap/silu_and_mul",
                                     "training+compile": "kernmap/silu_and_mul"}}})"));
  EXPECT_THROW(mapping_file_text("x.yaml", {}, sections), MappingFileError);
}

}  // namespace
}  // namespace kernmap
