// LayerRegistrar: the built-in layers' records (declared beside their ops) into the kernel table and the
// defaults level.
#include <utility>

#include "kernmap/registry.h"

namespace kernmap {
namespace {

// The mapping keys a kernel serves as a default: every request mode its descriptor qualifies for.
std::map<Mode, std::string> default_entries(const KernelDescriptor& kernel) {
  std::map<Mode, std::string> entries;
  for (const Mode base : {Mode::kInference, Mode::kTraining}) {
    if (base == Mode::kTraining && !kernel.has_backward) continue;
    entries[base] = kernel.name;
    if (kernel.compile_safe) entries[base | Mode::kCompile] = kernel.name;
  }
  return entries;
}

}  // namespace

LayerRegistrar::LayerRegistrar(const std::string& layer, KernelDescriptor reference,
                               std::vector<KernelRecord> kernels) {
  // The reference first: it is what makes the layer known to the defaults registered below.
  reference.layer = layer;
  register_kernel(std::move(reference));
  Mapping defaults;
  for (KernelRecord& record : kernels) {
    record.descriptor.layer = layer;
    for (const std::string& device : record.default_on)
      defaults[layer][device] = default_entries(record.descriptor);
    register_kernel(std::move(record.descriptor));
  }
  if (!defaults.empty()) register_default_mapping(defaults);
}

}  // namespace kernmap
