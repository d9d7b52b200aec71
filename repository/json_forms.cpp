// The JSON forms of descriptors and mappings (repository/json_forms.h).
#include "repository/json_forms.h"

#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace kernmap::detail {
namespace {

using nlohmann::json;

// A foreign supports() check: the callback and its user data, called with the inputs as JSON.
std::function<std::optional<std::string>(const KernelInputs&)> foreign_supports(kernmap_supports_fn fn,
                                                                                void* user_data) {
  return [fn, user_data](const KernelInputs& inputs) -> std::optional<std::string> {
    const std::string text = json{{"dtype", inputs.dtype}, {"shapes", inputs.shapes}}.dump();
    char reason[512] = {0};
    if (fn(user_data, text.c_str(), reason, sizeof reason) != 0) return std::nullopt;
    reason[sizeof reason - 1] = '\0';
    return reason[0] != '\0' ? std::string(reason) : std::string("inputs not supported");
  };
}

}  // namespace

char* copy_string(const std::string& text) {
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out != nullptr) std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}

json mapping_to_json(const Mapping& mapping) {
  json out = json::object();
  for (const auto& [layer, devices] : mapping) {
    json& by_device = out[layer];
    by_device = json::object();
    for (const auto& [device, modes] : devices) {
      json& by_mode = by_device[device];
      by_mode = json::object();
      for (const auto& [mode, kernel] : modes) by_mode[to_string(mode)] = kernel;
    }
  }
  return out;
}

Mapping mapping_from_json(const char* function, const json& j) {
  if (!j.is_object()) {
    throw std::invalid_argument(std::string(function) +
                                ": mapping must be a JSON object {layer: {device: {mode: kernel}}}, got " +
                                j.dump());
  }
  Mapping mapping;
  for (const auto& [layer, devices] : j.items()) {
    if (!devices.is_object()) {
      throw std::invalid_argument(std::string(function) + ": layer '" + layer +
                                  "' must map to an object {device: {mode: kernel}}, got " + devices.dump());
    }
    auto& by_device = mapping[layer];
    for (const auto& [device, modes] : devices.items()) {
      if (!modes.is_object()) {
        throw std::invalid_argument(std::string(function) + ": layer '" + layer + "' device '" + device +
                                    "' must map to an object {mode: kernel}, got " + modes.dump());
      }
      auto& by_mode = by_device[device];
      for (const auto& [mode, kernel] : modes.items()) by_mode[parse_mode(mode)] = kernel.get<std::string>();
    }
  }
  return mapping;
}

json descriptor_to_json(const KernelDescriptor& d) {
  return json{{"name", d.name},
              {"provider", d.provider()},
              {"layer", d.layer},
              {"devices", d.devices},
              {"dtypes", d.dtypes},
              {"has_backward", d.has_backward},
              {"compile_safe", d.compile_safe},
              {"deterministic", d.deterministic},
              {"op", d.op},
              {"description", d.description}};
}

KernelDescriptor descriptor_from_json(const json& j, kernmap_supports_fn supports, void* user_data) {
  if (!j.is_object() || !j.contains("name") || !j.contains("layer")) {
    throw std::invalid_argument(
        "kernmap_register_kernel: descriptor must be an object with \"name\" and "
        "\"layer\", got " +
        j.dump());
  }
  KernelDescriptor d;
  d.name = j.at("name").get<std::string>();
  d.layer = j.at("layer").get<std::string>();
  d.devices = field_or(j, "devices", std::vector<std::string>{"*"});
  d.dtypes = field_or(j, "dtypes", std::vector<std::string>{"float32", "bfloat16", "float16", "float64"});
  d.has_backward = field_or(j, "has_backward", false);
  d.compile_safe = field_or(j, "compile_safe", false);
  d.deterministic = field_or(j, "deterministic", true);
  d.op = field_or(j, "op", std::string());
  d.description = field_or(j, "description", std::string());
  if (supports != nullptr) d.supports = foreign_supports(supports, user_data);
  return d;
}

}  // namespace kernmap::detail
