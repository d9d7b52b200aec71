// kernmap registry: kernel descriptors, the layer -> device -> mode -> kernel mapping, and resolution.
//
// Three mapping levels, highest wins: scoped overrides (ScopedMapping, per thread), user registrations
// (register_mapping), built-in defaults. The highest level that maps a (layer, device) pair at all owns that
// pair: its mode entries are the only ones resolution considers (as in the Hugging Face `kernels` library,
// where a newer mapping for a device replaces the older one). A scope created with inherit=false hides every
// level below it.
//
// Resolution order (the `kernels` library's): inference -> inference+compile -> training -> training+compile
// -> fallback; training -> training+compile -> fallback; a +compile request accepts only compile-safe
// kernels; training accepts only kernels with a backward. When nothing acceptable is mapped the Decision
// names the layer's reference kernel and says why.
//
// Environment: KERNMAP_DISABLE=all|Layer,Layer,... forces the reference; KERNMAP_LOG=1 prints every decision
// to stderr. Both are read at each resolution.
//
// Thread safety: every function may be called from any thread. Scoped overrides are visible only on the
// thread that created them.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kernmap/export.h"

namespace kernmap {

/// Execution mode flags (the `kernels` library's Mode). kFallback is only a mapping key: "use for any mode
/// the kernel qualifies for, after the specific entries".
enum class Mode : unsigned { kInference = 1, kTraining = 2, kCompile = 4, kFallback = 8 };
constexpr Mode operator|(Mode a, Mode b) {
  return static_cast<Mode>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
constexpr bool has_flag(Mode m, Mode flag) {
  return (static_cast<unsigned>(m) & static_cast<unsigned>(flag)) != 0;
}

/// "inference", "training", "inference+compile", "training+compile", "fallback".
KERNMAP_API std::string to_string(Mode mode);
/// Inverse of to_string; throws std::invalid_argument naming the value and the accepted spellings.
KERNMAP_API Mode parse_mode(const std::string& text);

/// What a caller asks a kernel to take. Empty fields mean "not known yet" and are not checked.
struct KERNMAP_API KernelInputs {
  std::string dtype;  ///< torch dtype name: "float32", "bfloat16", "float16", "float64"
  std::vector<std::vector<int64_t>> shapes;  ///< input shapes, in the op's argument order
};

/// What a kernel is and what it supports; data, read by resolution (no per-kernel conditionals elsewhere).
struct KERNMAP_API KernelDescriptor {
  std::string name;                  ///< "provider/name", e.g. "kernmap/rms_norm"
  std::string layer;                 ///< layer it implements, e.g. "RMSNorm"
  std::vector<std::string> devices;  ///< torch device type names; "*" means any device
  std::vector<std::string> dtypes;   ///< dtype names it computes in
  bool has_backward = false;         ///< usable for training
  bool compile_safe = false;         ///< has fake/Meta implementations, usable under torch.compile
  bool deterministic = true;         ///< bit-identical results across runs and thread counts
  std::string op;           ///< torch op that runs it ("kernmap::rms_norm"); empty for non-torch kernels
  std::string description;  ///< one line for `kernmap kernels`
  /// Shape/stride check: nullopt when the kernel takes these inputs, else the reason it does not.
  std::function<std::optional<std::string>(const KernelInputs&)> supports;

  /// The part of name before '/'.
  std::string provider() const;
};

/// Registers a kernel. Throws std::invalid_argument when the name is malformed (not "provider/name"), the
/// layer is empty, a kernel of that name exists already, or (for a "reference/..." kernel) the layer has a
/// reference kernel already. Kernels are never unregistered.
KERNMAP_API void register_kernel(KernelDescriptor descriptor);
/// The kernel of that name, or nullptr. The pointer stays valid for the life of the process.
KERNMAP_API const KernelDescriptor* find_kernel(const std::string& name);
/// All registered kernels, sorted by name.
KERNMAP_API std::vector<const KernelDescriptor*> registered_kernels();
/// The reference kernel of a layer (the one whose provider is "reference"), or nullptr for an unknown layer.
KERNMAP_API const KernelDescriptor* reference_kernel(const std::string& layer);
/// Every layer, sorted by name: the layers that have a reference kernel. The one list of layers that
/// kernelize, the trainer's --kernels, ablate's rows and `kernmap kernels` read.
KERNMAP_API std::vector<std::string> registered_layers();

/// layer -> device -> mode -> kernel name.
using Mapping = std::map<std::string, std::map<std::string, std::map<Mode, std::string>>>;

/// A kernel of a LayerRegistrar: its descriptor (`layer` may be left empty: the record's layer is used) and
/// the devices where it is the built-in default, for every mode it qualifies for (the training modes need
/// has_backward, the +compile modes compile_safe).
struct KERNMAP_API KernelRecord {
  KernelDescriptor descriptor;
  std::vector<std::string> default_on;
};

/// The one record of a built-in layer, declared as a namespace-scope constant beside the layer's ops (the
/// file holding their TORCH_LIBRARY_IMPL blocks): the layer's reference kernel and its other kernels with the
/// devices each is the default on, all registered when the library loads. Throws (at load) as
/// register_kernel and register_default_mapping do, so a malformed record fails every test at once.
class KERNMAP_API LayerRegistrar {
 public:
  LayerRegistrar(const std::string& layer, KernelDescriptor reference,
                 std::vector<KernelRecord> kernels = {});
};

/// Adds user registrations (merged per (layer, device): a new entry for a pair replaces the old one). Throws
/// std::invalid_argument naming the first unknown layer or kernel, or a kernel registered for another layer.
KERNMAP_API void register_mapping(const Mapping& mapping);
/// Removes every user registration (defaults and scopes stay).
KERNMAP_API void clear_user_mappings();
/// Sets the built-in defaults for (layer, device) pairs; called once by the built-in kernel registration.
/// Validated like register_mapping, except that a kernel not registered (yet) is accepted: resolution then
/// falls back with "kernel X is not registered".
KERNMAP_API void register_default_mapping(const Mapping& mapping);

/// RAII scoped override, visible only on the creating thread until destruction. Scopes nest; with
/// inherit=false the levels below (outer scopes, user registrations, defaults) are hidden. The constructor
/// validates the mapping as register_mapping does and throws std::invalid_argument the same way.
class KERNMAP_API ScopedMapping {
 public:
  explicit ScopedMapping(Mapping mapping, bool inherit = true);
  ~ScopedMapping();
  ScopedMapping(const ScopedMapping&) = delete;
  ScopedMapping& operator=(const ScopedMapping&) = delete;
};

/// The outcome of resolution.
struct KERNMAP_API Decision {
  std::string layer;
  std::string device;
  Mode mode = Mode::kInference;
  const KernelDescriptor* kernel = nullptr;  ///< the chosen kernel; the layer's reference when fallback
  bool fallback = true;  ///< true when the reference was chosen instead of a mapped kernel
  std::string source;    ///< where the choice came from: "scoped", "user", "default", or "reference"
  std::string reason;  ///< why: "default mapping", "no mapping for npu", "dtype float64 not supported by ..."
};

/// Resolves a layer on a device in a mode. Throws std::invalid_argument for an unknown layer or a mode that
/// is not a request (kFallback, or kCompile alone).
KERNMAP_API Decision resolve(const std::string& layer, const std::string& device, Mode mode,
                             const KernelInputs& inputs = {});

/// The mapping resolution sees on this thread, all levels merged, for display.
KERNMAP_API Mapping effective_mapping();

}  // namespace kernmap
