// The runs that prove a kernel mapping: alignment (original vs kernelized, step by step) and ablation (step
// time per kernel, interleaved, with each step's peak CPU memory).
#include <algorithm>
#include <cmath>

#include "kernmap/train.h"
#include "ops/memory.h"

namespace kernmap::train {
namespace {

double rel_diff(double a, double b) {
  return std::abs(a - b) / std::max(std::abs(b), 1e-30);
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

// The layers the model's kernel layers bear, each once, in the order they first appear in the model.
std::vector<std::string> layers_of(torch::nn::Module& model) {
  std::vector<std::string> names;
  for (const auto& m : model.modules())
    if (auto* layer = dynamic_cast<KernelLayer*>(m.get());
        layer && std::find(names.begin(), names.end(), layer->layer_name()) == names.end())
      names.push_back(layer->layer_name());
  return names;
}

}  // namespace

AlignResult align(const std::function<std::shared_ptr<CausalLM>()>& make_model, const Dataset& data,
                  const TrainOptions& options, const LayerSet& layers, int64_t steps, double rtol,
                  const Progress& progress) {
  AlignResult result;
  result.rtol = rtol;
  auto original_model = make_model();
  auto kernel_model = make_model();
  restore_reference(*original_model);
  result.report = bind_kernels(*kernel_model, layers);
  Trainer original(original_model, data, options), kernelized(kernel_model, data, options);
  for (int64_t s = 0; s < steps; ++s) {
    result.original.push_back(original.step());
    result.kernelized.push_back(kernelized.step());
    const StepLog &a = result.original.back(), &b = result.kernelized.back();
    if (double d = rel_diff(b.loss, a.loss); d >= result.max_loss_rel) {
      result.max_loss_rel = d;
      result.worst_loss_step = a.step;
    }
    if (double d = rel_diff(b.grad_norm, a.grad_norm); d >= result.max_grad_norm_rel) {
      result.max_grad_norm_rel = d;
      result.worst_grad_norm_step = a.step;
    }
    if (progress) progress(s + 1, steps);
  }
  result.passed = std::isfinite(result.max_loss_rel) && std::isfinite(result.max_grad_norm_rel) &&
                  result.max_loss_rel <= rtol && result.max_grad_norm_rel <= rtol;
  return result;
}

std::vector<AblationRow> ablate(const std::function<std::shared_ptr<CausalLM>()>& make_model,
                                const Dataset& data, const TrainOptions& options, const LayerSet& layers,
                                int64_t warmup, int64_t steps, const Progress& progress) {
  ops::MemoryCounter& memory = ops::MemoryCounter::counter();
  std::vector<AblationRow> rows;
  std::vector<std::unique_ptr<Trainer>> trainers;
  auto add_row = [&](std::string name, LayerSet set) {
    auto model = make_model();
    bind_kernels(*model, set);
    trainers.push_back(std::make_unique<Trainer>(model, data, options));
    rows.push_back({std::move(name), std::move(set)});
  };
  add_row("original", {});
  for (const std::string& layer : layers_of(*make_model()))
    if (layers.count(layer)) add_row("+" + layer, {layer});
  LayerSet all;
  for (const auto& row : rows) all.insert(row.layers.begin(), row.layers.end());
  add_row("all", all);

  const int64_t total = warmup + steps;
  const size_t n = rows.size();
  for (int64_t s = 0; s < total; ++s) {
    for (size_t k = 0; k < n; ++k) {
      const size_t r = (static_cast<size_t>(s) + k) % n;  // rotate the order so no row is always first
      const int64_t before = memory.live();
      memory.reset_peak();
      const StepLog log = trainers[r]->step();
      rows[r].peak_bytes = std::max(rows[r].peak_bytes, static_cast<double>(memory.peak() - before));
      rows[r].final_loss = log.loss;
      if (s >= warmup) {
        rows[r].seconds.push_back(log.seconds);
        rows[r].cpu_seconds.push_back(log.cpu_seconds);
      }
    }
    if (progress) progress(s + 1, total);
  }
  for (AblationRow& row : rows) {
    row.median_s = percentile(row.seconds, 0.5);
    row.p25_s = percentile(row.seconds, 0.25);
    row.p75_s = percentile(row.seconds, 0.75);
    row.min_s = percentile(row.seconds, 0.0);
    row.median_cpu_s = percentile(row.cpu_seconds, 0.5);
    row.speedup_pct = (rows.front().median_s / row.median_s - 1) * 100;
    row.cpu_speedup_pct = (rows.front().median_cpu_s / row.median_cpu_s - 1) * 100;
  }
  return rows;
}

}  // namespace kernmap::train
