// kernelize(..., Verify) on the presets: every default kernel binds, verified, with its measured error; the
// test plugin's RMSNorm off by a relative 1e-3 in its forward, and the one off only in its backward, are
// refused with the error in the report; a layer the sample step never called is reported as not verified;
// parameters, gradients, train flags and the random state are left as they were; use_fallback=false raises
// and rebinds nothing.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernmap/models.h"
#include "kernmap/plugins.h"
#include "tests/cpp/plugin_repo.h"

namespace kernmap {
namespace {

void load_kmverify() {
  testing::load_test_plugin("kmverify");
}

// One forward of a fixed batch with labels: the loss.
Verify sample_step(CausalLM& model, bool labels = true) {
  const at::Tensor ids =
      at::randint(model.config().vocab_size, {2, 9}, at::TensorOptions().dtype(at::kLong).device(at::kCPU));
  return {
      [&model, ids, labels] { return labels ? model.forward(ids, ids).loss : model.forward(ids).logits; }};
}

void expect_verified(const ReportEntry& e, const std::string& context) {
  EXPECT_FALSE(e.fallback) << context << " " << e.path << ": " << e.reason;
  ASSERT_TRUE(e.error.has_value()) << context << " " << e.path << ": " << e.reason;
  ASSERT_TRUE(e.tolerance.has_value()) << context << " " << e.path;
  EXPECT_LE(*e.error, *e.tolerance) << context << " " << e.path;
}

TEST(Verify, EveryDefaultKernelBindsOnEveryPresetInEveryDtype) {
  for (const std::string& name : preset_names())
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      auto model = make_preset(name, at::TensorOptions().dtype(dtype));
      const Report plain = kernelize(*model, "cpu", Mode::kTraining);
      const Report report = kernelize(*model, "cpu", Mode::kTraining, true, sample_step(*model));
      ASSERT_EQ(report.entries.size(), plain.entries.size());
      const std::string context = name + " " + c10::toString(dtype);
      for (size_t i = 0; i < report.entries.size(); ++i) {
        const ReportEntry& e = report.entries[i];
        EXPECT_EQ(e.kernel, plain.entries[i].kernel) << context << " " << e.path;
        EXPECT_EQ(e.kernel.rfind("kernmap/", 0), 0u) << context << " " << e.path;
        EXPECT_EQ(e.reason, plain.entries[i].reason) << context << " " << e.path;
        expect_verified(e, context);
      }
    }
}

TEST(Verify, InferenceComparesOutputsOnly) {
  auto model = make_preset("qwen2-tiny");
  const Report report = kernelize(*model, "cpu", Mode::kInference, true, sample_step(*model, false));
  for (const ReportEntry& e : report.entries) {
    if (e.layer == "ForCausalLMLoss") {  // no labels: never called
      EXPECT_FALSE(e.fallback);
      EXPECT_FALSE(e.error.has_value());
      EXPECT_TRUE(e.reason.ends_with("; verify: not called by the sample batch")) << e.reason;
      continue;
    }
    expect_verified(e, "inference");
  }
}

TEST(Verify, LeavesParametersGradientsFlagsAndRandomStateAsTheyWere) {
  auto model = make_preset("qwen3-moe-tiny");
  model->eval();
  std::map<std::string, at::Tensor> values, grads;
  std::map<std::string, const void*> grad_storage;
  size_t i = 0;
  for (const auto& p : model->named_parameters()) {
    values[p.key()] = p.value().detach().clone();
    if (i++ % 2 == 0) {  // half with a gradient, half without
      p.value().mutable_grad() = at::full_like(p.value(), 0.5);
      grads[p.key()] = p.value().grad().clone();
      grad_storage[p.key()] = p.value().grad().const_data_ptr();
    }
  }
  const Verify step = sample_step(*model);
  const Report report = kernelize(*model, "cpu", Mode::kTraining, true, step);
  for (const ReportEntry& e : report.entries) expect_verified(e, "state");
  for (const auto& p : model->named_parameters()) {
    EXPECT_TRUE(at::equal(p.value(), values.at(p.key()))) << p.key();
    if (grads.count(p.key())) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_EQ(p.value().grad().const_data_ptr(), grad_storage.at(p.key())) << p.key();
      EXPECT_TRUE(at::equal(p.value().grad(), grads.at(p.key()))) << p.key();
    } else {
      EXPECT_FALSE(p.value().grad().defined()) << p.key();
    }
  }
  EXPECT_FALSE(model->is_training());
  for (const auto& m : model->modules()) EXPECT_FALSE(m->is_training());
}

TEST(Verify, CapturesWithoutTouchingTheRandomStream) {
  auto model = make_preset("qwen2-tiny");
  const Verify step = sample_step(*model);
  at::manual_seed(7);
  const at::Tensor expected = at::rand({8});
  at::manual_seed(7);
  // A step that draws random numbers itself (as dropout would) leaves the stream where it was.
  kernelize(*model, "cpu", Mode::kTraining, true, {[&step] {
    (void)at::rand({3});
    return step.step();
  }});
  EXPECT_TRUE(at::equal(at::rand({8}), expected));
}

struct Wrong {
  const char* kernel;
  const char* what;  // the result the reason names
};

class WrongKernel : public ::testing::TestWithParam<Wrong> {};

TEST_P(WrongKernel, IsRefusedWithTheMeasuredErrorAndTheOthersStayBound) {
  load_kmverify();
  const Wrong wrong = GetParam();
  for (const std::string& name : preset_names()) {
    auto model = make_preset(name);
    const ScopedMapping scope({{"RMSNorm", {{"cpu", {{Mode::kTraining, wrong.kernel}}}}}});
    const Report plain = kernelize(*model, "cpu", Mode::kTraining);
    const Report report = kernelize(*model, "cpu", Mode::kTraining, true, sample_step(*model));
    size_t refused = 0;
    for (size_t i = 0; i < report.entries.size(); ++i) {
      const ReportEntry& e = report.entries[i];
      if (e.layer != "RMSNorm") {
        expect_verified(e, name);
        continue;
      }
      EXPECT_EQ(plain.entries[i].kernel, wrong.kernel) << name << " " << e.path;
      EXPECT_TRUE(e.fallback) << name << " " << e.path << ": " << e.reason;
      EXPECT_EQ(e.kernel, "reference/rms_norm");
      EXPECT_EQ(e.source, "reference");
      EXPECT_EQ(e.reason.rfind(std::string("verify: ") + wrong.what + " max error ", 0), 0u) << e.reason;
      EXPECT_NE(e.reason.find(" > tolerance "), std::string::npos) << e.reason;
      ASSERT_TRUE(e.error && e.tolerance) << e.reason;
      EXPECT_GT(*e.error, *e.tolerance) << e.reason;
      ++refused;
    }
    EXPECT_GT(refused, 0u) << name;
    for (const auto& m : model->modules()) {
      if (auto* layer = dynamic_cast<KernelLayer*>(m.get()); layer && layer->layer_name() == "RMSNorm") {
        EXPECT_EQ(layer->kernel().name, "reference/rms_norm");
      }
    }

    const std::string table = report.table();
    EXPECT_NE(table.find("error / tolerance"), std::string::npos) << table;
    const nlohmann::json doc = nlohmann::json::parse(report.json());
    for (const nlohmann::json& row : doc["layers"]) {
      ASSERT_TRUE(row["error"].is_number()) << row;
      EXPECT_TRUE(row["tolerance"].is_number()) << row;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Plugin, WrongKernel,
                         ::testing::Values(Wrong{"kmverify/rms_norm_forward_off", "output"},
                                           Wrong{"kmverify/rms_norm_backward_off", "grad_x"}),
                         [](const auto& info) {
                           return std::string(info.param.what) == "output" ? "Forward" : "Backward";
                         });

TEST(Verify, TheSlowButCorrectKernelPasses) {
  load_kmverify();
  auto model = make_preset("qwen2-tiny");
  const ScopedMapping scope({{"RMSNorm", {{"cpu", {{Mode::kTraining, "kmverify/rms_norm_slow"}}}}}});
  const Report report = kernelize(*model, "cpu", Mode::kTraining, true, sample_step(*model));
  for (const ReportEntry& e : report.entries) {
    expect_verified(e, "slow");
    if (e.layer == "RMSNorm") {
      EXPECT_EQ(e.kernel, "kmverify/rms_norm_slow");
    }
  }
}

TEST(Verify, UseFallbackFalseRaisesAndRebindsNothing) {
  load_kmverify();
  auto model = make_preset("qwen2-tiny");
  restore_reference(*model);
  const ScopedMapping scope({{"RMSNorm", {{"cpu", {{Mode::kTraining, "kmverify/rms_norm_forward_off"}}}}}});
  try {
    kernelize(*model, "cpu", Mode::kTraining, false, sample_step(*model));
    FAIL() << "kernelize did not raise";
  } catch (const KernelizeError& e) {
    EXPECT_NE(std::string(e.what()).find("verify: output max error"), std::string::npos) << e.what();
    bool any = false;
    for (const ReportEntry& entry : e.report.entries) any = any || entry.fallback;
    EXPECT_TRUE(any);
  }
  for (const auto& m : model->modules()) {
    if (auto* layer = dynamic_cast<KernelLayer*>(m.get())) {
      EXPECT_EQ(layer->kernel().provider(), "reference") << layer->layer_name();
    }
  }
}

TEST(Verify, ReportJsonHasNullErrorsWhenNotVerified) {
  auto model = make_preset("qwen2-tiny");
  const Report report = kernelize(*model, "cpu", Mode::kTraining);
  const nlohmann::json doc = nlohmann::json::parse(report.json());
  for (const nlohmann::json& row : doc["layers"]) {
    EXPECT_TRUE(row.contains("error") && row["error"].is_null()) << row;
    EXPECT_TRUE(row.contains("tolerance") && row["tolerance"].is_null()) << row;
  }
  EXPECT_EQ(report.table().find("error / tolerance"), std::string::npos);
}

}  // namespace
}  // namespace kernmap
