// Test plugin "kmbadabi": its ABI symbol says a version this kernmap does not speak; nothing else may be
// called.
#include "kernmap/plugin.h"

KERNMAP_PLUGIN_EXPORT uint32_t kernmap_plugin_abi_version(void) {
  return KERNMAP_PLUGIN_ABI_VERSION + 1;
}

KERNMAP_PLUGIN_EXPORT int kernmap_plugin_register(const kernmap_plugin_host* host, char*, size_t) {
  return host->register_kernel(R"({"name": "kmbadabi/rms_norm", "layer": "RMSNorm"})", nullptr, nullptr,
                               nullptr);
}
