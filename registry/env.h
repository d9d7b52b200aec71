// Internal: the environment variables that steer resolution, read at each call so that tests and long-lived
// processes see changes.
#pragma once

#include <string>

namespace kernmap::detail {

/// True when KERNMAP_DISABLE is "all" or a comma-separated list naming `layer` (items trimmed of whitespace,
/// layer names case-sensitive).
bool disabled_by_env(const std::string& layer);

/// True when KERNMAP_LOG is set to anything but "" or "0".
bool decision_log_enabled();

}  // namespace kernmap::detail
