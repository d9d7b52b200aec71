// Internal: the JSON forms of the C API (include/kernmap/c_api.h), shared by the C entry points and the
// plugin host functions, so that a plugin's descriptor means exactly what kernmap_register_kernel's does.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <string>

#include "kernmap/c_api.h"
#include "kernmap/registry.h"

namespace kernmap::detail {

/// A copy of text in memory the caller releases with kernmap_free (std::free); nullptr when out of memory.
char* copy_string(const std::string& text);

/// Runs body for a C entry point named function, turning every exception into a status code and, when error
/// is not NULL, a message: std::invalid_argument -> KERNMAP_INVALID_ARGUMENT (its message, prefixed with
/// function when name_invalid_argument), JSON errors -> KERNMAP_INVALID_ARGUMENT, anything else ->
/// KERNMAP_INTERNAL_ERROR.
int guarded_call(const char* function, char** error, const std::function<void()>& body,
                 bool name_invalid_argument);

/// {"Layer": {"device": {"mode": "provider/kernel"}}} -> Mapping; throws std::invalid_argument naming
/// `function` and the entry (modes are checked by parse_mode; layers and kernels are checked by the
/// registry).
Mapping mapping_from_json(const char* function, const nlohmann::json& j);

/// A kernel descriptor as kernmap_register_kernel takes it; supports may be NULL. Throws
/// std::invalid_argument when name or layer is missing, nlohmann::json::exception for a field of the wrong
/// type.
KernelDescriptor descriptor_from_json(const nlohmann::json& j, kernmap_supports_fn supports, void* user_data);

}  // namespace kernmap::detail
