// Internal: the JSON forms of the C API (include/kernmap/c_api.h), shared by the C entry points and the
// plugin host functions, so that a plugin's descriptor means exactly what kernmap_register_kernel's does.
#pragma once

#include <nlohmann/json.hpp>

#include "kernmap/c_api.h"
#include "kernmap/registry.h"

namespace kernmap::detail {

/// {"Layer": {"device": {"mode": "provider/kernel"}}} -> Mapping; throws std::invalid_argument naming
/// `function` and the entry (modes are checked by parse_mode; layers and kernels are checked by the
/// registry).
Mapping mapping_from_json(const char* function, const nlohmann::json& j);

/// A kernel descriptor as kernmap_register_kernel takes it; supports may be NULL. Throws
/// std::invalid_argument when name or layer is missing, nlohmann::json::exception for a field of the wrong
/// type.
KernelDescriptor descriptor_from_json(const nlohmann::json& j, kernmap_supports_fn supports, void* user_data);

}  // namespace kernmap::detail
