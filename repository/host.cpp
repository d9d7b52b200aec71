// The host functions a plugin registers through, and the stage they write into (repository/host.h).
#include "repository/host.h"

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <exception>
#include <utility>

#include "registry/mapping_levels.h"
#include "repository/json_forms.h"

#ifndef KERNMAP_TORCH_VERSION
#error "KERNMAP_TORCH_VERSION must name the torch version kernmap is built against (CMakeLists.txt sets it)"
#endif
#ifndef KERNMAP_VERSION
#error "KERNMAP_VERSION must name kernmap's version (CMakeLists.txt sets it)"
#endif

namespace kernmap::repository {
namespace {

using nlohmann::json;

// The stage of the plugin whose kernmap_plugin_register runs on this thread.
thread_local Stage* current_stage = nullptr;

int host_fail(Stage* stage, const std::string& message, char** error) {
  if (stage != nullptr && stage->error.empty()) stage->error = message;
  if (error != nullptr) *error = detail::copy_string(message);
  return KERNMAP_INVALID_ARGUMENT;
}

int host_register_kernel(const char* descriptor_json, kernmap_supports_fn supports, void* user_data,
                         char** error) {
  Stage* stage = current_stage;
  if (stage == nullptr)
    return host_fail(nullptr,
                     "register_kernel: called outside kernmap_plugin_register (or on another thread)", error);
  const std::string who = "package '" + stage->package + "'";
  try {
    if (descriptor_json == nullptr)
      return host_fail(stage, who + ": register_kernel: descriptor_json is NULL", error);
    KernelDescriptor d = detail::descriptor_from_json(json::parse(descriptor_json), supports, user_data);
    for (const KernelDescriptor& staged : stage->kernels) {
      if (staged.name == d.name)
        return host_fail(stage, who + " registers kernel '" + d.name + "' twice", error);
    }
    if (find_kernel(d.name) != nullptr) {
      return host_fail(stage,
                       who + " registers kernel '" + d.name + "', which " + stage->origin(d.name) +
                           " registered already (kernel names are unique; the first registration stays)",
                       error);
    }
    if (d.provider() == "reference")
      return host_fail(stage, who + ": kernel '" + d.name + "': the provider 'reference' is kernmap's",
                       error);
    stage->kernels.push_back(std::move(d));
    return KERNMAP_OK;
  } catch (const std::exception& e) {
    return host_fail(stage, who + ": register_kernel: " + e.what(), error);
  }
}

int host_register_default_mapping(const char* mapping_json, char** error) {
  Stage* stage = current_stage;
  if (stage == nullptr)
    return host_fail(
        nullptr, "register_default_mapping: called outside kernmap_plugin_register (or on another thread)",
        error);
  const std::string who = "package '" + stage->package + "'";
  try {
    if (mapping_json == nullptr)
      return host_fail(stage, who + ": register_default_mapping: mapping_json is NULL", error);
    const Mapping m = detail::mapping_from_json("register_default_mapping", json::parse(mapping_json));
    for (const auto& [layer, devices] : m) {
      if (reference_kernel(layer) == nullptr)
        return host_fail(stage, who + ": register_default_mapping: " + detail::unknown_layer_message(layer),
                         error);
      for (const auto& [device, modes] : devices) {
        if (device.empty())
          return host_fail(
              stage, who + ": register_default_mapping: layer '" + layer + "' has an empty device", error);
        for (const auto& [mode, kernel] : modes) {
          const KernelDescriptor* k = find_kernel(kernel);
          for (const KernelDescriptor& staged : stage->kernels)
            if (staged.name == kernel) k = &staged;
          if (k == nullptr) {
            return host_fail(stage,
                             who + ": register_default_mapping: kernel '" + kernel + "' for " + layer +
                                 " on " + device + " is neither registered nor registered by this plugin",
                             error);
          }
          if (k->layer != layer) {
            return host_fail(stage,
                             who + ": register_default_mapping: kernel '" + kernel + "' implements layer '" +
                                 k->layer + "' (expected '" + layer + "')",
                             error);
          }
        }
        stage->defaults[layer][device] = modes;
      }
    }
    return KERNMAP_OK;
  } catch (const std::exception& e) {
    return host_fail(stage, who + ": register_default_mapping: " + e.what(), error);
  }
}

void host_free_string(char* text) {
  std::free(text);
}

}  // namespace

kernmap_plugin_host make_host(const std::string& package, const std::string& version,
                              const std::string& package_dir) {
  kernmap_plugin_host host{};
  host.abi_version = KERNMAP_PLUGIN_ABI_VERSION;
  host.struct_size = sizeof(kernmap_plugin_host);
  host.package = package.c_str();
  host.package_version = version.c_str();
  host.package_dir = package_dir.c_str();
  host.kernmap_version = KERNMAP_VERSION;
  host.torch_version = KERNMAP_TORCH_VERSION;
  host.register_kernel = &host_register_kernel;
  host.register_default_mapping = &host_register_default_mapping;
  host.free_string = &host_free_string;
  return host;
}

std::string call_register(kernmap_plugin_register_fn reg, const kernmap_plugin_host& host, Stage& stage) {
  char message[1024] = {0};
  int rc = 0;
  std::string thrown;
  current_stage = &stage;
  try {
    rc = reg(&host, message, sizeof message);
  } catch (const std::exception& e) {
    thrown = std::string(KERNMAP_PLUGIN_REGISTER_SYMBOL) + " threw: " + e.what();
  } catch (...) {
    thrown = std::string(KERNMAP_PLUGIN_REGISTER_SYMBOL) + " threw a non-standard exception";
  }
  current_stage = nullptr;
  if (!thrown.empty()) return thrown;
  message[sizeof message - 1] = '\0';
  if (rc != 0) {
    return std::string(KERNMAP_PLUGIN_REGISTER_SYMBOL) + " returned " + std::to_string(rc) + ": " +
           (message[0] != '\0' ? message : "(no message)");
  }
  return stage.error;
}

}  // namespace kernmap::repository
