// Internal: what resolution needs from the mapping levels (defaults, user registrations, scopes).
#pragma once

#include <map>
#include <optional>
#include <string>

#include "kernmap/registry.h"

namespace kernmap::detail {

/// The mode entries of the level that owns a (layer, device) pair on the calling thread.
struct OwnedEntries {
  std::string source;  ///< "scoped", "user" or "default"
  std::map<Mode, std::string>
      by_mode;  ///< a copy: callers evaluate kernels without holding any registry lock
};

/// The owning level's entries for (layer, device) as seen from this thread, or nullopt when no visible level
/// maps the pair.
std::optional<OwnedEntries> owning_entries(const std::string& layer, const std::string& device);

/// True when the built-in defaults level (register_default_mapping) maps (layer, device).
bool default_maps(const std::string& layer, const std::string& device);

/// "unknown layer 'X' (known: A, B)": the known layers are those with a reference kernel.
std::string unknown_layer_message(const std::string& layer);

}  // namespace kernmap::detail
