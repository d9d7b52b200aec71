// Test plugin "kmdup": registers a new kernel and one whose name kmgood has; it must be refused whole.
#include "kernmap/plugin.h"

KERNMAP_PLUGIN_EXPORT uint32_t kernmap_plugin_abi_version(void) {
  return KERNMAP_PLUGIN_ABI_VERSION;
}

KERNMAP_PLUGIN_EXPORT int kernmap_plugin_register(const kernmap_plugin_host* host, char*, size_t) {
  host->register_kernel(R"({"name": "kmdup/rms_norm", "layer": "RMSNorm"})", nullptr, nullptr, nullptr);
  // Ignores the error this returns: the host refuses the plugin regardless.
  host->register_kernel(R"({"name": "kmgood/rms_norm", "layer": "RMSNorm"})", nullptr, nullptr, nullptr);
  return 0;
}
