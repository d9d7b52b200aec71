// Test plugin "kmnoreg": exports the ABI symbol but not kernmap_plugin_register.
#include "kernmap/plugin.h"

KERNMAP_PLUGIN_EXPORT uint32_t kernmap_plugin_abi_version(void) {
  return KERNMAP_PLUGIN_ABI_VERSION;
}
