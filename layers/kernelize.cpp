// kernelize(): resolve each kernel layer of a module tree once and bind it; the Report of what was chosen and
// why.
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernmap/layers.h"
#include "layers/verify.h"

namespace kernmap {

namespace verify {

// Every kernel layer under module, with its path, in module order (the root first, as "").
std::vector<std::pair<std::string, KernelLayer*>> kernel_layers(torch::nn::Module& module) {
  std::vector<std::pair<std::string, KernelLayer*>> out;
  if (auto* self = dynamic_cast<KernelLayer*>(&module)) out.emplace_back("", self);
  for (const auto& item : module.named_modules("", /*include_self=*/false))
    if (auto* layer = dynamic_cast<KernelLayer*>(item.value().get())) out.emplace_back(item.key(), layer);
  return out;
}

std::string device_of(const torch::nn::Module& module) {
  for (const auto& p : module.parameters()) {
    if (p.device().type() == c10::DeviceType::Meta) break;
    return c10::DeviceTypeName(p.device().type(), /*lower_case=*/true);
  }
  return "cpu";
}

}  // namespace verify

namespace {

using verify::device_of;
using verify::kernel_layers;

// Checks each resolved kernel on the sample step's inputs (kernmap/layers.h, kernelize with Verify): a kernel
// off by more than its tolerance becomes a fallback to the reference with the measured error (Python's
// _kernelize._verified).
void verified(torch::nn::Module& module, const std::vector<std::pair<std::string, KernelLayer*>>& layers,
              const Verify& verify, bool training, std::vector<const KernelDescriptor*>& chosen,
              Report& report) {
  std::vector<KernelLayer*> all, resolved;
  for (size_t i = 0; i < layers.size(); ++i) {
    all.push_back(layers[i].second);
    if (!report.entries[i].fallback) resolved.push_back(layers[i].second);
  }
  const auto calls = verify::capture(module, all, resolved, verify, training);
  for (size_t i = 0; i < layers.size(); ++i) {
    ReportEntry& e = report.entries[i];
    if (e.fallback) continue;
    const auto call = calls.find(layers[i].second);
    if (call == calls.end()) {
      e.reason += "; verify: not called by the sample batch";
      continue;
    }
    verify::Check result;
    try {
      result = verify::check(verify::op_of(*chosen[i]), call->second, training);
    } catch (const std::invalid_argument& err) {  // no op to run: bind() below would refuse it too
      result = {0.0, 0.0, "output", std::string(err.what())};
    }
    if (result.passed()) {
      e.error = result.error;
      e.tolerance = result.tolerance;
      continue;
    }
    const KernelDescriptor* reference = reference_kernel(e.layer);
    const bool measured = !result.failure && std::isfinite(result.error);
    e = {e.path,
         e.layer,
         reference->name,
         true,
         "reference",
         result.reason(),
         measured ? std::optional<double>(result.error) : std::nullopt,
         result.failure ? std::nullopt : std::optional<double>(result.tolerance)};
    chosen[i] = reference;
  }
}

std::string figure(const std::optional<double>& v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2g", *v);
  return text;
}

}  // namespace

Report kernelize(torch::nn::Module& module, const std::string& device_or_empty, Mode mode,
                 bool use_fallback) {
  return kernelize(module, device_or_empty, mode, use_fallback, Verify{});
}

Report kernelize(torch::nn::Module& module, const std::string& device_or_empty, Mode mode, bool use_fallback,
                 const Verify& verify) {
  Report report;
  report.device = device_or_empty.empty() ? device_of(module) : device_or_empty;
  report.mode = mode;
  const auto layers = kernel_layers(module);
  std::vector<const KernelDescriptor*> chosen;
  bool any_fallback = false;
  for (const auto& [path, layer] : layers) {
    const Decision d = resolve(layer->layer_name(), report.device, mode, layer->kernel_inputs());
    report.entries.push_back({path, layer->layer_name(), d.kernel->name, d.fallback, d.source, d.reason});
    chosen.push_back(d.kernel);
  }
  if (verify.step) verified(module, layers, verify, has_flag(mode, Mode::kTraining), chosen, report);
  for (const ReportEntry& e : report.entries) any_fallback = any_fallback || e.fallback;
  if (!use_fallback && any_fallback) {
    std::string what = "kernelize: no usable " + to_string(mode) + " kernel on " + report.device + " for";
    for (const ReportEntry& e : report.entries)
      if (e.fallback) what += "\n  " + e.path + " (" + e.layer + "): " + e.reason;
    throw KernelizeError(what, report);
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    KernelLayer* layer = layers[i].second;
    ReportEntry& entry = report.entries[i];
    try {
      layer->bind(*chosen[i]);
    } catch (const std::invalid_argument& e) {
      // A mapped kernel whose op cannot be bound (a plugin registered a descriptor without its op): the layer
      // keeps working on its reference.
      if (!use_fallback) throw KernelizeError("kernelize: " + entry.path + ": " + e.what(), report);
      const KernelDescriptor* reference = reference_kernel(layer->layer_name());
      layer->bind(*reference);
      entry = {entry.path, entry.layer, reference->name, true, "reference", e.what()};
    }
  }
  return report;
}

Report restore_reference(torch::nn::Module& module) {
  Report report;
  report.device = device_of(module);
  for (const auto& [path, layer] : kernel_layers(module)) {
    const KernelDescriptor* reference = reference_kernel(layer->layer_name());
    layer->bind(*reference);
    report.entries.push_back(
        {path, layer->layer_name(), reference->name, true, "reference", "restored reference"});
  }
  return report;
}

std::string Report::table() const {
  const bool verified =
      std::any_of(entries.begin(), entries.end(), [](const ReportEntry& e) { return e.error; });
  std::vector<std::string> header = {"module", "layer", "kernel", "reason"};
  if (verified) header.insert(header.begin() + 3, "error / tolerance");
  std::vector<std::vector<std::string>> rows;
  for (const ReportEntry& e : entries) {
    rows.push_back({e.path.empty() ? "(root)" : e.path, e.layer, e.kernel, e.reason});
    if (verified)
      rows.back().insert(rows.back().begin() + 3,
                         e.error && e.tolerance ? figure(e.error) + " / " + figure(e.tolerance) : "-");
  }
  std::vector<size_t> width(header.size());
  for (size_t c = 0; c < header.size(); ++c) {
    width[c] = header[c].size();
    for (const auto& r : rows) width[c] = std::max(width[c], r[c].size());
  }
  std::ostringstream out;
  auto line = [&](const std::vector<std::string>& cells) {
    std::string s;
    for (size_t c = 0; c < cells.size(); ++c) {
      s += cells[c];
      if (c + 1 < cells.size()) s += std::string(width[c] - cells[c].size() + 2, ' ');
    }
    out << s << '\n';
  };
  line(header);
  std::vector<std::string> rule;
  for (size_t w : width) rule.emplace_back(w, '-');
  line(rule);
  for (const auto& r : rows) line(r);
  return out.str();
}

std::string Report::json() const {
  nlohmann::ordered_json layers = nlohmann::ordered_json::array();
  auto number = [](const std::optional<double>& v) { return v ? nlohmann::ordered_json(*v) : nullptr; };
  for (const ReportEntry& e : entries)
    layers.push_back({{"path", e.path},
                      {"layer", e.layer},
                      {"kernel", e.kernel},
                      {"fallback", e.fallback},
                      {"source", e.source},
                      {"reason", e.reason},
                      {"error", number(e.error)},
                      {"tolerance", number(e.tolerance)}});
  const nlohmann::ordered_json root = {{"device", device}, {"mode", to_string(mode)}, {"layers", layers}};
  return root.dump(2);
}

}  // namespace kernmap
