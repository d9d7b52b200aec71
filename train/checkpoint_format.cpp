// Trainer checkpoint names, dtypes and shapes (torch-free; see checkpoint_format.h).
#include "train/checkpoint_format.h"

#include <map>
#include <set>

namespace kernmap::train::checkpoint_format {
namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// What an expected tensor is, for messages.
std::string role(const std::string& name) {
  if (name == kStepTensor) return "the step count";
  if (name.starts_with("param/")) return "the model's parameter";
  return "the optimizer state of the model's parameter";
}

}  // namespace

std::vector<TensorSpec> optimizer_state(const std::vector<TensorSpec>& params) {
  std::vector<TensorSpec> out;
  for (const TensorSpec& p : params) {
    out.push_back({"exp_avg/" + p.name, p.dtype, p.shape});
    out.push_back({"exp_avg_sq/" + p.name, p.dtype, p.shape});
  }
  return out;
}

std::vector<TensorSpec> checkpoint_tensors(const std::vector<TensorSpec>& params) {
  std::vector<TensorSpec> out;
  for (const TensorSpec& p : params) out.push_back({"param/" + p.name, p.dtype, p.shape});
  for (TensorSpec& s : optimizer_state(params)) out.push_back(std::move(s));
  out.push_back({kStepTensor, "I64", {1}});
  return out;
}

void check_tensors(const std::vector<TensorSpec>& found, const std::vector<TensorSpec>& expected) {
  std::map<std::string, const TensorSpec*> wanted;
  for (const TensorSpec& e : expected) wanted[e.name] = &e;
  std::set<std::string> seen;
  for (const TensorSpec& t : found) {
    const std::string what = "tensor '" + t.name + "'";
    const auto it = wanted.find(t.name);
    if (it == wanted.end())
      throw FormatError(what +
                        " is not part of a trainer checkpoint of this model (unknown tensor; a checkpoint of "
                        "another model or run?)");
    if (!seen.insert(t.name).second) throw FormatError(what + " appears twice");
    const TensorSpec& e = *it->second;
    if (t.dtype != e.dtype)
      throw FormatError(what + " has dtype " + t.dtype + ", expected " + e.dtype + " (the dtype of " +
                        role(e.name) + ")");
    if (t.shape != e.shape)
      throw FormatError(what + " has shape " + shape_string(t.shape) + ", expected " + shape_string(e.shape) +
                        " (the shape of " + role(e.name) + ")");
  }
  for (const TensorSpec& e : expected)
    if (!seen.count(e.name)) throw FormatError("missing tensor '" + e.name + "' (" + role(e.name) + ")");
}

void check_step(int64_t step) {
  if (step < 0)
    throw FormatError("tensor '" + std::string(kStepTensor) + "' = " + std::to_string(step) +
                      ": a step count cannot be negative");
  if (step > kMaxStep)
    throw FormatError("tensor '" + std::string(kStepTensor) + "' = " + std::to_string(step) +
                      " is past the largest step count accepted, 2^53 = " + std::to_string(kMaxStep) +
                      " (no run reaches it; AdamW's bias corrections need the count exact as a double)");
}

}  // namespace kernmap::train::checkpoint_format
