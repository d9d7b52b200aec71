// tests/tolerances.json read once, and the comparisons the checks make with its figures.
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <optional>
#include <stdexcept>

#include "tests/cpp/kernels/harness.h"

namespace kernmap::testing {
namespace {

const nlohmann::json& table() {
  static const nlohmann::json json = [] {
    std::ifstream in(KERNMAP_TOLERANCES_JSON);
    if (!in) throw std::runtime_error("cannot read the tolerance table " KERNMAP_TOLERANCES_JSON);
    return nlohmann::json::parse(in);
  }();
  return json;
}

const char* json_name(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return "float64";
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    default:
      throw std::invalid_argument(std::string("no tolerance for dtype ") + c10::toString(t));
  }
}

}  // namespace

Tolerance tolerance(at::ScalarType dtype, int64_t terms) {
  const nlohmann::json& figures = table().at("elementwise").at(json_name(dtype));
  const double growth = std::pow(static_cast<double>(std::max<int64_t>(terms, 1)),
                                 table().at("sum").at("atol_exponent").get<double>());
  return {figures.at("rtol").get<double>(), figures.at("atol").get<double>() * growth};
}

LossTolerance linear_cross_entropy_tolerance(at::ScalarType dtype) {
  const nlohmann::json& figures = table().at("linear_cross_entropy").at(json_name(dtype));
  return {figures.at("loss").get<double>(), figures.at("grad").get<double>(),
          figures.at("weight_grad").get<double>(), figures.at("row_loss").get<double>(),
          figures.at("row_grad").get<double>()};
}

namespace {

// A failure when got and want differ in dtype or shape, a success when both are empty; nothing to say
// otherwise.
std::optional<::testing::AssertionResult> metadata_differs(const at::Tensor& got, const at::Tensor& want) {
  if (got.scalar_type() != want.scalar_type())
    return ::testing::AssertionFailure() << "dtype " << got.scalar_type() << " != " << want.scalar_type();
  if (got.sizes() != want.sizes())
    return ::testing::AssertionFailure() << "shape " << got.sizes() << " != " << want.sizes();
  if (got.numel() == 0) return ::testing::AssertionSuccess();
  return std::nullopt;
}

}  // namespace

::testing::AssertionResult within_fraction_of_largest(const at::Tensor& got, const at::Tensor& want,
                                                      double fraction) {
  if (auto differ = metadata_differs(got, want)) return *differ;
  const at::Tensor g = got.to(at::kDouble).reshape(-1), w = want.to(at::kDouble).reshape(-1);
  const double largest = w.abs().max().item<double>();
  // NaN anywhere in got is the largest error.
  const at::Tensor err = (g - w).abs().nan_to_num(INFINITY);
  const int64_t worst = err.argmax().item<int64_t>();
  const double allowed = fraction * largest;
  if (err[worst].item<double>() <= allowed) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "max |got - want| " << err[worst].item<double>() << " over " << allowed << " (" << fraction
         << " of the largest |want|, " << largest << ") at flat [" << worst << "]: got "
         << g[worst].item<double>() << ", want " << w[worst].item<double>();
}

::testing::AssertionResult close(const at::Tensor& got, const at::Tensor& want, Tolerance tol) {
  if (auto differ = metadata_differs(got, want)) return *differ;
  const at::Tensor g = got.to(at::kDouble).reshape(-1), w = want.to(at::kDouble).reshape(-1);
  const at::Tensor err = (g - w).abs();
  // Equal values are close (infinities of one sign included); NaN is close to nothing.
  const at::Tensor ok = g.eq(w) | err.le(tol.atol + tol.rtol * w.abs());
  if (ok.all().item<bool>()) return ::testing::AssertionSuccess();
  const at::Tensor bad = ~ok;
  const int64_t first = bad.nonzero()[0][0].item<int64_t>();
  const int64_t worst =
      at::where(bad, err.nan_to_num(INFINITY), at::zeros_like(err)).argmax().item<int64_t>();
  ::testing::AssertionResult failure = ::testing::AssertionFailure();
  failure << bad.sum().item<int64_t>() << " of " << g.numel() << " elements not close (rtol " << tol.rtol
          << ", atol " << tol.atol << ")";
  for (const auto& [what, i] : {std::pair<const char*, int64_t>{"first", first}, {"worst", worst}})
    failure << "; " << what << " at flat [" << i << "]: got " << g[i].item<double>() << ", want "
            << w[i].item<double>();
  return failure;
}

::testing::AssertionResult same_bits(const at::Tensor& got, const at::Tensor& want) {
  if (got.scalar_type() != want.scalar_type() || got.sizes() != want.sizes())
    return ::testing::AssertionFailure()
           << got.scalar_type() << got.sizes() << " vs " << want.scalar_type() << want.sizes();
  const auto as_int = [](const at::Tensor& t) {
    const int64_t size = t.element_size();
    return t.contiguous().view(size == 8 ? at::kLong : size == 4 ? at::kInt : at::kShort);
  };
  const at::Tensor differ = as_int(got).ne(as_int(want));
  if (!differ.any().item<bool>()) return ::testing::AssertionSuccess();
  const int64_t i = differ.reshape(-1).nonzero()[0].item<int64_t>();
  return ::testing::AssertionFailure()
         << differ.sum().item<int64_t>() << " elements differ; first at flat " << i << ": got "
         << got.reshape(-1)[i].item<double>() << ", want " << want.reshape(-1)[i].item<double>();
}

}  // namespace kernmap::testing
