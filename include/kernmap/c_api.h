/* kernmap C API: the registry across a C boundary, for the Python package (ctypes) and, later, plugins.
 *
 * Conventions (version 1):
 * - Every function that can fail returns 0 on success and a non-zero code on failure; on failure *error (when
 *   error is not NULL) receives a message that names the argument, the expected and the actual value. No C++
 *   exception crosses this boundary.
 * - Structured data travels as UTF-8 JSON text. Strings returned through char** are allocated by the library
 * and must be released with kernmap_free.
 * - Mappings are {"Layer": {"device": {"mode": "provider/kernel"}}}; modes are spelled "inference",
 * "training", "inference+compile", "training+compile", "fallback".
 * - A caller checks kernmap_c_api_version() == KERNMAP_C_API_VERSION before calling anything else: a later
 *   version may change a JSON shape or a signature and will bump the number.
 *
 * Thread safety: as the C++ registry (include/kernmap/registry.h). Scopes are per thread: kernmap_pop_scope
 * must run on the thread that pushed the scope.
 */
#ifndef KERNMAP_C_API_H_
#define KERNMAP_C_API_H_

#include <stddef.h>
#include <stdint.h>

#include "kernmap/export.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KERNMAP_C_API_VERSION 1

enum kernmap_status {
  KERNMAP_OK = 0,
  KERNMAP_INVALID_ARGUMENT = 1, /* bad JSON, unknown layer/kernel/mode, a duplicate kernel name, ... */
  KERNMAP_INTERNAL_ERROR = 2,   /* anything else (a bug): the message says what */
};

/* The API version this library implements (KERNMAP_C_API_VERSION at its build). */
KERNMAP_API int kernmap_c_api_version(void);

/* Releases a string returned by this library. NULL is accepted. */
KERNMAP_API void kernmap_free(char* text);

/* A kernel's shape check, called during resolution with the inputs as JSON ({"dtype": "float32", "shapes":
 * [[4, 8], [8]]}, fields empty when unknown). Returns 1 when the kernel takes the inputs; otherwise 0 after
 * writing a NUL-terminated reason of at most reason_capacity bytes (truncated) into reason. It must not
 * unwind (no exceptions, no longjmp) and may be called from any thread. */
typedef int (*kernmap_supports_fn)(void* user_data, const char* inputs_json, char* reason,
                                   size_t reason_capacity);

/* Registers a kernel from its descriptor: {"name": "acme/rms_norm", "layer": "RMSNorm", "devices": ["npu"],
 * "dtypes": ["float16", "bfloat16"], "has_backward": true, "compile_safe": false, "deterministic": true,
 * "op": "acme::rms_norm" (or "" for kernels that are not torch ops, such as Python callables), "description":
 * "..."}. Only name and layer are required. supports may be NULL; user_data is passed to it unchanged and
 * must stay valid for the life of the process (kernels are never unregistered). */
KERNMAP_API int kernmap_register_kernel(const char* descriptor_json, kernmap_supports_fn supports,
                                        void* user_data, char** error);

/* Adds user registrations (register_mapping). */
KERNMAP_API int kernmap_register_mapping(const char* mapping_json, char** error);
/* Adds built-in defaults (register_default_mapping): for device packages and plugins that bring defaults. */
KERNMAP_API int kernmap_register_default_mapping(const char* mapping_json, char** error);
/* Reads a mapping file (.json or .toml, docs/mapping.md) and validates it against the registry as it stands
 * (kernmap::load_mapping_file); *mapping_json receives the mapping in the shape above. On failure the message
 * starts with the location: "FILE:LINE:COL: problem" or "FILE: /Layer/device/mode: problem". */
KERNMAP_API int kernmap_load_mapping_file(const char* path, char** mapping_json, char** error);
/* Reads, validates and registers a mapping file as user registrations (kernmap::register_mapping_file);
 * nothing is registered when the file has an error. */
KERNMAP_API int kernmap_register_mapping_file(const char* path, char** error);
/* Removes every user registration. */
KERNMAP_API int kernmap_clear_user_mappings(char** error);

/* Pushes a scoped override on the calling thread (ScopedMapping); *handle identifies it for
 * kernmap_pop_scope. inherit = 0 hides every level below the scope. */
KERNMAP_API int kernmap_push_scope(const char* mapping_json, int inherit, uint64_t* handle, char** error);
/* Ends a scope pushed on this thread. Ending scopes out of nesting order is allowed. */
KERNMAP_API int kernmap_pop_scope(uint64_t handle, char** error);

/* Resolves {"layer": "RMSNorm", "device": "cpu", "mode": "training", "dtype": "bfloat16" (optional),
 * "shapes":
 * [[...], ...] (optional)} into *decision_json: {"layer", "device", "mode", "kernel", "op", "fallback",
 * "source", "reason"}. */
KERNMAP_API int kernmap_resolve(const char* request_json, char** decision_json, char** error);

/* Every registered kernel's descriptor (as kernmap_register_kernel takes it, plus "provider"), sorted by
 * name. */
KERNMAP_API int kernmap_list_kernels(char** kernels_json, char** error);

/* The mapping resolution sees on this thread, all levels merged. */
KERNMAP_API int kernmap_effective_mapping(char** mapping_json, char** error);

/* The CPU kernels' instruction-set level (include/kernmap/cpu.h): *levels_json receives {"level": "avx2",
 * "supported": ["baseline", "avx2"]} (the level in use, and the compiled levels this CPU runs, lowest first).
 */
KERNMAP_API int kernmap_cpu_levels(char** levels_json, char** error);
/* Makes `level` the level of the whole process from the next kernel call on (kernmap::set_cpu_level);
 * KERNMAP_INVALID_ARGUMENT, naming the level and the supported ones, when it is not one this CPU runs. */
KERNMAP_API int kernmap_set_cpu_level(const char* level, char** error);

/* Plugins (include/kernmap/plugins.h, docs/plugins.md). */

/* Loads plugin packages. options_json: {"paths": ["/repo", ...], "use_env_path": true (also KERNMAP_PATH),
 * "toolkits": {"cuda": "12.8"}, "strict": false}, every field optional, unknown fields are errors (NULL means
 * {"use_env_path": true}). *report_json receives the load report: {"process": {...}, "repositories":
 * [{"path", "has_lock", "error"}], "packages": [{"repository", "folder", "name", "version", "description",
 * "state"
 * ("loaded", "skipped", "refused"), "reason", "variant", "offered", "score", "kernels", "defaults"}]}. A
 * refused package is not an error unless "strict" is true: then the call returns KERNMAP_INVALID_ARGUMENT
 * with the refusals in *error, and *report_json is still set. */
KERNMAP_API int kernmap_load_plugins(const char* options_json, char** report_json, char** error);

/* Every load attempt of this process so far, in the report form of kernmap_load_plugins. */
KERNMAP_API int kernmap_plugin_report(char** report_json, char** error);

/* Writes dir/kernmap.lock pinning every package of the repository dir; *lock_json receives its text. Nothing
 * is written when any library is missing or does not match its manifest's sha256 (*error lists every
 * problem). */
KERNMAP_API int kernmap_write_lock(const char* dir, char** lock_json, char** error);

#ifdef __cplusplus
}
#endif

#endif /* KERNMAP_C_API_H_ */
