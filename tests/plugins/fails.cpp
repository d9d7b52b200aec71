// Test plugin "kmfails": registers a kernel, then returns non-zero with a message; nothing may be committed.
#include <cstdio>

#include "kernmap/plugin.h"

KERNMAP_PLUGIN_EXPORT uint32_t kernmap_plugin_abi_version(void) {
  return KERNMAP_PLUGIN_ABI_VERSION;
}

KERNMAP_PLUGIN_EXPORT int kernmap_plugin_register(const kernmap_plugin_host* host, char* error,
                                                  size_t capacity) {
  host->register_kernel(R"({"name": "kmfails/rms_norm", "layer": "RMSNorm"})", nullptr, nullptr, nullptr);
  std::snprintf(error, capacity, "the acme runtime is missing");
  return 3;
}
