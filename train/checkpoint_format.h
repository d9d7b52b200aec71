// The trainer checkpoint's layout without torch: which tensors a checkpoint of a model holds, under which
// names, dtypes and shapes, and the check of what a safetensors header lists against that (also linked alone
// by the fuzz target, tests/fuzz/). The values (finite weights and optimizer state) are checked with torch,
// in train/trainer.cpp and train/optim.cpp.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kernmap::train::checkpoint_format {

/// A checkpoint that does not fit the model: the message names the tensor and the problem.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One tensor as a safetensors header lists it; dtype by its safetensors name ("F32", "BF16", "I64", ...).
struct TensorSpec {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
};

/// The step count: one I64 element.
inline constexpr const char* kStepTensor = "trainer/step";
/// The largest step count accepted: 2^53, the largest count a double holds exactly (AdamW's bias corrections
/// take the step as a double), and more than 280 years of steps at a million a second.
inline constexpr int64_t kMaxStep = int64_t{1} << 53;

/// The optimizer state of these parameters: exp_avg/<name> and exp_avg_sq/<name>, each in its parameter's
/// dtype and shape.
std::vector<TensorSpec> optimizer_state(const std::vector<TensorSpec>& params);
/// Everything a trainer checkpoint of these parameters holds: param/<name> for each, their optimizer state,
/// and trainer/step.
std::vector<TensorSpec> checkpoint_tensors(const std::vector<TensorSpec>& params);

/// Throws FormatError naming the first tensor of `found` that `expected` does not list (or that appears
/// twice) or that has another dtype or shape, or the first expected tensor that is missing.
void check_tensors(const std::vector<TensorSpec>& found, const std::vector<TensorSpec>& expected);

/// Throws FormatError unless 0 <= step <= kMaxStep.
void check_step(int64_t step);

}  // namespace kernmap::train::checkpoint_format
