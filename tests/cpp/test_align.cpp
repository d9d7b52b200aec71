// align's verdict where it must hold on every machine: the three presets' correct kernels PASS at every CPU
// level this machine runs with one intra-op thread and at the best level with two, and qwen3-moe-tiny at 128
// tokens, whose router has a near-tie a correct rounding tips (replayed routing); a kernel wrong by 1e-3 in
// one layer (RMSNorm's output times 1 + 1e-3) FAILs (the noise run does not depend on the level: once is
// enough); free routing keeps the per-layer noise runs; every layer has the float64 kernel the noise run
// binds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/library.h>

#include <cstdio>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kernmap/cpu.h"
#include "kernmap/ops.h"
#include "kernmap/train.h"

namespace {

at::Tensor perturbed_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static auto reference = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("kernmap::reference_rms_norm", "")
                              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return reference.call(x, weight, eps) * (1 + 1e-3);
}

TORCH_LIBRARY(kernmap_test_align, m) {
  m.def("rms_norm_perturbed(Tensor x, Tensor weight, float eps) -> Tensor");
}
TORCH_LIBRARY_IMPL(kernmap_test_align, CompositeImplicitAutograd, m) {
  m.impl("rms_norm_perturbed", &perturbed_rms_norm);
}

const char* kPerturbed = "test/rms_norm_perturbed";

void register_perturbed() {
  if (kernmap::find_kernel(kPerturbed)) return;
  kernmap::register_kernel(
      kernmap::KernelDescriptor{.name = kPerturbed,
                                .layer = "RMSNorm",
                                .devices = {"cpu"},
                                .dtypes = {"float32", "bfloat16"},
                                .has_backward = true,
                                .op = "kernmap_test_align::rms_norm_perturbed",
                                .description = "RMSNorm x (1 + 1e-3): wrong on purpose"});
}

kernmap::train::AlignResult run_align(const std::string& preset, int64_t steps, int64_t seq_len = 64,
                                      kernmap::train::Routing routing = kernmap::train::Routing::kReplay) {
  const auto factory = [preset] { return kernmap::make_preset(preset); };
  const kernmap::train::Dataset data =
      kernmap::train::synthetic_dataset(kernmap::preset_config(preset).vocab_size, 64, seq_len);
  return kernmap::train::align(factory, data, {}, kernmap::train::parse_kernels("all"), steps, 1e-5, {},
                               false, routing);
}

class AlignEverywhere : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  void SetUp() override {
    previous_level_ = kernmap::cpu_level();
    previous_threads_ = at::get_num_threads();
    kernmap::set_cpu_level(std::get<0>(GetParam()));
    at::set_num_threads(std::get<1>(GetParam()));
  }
  void TearDown() override {
    kernmap::set_cpu_level(previous_level_);
    at::set_num_threads(previous_threads_);
  }
  std::string previous_level_;
  int previous_threads_ = 1;
};

TEST_P(AlignEverywhere, CorrectKernelsPassOnEveryPreset) {
  for (const std::string& preset : kernmap::preset_names()) {
    const kernmap::train::AlignResult res = run_align(preset, 20);
    EXPECT_TRUE(res.passed) << preset << ": loss " << res.max_loss_rel << " (step " << res.worst_loss_step
                            << "), grad_norm " << res.max_grad_norm_rel << " (step "
                            << res.worst_grad_norm_step << ")";
    for (const kernmap::ReportEntry& e : res.report.entries)
      EXPECT_FALSE(e.fallback) << preset << " " << e.path;
    // The floor covers every layer: the noise run has each on its float64 kernel.
    for (const kernmap::ReportEntry& e : res.noise_report.entries)
      EXPECT_EQ(e.kernel.rfind("float64/", 0), 0u) << preset << " " << e.path << " runs " << e.kernel;
    // A model that routes tokens replays the original's routing (and needs no per-layer noise runs); each
    // step of the kernelized run counts the tokens its own routers would have sent elsewhere.
    const bool moe = preset.find("moe") != std::string::npos;
    EXPECT_EQ(res.routing_replayed, moe) << preset;
    EXPECT_TRUE(res.noise_alone.empty()) << preset;
    ASSERT_EQ(res.routing.size(), moe ? 20u : 0u) << preset;
    for (const kernmap::RoutingTape::Flips& f : res.routing) {
      EXPECT_GT(f.calls, 0) << preset;
      EXPECT_EQ(f.tokens % (4 * 64), 0) << preset << ": every call routes the batch's 4 x 64 tokens";
      EXPECT_LE(f.flipped, f.tokens) << preset;
    }
    if (moe) {
      EXPECT_EQ(res.noise_routing.calls, res.routing.front().calls * 20) << preset;
    }
  }
}

// qwen3-moe-tiny at 128 tokens a row: a correct rounding (FusedAddRMSNorm's) tips a near-tie of a router at
// step 5 on a Zen 4 at avx2 and above; routing freely, the runs then part (grad_norm 4.4e-5 at step 17
// against a floor of 5e-7: a false FAIL). Replayed, the runs compare the kernels' arithmetic.
TEST_P(AlignEverywhere, ARouterNearTieDoesNotFailCorrectKernels) {
  const kernmap::train::AlignResult res = run_align("qwen3-moe-tiny", 20, 128);
  EXPECT_TRUE(res.passed) << "loss " << res.max_loss_rel << " (step " << res.worst_loss_step
                          << "), grad_norm " << res.max_grad_norm_rel << " (step " << res.worst_grad_norm_step
                          << ")";
  int64_t flipped = 0;
  for (const kernmap::RoutingTape::Flips& f : res.routing) flipped += f.flipped;
  std::printf(
      "qwen3-moe-tiny, 128 tokens: %lld tokens flipped in the kernelized run, %lld in the noise run\n",
      static_cast<long long>(flipped), static_cast<long long>(res.noise_routing.flipped));
}

TEST(Align, FreeRoutingSamplesEachLayerAlone) {
  const kernmap::train::AlignResult res = run_align("qwen3-moe-tiny", 3, 64, kernmap::train::Routing::kFree);
  EXPECT_FALSE(res.routing_replayed);
  EXPECT_TRUE(res.routing.empty());
  std::set<std::string> layers;
  for (const kernmap::ReportEntry& e : res.noise_report.entries) layers.insert(e.layer);
  EXPECT_EQ(res.noise_alone.size(), layers.size());
  for (const auto& [layer, logs] : res.noise_alone) EXPECT_EQ(logs.size(), 3u) << layer;
}

TEST(Align, AKernelWrongBy1e3InOneLayerFails) {
  register_perturbed();
  kernmap::ScopedMapping perturbed({{"RMSNorm", {{"cpu", {{kernmap::Mode::kFallback, kPerturbed}}}}}});
  for (const std::string& preset : {std::string("qwen2-tiny"), std::string("qwen3-moe-tiny")}) {
    const kernmap::train::AlignResult res = run_align(preset, 3);  // it fails at step 1 already
    EXPECT_FALSE(res.passed) << preset;
    EXPECT_GT(res.verdict.grad_norm.diff[0], res.verdict.grad_norm.tolerance[0])
        << preset << ": the error shows from the first step";
    bool bound = false;
    for (const kernmap::ReportEntry& e : res.report.entries) bound = bound || e.kernel == kPerturbed;
    EXPECT_TRUE(bound) << preset;
    // The noise run is the float64 kernels', unaffected by the mapping: its floor stays at the rounding
    // level.
    EXPECT_LT(res.verdict.grad_norm.floor[0], 1e-6) << preset;
  }
}

TEST(Float64Kernels, EveryLayerHasOne) {
  for (const std::string& layer : kernmap::registered_layers()) {
    const kernmap::KernelDescriptor* k = kernmap::train::float64_kernel(layer);
    ASSERT_NE(k, nullptr) << layer << " has no float64 kernel: align's noise floor would not cover it";
    EXPECT_TRUE(k->has_backward) << k->name;
    // It runs wherever the reference runs, on whatever the reference takes.
    const kernmap::KernelDescriptor* ref = kernmap::reference_kernel(layer);
    EXPECT_EQ(k->devices, ref->devices) << k->name;
    EXPECT_EQ(k->dtypes, ref->dtypes) << k->name;
    EXPECT_FALSE(static_cast<bool>(k->supports)) << k->name << " refuses inputs the reference takes";
  }
}

std::vector<std::tuple<std::string, int>> everywhere() {
  std::vector<std::tuple<std::string, int>> out;
  const std::vector<std::string> levels = kernmap::supported_cpu_levels();
  for (const std::string& level : levels) out.emplace_back(level, 1);
  out.emplace_back(levels.back(), 2);
  return out;
}

INSTANTIATE_TEST_SUITE_P(LevelsAndThreads, AlignEverywhere, ::testing::ValuesIn(everywhere()),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) +
                                  "threads";
                         });

}  // namespace
