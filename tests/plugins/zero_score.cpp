// Test plugin "kmzero": its score says it does not suit this machine, so it must be skipped unregistered.
#include <cstdio>

#include "kernmap/plugin.h"

KERNMAP_PLUGIN_EXPORT uint32_t kernmap_plugin_abi_version(void) {
  return KERNMAP_PLUGIN_ABI_VERSION;
}

KERNMAP_PLUGIN_EXPORT int kernmap_plugin_score(const kernmap_plugin_host*, char* reason, size_t capacity) {
  std::snprintf(reason, capacity, "no acme NPU on this machine");
  return 0;
}

KERNMAP_PLUGIN_EXPORT int kernmap_plugin_register(const kernmap_plugin_host* host, char*, size_t) {
  return host->register_kernel(R"({"name": "kmzero/rms_norm", "layer": "RMSNorm"})", nullptr, nullptr,
                               nullptr);
}
