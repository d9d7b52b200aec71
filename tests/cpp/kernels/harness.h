// The kernel test harness: one table of cases (table.cpp), each run at every compiled CPU level this machine
// runs and in every dtype of its row, against one tolerance table (tests/tolerances.json), with every fresh
// allocation poisoned (poison.cpp). main.cpp registers the cases as gtest tests and reports the levels it
// cannot run by name.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cpu/isa.h"

namespace kernmap::testing {

/// The floating dtypes every kernel takes, in the order tests run them.
inline const std::vector<at::ScalarType> kAllDtypes = {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble};

/// The sizes one case runs on: named sizes in the order the test name shows them, optional group sizes (the
/// rows of each group of a grouped product), and optionally the layouts of this shape alone (instead of the
/// row's).
struct Shape {
  std::vector<std::pair<std::string, int64_t>> sizes = {};
  std::vector<int64_t> groups = {};
  std::vector<std::string> layouts = {};
};

/// Every combination of the named size lists, the first name varying slowest.
std::vector<Shape> grid(const std::vector<std::pair<std::string, std::vector<int64_t>>>& axes);

/// One case of the table as its check sees it (the harness has made the level active and seeded torch).
struct Case {
  const Shape* shape;
  std::string layout;
  at::ScalarType dtype;  ///< Undefined for a row without dtypes
  kernmap::cpu::Level level;
  /// The named size; throws std::out_of_range naming it when the shape has no such size.
  int64_t operator[](const std::string& name) const;
  const std::vector<int64_t>& groups() const { return shape->groups; }
};

/// One row of the table: an op (or one property of an op), the shapes and layouts it runs on (every shape
/// with every layout), the dtypes, and the check that runs one case. `skip` leaves out the cases it returns
/// true for (each row says why).
struct Row {
  std::string op;
  std::vector<Shape> shapes;
  std::vector<std::string> layouts;
  std::function<void(const Case&)> check;
  std::vector<at::ScalarType> dtypes = kAllDtypes;
  std::function<bool(const Case&)> skip = {};
};
/// The dtypes of a row whose check does not depend on one.
inline const std::vector<at::ScalarType> kNoDtype = {at::ScalarType::Undefined};

/// The table (table.cpp).
const std::vector<Row>& kernel_table();

// ---- tolerances (tolerance.cpp)
// ----------------------------------------------------------------------------

struct Tolerance {
  double rtol, atol;
};
/// tests/tolerances.json's figures for a result computed from inputs of `dtype` that sums `terms` terms (the
/// rule "sum": atol * terms ** atol_exponent).
Tolerance tolerance(at::ScalarType dtype, int64_t terms = 1);

/// got and want have the same dtype and shape and |got - want| <= atol + rtol * |want| everywhere (NaN is
/// never close: a poisoned element left unwritten fails). The failure names the worst element.
::testing::AssertionResult close(const at::Tensor& got, const at::Tensor& want, Tolerance tol);
/// got and want hold the same bits (NaN payloads and signed zeros included).
::testing::AssertionResult same_bits(const at::Tensor& got, const at::Tensor& want);

/// tests/tolerances.json's "linear_cross_entropy" figures for inputs of `dtype`: fractions of the largest
/// |reference| of each result (row_loss: of each row's own loss).
struct LossTolerance {
  double loss, grad, weight_grad, row_loss, row_grad;
};
LossTolerance linear_cross_entropy_tolerance(at::ScalarType dtype);
/// got and want have the same dtype and shape and max |got - want| <= fraction * max |want| (NaN in got
/// fails). The failure names the worst element.
::testing::AssertionResult within_fraction_of_largest(const at::Tensor& got, const at::Tensor& want,
                                                      double fraction);

// ---- the common check: a kernmap op against its reference (reference_check.cpp) ---------------------------

/// The outputs of an op: one tensor, or the two of an op that returns a pair (add_rms_norm's normed output
/// and sum). Implicit, so that a row's kernel and reference return what the op returns.
struct Outputs {
  std::vector<at::Tensor> tensors;
  Outputs(at::Tensor t) : tensors{std::move(t)} {}
  Outputs(std::tuple<at::Tensor, at::Tensor> t)
      : tensors{std::move(std::get<0>(t)), std::move(std::get<1>(t))} {}
};

/// An op and its reference on the same inputs, forward and backward.
struct Compared {
  /// The inputs, in the layouts of the case; the floating ones get gradients.
  std::vector<at::Tensor> inputs;
  std::function<Outputs(const std::vector<at::Tensor>&)> kernel, reference;
  /// Per compared result (each output, then the gradient of each floating input in order): how many terms it
  /// sums (the tolerance rule "sum"); missing entries are 1.
  std::vector<int64_t> terms = {};
  /// For 16-bit dtypes: judge each result by its distance from the reference computed in float64 (on the
  /// same, already rounded, inputs), which may be at most twice the 16-bit reference's own distance plus the
  /// dtype's one-term atol and 4 ulps of the result's largest element. For ops whose reference rounds
  /// intermediates to the 16-bit dtype (transformers' experts: the activations, each expert's output rows)
  /// where the kernel rounds in other places: two correct roundings of a long chain differ by more than a
  /// fixed tolerance of the result's size, but the kernel must not be further from the exact value than the
  /// reference is.
  bool low_precision_against_float64 = false;
};
/// Runs the kernel and the reference on the inputs, then both backward with one random gradient per output,
/// and checks every output and every input gradient with the tolerance of the case's dtype. Returns the
/// kernel's outputs and input gradients, in that order (for a row's further checks). Kernel outputs that have
/// no autograd history are compared forward only.
std::vector<at::Tensor> expect_matches_reference(const Case& c, const Compared& op);

/// Inputs [rows, n] holding the same random values in each layout of kRowLayouts: "contiguous", "sliced1" and
/// "sliced2" (a column slice starting 1 or 2 elements into rows n + 3 or n + 5 wide), "transposed" (a
/// column-major copy viewed back), "3d" ([2 or 3, rows / that, n]: a view of the contiguous tensor).
at::Tensor laid_out(const std::string& layout, int64_t rows, int64_t n, at::ScalarType dtype);
inline const std::vector<std::string> kRowLayouts = {"contiguous", "sliced1", "sliced2", "transposed", "3d"};
/// The layout after `layout` in kRowLayouts, the last followed by the first: a second operand's, so that two
/// operands of one case differ in layout.
const std::string& next_row_layout(const std::string& layout);

/// Standard normal values drawn in float64, rounded to dtype.
at::Tensor randn(at::IntArrayRef sizes, at::ScalarType dtype);
/// A norm's weight [H]: 1 + 0.1 standard normal values drawn in float64, rounded to dtype.
at::Tensor norm_weight(int64_t H, at::ScalarType dtype);
/// The int32 cumulative row ends of groups of these sizes (grouped_mm's offs).
at::Tensor offsets(const std::vector<int64_t>& group_sizes);
/// The accumulation type of a dtype: float64 for float64, else float32.
inline at::ScalarType acc_of(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace kernmap::testing
