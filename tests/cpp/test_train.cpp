// The trainer's refusals (library level): hyper-parameters out of range, a non-finite loss or gradient norm,
// checkpoints that are not a checkpoint of the model, and SFT data with read errors, NUL bytes and 64-bit
// ids. The runs themselves (equality with PyTorch, resume, alignment) are tested in
// tests/python/test_train.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include "kernmap/safetensors.h"
#include "kernmap/train.h"

namespace kernmap::train {
namespace {

namespace fs = std::filesystem;

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

// The message of what fn throws as E, or "no error".
template <class E>
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "no error";
}

::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << part << "' not in: " << text;
}

Dataset tiny_data(const ModelConfig& c) {
  return synthetic_dataset(c.vocab_size, 5, 8);
}

TEST(TrainOptions, OutOfRangeHyperParametersAreRefusedByName) {
  auto model = make_preset("qwen2-tiny");
  const Dataset data = tiny_data(model->config());
  auto refused = [&](const std::function<void(TrainOptions&)>& edit) {
    TrainOptions o;
    edit(o);
    return error_of<std::invalid_argument>([&] { Trainer(model, data, o); });
  };
  EXPECT_TRUE(
      contains(refused([](TrainOptions& o) { o.adam.lr = kNaN; }), "lr = nan (must be finite and > 0)"));
  EXPECT_TRUE(contains(refused([](TrainOptions& o) { o.adam.lr = -1e-3; }), "lr = -0.001"));
  EXPECT_TRUE(contains(refused([](TrainOptions& o) { o.adam.lr = 0; }), "lr = 0"));
  EXPECT_TRUE(contains(refused([](TrainOptions& o) { o.adam.lr = kInf; }), "lr = inf"));
  EXPECT_TRUE(contains(refused([](TrainOptions& o) { o.adam.beta1 = 1; }), "beta1 = 1 (must be in [0, 1))"));
  EXPECT_TRUE(contains(refused([](TrainOptions& o) { o.adam.beta2 = -0.5; }), "beta2 = -0.5"));
  EXPECT_TRUE(contains(refused([](TrainOptions& o) { o.adam.beta2 = kNaN; }), "beta2 = nan"));
  EXPECT_TRUE(contains(refused([](TrainOptions& o) { o.adam.eps = 0; }), "eps = 0 (must be finite and > 0)"));
  EXPECT_TRUE(contains(refused([](TrainOptions& o) { o.adam.weight_decay = -0.1; }),
                       "weight_decay = -0.1 (must be finite and >= 0)"));
  EXPECT_TRUE(contains(refused([](TrainOptions& o) { o.adam.weight_decay = kNaN; }), "weight_decay = nan"));
  EXPECT_TRUE(
      contains(refused([](TrainOptions& o) { o.max_grad_norm = -1; }), "max_grad_norm = -1 (must be > 0"));
  EXPECT_TRUE(contains(refused([](TrainOptions& o) { o.max_grad_norm = 0; }), "max_grad_norm = 0"));
  EXPECT_TRUE(contains(refused([](TrainOptions& o) { o.max_grad_norm = kNaN; }), "max_grad_norm = nan"));
  EXPECT_TRUE(contains(refused([](TrainOptions& o) { o.batch_size = 0; }), "batch_size = 0 (must be >= 1)"));
  EXPECT_TRUE(contains(refused([](TrainOptions& o) { o.batch_size = -3; }), "batch_size = -3"));
  EXPECT_EQ(refused([](TrainOptions& o) { o.max_grad_norm = kInf; }), "no error");  // no clipping
  EXPECT_EQ(refused([](TrainOptions&) {}), "no error");
}

// A copy of every parameter, to check that a refused step or load changed nothing.
std::vector<at::Tensor> snapshot(CausalLM& model) {
  std::vector<at::Tensor> out;
  for (const auto& p : model.parameters()) out.push_back(p.detach().clone());
  return out;
}
bool unchanged(CausalLM& model, const std::vector<at::Tensor>& before) {
  const auto params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i)
    if (!at::equal(params[i].detach().nan_to_num(0), before[i].nan_to_num(0))) return false;
  return true;
}

TEST(Trainer, ANonFiniteLossStopsNamingTheStepBeforeAnyUpdate) {
  auto model = make_preset("qwen2-tiny");
  const Dataset data = tiny_data(model->config());
  Trainer trainer(model, data, {});
  trainer.step();
  {
    at::NoGradGuard no_grad;
    model->named_parameters()["model.norm.weight"][3] = kNaN;
  }
  const auto before = snapshot(*model);
  const std::string message = error_of<NonFiniteError>([&] { trainer.step(); });
  EXPECT_TRUE(contains(message, "step 2: the loss is nan"));
  EXPECT_TRUE(contains(message, "the parameters are those after step 1"));
  EXPECT_TRUE(unchanged(*model, before));
  EXPECT_EQ(trainer.steps(), 1);
}

TEST(Trainer, ANonFiniteGradientNormStopsNamingTheStep) {
  // Final-norm weights of 1e30 keep the loss finite (logits of ~1e30, a cross entropy of the same size) while
  // the gradients of the lm_head, ~1e30 each, overflow the float norm.
  auto model = make_preset("qwen2-moe-tiny");
  const Dataset data = tiny_data(model->config());
  Trainer trainer(model, data, {});
  {
    at::NoGradGuard no_grad;
    model->named_parameters()["model.norm.weight"].fill_(1e30);
  }
  const auto before = snapshot(*model);
  const std::string message = error_of<NonFiniteError>([&] { trainer.step(); });
  EXPECT_TRUE(contains(message, "step 1: the gradient norm is inf"));
  EXPECT_TRUE(unchanged(*model, before));
}

TEST(Trainer, SkipNonFiniteSkipsTheUpdateAndCountsTheStep) {
  auto model = make_preset("qwen2-tiny");
  const Dataset data = tiny_data(model->config());
  TrainOptions options;
  options.skip_non_finite = true;
  Trainer trainer(model, data, options);
  const StepLog first = trainer.step();
  EXPECT_FALSE(first.skipped);
  {
    at::NoGradGuard no_grad;
    model->named_parameters()["model.norm.weight"][0] = kInf;
  }
  const auto before = snapshot(*model);
  const StepLog second = trainer.step();
  EXPECT_TRUE(second.skipped);
  EXPECT_EQ(second.step, 2);
  EXPECT_FALSE(std::isfinite(second.loss));
  EXPECT_TRUE(unchanged(*model, before));
  EXPECT_EQ(trainer.steps(), 2);
  EXPECT_EQ(trainer.skipped_steps(), 1);
}

TEST(Data, BatchesOfHugeStepsWrapWithoutOverflow) {
  // step * batch_size = 2^53 * 2048 is past 2^63; the row of slot b is (step * batch_size + b) mod n exactly:
  // 2^53 = 2^(3*17+2) = 4 (mod 7) and 2048 = 4 (mod 7), so slot b takes example (16 + b) mod 7 = (2 + b)
  // mod 7.
  const Dataset data = synthetic_dataset(50, 7, 4);
  const Batch batch = make_batch(data, int64_t{1} << 53, 2048, 0);
  for (int64_t b : {0, 1, 6, 2047}) {
    const Example& e = data.examples[(2 + b) % 7];
    EXPECT_EQ(batch.input_ids[b][0].item<int64_t>(), e.prompt_ids[0]) << b;
    EXPECT_EQ(batch.input_ids[b][3].item<int64_t>(), e.response_ids[1]) << b;
  }
}

// ---- checkpoints ----

class Checkpoints : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kernmap_test_train_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    model_ = make_preset("qwen2-tiny");
    data_ = tiny_data(model_->config());
    Trainer trainer(model_, data_, {});
    trainer.step();
    trainer.step();
    trainer.save_checkpoint(dir_.string());
    saved_ = read_safetensors(file());
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string file() const { return (dir_ / "checkpoint.safetensors").string(); }

  // The saved checkpoint with `edit` applied, loaded into a fresh trainer: the error message, and whether the
  // trainer was left untouched.
  std::string load_edited(const std::function<void(std::vector<std::pair<std::string, at::Tensor>>&)>& edit) {
    auto tensors = saved_;
    edit(tensors);
    write_safetensors(file(), tensors);
    auto model = make_preset("qwen2-tiny");
    Trainer trainer(model, data_, {});
    const auto before = snapshot(*model);
    const std::string message = error_of<CheckpointError>([&] { trainer.load_checkpoint(dir_.string()); });
    EXPECT_TRUE(unchanged(*model, before)) << message;
    EXPECT_EQ(trainer.steps(), 0) << message;
    EXPECT_TRUE(contains(message, file()));
    EXPECT_EQ(message.find("Exception raised from"), std::string::npos) << message;  // no backtrace
    return message;
  }
  static void set(std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& name,
                  at::Tensor value) {
    for (auto& [n, t] : tensors)
      if (n == name) t = std::move(value);
  }
  static at::Tensor get(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                        const std::string& name) {
    for (const auto& [n, t] : tensors)
      if (n == name) return t.clone();
    return {};
  }

  fs::path dir_;
  std::shared_ptr<CausalLM> model_;
  Dataset data_;
  std::vector<std::pair<std::string, at::Tensor>> saved_;
};

TEST_F(Checkpoints, AValidOneLoadsAndReturnsItsStep) {
  auto model = make_preset("qwen2-tiny");
  Trainer trainer(model, data_, {});
  EXPECT_EQ(trainer.load_checkpoint(dir_.string()), 2);
  EXPECT_EQ(trainer.steps(), 2);
}

TEST_F(Checkpoints, StepTensorsThatAreNotOneInt64AreRefused) {
  const std::string step = "trainer/step";
  EXPECT_TRUE(contains(load_edited([&](auto& t) { set(t, step, at::full({1}, 2.0)); }),
                       "tensor 'trainer/step' has dtype F32, expected I64 (the dtype of the step count)"));
  EXPECT_TRUE(contains(load_edited([&](auto& t) { set(t, step, at::full({1}, kNaN)); }), "has dtype F32"));
  EXPECT_TRUE(
      contains(load_edited([&](auto& t) { set(t, step, at::ones({1}, at::kBool)); }), "has dtype BOOL"));
  EXPECT_TRUE(contains(load_edited([&](auto& t) { set(t, step, at::full({2}, int64_t{2})); }),
                       "tensor 'trainer/step' has shape [2], expected [1]"));
}

TEST_F(Checkpoints, StepCountsOutsideZeroToTwoPow53AreRefused) {
  const std::string step = "trainer/step";
  EXPECT_TRUE(contains(load_edited([&](auto& t) { set(t, step, at::full({1}, int64_t{-5})); }),
                       "tensor 'trainer/step' = -5: a step count cannot be negative"));
  EXPECT_TRUE(
      contains(load_edited([&](auto& t) { set(t, step, at::full({1}, int64_t{1} << 62)); }),
               "tensor 'trainer/step' = 4611686018427387904 is past the largest step count accepted, 2^53"));
}

TEST_F(Checkpoints, ParametersOfAnotherDtypeUnknownAndMissingTensorsAreRefused) {
  const std::string norm = "param/model.norm.weight";
  EXPECT_TRUE(
      contains(load_edited([&](auto& t) { set(t, norm, at::ones({64}, at::kChar)); }),
               "tensor 'param/model.norm.weight' has dtype I8, expected F32 (the dtype of the model's "
               "parameter)"));
  EXPECT_TRUE(contains(load_edited([&](auto& t) { set(t, norm, at::ones({65})); }),
                       "tensor 'param/model.norm.weight' has shape [65], expected [64]"));
  EXPECT_TRUE(contains(load_edited([&](auto& t) { t.emplace_back("param/extra", at::ones({2})); }),
                       "tensor 'param/extra' is not part of a trainer checkpoint of this model"));
  EXPECT_TRUE(
      contains(load_edited([&](auto& t) {
                 std::erase_if(t, [](const auto& item) { return item.first == "exp_avg/model.norm.weight"; });
               }),
               "missing tensor 'exp_avg/model.norm.weight' (the optimizer state of the model's parameter)"));
  EXPECT_TRUE(contains(load_edited([&](auto& t) {
                         std::erase_if(t, [](const auto& item) { return item.first == "trainer/step"; });
                       }),
                       "missing tensor 'trainer/step' (the step count)"));
}

TEST_F(Checkpoints, NonFiniteWeightsAndOptimizerStateAreRefused) {
  auto with = [&](const std::string& name, int64_t index, double value) {
    return load_edited([&](auto& t) {
      at::Tensor v = get(t, name);
      v[index] = value;
      set(t, name, v);
    });
  };
  EXPECT_TRUE(contains(with("param/model.norm.weight", 3, kNaN),
                       "tensor 'param/model.norm.weight' holds 1 NaN or infinite value"));
  EXPECT_TRUE(contains(with("exp_avg/model.norm.weight", 0, kNaN),
                       "optimizer state: tensor 'exp_avg/model.norm.weight' holds 1 NaN or infinite value"));
  EXPECT_TRUE(contains(with("exp_avg_sq/model.norm.weight", 1, kInf),
                       "tensor 'exp_avg_sq/model.norm.weight' holds 1 NaN or infinite value"));
  EXPECT_TRUE(contains(with("exp_avg_sq/model.norm.weight", 2, -1.5),
                       "tensor 'exp_avg_sq/model.norm.weight' holds 1 negative value (the smallest -1.5); "
                       "exp_avg_sq is a running mean of squares"));
}

TEST(AdamW, LoadStateRefusesAStepPastTwoPow53AndChangesNothing) {
  at::Tensor p = at::ones({3}).requires_grad_(true);
  AdamW optimizer({{"p", p}}, {});
  auto state = optimizer.state();
  state[1].second = at::full({3}, -1.0);
  EXPECT_TRUE(
      contains(error_of<CheckpointError>([&] { optimizer.load_state(optimizer.state(), int64_t{1} << 54); }),
               "past the largest step count"));
  EXPECT_TRUE(contains(error_of<CheckpointError>([&] { optimizer.load_state(state, 1); }), "negative value"));
  EXPECT_EQ(optimizer.steps(), 0);
  EXPECT_TRUE(at::equal(optimizer.state()[1].second, at::zeros({3})));
}

// ---- data ----

std::string write_file(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

TEST(Data, ANulByteInALineIsMalformed) {
  const fs::path dir = fs::temp_directory_path() / ("kernmap_test_data_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string good = R"({"prompt_ids": [1, 2], "response_ids": [3]})";
  // A NUL after the object: the JSON parser would stop there and take the line as good.
  const std::string path = write_file(
      dir / "nul.jsonl", good + "\n" + good + std::string(1, '\0') + R"(, "x": [1])" + "\n" + good + "\n");
  const std::string message = error_of<DataError>([&] { read_jsonl(path, 10, false); });
  EXPECT_TRUE(contains(message, "1 malformed line"));
  EXPECT_TRUE(
      contains(message, "line 2: not valid JSON: a NUL byte at offset " + std::to_string(good.size())));
  const Dataset skipped = read_jsonl(path, 10, true);
  EXPECT_EQ(skipped.examples.size(), 2u);
  fs::remove_all(dir);
}

TEST(Data, TokenIdsPastInt64AreReportedByTheirValue) {
  std::istringstream in(R"({"prompt_ids": [1, 18446744073709551615], "response_ids": [3]})"
                        "\n"
                        R"({"prompt_ids": [1], "response_ids": [9223372036854775808]})"
                        "\n"
                        R"({"prompt_ids": [1], "response_ids": [-9223372036854775808]})"
                        "\n");
  const std::string message = error_of<DataError>([&] { read_jsonl(in, "ids.jsonl", 10, false); });
  EXPECT_TRUE(contains(message,
                       "line 1: \"prompt_ids\"[1] = 18446744073709551615 is outside the vocabulary [0, 10)"));
  EXPECT_TRUE(contains(message, "line 2: \"response_ids\"[0] = 9223372036854775808 is outside"));
  EXPECT_TRUE(contains(message, "line 3: \"response_ids\"[0] = -9223372036854775808 is outside"));
}

TEST(Data, AReadErrorIsAnErrorNotTheEndOfTheData) {
  // A directory opens, and its first read fails (EISDIR).
  const std::string dir = fs::temp_directory_path().string();
  EXPECT_TRUE(
      contains(error_of<DataError>([&] { read_jsonl(dir, 10, true); }), dir + ": read error after line 0"));

  // A real I/O error in the middle of the data: /proc/self/mem read from a page of JSONL lines that is
  // followed by an unmapped one (PROT_NONE would not do: the kernel reads such pages for /proc/self/mem). The
  // first read returns the lines; the next fails with EIO.
  const long page = ::sysconf(_SC_PAGESIZE);
  char* region = static_cast<char*>(
      ::mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(region, MAP_FAILED);
  const std::string line = R"({"prompt_ids": [1, 2], "response_ids": [3]})"
                           "\n";
  std::memset(region, ' ', page);
  const int64_t lines = page / static_cast<int64_t>(line.size());
  for (int64_t i = 0; i < lines; ++i) std::memcpy(region + i * line.size(), line.data(), line.size());
  region[page - 1] = '\n';
  ASSERT_EQ(::munmap(region + page, page), 0);
  std::ifstream mem("/proc/self/mem", std::ios::binary);
  ASSERT_TRUE(mem.is_open());
  mem.seekg(static_cast<std::streamoff>(reinterpret_cast<uintptr_t>(region)));
  const std::string message = error_of<DataError>([&] { read_jsonl(mem, "mem.jsonl", 10, true); });
  EXPECT_TRUE(contains(message, "mem.jsonl: read error after line " + std::to_string(lines + 1)));
  EXPECT_TRUE(contains(message, "Input/output error"));
  ::munmap(region, page);
}

}  // namespace
}  // namespace kernmap::train
