// Mapping files against the registry: the names a parsed file uses are checked when it is applied, each
// problem reported at the location of the entry that has it.
#include "kernmap/mapping_file.h"

#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "mapping_file/format.h"
#include "registry/mapping_levels.h"

namespace kernmap {
namespace {

namespace mf = mapping_file;

// torch's device type names (c10/core/DeviceType.h, as torch.device spells them) and the names devices go by
// in the Hugging Face `kernels` library and torch's PrivateUse1 backends.
const std::set<std::string> kTorchDevices = {"cpu",   "cuda", "mkldnn",        "opengl", "opencl", "ideep",
                                             "hip",   "ve",   "fpga",          "maia",   "xla",    "vulkan",
                                             "metal", "xpu",  "mps",           "meta",   "hpu",    "lazy",
                                             "ipu",   "mtia", "privateuseone", "npu",    "rocm"};

std::string join(const std::set<std::string>& names) {
  std::string out;
  for (const std::string& n : names) {
    if (!out.empty()) out += ", ";
    out += n;
  }
  return out;
}

std::set<std::string> known_devices() {
  std::set<std::string> devices = kTorchDevices;
  for (const KernelDescriptor* k : registered_kernels()) {
    for (const std::string& d : k->devices) {
      if (d != "*") devices.insert(d);
    }
  }
  return devices;
}

bool runs_on(const KernelDescriptor& kernel, const std::string& device) {
  for (const std::string& d : kernel.devices) {
    if (d == "*" || d == device) return true;
  }
  return false;
}

std::string kernels_of(const std::string& layer) {
  std::set<std::string> names;
  for (const KernelDescriptor* k : registered_kernels()) {
    if (k->layer == layer) names.insert(k->name);
  }
  return join(names);
}

constexpr std::size_t kMaxReported = 20;

Mapping validate(const mf::ParsedMapping& file) {
  const std::set<std::string> devices = known_devices();
  std::vector<std::string> errors;
  auto report = [&](mf::Location at, const std::vector<std::string>& keys, const std::string& problem) {
    errors.push_back(file.where(at, keys) + ": " + problem);
  };
  Mapping mapping;
  for (const mf::LayerEntry& layer : file.layers) {
    if (reference_kernel(layer.layer) == nullptr) {
      report(layer.at, {layer.layer}, detail::unknown_layer_message(layer.layer));
      continue;
    }
    auto& by_device = mapping[layer.layer];
    for (const mf::DeviceEntry& device : layer.devices) {
      if (devices.count(device.device) == 0) {
        report(device.at, {layer.layer, device.device},
               "unknown device '" + device.device + "' for layer '" + layer.layer +
                   "' (known: " + join(devices) + ")");
        continue;
      }
      auto& by_mode = by_device[device.device];
      for (const mf::ModeEntry& entry : device.modes) {
        std::vector<std::string> keys = {layer.layer, device.device};
        if (!entry.shorthand) keys.push_back(entry.mode);
        Mode mode;
        try {
          mode = parse_mode(entry.mode);
        } catch (const std::invalid_argument&) {
          report(entry.mode_at, keys,
                 "unknown mode '" + entry.mode +
                     "' (accepted: inference, training, inference+compile, training+compile, fallback)");
          continue;
        }
        const std::string what = "kernel '" + entry.kernel + "' for layer '" + layer.layer + "' on device '" +
                                 device.device + "' (" + entry.mode + ")";
        const KernelDescriptor* kernel = find_kernel(entry.kernel);
        if (kernel == nullptr) {
          report(entry.kernel_at, keys,
                 "unknown " + what + " (registered kernels of layer '" + layer.layer +
                     "': " + kernels_of(layer.layer) + ")");
          continue;
        }
        if (kernel->layer != layer.layer) {
          report(entry.kernel_at, keys,
                 what + " implements layer '" + kernel->layer + "', not '" + layer.layer +
                     "' (registered kernels of layer '" + layer.layer + "': " + kernels_of(layer.layer) +
                     ")");
          continue;
        }
        if (!runs_on(*kernel, device.device)) {
          std::set<std::string> its(kernel->devices.begin(), kernel->devices.end());
          report(entry.kernel_at, keys,
                 what + " does not run on '" + device.device + "' (its devices: " + join(its) + ")");
          continue;
        }
        by_mode[mode] = entry.kernel;
      }
    }
  }
  if (!errors.empty()) {
    std::string message;
    for (std::size_t i = 0; i < errors.size() && i < kMaxReported; ++i) {
      if (i > 0) message += '\n';
      message += errors[i];
    }
    if (errors.size() > kMaxReported) {
      message += "\n... and " + std::to_string(errors.size() - kMaxReported) + " more errors";
    }
    throw MappingFileError(message);
  }
  return mapping;
}

}  // namespace

Mapping load_mapping_file(const std::string& path) {
  mf::ParsedMapping parsed;
  try {
    parsed = mf::read_mapping_file(path);
  } catch (const mf::Error& e) {
    throw MappingFileError(e.what());
  }
  return validate(parsed);
}

void register_mapping_file(const std::string& path) {
  register_mapping(load_mapping_file(path));
}

}  // namespace kernmap
