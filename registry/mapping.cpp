// The three mapping levels: built-in defaults and user registrations (process-wide), scoped overrides (per
// thread).
#include <algorithm>
#include <iterator>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <stdexcept>
#include <utility>
#include <vector>

#include "kernmap/registry.h"
#include "registry/mapping_levels.h"

namespace kernmap {
namespace {

struct GlobalLevels {
  std::shared_mutex mutex;
  Mapping user;
  Mapping defaults;
};

// Function-local so that built-in registrations running as static initializers find it built.
GlobalLevels& global_levels() {
  static GlobalLevels levels;
  return levels;
}

struct Scope {
  const ScopedMapping* owner;  // identifies the entry to remove, even if scopes end out of nesting order
  Mapping mapping;
  bool inherit;
};

std::vector<Scope>& scope_stack() {
  thread_local std::vector<Scope> stack;
  return stack;
}

bool is_mapping_key(Mode mode) {
  return mode == Mode::kInference || mode == Mode::kTraining || mode == (Mode::kInference | Mode::kCompile) ||
         mode == (Mode::kTraining | Mode::kCompile) || mode == Mode::kFallback;
}

// Defaults may name kernels that are not registered (yet): a device's kernels can live in a library that is
// loaded separately, and resolution then reports the missing kernel. User and scoped mappings must name
// registered kernels, so that a typo fails where it was made.
enum class UnregisteredKernels { kReject, kAllow };

void validate_entry(const std::string& caller, const std::string& layer, const std::string& device, Mode mode,
                    const std::string& kernel_name, UnregisteredKernels unregistered) {
  const std::string where = "layer '" + layer + "' on device '" + device + "'";
  if (!is_mapping_key(mode)) {
    throw std::invalid_argument(caller + ": mode key " + to_string(mode) + " for " + where +
                                " is not a mapping key (expected one of: inference, training, "
                                "inference+compile, training+compile, fallback)");
  }
  const std::string entry =
      "kernel '" + kernel_name + "' mapped for " + where + " (mode " + to_string(mode) + ")";
  const KernelDescriptor* kernel = find_kernel(kernel_name);
  if (kernel == nullptr) {
    if (unregistered == UnregisteredKernels::kAllow) return;
    throw std::invalid_argument(caller + ": " + entry +
                                " is not registered (expected a registered kernel of layer '" + layer + "')");
  }
  if (kernel->layer != layer) {
    throw std::invalid_argument(caller + ": " + entry + " implements layer '" + kernel->layer +
                                "' (expected '" + layer + "')");
  }
}

void validate(const std::string& caller, const Mapping& mapping, UnregisteredKernels unregistered) {
  for (const auto& [layer, devices] : mapping) {
    if (reference_kernel(layer) == nullptr) {
      throw std::invalid_argument(caller + ": " + detail::unknown_layer_message(layer));
    }
    for (const auto& [device, modes] : devices) {
      if (device.empty()) {
        throw std::invalid_argument(
            caller + ": layer '" + layer +
            "' has an empty device name (expected a torch device type such as 'cpu')");
      }
      for (const auto& [mode, kernel_name] : modes)
        validate_entry(caller, layer, device, mode, kernel_name, unregistered);
    }
  }
}

// A (layer, device) entry of `source` replaces the whole entry of `target`: the newer level owns the pair.
void merge_into(Mapping& target, const Mapping& source) {
  for (const auto& [layer, devices] : source) {
    for (const auto& [device, modes] : devices) target[layer][device] = modes;
  }
}

const std::map<Mode, std::string>* find_entries(const Mapping& mapping, const std::string& layer,
                                                const std::string& device) {
  const auto layer_it = mapping.find(layer);
  if (layer_it == mapping.end()) return nullptr;
  const auto device_it = layer_it->second.find(device);
  return device_it == layer_it->second.end() ? nullptr : &device_it->second;
}

}  // namespace

void register_mapping(const Mapping& mapping) {
  validate("register_mapping", mapping, UnregisteredKernels::kReject);
  GlobalLevels& levels = global_levels();
  std::unique_lock lock(levels.mutex);
  merge_into(levels.user, mapping);
}

void clear_user_mappings() {
  GlobalLevels& levels = global_levels();
  std::unique_lock lock(levels.mutex);
  levels.user.clear();
}

void register_default_mapping(const Mapping& mapping) {
  validate("register_default_mapping", mapping, UnregisteredKernels::kAllow);
  GlobalLevels& levels = global_levels();
  std::unique_lock lock(levels.mutex);
  merge_into(levels.defaults, mapping);
}

ScopedMapping::ScopedMapping(Mapping mapping, bool inherit) {
  validate("ScopedMapping", mapping, UnregisteredKernels::kReject);
  scope_stack().push_back(Scope{this, std::move(mapping), inherit});
}

ScopedMapping::~ScopedMapping() {
  std::vector<Scope>& stack = scope_stack();
  const auto it =
      std::find_if(stack.rbegin(), stack.rend(), [this](const Scope& s) { return s.owner == this; });
  if (it != stack.rend()) stack.erase(std::next(it).base());
}

Mapping effective_mapping() {
  const std::vector<Scope>& stack = scope_stack();
  const auto opaque = std::find_if(stack.rbegin(), stack.rend(), [](const Scope& s) { return !s.inherit; });
  Mapping merged;
  if (opaque == stack.rend()) {
    GlobalLevels& levels = global_levels();
    std::shared_lock lock(levels.mutex);
    merged = levels.defaults;
    merge_into(merged, levels.user);
  }
  // Outermost visible scope first, so inner scopes replace outer ones.
  const auto first_visible = opaque == stack.rend() ? stack.begin() : std::prev(opaque.base());
  std::for_each(first_visible, stack.end(),
                [&merged](const Scope& scope) { merge_into(merged, scope.mapping); });
  return merged;
}

namespace detail {

std::optional<OwnedEntries> owning_entries(const std::string& layer, const std::string& device) {
  const std::vector<Scope>& stack = scope_stack();
  for (auto scope = stack.rbegin(); scope != stack.rend(); ++scope) {
    if (const auto* entries = find_entries(scope->mapping, layer, device))
      return OwnedEntries{"scoped", *entries};
    if (!scope->inherit) return std::nullopt;
  }
  GlobalLevels& levels = global_levels();
  std::shared_lock lock(levels.mutex);
  if (const auto* entries = find_entries(levels.user, layer, device)) return OwnedEntries{"user", *entries};
  if (const auto* entries = find_entries(levels.defaults, layer, device))
    return OwnedEntries{"default", *entries};
  return std::nullopt;
}

bool default_maps(const std::string& layer, const std::string& device) {
  GlobalLevels& levels = global_levels();
  std::shared_lock lock(levels.mutex);
  return find_entries(levels.defaults, layer, device) != nullptr;
}

std::string unknown_layer_message(const std::string& layer) {
  std::string list;
  for (const std::string& name : registered_layers()) list += (list.empty() ? "" : ", ") + name;
  return "unknown layer '" + layer + "' (known: " + (list.empty() ? "none" : list) + ")";
}

}  // namespace detail
}  // namespace kernmap
