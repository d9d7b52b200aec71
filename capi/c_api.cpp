// The C API (include/kernmap/c_api.h): JSON in, JSON out, status codes and messages instead of exceptions.
#include "kernmap/c_api.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "capi/guarded.h"
#include "kernmap/cpu.h"
#include "kernmap/mapping_file.h"
#include "kernmap/registry.h"
#include "repository/json_forms.h"

namespace kernmap {
namespace {

using nlohmann::json;

using detail::copy_string;
using detail::descriptor_to_json;
using detail::field_or;
using detail::mapping_to_json;

template <typename Body>
int guarded(const char* function, char** error, Body&& body) {
  return detail::guarded_call(function, error, body, /*name_invalid_argument=*/false);
}

json parse(const char* function, const char* what, const char* text) {
  if (text == nullptr) throw std::invalid_argument(std::string(function) + ": " + what + " is NULL");
  return json::parse(text);
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

int kernmap_cpu_levels(char** levels_json, char** error) {
  return guarded("kernmap_cpu_levels", error, [&] {
    if (levels_json == nullptr) throw std::invalid_argument("kernmap_cpu_levels: levels_json is NULL");
    *levels_json = copy_string(json{{"level", cpu_level()}, {"supported", supported_cpu_levels()}}.dump());
  });
}

int kernmap_set_cpu_level(const char* level, char** error) {
  return guarded("kernmap_set_cpu_level", error, [&] {
    if (level == nullptr) throw std::invalid_argument("kernmap_set_cpu_level: level is NULL");
    set_cpu_level(level);
  });
}

}  // extern "C"
