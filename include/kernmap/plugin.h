/* kernmap plugin ABI: how a shared library outside kernmap registers kernels for any device.
 *
 * A plugin is a shared library in a package folder of a local kernel repository (docs/plugins.md). kernmap
 * loads it like this, and stops at the first step that fails, leaving the process working:
 *
 *   1. the manifest's "plugin_abi" must equal KERNMAP_PLUGIN_ABI_VERSION (checked before the library is
 * opened);
 *   2. the library's sha256 must equal the manifest's (and the lock's, when the repository has a
 * kernmap.lock), and the file must be an ELF shared object;
 *   3. the library is opened (dlopen, RTLD_NOW | RTLD_LOCAL) and never closed: kernels from it may run at any
 *      time until the process ends;
 *   4. kernmap_plugin_abi_version() is called first and must return KERNMAP_PLUGIN_ABI_VERSION;
 *   5. kernmap_plugin_score(), when exported, says whether the plugin suits this machine (a score <= 0 skips
 * it, with the plugin's reason); a higher score wins when two plugins bring defaults for the same layer and
 *      device;
 *   6. kernmap_plugin_register() registers the plugin's kernels and default mappings through the host's
 *      functions. Registrations are staged and committed only when it returns 0 and every kernel name is new:
 *      a plugin that fails, throws, or repeats a registered kernel name registers nothing.
 *
 * A plugin registers its torch ops (TORCH_LIBRARY / torch::Library) itself. The recommended place is inside
 * kernmap_plugin_register, so that nothing of the plugin runs before its ABI version was checked. The op a
 * kernel descriptor names must take the arguments of the layer's op (docs/ops.md: RMSNorm takes
 * (Tensor x, Tensor weight, float eps) -> Tensor, like kernmap::rms_norm); a kernel with "has_backward" must
 * register an Autograd implementation.
 *
 * No C++ exception may cross these functions; kernmap catches one that does and refuses the plugin.
 */
#ifndef KERNMAP_PLUGIN_H_
#define KERNMAP_PLUGIN_H_

#include <stddef.h>
#include <stdint.h>

#include "kernmap/c_api.h"
#include "kernmap/export.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KERNMAP_PLUGIN_ABI_VERSION 1

/* What kernmap hands a plugin: facts about the process and the registration functions. Fields are only ever
 * appended; struct_size says how many the host has. The pointers stay valid during the call they are given
 * to; the strings must be copied if kept. */
typedef struct kernmap_plugin_host {
  uint32_t abi_version;        /* KERNMAP_PLUGIN_ABI_VERSION of the host */
  uint32_t struct_size;        /* sizeof(kernmap_plugin_host) in the host */
  const char* package;         /* the manifest's "name" */
  const char* package_version; /* the manifest's "version" */
  const char* package_dir;     /* absolute path of the package folder */
  const char* kernmap_version; /* "0.1.0" */
  const char* torch_version;   /* the torch the host was built against, "2.15.0" */
  /* As kernmap_register_kernel (c_api.h); the kernel name's provider (before '/') is the plugin's choice. */
  int (*register_kernel)(const char* descriptor_json, kernmap_supports_fn supports, void* user_data,
                         char** error);
  /* As kernmap_register_default_mapping: defaults for (layer, device) pairs kernmap itself does not map. */
  int (*register_default_mapping)(const char* mapping_json, char** error);
  /* Releases a string the two functions above returned through error. */
  void (*free_string)(char* text);
} kernmap_plugin_host;

/* Required. Returns the KERNMAP_PLUGIN_ABI_VERSION the plugin was built with. Called before anything else. */
typedef uint32_t (*kernmap_plugin_abi_version_fn)(void);
#define KERNMAP_PLUGIN_ABI_VERSION_SYMBOL "kernmap_plugin_abi_version"

/* Optional. A score > 0 when the plugin suits this process (its device is present, its runtime loads), else
 * <= 0 after writing why into reason (NUL-terminated, at most reason_capacity bytes). Without this symbol the
 * score is 1. */
typedef int (*kernmap_plugin_score_fn)(const kernmap_plugin_host* host, char* reason, size_t reason_capacity);
#define KERNMAP_PLUGIN_SCORE_SYMBOL "kernmap_plugin_score"

/* Required. Registers the plugin's kernels and default mappings through host. Returns 0 on success; otherwise
 * non-zero after writing what went wrong into error (NUL-terminated, at most error_capacity bytes). */
typedef int (*kernmap_plugin_register_fn)(const kernmap_plugin_host* host, char* error,
                                          size_t error_capacity);
#define KERNMAP_PLUGIN_REGISTER_SYMBOL "kernmap_plugin_register"

/* Marks the plugin's entry points for export (KERNMAP_API, kernmap/export.h), also from a plugin built with
 * -fvisibility=hidden: KERNMAP_PLUGIN_EXPORT uint32_t kernmap_plugin_abi_version(void). */
#ifdef __cplusplus
#define KERNMAP_PLUGIN_EXPORT extern "C" KERNMAP_API
#else
#define KERNMAP_PLUGIN_EXPORT KERNMAP_API
#endif

#ifdef __cplusplus
}
#endif

#endif /* KERNMAP_PLUGIN_H_ */
