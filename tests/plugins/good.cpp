// Test plugin "kmgood": a CPU RMSNorm with its own torch op (kmgood::rms_norm), the same op offered as a
// kernel for the "npu" device with a default mapping for it, and a default for RMSNorm on cpu that kernmap's
// built-in default must keep. The op kmgood::calls() counts forward calls, so a test can tell this kernel ran
// (the library is loaded from a sealed copy under /proc/self/fd, so a test cannot find it by its path).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <cstdio>
#include <memory>

#include "kernmap/plugin.h"

namespace {

std::atomic<int> calls{0};

// transformers' RMSNorm math in ATen ops (CompositeImplicitAutograd: autograd derives the backward).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  ++calls;
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor r = at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * (h * r).to(x.scalar_type());
}

// Kept for the life of the process: destroying a torch::Library removes its ops.
std::unique_ptr<torch::Library> ops;

int fail(const kernmap_plugin_host* host, char* error, size_t capacity, char* message) {
  std::snprintf(error, capacity, "%s", message != nullptr ? message : "registration failed");
  host->free_string(message);
  return 1;
}

}  // namespace

KERNMAP_PLUGIN_EXPORT uint32_t kernmap_plugin_abi_version(void) {
  return KERNMAP_PLUGIN_ABI_VERSION;
}

KERNMAP_PLUGIN_EXPORT int kernmap_plugin_score(const kernmap_plugin_host*, char*, size_t) {
  return 2;
}

KERNMAP_PLUGIN_EXPORT int kernmap_plugin_register(const kernmap_plugin_host* host, char* error,
                                                  size_t capacity) {
  if (!ops) {
    ops = std::make_unique<torch::Library>(torch::Library::DEF, "kmgood", std::nullopt, __FILE__, __LINE__);
    ops->def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
    ops->def("calls() -> int", [] { return int64_t{calls.load()}; });
  }
  char* message = nullptr;
  if (host->register_kernel(R"j({"name": "kmgood/rms_norm", "layer": "RMSNorm", "devices": ["cpu"],
        "has_backward": true, "op": "kmgood::rms_norm", "description": "test plugin RMSNorm (ATen ops)"})j",
                            nullptr, nullptr, &message) != 0)
    return fail(host, error, capacity, message);
  if (host->register_kernel(R"({"name": "kmgood/rms_norm_npu", "layer": "RMSNorm", "devices": ["npu"],
        "has_backward": true, "op": "kmgood::rms_norm", "description": "test plugin RMSNorm for npu"})",
                            nullptr, nullptr, &message) != 0)
    return fail(host, error, capacity, message);
  if (host->register_default_mapping(
          R"({"RMSNorm": {"npu": {"inference": "kmgood/rms_norm_npu", "training": "kmgood/rms_norm_npu"},
                          "cpu": {"inference": "kmgood/rms_norm"}}})",
          &message) != 0)
    return fail(host, error, capacity, message);
  return 0;
}
