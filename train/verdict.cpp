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
                           const std::vector<std::vector<double>>& noise_runs, double rtol,
                           double noise_factor) {
  // The noise length named is the first that differs from the original's (the first run's when none does).
  size_t noise_steps = noise_runs.empty() ? original.size() : noise_runs.front().size();
  for (const auto& run : noise_runs)
    if (run.size() != original.size()) {
      noise_steps = run.size();
      break;
    }
  if (kernelized.size() != original.size() || noise_steps != original.size())
    throw std::invalid_argument("judge: the runs must have the same number of steps, got original " +
                                std::to_string(original.size()) + ", kernelized " +
                                std::to_string(kernelized.size()) + ", noise " + std::to_string(noise_steps));
  MetricVerdict v;
  double running = 0;
  for (size_t s = 0; s < original.size(); ++s) {
    v.diff.push_back(rel_diff(kernelized[s], original[s]));
    double noise = 0;
    for (const auto& run : noise_runs) {
      const double n = rel_diff(run[s], original[s]);
      if (std::isfinite(n)) noise = std::max(noise, n);  // a broken noise run cannot widen the tolerance
    }
    v.noise.push_back(noise);
    running = std::max(running, noise);
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
              const std::vector<std::vector<StepLog>>& noise_runs, double rtol, double noise_factor) {
  auto series = [](const std::vector<StepLog>& logs, double StepLog::*field) {
    std::vector<double> out;
    for (const StepLog& s : logs) out.push_back(s.*field);
    return out;
  };
  auto noise_series = [&](double StepLog::*field) {
    std::vector<std::vector<double>> out;
    for (const auto& run : noise_runs) out.push_back(series(run, field));
    return out;
  };
  Verdict v;
  v.rtol = rtol;
  v.noise_factor = noise_factor;
  v.loss = judge_metric(series(original, &StepLog::loss), series(kernelized, &StepLog::loss),
                        noise_series(&StepLog::loss), rtol, noise_factor);
  v.grad_norm = judge_metric(series(original, &StepLog::grad_norm), series(kernelized, &StepLog::grad_norm),
                             noise_series(&StepLog::grad_norm), rtol, noise_factor);
  v.passed = v.loss.passed && v.grad_norm.passed;
  return v;
}

}  // namespace kernmap::train
