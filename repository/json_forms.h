// Internal: the JSON forms of kernel descriptors and mappings (include/kernmap/c_api.h), shared by the plugin
// host (a plugin registers through them) and the C API, so that a plugin's descriptor means exactly what
// kernmap_register_kernel's does; and the C strings both hand out.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "kernmap/c_api.h"
#include "kernmap/registry.h"

namespace kernmap::detail {

/// A copy of text in memory the caller releases with std::free (kernmap_free, the host's free_string);
/// nullptr when out of memory.
char* copy_string(const std::string& text);

/// object[key] as T, or fallback when the key is missing or null.
template <typename T>
T field_or(const nlohmann::json& object, const char* key, T fallback) {
  const auto it = object.find(key);
  return it == object.end() || it->is_null() ? fallback : it->get<T>();
}

/// {"Layer": {"device": {"mode": "provider/kernel"}}} -> Mapping; throws std::invalid_argument naming
/// `function` and the entry (modes are checked by parse_mode; layers and kernels are checked by the
/// registry).
Mapping mapping_from_json(const char* function, const nlohmann::json& j);
/// The inverse of mapping_from_json: modes spelled by to_string.
nlohmann::json mapping_to_json(const Mapping& mapping);

/// A kernel descriptor as kernmap_register_kernel takes it; supports may be NULL. Throws
/// std::invalid_argument when name or layer is missing, nlohmann::json::exception for a field of the wrong
/// type.
KernelDescriptor descriptor_from_json(const nlohmann::json& j, kernmap_supports_fn supports, void* user_data);
/// A descriptor as kernmap_list_kernels gives it: descriptor_from_json's fields and "provider".
nlohmann::json descriptor_to_json(const KernelDescriptor& d);

}  // namespace kernmap::detail
