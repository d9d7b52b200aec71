// Shared pieces of `kernmap bench ops`: a benchmark case is one op, pass, dtype and shape with the
// implementations timed side by side.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace kernmap::cli {

struct Impl {
  /// An implementation whose name contains "kernmap" runs kernmap's CPU kernels: with --levels it is timed at
  /// each level; the others (the reference, torch's, a dense product) once.
  std::string name;
  std::function<void()> run;
  /// When > 0: timed this many times at most, without warm-up (an implementation that takes minutes, such as
  /// the eager experts loop's backward, which materializes a full-size weight gradient per expert).
  int reps_cap = 0;
  /// Whether the bench leaves the caches as they are before this implementation's runs (the dense GEMM
  /// probes: a product's best rate, operands cached, is the compute limit), instead of emptying them.
  bool keep_caches = false;
};

struct Case {
  std::string op, pass, dtype, shape;
  double bytes = 0;  ///< each input read once plus each output written once (every expert's weights included)
  double flops = 0;  ///< 0 for memory-bound ops
  int max_reps = 0;  ///< caps --reps for cases that take seconds per repetition (0: no cap)
  std::vector<Impl> impls;
  /// The part of `bytes` written (< 0: not stated). Where stated, the bytes read also floor the case at the
  /// machine's read rate, which can be below its copy rate (bytes read + written: 31-36 against 44-48 GB/s on
  /// xeon-amx-vm): a case that mostly reads (MoE weights) cannot move its bytes at the copy rate.
  double written = -1;
  /// Whether kernmap's implementation computes the FLOPs in kernmap's CPU kernels, bound to the level they
  /// run at (false: through ATen's BLAS or oneDNN, which use the CPU's best instructions whatever the level,
  /// so its floor is the machine's fastest dense rate at every level).
  bool level_bound_flops = true;
};

/// Builds one case (its tensors live only while it runs: MoE cases hold gigabytes of expert weights).
using CaseBuilder = std::function<Case()>;
/// Whether cases of a shape (as the table prints it) are wanted: factories skip the others before making
/// tensors.
using ShapeFilter = std::function<bool(const std::string& shape)>;
/// A case family: the cases of one op for a dtype name ("float32", "bfloat16").
using CaseFactory =
    std::function<std::vector<CaseBuilder>(const std::string& dtype, const ShapeFilter& wanted)>;

at::ScalarType dtype_of(const std::string& name);
std::string shape_string(at::IntArrayRef s);
/// fwd+bwd of f on inputs that require grad (floating inputs only; where `trainable` is given, only those it
/// marks: the others stay frozen, as LoRA leaves a base weight), with a fixed upstream gradient; grads are
/// dropped between runs so no accumulation pass is timed (so implementations may share the same inputs).
std::function<void()> fwd_bwd(std::vector<at::Tensor> inputs, at::Tensor grad,
                              std::function<at::Tensor(const std::vector<at::Tensor>&)> f,
                              std::vector<bool> trainable = {});

/// Builders for the `count` cases made together (a forward and a forward+backward case sharing tensors, and
/// for experts a frozen-weights forward+backward): the first runs make(), each hands out its case, and the
/// tensors are released after the last one is taken.
std::vector<CaseBuilder> builders_of(std::function<std::vector<Case>()> make, size_t count = 2);

std::vector<CaseBuilder> rms_norm_cases(const std::string& dtype, const ShapeFilter& wanted);
std::vector<CaseBuilder> add_rms_norm_cases(const std::string& dtype, const ShapeFilter& wanted);
std::vector<CaseBuilder> rotary_cases(const std::string& dtype, const ShapeFilter& wanted);
std::vector<CaseBuilder> silu_cases(const std::string& dtype, const ShapeFilter& wanted);
std::vector<CaseBuilder> swiglu_cases(const std::string& dtype, const ShapeFilter& wanted);
std::vector<CaseBuilder> silu_and_mul_cases(const std::string& dtype, const ShapeFilter& wanted);
std::vector<CaseBuilder> grouped_mm_cases(const std::string& dtype, const ShapeFilter& wanted);
std::vector<CaseBuilder> experts_cases(const std::string& dtype, const ShapeFilter& wanted);
std::vector<CaseBuilder> linear_cross_entropy_cases(const std::string& dtype, const ShapeFilter& wanted);

}  // namespace kernmap::cli
