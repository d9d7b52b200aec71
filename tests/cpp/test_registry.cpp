// Registry tests: descriptors, mapping levels, resolution order and reasons, environment, threads.
//
// The binary may also hold the built-in kernels (RMSNorm, SiLU, SiluAndMul), so these tests use layers and
// kernel names of their own and only assert about those.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "kernmap/registry.h"

namespace kernmap {
namespace {

constexpr Mode kInferenceCompile = Mode::kInference | Mode::kCompile;
constexpr Mode kTrainingCompile = Mode::kTraining | Mode::kCompile;

KernelDescriptor kernel(std::string name, std::string layer, std::vector<std::string> devices,
                        bool has_backward, bool compile_safe) {
  KernelDescriptor d;
  d.name = std::move(name);
  d.layer = std::move(layer);
  d.devices = std::move(devices);
  d.dtypes = {"float32", "bfloat16"};
  d.has_backward = has_backward;
  d.compile_safe = compile_safe;
  return d;
}

// Test kernels and defaults, registered once per process (kernels can never be unregistered).
void register_test_kernels() {
  static const bool registered = [] {
    KernelDescriptor reference_norm = kernel("reference/test_norm", "TestNorm", {"*"}, true, true);
    reference_norm.dtypes = {"float32", "bfloat16", "float16", "float64"};
    register_kernel(std::move(reference_norm));
    register_kernel(kernel("reference/test_act", "TestAct", {"*"}, true, true));
    register_kernel(kernel("tk/fast", "TestNorm", {"cpu", "cuda"}, true, true));
    register_kernel(kernel("tk/nobwd", "TestNorm", {"cpu"}, false, true));
    register_kernel(kernel("tk/eager", "TestNorm", {"cpu"}, true, false));
    register_kernel(kernel("tk/npu", "TestNorm", {"npu"}, true, true));
    register_kernel(kernel("tk/anywhere", "TestNorm", {"*"}, true, true));
    register_kernel(kernel("tk/act", "TestAct", {"cpu"}, true, true));
    KernelDescriptor picky = kernel("tk/picky", "TestNorm", {"cpu"}, true, true);
    picky.supports = [](const KernelInputs& inputs) -> std::optional<std::string> {
      if (!inputs.shapes.empty() && inputs.shapes[0].back() % 2 != 0) {
        return "tk/picky needs an even hidden size, got " + std::to_string(inputs.shapes[0].back());
      }
      return std::nullopt;
    };
    register_kernel(std::move(picky));
    register_default_mapping({
        {"TestNorm",
         {{"cpu", {{Mode::kInference, "tk/fast"}}},
          {"cuda", {{Mode::kTraining, "tk/fast"}}},
          // Defaults may name kernels built into a library that is not loaded.
          {"rocm", {{Mode::kInference, "tk/not_built"}}}}},
        {"TestAct", {{"cpu", {{Mode::kFallback, "tk/act"}}}}},
    });
    return true;
  }();
  (void)registered;
}

// Sets (or unsets, with nullopt) an environment variable and restores the old value on destruction.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::optional<std::string>& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    set(value);
  }
  ~ScopedEnv() { set(old_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  void set(const std::optional<std::string>& value) {
    if (value) {
      setenv(name_, value->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  const char* name_;
  std::optional<std::string> old_;
};

class RegistryTest : public testing::Test {
 protected:
  void SetUp() override {
    register_test_kernels();
    clear_user_mappings();
  }
  void TearDown() override { clear_user_mappings(); }

  ScopedEnv no_disable_{"KERNMAP_DISABLE", std::nullopt};
  ScopedEnv no_log_{"KERNMAP_LOG", std::nullopt};
};

// Checks the whole decision: chosen kernel, fallback flag, source and reason.
void expect_decision(const Decision& d, const std::string& kernel, bool fallback, const std::string& source,
                     const std::string& reason) {
  ASSERT_NE(d.kernel, nullptr);
  EXPECT_EQ(d.kernel->name, kernel);
  EXPECT_EQ(d.fallback, fallback);
  EXPECT_EQ(d.source, source);
  EXPECT_EQ(d.reason, reason);
}

void expect_reference(const Decision& d, const std::string& reason) {
  expect_decision(d, "reference/test_norm", true, "reference", reason);
}

template <typename F>
std::string invalid_argument_message(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected std::invalid_argument";
  return {};
}

// --- descriptors ---

TEST_F(RegistryTest, FindsRegisteredKernelsSortedByName) {
  const KernelDescriptor* fast = find_kernel("tk/fast");
  ASSERT_NE(fast, nullptr);
  EXPECT_EQ(fast->layer, "TestNorm");
  EXPECT_EQ(fast->provider(), "tk");
  EXPECT_EQ(find_kernel("tk/fast"), fast);  // stable pointer
  EXPECT_EQ(find_kernel("tk/missing"), nullptr);

  const std::vector<const KernelDescriptor*> all = registered_kernels();
  EXPECT_TRUE(std::is_sorted(all.begin(), all.end(), [](auto* a, auto* b) { return a->name < b->name; }));
  EXPECT_NE(std::find(all.begin(), all.end(), fast), all.end());

  ASSERT_NE(reference_kernel("TestNorm"), nullptr);
  EXPECT_EQ(reference_kernel("TestNorm")->name, "reference/test_norm");
  EXPECT_EQ(reference_kernel("TestNorm")->provider(), "reference");
  EXPECT_EQ(reference_kernel("NoSuchLayer"), nullptr);
}

TEST_F(RegistryTest, RejectsMalformedKernelNames) {
  for (const std::string name : {"", "noslash", "/name", "provider/", "a/b/c", "tk/with space"}) {
    const std::string message =
        invalid_argument_message([&] { register_kernel(kernel(name, "TestNorm", {"cpu"}, true, true)); });
    EXPECT_NE(message.find("'" + name + "'"), std::string::npos) << message;
    EXPECT_NE(message.find("provider/name"), std::string::npos) << message;
    EXPECT_EQ(find_kernel(name), nullptr);
  }
}

TEST_F(RegistryTest, RejectsEmptyLayerDuplicatesAndASecondReference) {
  std::string message =
      invalid_argument_message([] { register_kernel(kernel("tk/no_layer", "", {"cpu"}, true, true)); });
  EXPECT_NE(message.find("'tk/no_layer' has an empty layer"), std::string::npos) << message;
  EXPECT_EQ(find_kernel("tk/no_layer"), nullptr);

  message =
      invalid_argument_message([] { register_kernel(kernel("tk/fast", "TestAct", {"cpu"}, true, true)); });
  EXPECT_NE(message.find("'tk/fast' is registered already (for layer 'TestNorm')"), std::string::npos)
      << message;
  EXPECT_EQ(find_kernel("tk/fast")->layer, "TestNorm");

  message = invalid_argument_message(
      [] { register_kernel(kernel("reference/test_norm_again", "TestNorm", {"*"}, true, true)); });
  EXPECT_NE(message.find("'TestNorm' has a reference kernel already ('reference/test_norm')"),
            std::string::npos)
      << message;
  EXPECT_EQ(find_kernel("reference/test_norm_again"), nullptr);
  EXPECT_EQ(reference_kernel("TestNorm")->name, "reference/test_norm");
}

// --- modes ---

TEST_F(RegistryTest, ModeSpellingsRoundTrip) {
  const std::pair<Mode, std::string> spellings[] = {
      {Mode::kInference, "inference"},
      {Mode::kTraining, "training"},
      {kInferenceCompile, "inference+compile"},
      {kTrainingCompile, "training+compile"},
      {Mode::kFallback, "fallback"},
  };
  for (const auto& [mode, text] : spellings) {
    EXPECT_EQ(to_string(mode), text);
    EXPECT_EQ(parse_mode(text), mode);
  }
  EXPECT_EQ(to_string(Mode::kCompile), "compile");
  EXPECT_EQ(to_string(Mode::kInference | Mode::kTraining), "inference+training");
}

TEST_F(RegistryTest, ParseModeRejectsOtherSpellings) {
  for (const std::string text : {"", "Inference", "compile", "compile+inference", "inference "}) {
    const std::string message = invalid_argument_message([&] { parse_mode(text); });
    EXPECT_NE(message.find("'" + text + "'"), std::string::npos) << message;
    EXPECT_NE(message.find("inference, training, inference+compile, training+compile, fallback"),
              std::string::npos)
        << message;
  }
}

// --- resolution order and reasons ---

TEST_F(RegistryTest, DefaultMappingIsUsed) {
  const Decision d = resolve("TestNorm", "cpu", Mode::kInference);
  expect_decision(d, "tk/fast", false, "default", "default mapping (inference)");
  EXPECT_EQ(d.layer, "TestNorm");
  EXPECT_EQ(d.device, "cpu");
  EXPECT_EQ(d.mode, Mode::kInference);
}

TEST_F(RegistryTest, InferenceFallsThroughToTrainingEntries) {
  register_mapping({{"TestNorm", {{"cpu", {{Mode::kTraining, "tk/anywhere"}}}}}});
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/anywhere", false, "user",
                  "user mapping (training)");
}

TEST_F(RegistryTest, InferencePrefersInferenceCompileOverTraining) {
  register_mapping({{"TestNorm",
                     {{"cpu",
                       {{Mode::kTraining, "tk/fast"},
                        {kInferenceCompile, "tk/anywhere"},
                        {Mode::kFallback, "tk/eager"}}}}}});
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/anywhere", false, "user",
                  "user mapping (inference+compile)");
}

TEST_F(RegistryTest, TrainingRejectsKernelWithoutBackward) {
  register_mapping({{"TestNorm", {{"cpu", {{Mode::kTraining, "tk/nobwd"}}}}}});
  expect_reference(resolve("TestNorm", "cpu", Mode::kTraining), "tk/nobwd has no backward");
  // Inference needs no backward, so the same entry serves it.
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/nobwd", false, "user",
                  "user mapping (training)");
}

TEST_F(RegistryTest, TrainingIgnoresInferenceEntries) {
  register_mapping(
      {{"TestNorm", {{"cpu", {{Mode::kInference, "tk/fast"}, {kInferenceCompile, "tk/fast"}}}}}});
  expect_reference(resolve("TestNorm", "cpu", Mode::kTraining), "no training mapping for TestNorm on cpu");
}

TEST_F(RegistryTest, TrainingFallsThroughToFallbackKey) {
  register_mapping(
      {{"TestNorm", {{"cpu", {{Mode::kTraining, "tk/nobwd"}, {Mode::kFallback, "tk/anywhere"}}}}}});
  expect_decision(resolve("TestNorm", "cpu", Mode::kTraining), "tk/anywhere", false, "user",
                  "user mapping (fallback)");
}

TEST_F(RegistryTest, FirstRejectionIsTheReason) {
  register_mapping({{"TestNorm", {{"cpu", {{Mode::kTraining, "tk/nobwd"}, {kTrainingCompile, "tk/npu"}}}}}});
  expect_reference(resolve("TestNorm", "cpu", Mode::kTraining), "tk/nobwd has no backward");
}

TEST_F(RegistryTest, CompileRequestRejectsKernelsThatAreNotCompileSafe) {
  register_mapping({{"TestNorm", {{"cpu", {{kInferenceCompile, "tk/eager"}}}}}});
  expect_reference(resolve("TestNorm", "cpu", kInferenceCompile), "tk/eager is not compile-safe");
  // An eager request may use a +compile entry.
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/eager", false, "user",
                  "user mapping (inference+compile)");

  register_mapping(
      {{"TestNorm", {{"cpu", {{kInferenceCompile, "tk/eager"}, {Mode::kFallback, "tk/fast"}}}}}});
  expect_decision(resolve("TestNorm", "cpu", kInferenceCompile), "tk/fast", false, "user",
                  "user mapping (fallback)");
}

TEST_F(RegistryTest, TrainingCompileUsesOnlyTrainingCompileAndFallback) {
  register_mapping({{"TestNorm", {{"cpu", {{Mode::kTraining, "tk/fast"}, {kInferenceCompile, "tk/fast"}}}}}});
  expect_reference(resolve("TestNorm", "cpu", kTrainingCompile),
                   "no training+compile mapping for TestNorm on cpu");

  register_mapping(
      {{"TestNorm", {{"cpu", {{kTrainingCompile, "tk/eager"}, {Mode::kFallback, "tk/nobwd"}}}}}});
  expect_reference(resolve("TestNorm", "cpu", kTrainingCompile), "tk/eager is not compile-safe");

  register_mapping({{"TestNorm", {{"cpu", {{kTrainingCompile, "tk/fast"}}}}}});
  expect_decision(resolve("TestNorm", "cpu", kTrainingCompile), "tk/fast", false, "user",
                  "user mapping (training+compile)");
}

TEST_F(RegistryTest, RejectsKernelForAnotherDevice) {
  register_mapping(
      {{"TestNorm",
        {{"npu", {{Mode::kInference, "tk/fast"}}}, {"xpu", {{Mode::kInference, "tk/anywhere"}}}}}});
  expect_reference(resolve("TestNorm", "npu", Mode::kInference), "tk/fast does not run on npu");
  // "*" runs anywhere.
  expect_decision(resolve("TestNorm", "xpu", Mode::kInference), "tk/anywhere", false, "user",
                  "user mapping (inference)");
}

TEST_F(RegistryTest, UnmappedDeviceFallsBack) {
  expect_reference(resolve("TestNorm", "mps", Mode::kInference), "no mapping for mps");
  expect_reference(resolve("TestNorm", "cpu", Mode::kTraining), "no training mapping for TestNorm on cpu");
}

TEST_F(RegistryTest, UnregisteredDefaultKernelFallsBack) {
  expect_reference(resolve("TestNorm", "rocm", Mode::kInference), "kernel tk/not_built is not registered");
}

TEST_F(RegistryTest, RejectsUnsupportedDtype) {
  expect_reference(resolve("TestNorm", "cpu", Mode::kInference, {.dtype = "float64", .shapes = {}}),
                   "dtype float64 not supported by tk/fast");
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference, {.dtype = "bfloat16", .shapes = {}}),
                  "tk/fast", false, "default", "default mapping (inference)");
}

TEST_F(RegistryTest, RejectsInputsTheKernelDoesNotSupport) {
  register_mapping({{"TestNorm", {{"cpu", {{Mode::kInference, "tk/picky"}}}}}});
  expect_reference(
      resolve("TestNorm", "cpu", Mode::kInference, {.dtype = "float32", .shapes = {{4, 7}, {7}}}),
      "tk/picky needs an even hidden size, got 7");
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference, {.dtype = "float32", .shapes = {{4, 8}, {8}}}),
                  "tk/picky", false, "user", "user mapping (inference)");
}

TEST_F(RegistryTest, ResolveRejectsUnknownLayersAndNonRequestModes) {
  std::string message = invalid_argument_message([] { resolve("NoSuchLayer", "cpu", Mode::kInference); });
  EXPECT_NE(message.find("unknown layer 'NoSuchLayer' (known: "), std::string::npos) << message;
  EXPECT_NE(message.find("TestAct, "), std::string::npos) << message;
  EXPECT_NE(message.find("TestNorm"), std::string::npos) << message;

  message = invalid_argument_message([] { resolve("TestNorm", "cpu", Mode::kFallback); });
  EXPECT_NE(message.find("mode fallback is not a request"), std::string::npos) << message;
  message = invalid_argument_message([] { resolve("TestNorm", "cpu", Mode::kCompile); });
  EXPECT_NE(message.find("mode compile is not a request"), std::string::npos) << message;
  message = invalid_argument_message([] { resolve("TestNorm", "cpu", Mode::kInference | Mode::kTraining); });
  EXPECT_NE(message.find("mode inference+training is not a request"), std::string::npos) << message;
}

// --- register_mapping validation ---

TEST_F(RegistryTest, RegisterMappingRejectsUnregisteredKernel) {
  const std::string message = invalid_argument_message([] {
    register_mapping({{"TestNorm", {{"cpu", {{Mode::kTraining, "tk/typo"}}}}}});
  });
  EXPECT_NE(
      message.find("register_mapping: kernel 'tk/typo' mapped for layer 'TestNorm' on device 'cpu' (mode "
                   "training) is not registered"),
      std::string::npos)
      << message;
}

TEST_F(RegistryTest, RegisterMappingRejectsKernelOfAnotherLayer) {
  const std::string message = invalid_argument_message([] {
    register_mapping({{"TestNorm", {{"cpu", {{Mode::kInference, "tk/act"}}}}}});
  });
  EXPECT_NE(
      message.find("kernel 'tk/act' mapped for layer 'TestNorm' on device 'cpu' (mode inference) implements "
                   "layer 'TestAct' (expected 'TestNorm')"),
      std::string::npos)
      << message;
}

TEST_F(RegistryTest, RegisterMappingRejectsUnknownLayerBadModeKeyAndEmptyDevice) {
  std::string message = invalid_argument_message([] {
    register_mapping({{"NoSuchLayer", {{"cpu", {{Mode::kInference, "tk/fast"}}}}}});
  });
  EXPECT_NE(message.find("unknown layer 'NoSuchLayer'"), std::string::npos) << message;

  for (const Mode key :
       {Mode::kCompile, Mode::kInference | Mode::kTraining, Mode::kFallback | Mode::kCompile}) {
    message = invalid_argument_message([key] {
      register_mapping({{"TestNorm", {{"cpu", {{key, "tk/fast"}}}}}});
    });
    EXPECT_NE(message.find("mode key " + to_string(key) +
                           " for layer 'TestNorm' on device 'cpu' is not a mapping key"),
              std::string::npos)
        << message;
  }

  message = invalid_argument_message([] {
    register_mapping({{"TestNorm", {{"", {{Mode::kInference, "tk/fast"}}}}}});
  });
  EXPECT_NE(message.find("layer 'TestNorm' has an empty device name"), std::string::npos) << message;
}

TEST_F(RegistryTest, RejectedMappingChangesNothing) {
  // "TestAct" sorts before "TestNorm": the valid pair is seen first and must not be applied either.
  EXPECT_THROW(register_mapping({{"TestAct", {{"cpu", {{Mode::kInference, "reference/test_act"}}}}},
                                 {"TestNorm", {{"cpu", {{Mode::kInference, "tk/typo"}}}}}}),
               std::invalid_argument);
  expect_decision(resolve("TestAct", "cpu", Mode::kInference), "tk/act", false, "default",
                  "default mapping (fallback)");

  EXPECT_THROW(ScopedMapping({{"TestNorm", {{"cpu", {{Mode::kInference, "tk/typo"}}}}}}),
               std::invalid_argument);
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/fast", false, "default",
                  "default mapping (inference)");
}

// --- levels ---

TEST_F(RegistryTest, ScopedBeatsUserBeatsDefault) {
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/fast", false, "default",
                  "default mapping (inference)");
  register_mapping({{"TestNorm", {{"cpu", {{Mode::kInference, "tk/anywhere"}}}}}});
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/anywhere", false, "user",
                  "user mapping (inference)");
  {
    ScopedMapping scope({{"TestNorm", {{"cpu", {{Mode::kInference, "tk/eager"}}}}}});
    expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/eager", false, "scoped",
                    "scoped mapping (inference)");
  }
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/anywhere", false, "user",
                  "user mapping (inference)");
}

TEST_F(RegistryTest, HighestLevelMappingTheDeviceOwnsIt) {
  // The default's earlier-ranked inference entry is not consulted: the user level owns (TestNorm, cpu).
  register_mapping({{"TestNorm", {{"cpu", {{Mode::kTraining, "tk/anywhere"}}}}}});
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/anywhere", false, "user",
                  "user mapping (training)");

  // Owning without a usable mode hides the default's training entry for cuda.
  register_mapping({{"TestNorm", {{"cuda", {{Mode::kInference, "tk/fast"}}}}}});
  expect_reference(resolve("TestNorm", "cuda", Mode::kTraining), "no training mapping for TestNorm on cuda");

  // Other devices and layers keep their defaults.
  expect_decision(resolve("TestAct", "cpu", Mode::kTraining), "tk/act", false, "default",
                  "default mapping (fallback)");
}

TEST_F(RegistryTest, LaterRegistrationReplacesThePairOnly) {
  register_mapping(
      {{"TestNorm", {{"cpu", {{Mode::kInference, "tk/eager"}}}, {"npu", {{Mode::kInference, "tk/npu"}}}}}});
  register_mapping({{"TestNorm", {{"cpu", {{Mode::kTraining, "tk/anywhere"}}}}}});
  // The cpu inference entry is gone, not merged with the new training entry.
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/anywhere", false, "user",
                  "user mapping (training)");
  expect_decision(resolve("TestNorm", "npu", Mode::kInference), "tk/npu", false, "user",
                  "user mapping (inference)");
}

TEST_F(RegistryTest, ClearUserMappingsKeepsDefaultsAndScopes) {
  register_mapping(
      {{"TestNorm",
        {{"cpu", {{Mode::kInference, "tk/anywhere"}}}, {"npu", {{Mode::kInference, "tk/npu"}}}}}});
  ScopedMapping scope({{"TestAct", {{"cpu", {{Mode::kInference, "reference/test_act"}}}}}});
  clear_user_mappings();
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/fast", false, "default",
                  "default mapping (inference)");
  expect_reference(resolve("TestNorm", "npu", Mode::kInference), "no mapping for npu");
  expect_decision(resolve("TestAct", "cpu", Mode::kInference), "reference/test_act", false, "scoped",
                  "scoped mapping (inference)");
}

TEST_F(RegistryTest, NestedScopesInheritUnlessToldNot) {
  register_mapping({{"TestNorm", {{"npu", {{Mode::kInference, "tk/npu"}}}}}});
  ScopedMapping outer({{"TestNorm", {{"cpu", {{Mode::kInference, "tk/anywhere"}}}}}});
  {
    ScopedMapping inner({{"TestNorm", {{"cuda", {{Mode::kInference, "tk/fast"}}}}}});
    expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/anywhere", false, "scoped",
                    "scoped mapping (inference)");
    expect_decision(resolve("TestNorm", "cuda", Mode::kInference), "tk/fast", false, "scoped",
                    "scoped mapping (inference)");
    expect_decision(resolve("TestNorm", "npu", Mode::kInference), "tk/npu", false, "user",
                    "user mapping (inference)");
  }
  {
    ScopedMapping opaque({{"TestNorm", {{"cuda", {{Mode::kInference, "tk/fast"}}}}}}, /*inherit=*/false);
    expect_reference(resolve("TestNorm", "cpu", Mode::kInference), "no mapping for cpu");
    expect_reference(resolve("TestNorm", "npu", Mode::kInference), "no mapping for npu");
    // Defaults of every layer are hidden, not only those of the layers the scope maps.
    expect_decision(resolve("TestAct", "cpu", Mode::kInference), "reference/test_act", true, "reference",
                    "no mapping for cpu");
    expect_decision(resolve("TestNorm", "cuda", Mode::kInference), "tk/fast", false, "scoped",
                    "scoped mapping (inference)");
    {
      // A scope inside the opaque one still inherits from it.
      ScopedMapping innermost({{"TestNorm", {{"cpu", {{Mode::kTraining, "tk/eager"}}}}}});
      expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/eager", false, "scoped",
                      "scoped mapping (training)");
      expect_decision(resolve("TestNorm", "cuda", Mode::kInference), "tk/fast", false, "scoped",
                      "scoped mapping (inference)");
    }
  }
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/anywhere", false, "scoped",
                  "scoped mapping (inference)");
}

TEST_F(RegistryTest, ScopesEndingOutOfOrderRemoveTheirOwnEntries) {
  auto first =
      std::make_unique<ScopedMapping>(Mapping{{"TestNorm", {{"cpu", {{Mode::kInference, "tk/anywhere"}}}}}});
  auto second =
      std::make_unique<ScopedMapping>(Mapping{{"TestNorm", {{"npu", {{Mode::kInference, "tk/npu"}}}}}});
  first.reset();
  expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/fast", false, "default",
                  "default mapping (inference)");
  expect_decision(resolve("TestNorm", "npu", Mode::kInference), "tk/npu", false, "scoped",
                  "scoped mapping (inference)");
  second.reset();
  expect_reference(resolve("TestNorm", "npu", Mode::kInference), "no mapping for npu");
}

TEST_F(RegistryTest, ScopesAreVisibleOnlyOnTheirThread) {
  constexpr int kThreads = 8;
  constexpr int kIterations = 2000;
  std::atomic<int> finished{0};
  std::atomic<int> wrong_in_threads{0};
  // The readers start once the main thread holds its scope, so that its rounds overlap theirs (on a busy
  // machine they could otherwise all finish before the main thread's first round).
  std::atomic<bool> main_in_scope{false};
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      while (!main_in_scope) std::this_thread::yield();
      for (int i = 0; i < kIterations; ++i) {
        const Decision d = resolve("TestNorm", "cpu", Mode::kInference);
        if (d.kernel->name != "tk/fast" || d.source != "default") ++wrong_in_threads;
      }
      ++finished;
    });
  }
  // A writer on another layer exercises the global lock while the readers run.
  std::thread writer([&] {
    while (finished < kThreads)
      register_mapping({{"TestAct", {{"npu", {{Mode::kInference, "reference/test_act"}}}}}});
  });
  int wrong_in_main = 0;
  do {
    {
      ScopedMapping scope({{"TestNorm", {{"cpu", {{Mode::kInference, "tk/anywhere"}}}}}});
      main_in_scope = true;
      const Decision d = resolve("TestNorm", "cpu", Mode::kInference);
      if (d.kernel->name != "tk/anywhere" || d.source != "scoped") ++wrong_in_main;
    }
    const Decision d = resolve("TestNorm", "cpu", Mode::kInference);
    if (d.kernel->name != "tk/fast" || d.source != "default") ++wrong_in_main;
  } while (finished < kThreads);
  for (std::thread& thread : threads) thread.join();
  writer.join();
  EXPECT_EQ(wrong_in_threads, 0);
  EXPECT_EQ(wrong_in_main, 0);
}

// --- environment ---

TEST_F(RegistryTest, DisableAllForcesTheReference) {
  ScopedEnv disable("KERNMAP_DISABLE", "all");
  ScopedMapping scope({{"TestNorm", {{"cpu", {{Mode::kInference, "tk/anywhere"}}}}}});
  expect_reference(resolve("TestNorm", "cpu", Mode::kInference), "disabled by KERNMAP_DISABLE");
  expect_decision(resolve("TestAct", "cpu", Mode::kInference), "reference/test_act", true, "reference",
                  "disabled by KERNMAP_DISABLE");
}

TEST_F(RegistryTest, DisableListNamesLayersExactly) {
  {
    ScopedEnv disable("KERNMAP_DISABLE", " Other ,  TestAct\t,");
    expect_decision(resolve("TestAct", "cpu", Mode::kInference), "reference/test_act", true, "reference",
                    "disabled by KERNMAP_DISABLE");
    expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/fast", false, "default",
                    "default mapping (inference)");
  }
  {
    ScopedEnv disable("KERNMAP_DISABLE", "testnorm,TestNor,TestNormX");
    expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/fast", false, "default",
                    "default mapping (inference)");
  }
  {
    ScopedEnv disable("KERNMAP_DISABLE", "");
    expect_decision(resolve("TestNorm", "cpu", Mode::kInference), "tk/fast", false, "default",
                    "default mapping (inference)");
  }
  // Errors about the arguments come before the environment.
  ScopedEnv disable("KERNMAP_DISABLE", "all");
  EXPECT_THROW(resolve("NoSuchLayer", "cpu", Mode::kInference), std::invalid_argument);
}

TEST_F(RegistryTest, LogPrintsOneLinePerDecision) {
  {
    ScopedEnv log("KERNMAP_LOG", "1");
    testing::internal::CaptureStderr();
    resolve("TestNorm", "cpu", Mode::kInference);
    resolve("TestNorm", "mps", Mode::kTraining);
    EXPECT_EQ(testing::internal::GetCapturedStderr(),
              "[kernmap] TestNorm on cpu (inference): tk/fast \u2014 default mapping (inference)\n"
              "[kernmap] TestNorm on mps (training): reference/test_norm \u2014 no mapping for mps\n");
  }
  for (const std::optional<std::string>& off :
       {std::optional<std::string>("0"), std::optional<std::string>(""), std::optional<std::string>()}) {
    ScopedEnv log("KERNMAP_LOG", off);
    testing::internal::CaptureStderr();
    resolve("TestNorm", "cpu", Mode::kInference);
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  }
}

// --- effective mapping ---

TEST_F(RegistryTest, EffectiveMappingMergesLevelsPerPair) {
  register_mapping({{"TestNorm", {{"npu", {{Mode::kInference, "tk/npu"}}}}}});
  ScopedMapping scope({{"TestNorm", {{"cpu", {{Mode::kTraining, "tk/anywhere"}}}}}});
  const Mapping merged = effective_mapping();
  const auto& norm = merged.at("TestNorm");
  EXPECT_EQ(norm.at("cpu"), (std::map<Mode, std::string>{{Mode::kTraining, "tk/anywhere"}}));
  EXPECT_EQ(norm.at("cuda"), (std::map<Mode, std::string>{{Mode::kTraining, "tk/fast"}}));
  EXPECT_EQ(norm.at("npu"), (std::map<Mode, std::string>{{Mode::kInference, "tk/npu"}}));
  EXPECT_EQ(merged.at("TestAct").at("cpu"), (std::map<Mode, std::string>{{Mode::kFallback, "tk/act"}}));

  const Mapping only = {{"TestAct", {{"cpu", {{Mode::kInference, "reference/test_act"}}}}}};
  {
    ScopedMapping opaque(only, /*inherit=*/false);
    EXPECT_EQ(effective_mapping(), only);
    ScopedMapping inner({{"TestNorm", {{"cpu", {{Mode::kInference, "tk/fast"}}}}}});
    const Mapping expected = {{"TestAct", {{"cpu", {{Mode::kInference, "reference/test_act"}}}}},
                              {"TestNorm", {{"cpu", {{Mode::kInference, "tk/fast"}}}}}};
    EXPECT_EQ(effective_mapping(), expected);
  }
  EXPECT_EQ(effective_mapping(), merged);
}

TEST_F(RegistryTest, EffectiveMappingIsPerThread) {
  ScopedMapping scope({{"TestNorm", {{"cpu", {{Mode::kTraining, "tk/anywhere"}}}}}});
  Mapping seen_elsewhere;
  std::thread([&] { seen_elsewhere = effective_mapping(); }).join();
  EXPECT_EQ(seen_elsewhere.at("TestNorm").at("cpu"),
            (std::map<Mode, std::string>{{Mode::kInference, "tk/fast"}}));
  EXPECT_EQ(effective_mapping().at("TestNorm").at("cpu"),
            (std::map<Mode, std::string>{{Mode::kTraining, "tk/anywhere"}}));
}

}  // namespace
}  // namespace kernmap
