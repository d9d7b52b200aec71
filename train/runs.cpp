// The runs that prove a kernel mapping: alignment (original vs kernelized, step by step, judged against the
// noise floor measured in the same run) and ablation (step time per kernel against transformers' default
// experts, interleaved, with each step's peak CPU memory).
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "kernmap/memory.h"
#include "kernmap/train.h"

namespace kernmap::train {
namespace {

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

// The experts implementation a binding runs, by the kernel of its first Experts layer ("" without experts).
std::string experts_of(const Report& report) {
  for (const ReportEntry& e : report.entries) {
    if (e.layer != "Experts") continue;
    if (!e.fallback) return "kernmap";
    for (const char* name : {"grouped_mm", "batched_mm", "eager"})
      if (experts_baseline_kernel(name) == e.kernel) return name;
    return e.kernel;
  }
  return "";
}

}  // namespace

std::string experts_baseline_kernel(const std::string& implementation) {
  if (implementation == "grouped_mm") return "transformers/experts_grouped_mm";
  if (implementation == "batched_mm") return "transformers/experts_batched_mm";
  if (implementation == "eager") return reference_kernel("Experts")->name;
  throw std::invalid_argument("unknown experts implementation '" + implementation +
                              "' (expected grouped_mm, batched_mm or eager)");
}

const KernelDescriptor* float64_kernel(const std::string& layer) {
  for (const KernelDescriptor* k : registered_kernels())
    if (k->layer == layer && k->provider() == "float64") return k;
  return nullptr;
}

AlignResult align(const std::function<std::shared_ptr<CausalLM>()>& make_model, const Dataset& data,
                  const TrainOptions& options, const LayerSet& layers, int64_t steps, double rtol,
                  const Progress& progress, bool verify, Routing routing) {
  AlignResult result;
  result.rtol = rtol;
  Baseline noise_kernels;
  for (const std::string& layer : layers)
    if (const KernelDescriptor* k = float64_kernel(layer)) noise_kernels[layer] = k->name;
  std::vector<std::string> present;
  {
    const std::shared_ptr<CausalLM> probe = make_model();  // freed before the runs
    present = layers_of(*probe);
    result.routes_tokens = probe->routes_tokens();
  }
  // A model that routes tokens: the runs after the original replay its routing, or (free routing) one more
  // noise run per selected layer it has, that layer alone on its float64 kernel.
  const std::shared_ptr<RoutingTape> tape =
      routing == Routing::kReplay && result.routes_tokens ? std::make_shared<RoutingTape>() : nullptr;
  result.routing_replayed = tape != nullptr;
  std::vector<std::string> alone;
  for (const std::string& layer : present)
    if (noise_kernels.count(layer)) alone.push_back(layer);
  if (tape || alone.size() < 2 || std::find(present.begin(), present.end(), "Experts") == present.end())
    alone.clear();
  const int64_t total = static_cast<int64_t>(3 + alone.size()) * steps;
  int64_t done = 0;
  // flips: per step, the routers' flips against the replayed routing (replaying runs with a tape).
  auto run = [&](const std::function<Report(CausalLM&)>& bind, std::vector<StepLog>& logs,
                 std::vector<RoutingTape::Flips>* flips = nullptr) {
    auto model = make_model();
    Report report = bind(*model);
    if (tape) {
      // After the binding: verifying kernels runs the model on a sample batch, which must not be replayed.
      if (flips)
        tape->replay();
      else
        tape->record();
      model->set_routing_tape(tape);
    }
    Trainer trainer(model, data, options);
    for (int64_t s = 0; s < steps; ++s) {
      logs.push_back(trainer.step());
      if (tape && flips) flips->push_back(tape->take_flips());
      if (progress) progress(++done, total);
    }
    return report;
  };
  run([](CausalLM& m) { return restore_reference(m); }, result.original);
  std::vector<RoutingTape::Flips> noise_flips;
  result.noise_report =
      run([&](CausalLM& m) { return bind_kernels(m, {}, noise_kernels); }, result.noise, &noise_flips);
  for (const RoutingTape::Flips& f : noise_flips) result.noise_routing.add(f);
  for (const std::string& layer : alone) {
    const Baseline one{{layer, noise_kernels.at(layer)}};
    run([&](CausalLM& m) { return bind_kernels(m, {}, one); }, result.noise_alone[layer]);
  }
  result.report = run(
      [&](CausalLM& m) {
        return bind_kernels(m, layers, {}, verify ? sample_step(m, data, options.batch_size) : Verify{});
      },
      result.kernelized, &result.routing);
  std::vector<std::vector<StepLog>> noise_runs{result.noise};
  for (const auto& entry : result.noise_alone) noise_runs.push_back(entry.second);
  result.verdict = judge(result.original, result.kernelized, noise_runs, rtol);
  result.max_loss_rel = result.verdict.loss.max_diff;
  result.max_grad_norm_rel = result.verdict.grad_norm.max_diff;
  result.worst_loss_step = result.verdict.loss.max_diff_step;
  result.worst_grad_norm_step = result.verdict.grad_norm.max_diff_step;
  result.passed = result.verdict.passed;
  return result;
}

std::vector<AblationRow> ablate(const std::function<std::shared_ptr<CausalLM>()>& make_model,
                                const Dataset& data, const TrainOptions& options, const LayerSet& layers,
                                int64_t warmup, int64_t steps, const Progress& progress,
                                const std::string& experts, const std::vector<std::string>& more_experts,
                                bool verify) {
  count_cpu_memory();
  const Baseline baseline{{"Experts", experts_baseline_kernel(experts)}};
  for (const std::string& name : more_experts) experts_baseline_kernel(name);  // unknown names throw first
  std::vector<AblationRow> rows;
  std::vector<std::unique_ptr<Trainer>> trainers;
  auto add_row = [&](std::string name, LayerSet set, const Baseline& b) {
    auto model = make_model();
    const bool check = verify && !set.empty();
    Report report =
        bind_kernels(*model, set, b, check ? sample_step(*model, data, options.batch_size) : Verify{});
    trainers.push_back(std::make_unique<Trainer>(model, data, options));
    rows.push_back({std::move(name), std::move(set), experts_of(report)});
    rows.back().report = std::move(report);
  };
  const std::vector<std::string> model_layers = layers_of(*make_model());
  const bool has_experts = std::count(model_layers.begin(), model_layers.end(), "Experts") > 0;
  add_row("original", {}, baseline);
  if (has_experts)
    for (const std::string& name : more_experts)
      if (name != experts)
        add_row("original (experts " + name + ")", {}, {{"Experts", experts_baseline_kernel(name)}});
  for (const std::string& layer : model_layers)
    if (layers.count(layer)) add_row("+" + layer, {layer}, baseline);
  LayerSet all;
  for (const auto& row : rows) all.insert(row.layers.begin(), row.layers.end());
  add_row("all", all, baseline);

  const int64_t total = warmup + steps;
  const size_t n = rows.size();
  for (int64_t s = 0; s < total; ++s) {
    for (size_t k = 0; k < n; ++k) {
      const size_t r = (static_cast<size_t>(s) + k) % n;  // rotate the order so no row is always first
      reset_cpu_memory_peak();
      const int64_t before = cpu_memory().in_use;
      const StepLog log = trainers[r]->step();
      rows[r].final_loss = log.loss;
      if (s >= warmup) {  // warm-up steps also hold one-time allocations (caches, lazily created state)
        rows[r].peak_bytes = std::max(rows[r].peak_bytes, static_cast<double>(cpu_memory().peak - before));
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
