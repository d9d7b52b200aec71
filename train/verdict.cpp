// The verdict of an alignment run: one definition for the C++ command and Python (python/kernmap/train/
// verdict.py), written out in docs/training.md ("The verdict") and checked against the same cases
// (tests/data/verdict_cases.json) by tests/cpp/test_verdict.cpp and tests/python/test_verdict.py.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "kernmap/train.h"

namespace kernmap::train {
namespace {

constexpr double kTiny =
    1e-30;  // the denominator's floor, so an original value of 0 gives a finite difference

}  // namespace

double rel_diff(double value, double original) {
  const double d = std::abs(value - original) / std::max(std::abs(original), kTiny);
  return std::isfinite(d) ? d : std::numeric_limits<double>::infinity();
}

MetricVerdict judge_metric(const std::vector<double>& original, const std::vector<double>& kernelized,
                           const std::vector<double>& noise_run, double rtol, double noise_factor) {
  if (original.size() != kernelized.size() || original.size() != noise_run.size())
    throw std::invalid_argument("judge: the runs must have the same number of steps, got original " +
                                std::to_string(original.size()) + ", kernelized " +
                                std::to_string(kernelized.size()) + ", noise " +
                                std::to_string(noise_run.size()));
  MetricVerdict v;
  double running = 0;
  for (size_t s = 0; s < original.size(); ++s) {
    v.diff.push_back(rel_diff(kernelized[s], original[s]));
    const double n = rel_diff(noise_run[s], original[s]);
    v.noise.push_back(std::isfinite(n) ? n : 0.0);  // a broken noise run cannot widen the tolerance
    running = std::max(running, v.noise.back());
    v.floor.push_back(running);
    v.tolerance.push_back(std::max(rtol, noise_factor * running));
  }
  double worst_ratio = -1;
  v.passed = true;
  for (size_t s = 0; s < v.diff.size(); ++s) {
    const double d = v.diff[s], t = v.tolerance[s];
    const auto step = static_cast<int64_t>(s + 1);
    if (d >= v.max_diff) {
      v.max_diff = d;
      v.max_diff_step = step;
    }
    const double ratio = t > 0 ? d / t : (d > 0 ? std::numeric_limits<double>::infinity() : 0.0);
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      v.worst_step = step;
    }
    v.passed = v.passed && d <= t;
  }
  return v;
}

Verdict judge(const std::vector<StepLog>& original, const std::vector<StepLog>& kernelized,
              const std::vector<StepLog>& noise_run, double rtol, double noise_factor) {
  auto series = [](const std::vector<StepLog>& logs, double StepLog::*field) {
    std::vector<double> out;
    for (const StepLog& s : logs) out.push_back(s.*field);
    return out;
  };
  Verdict v;
  v.rtol = rtol;
  v.noise_factor = noise_factor;
  v.loss = judge_metric(series(original, &StepLog::loss), series(kernelized, &StepLog::loss),
                        series(noise_run, &StepLog::loss), rtol, noise_factor);
  v.grad_norm = judge_metric(series(original, &StepLog::grad_norm), series(kernelized, &StepLog::grad_norm),
                             series(noise_run, &StepLog::grad_norm), rtol, noise_factor);
  v.passed = v.loss.passed && v.grad_norm.passed;
  return v;
}

}  // namespace kernmap::train
