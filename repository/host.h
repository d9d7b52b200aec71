// Internal: kernmap's side of the plugin ABI (include/kernmap/plugin.h). A plugin registers through the host
// struct's functions into a stage; nothing it registers is visible until the loader commits the stage.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kernmap/plugin.h"
#include "kernmap/registry.h"

namespace kernmap::repository {

/// What a plugin registered during its kernmap_plugin_register call, not yet visible to anyone.
struct Stage {
  std::string package;  ///< the manifest's name, for messages
  /// Where an already registered kernel came from, for the message about a name registered twice.
  std::function<std::string(const std::string& kernel)> origin;
  std::vector<KernelDescriptor> kernels;
  Mapping defaults;
  std::string error;  ///< the first failed host call; the plugin is refused even if it returns 0
};

/// The host struct for a package: the package's and kernmap's facts, and the registration functions. The
/// strings must outlive it.
kernmap_plugin_host make_host(const std::string& package, const std::string& version,
                              const std::string& package_dir);

/// Calls the plugin's register function while the host's registration functions write into stage (on this
/// thread; loads are serialized). Returns "" on success, else why the plugin is refused: it threw, returned
/// non-zero (with its message), or a host call failed.
std::string call_register(kernmap_plugin_register_fn reg, const kernmap_plugin_host& host, Stage& stage);

}  // namespace kernmap::repository
