// The common check (an op against its reference, forward and backward) and the input builders of the table.
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <iterator>
#include <stdexcept>
#include <string>

#include "tests/cpp/kernels/harness.h"

namespace kernmap::testing {

std::vector<Shape> grid(const std::vector<std::pair<std::string, std::vector<int64_t>>>& axes) {
  std::vector<Shape> out = {Shape{}};
  for (const auto& [name, values] : axes) {
    std::vector<Shape> next;
    for (const Shape& s : out)
      for (int64_t v : values) {
        Shape grown = s;
        grown.sizes.emplace_back(name, v);
        next.push_back(std::move(grown));
      }
    out = std::move(next);
  }
  return out;
}

int64_t Case::operator[](const std::string& name) const {
  for (const auto& [n, v] : shape->sizes)
    if (n == name) return v;
  throw std::out_of_range("the case's shape has no size '" + name + "'");
}

at::Tensor randn(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::randn(sizes, at::kDouble).to(dtype);
}

at::Tensor norm_weight(int64_t H, at::ScalarType dtype) {
  return (1 + 0.1 * at::randn({H}, at::kDouble)).to(dtype);
}

at::Tensor offsets(const std::vector<int64_t>& group_sizes) {
  std::vector<int> ends;
  int total = 0;
  for (int64_t n : group_sizes) ends.push_back(total += static_cast<int>(n));
  return at::tensor(ends, at::kInt);
}

at::Tensor laid_out(const std::string& layout, int64_t rows, int64_t n, at::ScalarType dtype) {
  const at::Tensor values = randn({rows, n}, dtype);
  if (layout == "contiguous") return values;
  if (layout == "sliced1" || layout == "sliced2") {
    const int64_t offset = layout == "sliced1" ? 1 : 2;
    at::Tensor wide = randn({rows, n + 2 * offset + 1}, dtype);
    return wide.narrow(1, offset, n).copy_(values);
  }
  if (layout == "transposed") return values.t().contiguous().t();
  if (layout == "3d") {
    if (rows % 2 != 0) throw std::invalid_argument("layout 3d needs an even row count");
    return values.view({2, rows / 2, n});
  }
  throw std::invalid_argument("unknown layout '" + layout + "'");
}

const std::string& next_row_layout(const std::string& layout) {
  const auto it = std::find(kRowLayouts.begin(), kRowLayouts.end(), layout);
  if (it == kRowLayouts.end()) throw std::invalid_argument("unknown layout '" + layout + "'");
  return std::next(it) == kRowLayouts.end() ? kRowLayouts.front() : *std::next(it);
}

namespace {

// max |got - exact| <= 2 max |reference - exact| + atol + 4 ulps of the result's largest element (exact in
// float64): a rounding to the 16-bit dtype placed elsewhere in the chain moves a result by a few of its ulps.
::testing::AssertionResult no_further_than_the_reference(const at::Tensor& got, const at::Tensor& reference,
                                                         const at::Tensor& exact, double atol) {
  const double mine = (got.to(at::kDouble) - exact).abs().max().item<double>();
  const double theirs = (reference.to(at::kDouble) - exact).abs().max().item<double>();
  const double ulp = got.scalar_type() == at::kBFloat16 ? 0x1p-7 : 0x1p-10;  // at 1.0
  const double allowed = 2 * theirs + atol + 4 * ulp * exact.abs().max().item<double>();
  if (mine <= allowed) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "the kernel is " << mine << " from the float64 result at most, the "
                                       << "reference " << theirs << " (allowed: " << allowed << ")";
}

bool low_precision(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf;
}

}  // namespace

std::vector<at::Tensor> expect_matches_reference(const Case& c, const Compared& op) {
  if (op.low_precision_against_float64 && low_precision(c.dtype)) {
    const auto leaves = [&](bool exact) {
      std::vector<at::Tensor> out;
      for (const at::Tensor& t : op.inputs)
        out.push_back(t.is_floating_point() ? (exact ? t.to(at::kDouble) : t).detach().requires_grad_(true)
                                            : t);
      return out;
    };
    const std::vector<at::Tensor> mine = leaves(false), theirs = leaves(false), exact = leaves(true);
    // Ops with one output (the experts).
    const at::Tensor y = op.kernel(mine).tensors.at(0), want = op.reference(theirs).tensors.at(0),
                     truth = op.reference(exact).tensors.at(0);
    const double atol = tolerance(c.dtype).atol;
    EXPECT_TRUE(no_further_than_the_reference(y, want, truth, atol)) << "the output";
    std::vector<at::Tensor> results = {y.detach()};
    const at::Tensor dy = randn(y.sizes(), y.scalar_type());
    torch::autograd::backward({y}, {dy});
    torch::autograd::backward({want}, {dy});
    torch::autograd::backward({truth}, {dy.to(at::kDouble)});
    for (size_t i = 0; i < mine.size(); ++i) {
      if (!mine[i].is_floating_point()) continue;
      EXPECT_TRUE(no_further_than_the_reference(mine[i].grad(), theirs[i].grad(), exact[i].grad(), atol))
          << "the gradient of input " << i;
      results.push_back(mine[i].grad());
    }
    return results;
  }
  const auto terms = [&](size_t i) { return i < op.terms.size() ? op.terms[i] : int64_t{1}; };
  // Leaves over the same memory as the inputs (detach keeps each layout's strides; a clone would not).
  const auto leaves = [&] {
    std::vector<at::Tensor> out;
    for (const at::Tensor& t : op.inputs)
      out.push_back(t.is_floating_point() ? t.detach().requires_grad_(true) : t);
    return out;
  };
  const std::vector<at::Tensor> mine = leaves(), theirs = leaves();
  const std::vector<at::Tensor> ys = op.kernel(mine).tensors, wants = op.reference(theirs).tensors;
  if (ys.size() != wants.size()) {
    ADD_FAILURE() << "the kernel returns " << ys.size() << " outputs, the reference " << wants.size();
    return {};
  }
  bool forward = true;
  std::vector<at::Tensor> results, with_history, their_outputs, dys;
  for (size_t i = 0; i < ys.size(); ++i) {
    const ::testing::AssertionResult close_enough = close(ys[i], wants[i], tolerance(c.dtype, terms(i)));
    EXPECT_TRUE(close_enough) << (ys.size() == 1 ? std::string("the output") : "output " + std::to_string(i));
    forward = forward && close_enough;
    results.push_back(ys[i].detach());
    if (!ys[i].requires_grad()) continue;
    with_history.push_back(ys[i]);
    their_outputs.push_back(wants[i]);
    dys.push_back(randn(ys[i].sizes(), ys[i].scalar_type()));
  }
  if (!forward || with_history.empty()) return results;
  torch::autograd::backward(with_history, dys);
  torch::autograd::backward(their_outputs, dys);
  size_t result = ys.size();
  for (size_t i = 0; i < mine.size(); ++i) {
    if (!mine[i].is_floating_point()) continue;
    const at::Tensor& got = mine[i].grad();
    const at::Tensor& expected = theirs[i].grad();
    if (got.defined() != expected.defined()) {
      ADD_FAILURE() << "the gradient of input " << i << " is " << (got.defined() ? "" : "not ")
                    << "defined, the reference's is " << (expected.defined() ? "" : "not");
    } else if (got.defined()) {
      EXPECT_TRUE(close(got, expected, tolerance(c.dtype, terms(result)))) << "the gradient of input " << i;
    }
    results.push_back(got);
    ++result;
  }
  return results;
}

}  // namespace kernmap::testing
