// Kernel descriptors: the process-wide table of registered kernels, and the spelling of modes.
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <utility>

#include "kernmap/registry.h"

namespace kernmap {
namespace {

constexpr const char* kReferenceProvider = "reference";

struct KernelTable {
  std::shared_mutex mutex;
  std::map<std::string, std::unique_ptr<KernelDescriptor>> by_name;
  std::map<std::string, const KernelDescriptor*> reference_by_layer;
};

// Function-local so that registrations from static initializers of other translation units find it built.
KernelTable& kernel_table() {
  static KernelTable table;
  return table;
}

bool is_malformed_name(const std::string& name) {
  const auto slash = name.find('/');
  if (slash == std::string::npos || slash == 0 || slash + 1 == name.size()) return true;
  if (name.find('/', slash + 1) != std::string::npos) return true;
  return name.find_first_of(" \t\r\n") != std::string::npos;
}

const std::pair<Mode, const char*> kModeSpellings[] = {
    {Mode::kInference, "inference"},
    {Mode::kTraining, "training"},
    {Mode::kInference | Mode::kCompile, "inference+compile"},
    {Mode::kTraining | Mode::kCompile, "training+compile"},
    {Mode::kFallback, "fallback"},
};

const std::pair<Mode, const char*> kFlagSpellings[] = {
    {Mode::kInference, "inference"},
    {Mode::kTraining, "training"},
    {Mode::kCompile, "compile"},
    {Mode::kFallback, "fallback"},
};

constexpr unsigned kAllFlags = 15;

}  // namespace

std::string KernelDescriptor::provider() const {
  return name.substr(0, name.find('/'));
}

void register_kernel(KernelDescriptor descriptor) {
  if (is_malformed_name(descriptor.name)) {
    throw std::invalid_argument("register_kernel: name '" + descriptor.name +
                                "' is malformed (expected 'provider/name', both parts non-empty, one '/', "
                                "no whitespace)");
  }
  if (descriptor.layer.empty()) {
    throw std::invalid_argument("register_kernel: kernel '" + descriptor.name +
                                "' has an empty layer (expected a layer name such as 'RMSNorm')");
  }
  KernelTable& table = kernel_table();
  std::unique_lock lock(table.mutex);
  if (const auto it = table.by_name.find(descriptor.name); it != table.by_name.end()) {
    throw std::invalid_argument("register_kernel: a kernel named '" + descriptor.name +
                                "' is registered already (for layer '" + it->second->layer + "')");
  }
  const bool is_reference = descriptor.provider() == kReferenceProvider;
  if (is_reference) {
    if (const auto it = table.reference_by_layer.find(descriptor.layer);
        it != table.reference_by_layer.end()) {
      throw std::invalid_argument("register_kernel: layer '" + descriptor.layer +
                                  "' has a reference kernel already ('" + it->second->name +
                                  "'), cannot add '" + descriptor.name + "'");
    }
  }
  auto owned = std::make_unique<KernelDescriptor>(std::move(descriptor));
  if (is_reference) table.reference_by_layer.emplace(owned->layer, owned.get());
  const std::string name = owned->name;
  table.by_name.emplace(name, std::move(owned));
}

const KernelDescriptor* find_kernel(const std::string& name) {
  KernelTable& table = kernel_table();
  std::shared_lock lock(table.mutex);
  const auto it = table.by_name.find(name);
  return it == table.by_name.end() ? nullptr : it->second.get();
}

std::vector<const KernelDescriptor*> registered_kernels() {
  KernelTable& table = kernel_table();
  std::shared_lock lock(table.mutex);
  std::vector<const KernelDescriptor*> kernels;
  kernels.reserve(table.by_name.size());
  for (const auto& [name, descriptor] : table.by_name) kernels.push_back(descriptor.get());
  return kernels;
}

const KernelDescriptor* reference_kernel(const std::string& layer) {
  KernelTable& table = kernel_table();
  std::shared_lock lock(table.mutex);
  const auto it = table.reference_by_layer.find(layer);
  return it == table.reference_by_layer.end() ? nullptr : it->second;
}

std::vector<std::string> registered_layers() {
  KernelTable& table = kernel_table();
  std::shared_lock lock(table.mutex);
  std::vector<std::string> layers;
  layers.reserve(table.reference_by_layer.size());
  for (const auto& [layer, reference] : table.reference_by_layer) layers.push_back(layer);
  return layers;
}

std::string to_string(Mode mode) {
  for (const auto& [value, spelling] : kModeSpellings) {
    if (value == mode) return spelling;
  }
  // Neither a request nor a mapping key: spell its flags, so that errors about it stay readable.
  std::string text;
  for (const auto& [flag, spelling] : kFlagSpellings) {
    if (!has_flag(mode, flag)) continue;
    if (!text.empty()) text += '+';
    text += spelling;
  }
  const auto bits = static_cast<unsigned>(mode);
  if (text.empty() || (bits & ~kAllFlags) != 0) return "Mode(" + std::to_string(bits) + ")";
  return text;
}

Mode parse_mode(const std::string& text) {
  std::string accepted;
  for (const auto& [value, spelling] : kModeSpellings) {
    if (text == spelling) return value;
    accepted += (accepted.empty() ? "" : ", ") + std::string(spelling);
  }
  throw std::invalid_argument("parse_mode: mode '" + text + "' is not one of: " + accepted);
}

}  // namespace kernmap
