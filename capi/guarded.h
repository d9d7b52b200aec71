// Internal: the exception boundary of the C API, shared by its registry and plugin entry points.
#pragma once

#include <functional>

namespace kernmap::detail {

/// Runs body for a C entry point named function, turning every exception into a status code and, when error
/// is not NULL, a message: std::invalid_argument -> KERNMAP_INVALID_ARGUMENT (its message, prefixed with
/// function when name_invalid_argument), JSON errors -> KERNMAP_INVALID_ARGUMENT, anything else ->
/// KERNMAP_INTERNAL_ERROR.
int guarded_call(const char* function, char** error, const std::function<void()>& body,
                 bool name_invalid_argument);

}  // namespace kernmap::detail
