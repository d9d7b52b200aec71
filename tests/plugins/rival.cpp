// Test plugin "kmrival": a higher score than kmgood and a default for RMSNorm on npu, which must win over
// kmgood's.
#include <cstdio>

#include "kernmap/plugin.h"

KERNMAP_PLUGIN_EXPORT uint32_t kernmap_plugin_abi_version(void) {
  return KERNMAP_PLUGIN_ABI_VERSION;
}

KERNMAP_PLUGIN_EXPORT int kernmap_plugin_score(const kernmap_plugin_host*, char*, size_t) {
  return 5;
}

KERNMAP_PLUGIN_EXPORT int kernmap_plugin_register(const kernmap_plugin_host* host, char* error,
                                                  size_t capacity) {
  char* message = nullptr;
  if (host->register_kernel(R"({"name": "kmrival/rms_norm_npu", "layer": "RMSNorm", "devices": ["npu"],
        "has_backward": true, "op": "kmgood::rms_norm"})",
                            nullptr, nullptr, &message) != 0 ||
      host->register_default_mapping(R"({"RMSNorm": {"npu": {"inference": "kmrival/rms_norm_npu"}}})",
                                     &message) != 0) {
    std::snprintf(error, capacity, "%s", message);
    host->free_string(message);
    return 1;
  }
  return 0;
}
