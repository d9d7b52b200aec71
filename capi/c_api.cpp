// The C API (include/kernmap/c_api.h): JSON in, JSON out, status codes and messages instead of exceptions.
#include "kernmap/c_api.h"

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernmap/mapping_file.h"
#include "kernmap/registry.h"
#include "repository/json_forms.h"

namespace kernmap {
namespace {

using nlohmann::json;

using detail::copy_string;

template <typename Body>
int guarded(const char* function, char** error, Body&& body) {
  return detail::guarded_call(function, error, body, /*name_invalid_argument=*/false);
}

json parse(const char* function, const char* what, const char* text) {
  if (text == nullptr) throw std::invalid_argument(std::string(function) + ": " + what + " is NULL");
  return json::parse(text);
}

template <typename T>
T field_or(const json& object, const char* key, T fallback) {
  const auto it = object.find(key);
  return it == object.end() || it->is_null() ? fallback : it->get<T>();
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

// Scopes live on the heap between push and pop; the handle is the address, checked against this table so that
// a stale or foreign handle is an error, not a crash.
struct ScopeTable {
  std::mutex mutex;
  std::unordered_map<uint64_t, std::unique_ptr<ScopedMapping>> scopes;
};

ScopeTable& scope_table() {
  static ScopeTable table;
  return table;
}

}  // namespace

namespace detail {

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

}  // namespace detail
}  // namespace kernmap

using namespace kernmap;  // NOLINT(google-build-using-namespace): the C entry points below only forward

extern "C" {

int kernmap_c_api_version(void) {
  return KERNMAP_C_API_VERSION;
}

void kernmap_free(char* text) {
  std::free(text);
}

int kernmap_register_kernel(const char* descriptor_json, kernmap_supports_fn supports, void* user_data,
                            char** error) {
  return guarded("kernmap_register_kernel", error, [&] {
    const json j = parse("kernmap_register_kernel", "descriptor_json", descriptor_json);
    register_kernel(detail::descriptor_from_json(j, supports, user_data));
  });
}

int kernmap_register_mapping(const char* mapping_json, char** error) {
  return guarded("kernmap_register_mapping", error, [&] {
    register_mapping(detail::mapping_from_json(
        "register_mapping", parse("kernmap_register_mapping", "mapping_json", mapping_json)));
  });
}

int kernmap_register_default_mapping(const char* mapping_json, char** error) {
  return guarded("kernmap_register_default_mapping", error, [&] {
    register_default_mapping(detail::mapping_from_json(
        "register_default_mapping", parse("kernmap_register_default_mapping", "mapping_json", mapping_json)));
  });
}

int kernmap_load_mapping_file(const char* path, char** mapping_json, char** error) {
  return guarded("kernmap_load_mapping_file", error, [&] {
    if (path == nullptr) throw std::invalid_argument("kernmap_load_mapping_file: path is NULL");
    if (mapping_json == nullptr)
      throw std::invalid_argument("kernmap_load_mapping_file: mapping_json is NULL");
    *mapping_json = copy_string(mapping_to_json(load_mapping_file(path)).dump());
  });
}

int kernmap_register_mapping_file(const char* path, char** error) {
  return guarded("kernmap_register_mapping_file", error, [&] {
    if (path == nullptr) throw std::invalid_argument("kernmap_register_mapping_file: path is NULL");
    register_mapping_file(path);
  });
}

int kernmap_clear_user_mappings(char** error) {
  return guarded("kernmap_clear_user_mappings", error, [] { clear_user_mappings(); });
}

int kernmap_push_scope(const char* mapping_json, int inherit, uint64_t* handle, char** error) {
  return guarded("kernmap_push_scope", error, [&] {
    if (handle == nullptr) throw std::invalid_argument("kernmap_push_scope: handle is NULL");
    Mapping mapping =
        detail::mapping_from_json("use_mapping", parse("kernmap_push_scope", "mapping_json", mapping_json));
    auto scope = std::make_unique<ScopedMapping>(std::move(mapping), inherit != 0);
    const auto key = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(scope.get()));
    ScopeTable& table = scope_table();
    std::lock_guard lock(table.mutex);
    table.scopes.emplace(key, std::move(scope));
    *handle = key;
  });
}

int kernmap_pop_scope(uint64_t handle, char** error) {
  return guarded("kernmap_pop_scope", error, [&] {
    std::unique_ptr<ScopedMapping> scope;
    {
      ScopeTable& table = scope_table();
      std::lock_guard lock(table.mutex);
      const auto it = table.scopes.find(handle);
      if (it == table.scopes.end()) {
        throw std::invalid_argument("kernmap_pop_scope: handle " + std::to_string(handle) +
                                    " is not an open scope (already ended, or never pushed)");
      }
      scope = std::move(it->second);
      table.scopes.erase(it);
    }
    scope.reset();  // outside the table lock: the destructor touches only this thread's scope stack
  });
}

int kernmap_resolve(const char* request_json, char** decision_json, char** error) {
  return guarded("kernmap_resolve", error, [&] {
    if (decision_json == nullptr) throw std::invalid_argument("kernmap_resolve: decision_json is NULL");
    const json j = parse("kernmap_resolve", "request_json", request_json);
    KernelInputs inputs;
    inputs.dtype = field_or(j, "dtype", std::string());
    inputs.shapes = field_or(j, "shapes", std::vector<std::vector<int64_t>>{});
    const Decision d = resolve(j.at("layer").get<std::string>(), j.at("device").get<std::string>(),
                               parse_mode(j.at("mode").get<std::string>()), inputs);
    const json out{{"layer", d.layer},         {"device", d.device}, {"mode", to_string(d.mode)},
                   {"kernel", d.kernel->name}, {"op", d.kernel->op}, {"fallback", d.fallback},
                   {"source", d.source},       {"reason", d.reason}};
    *decision_json = copy_string(out.dump());
  });
}

int kernmap_list_kernels(char** kernels_json, char** error) {
  return guarded("kernmap_list_kernels", error, [&] {
    if (kernels_json == nullptr) throw std::invalid_argument("kernmap_list_kernels: kernels_json is NULL");
    json out = json::array();
    for (const KernelDescriptor* d : registered_kernels()) out.push_back(descriptor_to_json(*d));
    *kernels_json = copy_string(out.dump());
  });
}

int kernmap_effective_mapping(char** mapping_json, char** error) {
  return guarded("kernmap_effective_mapping", error, [&] {
    if (mapping_json == nullptr)
      throw std::invalid_argument("kernmap_effective_mapping: mapping_json is NULL");
    *mapping_json = copy_string(mapping_to_json(effective_mapping()).dump());
  });
}

}  // extern "C"

namespace kernmap::detail {

char* copy_string(const std::string& text) {
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out != nullptr) std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}

int guarded_call(const char* function, char** error, const std::function<void()>& body,
                 bool name_invalid_argument) {
  const auto fail = [&](int status, const std::string& message) {
    if (error != nullptr) *error = copy_string(message);
    return status;
  };
  try {
    body();
    return KERNMAP_OK;
  } catch (const std::invalid_argument& e) {
    return fail(KERNMAP_INVALID_ARGUMENT,
                name_invalid_argument ? std::string(function) + ": " + e.what() : e.what());
  } catch (const nlohmann::json::exception& e) {
    return fail(KERNMAP_INVALID_ARGUMENT, std::string(function) + ": invalid JSON argument: " + e.what());
  } catch (const std::exception& e) {
    return fail(KERNMAP_INTERNAL_ERROR, std::string(function) + ": " + e.what());
  } catch (...) {
    return fail(KERNMAP_INTERNAL_ERROR, std::string(function) + ": unknown error");
  }
}

}  // namespace kernmap::detail
