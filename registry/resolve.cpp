// Resolution: from (layer, device, mode, inputs) to a kernel, or to the layer's reference with the reason.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernmap/registry.h"
#include "registry/env.h"
#include "registry/mapping_levels.h"

namespace kernmap {
namespace {

constexpr Mode kInferenceCompile = Mode::kInference | Mode::kCompile;
constexpr Mode kTrainingCompile = Mode::kTraining | Mode::kCompile;

// The mapping keys a request may use, in the order the `kernels` library tries them.
std::optional<std::vector<Mode>> candidate_keys(Mode request) {
  if (request == Mode::kInference) {
    return std::vector{Mode::kInference, kInferenceCompile, Mode::kTraining, kTrainingCompile,
                       Mode::kFallback};
  }
  if (request == kInferenceCompile) return std::vector{kInferenceCompile, kTrainingCompile, Mode::kFallback};
  if (request == Mode::kTraining) return std::vector{Mode::kTraining, kTrainingCompile, Mode::kFallback};
  if (request == kTrainingCompile) return std::vector{kTrainingCompile, Mode::kFallback};
  return std::nullopt;
}

// nullopt when the kernel can serve the request, else why not.
std::optional<std::string> rejection(const std::string& kernel_name, const std::string& device, Mode request,
                                     const KernelInputs& inputs) {
  const KernelDescriptor* kernel = find_kernel(kernel_name);
  if (kernel == nullptr) return "kernel " + kernel_name + " is not registered";
  const auto& devices = kernel->devices;
  if (std::find(devices.begin(), devices.end(), device) == devices.end() &&
      std::find(devices.begin(), devices.end(), "*") == devices.end()) {
    return kernel_name + " does not run on " + device;
  }
  if (has_flag(request, Mode::kTraining) && !kernel->has_backward) return kernel_name + " has no backward";
  if (has_flag(request, Mode::kCompile) && !kernel->compile_safe) return kernel_name + " is not compile-safe";
  const auto& dtypes = kernel->dtypes;
  if (!inputs.dtype.empty() && std::find(dtypes.begin(), dtypes.end(), inputs.dtype) == dtypes.end()) {
    return "dtype " + inputs.dtype + " not supported by " + kernel_name;
  }
  if (kernel->supports) return kernel->supports(inputs);
  return std::nullopt;
}

Decision decide(Decision decision, const std::vector<Mode>& keys, const KernelInputs& inputs) {
  const std::optional<detail::OwnedEntries> owned = detail::owning_entries(decision.layer, decision.device);
  if (!owned) {
    decision.reason = "no mapping for " + decision.device;
    return decision;
  }
  std::optional<std::string> first_rejection;
  bool any_candidate = false;
  for (const Mode key : keys) {
    const auto entry = owned->by_mode.find(key);
    if (entry == owned->by_mode.end()) continue;
    any_candidate = true;
    std::optional<std::string> why_not = rejection(entry->second, decision.device, decision.mode, inputs);
    if (!why_not) {
      decision.kernel = find_kernel(entry->second);
      decision.fallback = false;
      decision.source = owned->source;
      decision.reason = owned->source + " mapping (" + to_string(key) + ")";
      return decision;
    }
    if (!first_rejection) first_rejection = std::move(why_not);
  }
  decision.reason = any_candidate ? *first_rejection
                                  : "no " + to_string(decision.mode) + " mapping for " + decision.layer +
                                        " on " + decision.device;
  return decision;
}

void log_decision(const Decision& decision) {
  // One fputs per line: stdio locks the stream, so lines from concurrent resolutions do not interleave.
  const std::string line = "[kernmap] " + decision.layer + " on " + decision.device + " (" +
                           to_string(decision.mode) + "): " + decision.kernel->name + " \u2014 " +
                           decision.reason + "\n";
  std::fputs(line.c_str(), stderr);
}

}  // namespace

Decision resolve(const std::string& layer, const std::string& device, Mode mode, const KernelInputs& inputs) {
  const KernelDescriptor* reference = reference_kernel(layer);
  if (reference == nullptr) throw std::invalid_argument("resolve: " + detail::unknown_layer_message(layer));
  const std::optional<std::vector<Mode>> keys = candidate_keys(mode);
  if (!keys) {
    throw std::invalid_argument("resolve: mode " + to_string(mode) +
                                " is not a request (expected inference, training, inference+compile or "
                                "training+compile)");
  }
  Decision decision{.layer = layer,
                    .device = device,
                    .mode = mode,
                    .kernel = reference,
                    .fallback = true,
                    .source = "reference",
                    .reason = {}};
  if (detail::disabled_by_env(layer)) {
    decision.reason = "disabled by KERNMAP_DISABLE";
  } else {
    decision = decide(std::move(decision), *keys, inputs);
  }
  if (detail::decision_log_enabled()) log_decision(decision);
  return decision;
}

}  // namespace kernmap
