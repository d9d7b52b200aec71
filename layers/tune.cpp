// tune(): every eligible kernel of each layer a model bears, verified and timed on the model's live inputs
// (kernmap/tune.h; Python's _tune.py step for step).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernmap/tune.h"
#include "layers/tune_file.h"
#include "layers/verify.h"

namespace kernmap {
namespace {

using Tensor = at::Tensor;

struct Eligible {
  const KernelDescriptor* kernel;
  std::optional<std::string> why_not;  ///< nullopt when it can run here
};

// Every registered kernel of the layer with why it cannot run here, as resolution decides with it mapped
// alone (device, dtype, backward, its supports() on the live shapes), and whether its torch op exists.
std::vector<Eligible> eligible(const std::string& layer, const std::string& device,
                               const verify::Call& call) {
  std::vector<Eligible> out;
  const KernelInputs inputs{verify::dtype_name(call.dtype()), call.shapes()};
  for (const KernelDescriptor* k : registered_kernels()) {
    if (k->layer != layer) continue;
    std::optional<std::string> why_not;
    if (k->provider() != "reference") {
      const ScopedMapping only({{layer, {{device, {{Mode::kTraining, k->name}}}}}}, /*inherit=*/false);
      const Decision d = resolve(layer, device, Mode::kTraining, inputs);
      if (d.fallback || d.kernel != k) why_not = d.reason;
    }
    if (!why_not) {
      try {
        (void)verify::op_of(*k);
      } catch (const std::invalid_argument& e) {
        why_not = e.what();
      }
    }
    out.push_back({k, why_not});
  }
  return out;
}

// The worst check over the calls; the first that fails.
verify::Check verified(const c10::OperatorHandle& op, const std::vector<const verify::Call*>& calls) {
  std::optional<verify::Check> worst;
  for (const verify::Call* call : calls) {
    const verify::Check c = verify::check(op, *call, /*training=*/true);
    if (!c.passed()) return c;
    if (!worst || c.error / c.tolerance > worst->error / worst->tolerance) worst = c;
  }
  return *worst;
}

// One sample step's calls of a layer through op, forward and backward under the fixed upstream gradients; the
// leaves' gradients dropped after each run so that no accumulation is timed.
std::function<void()> step_of(const c10::OperatorHandle& op, const std::vector<const verify::Call*>& calls) {
  std::vector<verify::Prepared> prepared;
  for (const verify::Call* call : calls) prepared.push_back(verify::prepare(*call, /*training=*/true));
  return [op, prepared]() mutable {
    const at::AutoGradMode grad_mode(true);
    for (verify::Prepared& p : prepared) {
      std::vector<c10::IValue> stack = p.args;
      op.callBoxed(stack);
      std::vector<Tensor> outs;
      for (const Tensor& o : verify::outputs_of(stack))
        if (o.requires_grad()) outs.push_back(o);
      if (!outs.empty() && !p.leaves.empty()) torch::autograd::backward(outs, verify::upstream(outs));
      for (Tensor& leaf : p.leaves) leaf.mutable_grad().reset();
    }
  };
}

// Median milliseconds of each run after warm-up, the runs interleaved (Python's bench.time_interleaved).
std::vector<double> time_interleaved(const std::vector<std::function<void()>>& runs, int64_t warmup,
                                     int64_t reps) {
  std::vector<std::vector<double>> ms(runs.size());
  for (int64_t r = 0; r < warmup + reps; ++r)
    for (size_t i = 0; i < runs.size(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      runs[i]();
      const auto t1 = std::chrono::steady_clock::now();
      if (r >= warmup) ms[i].push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
  std::vector<double> out;
  for (std::vector<double>& m : ms) {
    std::sort(m.begin(), m.end());
    out.push_back(m[m.size() / 2]);
  }
  return out;
}

std::string fixed3(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3f", v);
  return text;
}

std::string ratio_text(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", v);
  return text;
}

TuneLayer tune_layer(const std::string& layer, const std::string& device,
                     const std::vector<const verify::Call*>& calls, const TuneOptions& options) {
  TuneLayer result{layer, static_cast<int64_t>(calls.size()), {}, "", {}};
  std::vector<std::pair<std::string, int64_t>> counts;  // shape classes in order of first appearance
  for (const verify::Call* call : calls) {
    const std::vector<std::vector<int64_t>> shapes = call->shapes();
    std::string key;
    for (const int64_t d : shapes.at(0)) {
      if (!key.empty()) key += 'x';
      key += std::to_string(d);
    }
    key += " " + verify::dtype_name(call->dtype());
    auto it = std::find_if(counts.begin(), counts.end(), [&](const auto& c) { return c.first == key; });
    if (it == counts.end()) {
      counts.emplace_back(key, 1);
    } else {
      ++it->second;
    }
  }
  for (const auto& [key, n] : counts) result.shapes.push_back(key + " (" + std::to_string(n) + ")");
  std::vector<size_t> timed;
  std::vector<std::function<void()>> runs;
  for (const Eligible& e : eligible(layer, device, *calls.front())) {
    result.candidates.push_back({e.kernel->name, std::nullopt, std::nullopt, std::nullopt, ""});
    TuneCandidate& c = result.candidates.back();
    if (e.why_not) {
      c.verdict = "not eligible: " + *e.why_not;
      continue;
    }
    const c10::OperatorHandle op = verify::op_of(*e.kernel);
    const verify::Check check = verified(op, calls);
    if (!check.failure) {
      c.error = check.error;
      c.tolerance = check.tolerance;
    }
    if (!check.passed()) {
      c.verdict = "failed " + check.reason();
      continue;
    }
    timed.push_back(result.candidates.size() - 1);
    runs.push_back(step_of(op, calls));
  }
  if (timed.empty()) return result;
  const std::vector<double> medians = time_interleaved(runs, options.warmup, options.reps);
  size_t best = timed.front();
  for (size_t i = 0; i < timed.size(); ++i) {
    result.candidates[timed[i]].median_ms = medians[i];
    if (medians[i] < *result.candidates[best].median_ms) best = timed[i];
  }
  const TuneCandidate& winner = result.candidates[best];
  result.winner = winner.kernel;
  for (const size_t i : timed) {
    TuneCandidate& c = result.candidates[i];
    c.verdict = i == best ? "winner"
                          : "slower: " + ratio_text(*c.median_ms / *winner.median_ms) + "x " + winner.kernel +
                                "'s " + fixed3(*winner.median_ms) + " ms";
  }
  return result;
}

nlohmann::ordered_json optional_json(const std::optional<double>& v) {
  return v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(nullptr);
}

std::string figure2(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2g", v);
  return text;
}

}  // namespace

std::map<std::string, std::string> TuneResult::winners() const {
  std::map<std::string, std::string> out;
  for (const TuneLayer& l : layers)
    if (!l.winner.empty()) out[l.layer] = l.winner;
  return out;
}

Mapping TuneResult::mapping() const {
  Mapping out;
  for (const auto& [layer, kernel] : winners()) out[layer][device][Mode::kTraining] = kernel;
  return out;
}

std::string TuneResult::table() const {
  const std::vector<std::string> header = {"layer",  "calls", "kernel", "median ms", "error / tolerance",
                                           "verdict"};
  std::vector<std::vector<std::string>> rows;
  for (const TuneLayer& l : layers)
    for (const TuneCandidate& c : l.candidates)
      rows.push_back({l.layer, std::to_string(l.calls), c.kernel, c.median_ms ? fixed3(*c.median_ms) : "-",
                      c.error ? figure2(*c.error) + " / " + figure2(*c.tolerance) : "-", c.verdict});
  std::vector<size_t> width;
  for (const std::string& h : header) width.push_back(h.size());
  for (const auto& r : rows)
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  auto line = [&](const std::vector<std::string>& cells) {
    std::string s;
    for (size_t i = 0; i < cells.size(); ++i)
      s += cells[i] + (i + 1 < cells.size() ? std::string(width[i] - cells[i].size() + 2, ' ') : "");
    while (!s.empty() && s.back() == ' ') s.pop_back();
    return s + "\n";
  };
  std::string summary = "kernmap tune on " + device + " (" + machine.cpu + ", " +
                        std::to_string(machine.threads) + " threads): ";
  bool first = true;
  for (const TuneLayer& l : layers)  // in model order, as Python's
    if (!l.winner.empty()) {
      summary += (first ? "" : ", ") + l.layer + " -> " + l.winner;
      first = false;
    }
  std::string out = summary + "\n" + line(header);
  std::vector<std::string> rule;
  for (const size_t w : width) rule.emplace_back(w, '-');
  out += line(rule);
  for (const auto& r : rows) out += line(r);
  return out;
}

std::string TuneResult::json() const {
  auto text_or_null = [](const std::string& s) {
    return s.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(s);
  };
  const TuneMachine& m = machine;
  nlohmann::ordered_json mapping_json = nlohmann::ordered_json::object();
  for (const TuneLayer& l : layers)
    if (!l.winner.empty()) mapping_json[l.layer][device]["training"] = l.winner;
  nlohmann::ordered_json layer_json = nlohmann::ordered_json::array();
  for (const TuneLayer& l : layers) {
    nlohmann::ordered_json candidates = nlohmann::ordered_json::array();
    for (const TuneCandidate& c : l.candidates)
      candidates.push_back({{"kernel", c.kernel},
                            {"median_ms", optional_json(c.median_ms)},
                            {"error", optional_json(c.error)},
                            {"tolerance", optional_json(c.tolerance)},
                            {"verdict", c.verdict}});
    layer_json.push_back({{"layer", l.layer},
                          {"calls", l.calls},
                          {"shapes", l.shapes},
                          {"winner", text_or_null(l.winner)},
                          {"candidates", candidates}});
  }
  const nlohmann::ordered_json doc = {{"kernmap_tune", 1},
                                      {"device", device},
                                      {"machine",
                                       {{"host", m.host},
                                        {"cpu", m.cpu},
                                        {"arch", m.arch},
                                        {"cores", m.cores},
                                        {"threads", m.threads},
                                        {"aten_cpu_level", m.aten_cpu_level},
                                        {"kernmap_cpu_level", m.kernmap_cpu_level},
                                        {"kernmap_cpu_isa_env", text_or_null(m.kernmap_cpu_isa_env)},
                                        {"accelerator", nullptr},
                                        {"torch", m.torch},
                                        {"transformers", nullptr},
                                        {"kernmap", m.kernmap},
                                        {"date", m.date}}},
                                      {"mapping", mapping_json},
                                      {"layers", layer_json}};
  return doc.dump(1);
}

TuneResult tune(torch::nn::Module& module, const std::string& device_or_empty, const Verify& step,
                const TuneOptions& options) {
  if (options.warmup < 0 || options.reps < 1)
    throw std::invalid_argument("tune: warmup must be >= 0 and reps >= 1, got warmup=" +
                                std::to_string(options.warmup) + ", reps=" + std::to_string(options.reps));
  if (!step.step)
    throw std::invalid_argument("tune: the sample step is empty (Verify::step must run a forward)");
  TuneResult result;
  result.device = device_or_empty.empty() ? verify::device_of(module) : device_or_empty;
  std::vector<KernelLayer*> all;
  for (const auto& [path, layer] : verify::kernel_layers(module)) all.push_back(layer);
  const auto calls = verify::capture(module, all, all, step, /*training=*/true);
  std::vector<std::pair<std::string, std::vector<const verify::Call*>>> by_layer;  // in model order
  for (KernelLayer* layer : all) {
    const auto call = calls.find(layer);
    if (call == calls.end()) continue;
    auto it = std::find_if(by_layer.begin(), by_layer.end(),
                           [&](const auto& l) { return l.first == layer->layer_name(); });
    if (it == by_layer.end()) it = by_layer.insert(by_layer.end(), {layer->layer_name(), {}});
    it->second.push_back(&call->second);
  }
  for (const auto& [layer, layer_calls] : by_layer)
    result.layers.push_back(tune_layer(layer, result.device, layer_calls, options));
  result.machine = tune_machine(result.device);
  return result;
}

}  // namespace kernmap
