// Test plugin "kmthrows": registers a kernel, then throws; the staged kernel must not appear.
#include <stdexcept>

#include "kernmap/plugin.h"

KERNMAP_PLUGIN_EXPORT uint32_t kernmap_plugin_abi_version(void) {
  return KERNMAP_PLUGIN_ABI_VERSION;
}

KERNMAP_PLUGIN_EXPORT int kernmap_plugin_register(const kernmap_plugin_host* host, char*, size_t) {
  host->register_kernel(R"({"name": "kmthrows/rms_norm", "layer": "RMSNorm"})", nullptr, nullptr, nullptr);
  throw std::runtime_error("boom from kmthrows");
}
