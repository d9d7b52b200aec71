// Test plugin "kmverify": RMSNorm kernels that verify and tune must tell apart (tests/cpp/test_verify.cpp,
// tests/python/test_cli_tune.py), no default mappings. kmverify/rms_norm_forward_off is off by a relative
// 1e-3 in its output only (its gradients are exact); kmverify/rms_norm_backward_off computes the exact output
// but adds 1e-3 * grad_y to grad_x; kmverify/rms_norm_slow is exact and sleeps 20 ms a call (slower than any
// kernel of a tiny preset's norm). Each is transformers' RMSNorm math in ATen ops (CompositeImplicitAutograd:
// autograd derives the backward).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <thread>

#include "kernmap/plugin.h"

namespace {

at::Tensor reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor r = at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * (h * r).to(x.scalar_type());
}

// The output times 1 + 1e-3, the gradients the reference's: the difference is detached.
at::Tensor forward_off(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor y = reference(x, weight, eps);
  return y + (y * 1e-3).detach();
}

// a - a.detach() is exactly zero in value and has gradient 1e-3 with respect to x: the output is the
// reference's, bit for bit, and grad_x is off by 1e-3 * grad_y.
at::Tensor backward_off(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor a = x * 1e-3;
  return reference(x, weight, eps) + (a - a.detach());
}

at::Tensor slow(const at::Tensor& x, const at::Tensor& weight, double eps) {
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return reference(x, weight, eps);
}

// Kept for the life of the process: destroying a torch::Library removes its ops.
std::unique_ptr<torch::Library> ops;

}  // namespace

KERNMAP_PLUGIN_EXPORT uint32_t kernmap_plugin_abi_version(void) {
  return KERNMAP_PLUGIN_ABI_VERSION;
}

KERNMAP_PLUGIN_EXPORT int kernmap_plugin_register(const kernmap_plugin_host* host, char* error,
                                                  size_t capacity) {
  if (!ops) {
    ops = std::make_unique<torch::Library>(torch::Library::DEF, "kmverify", std::nullopt, __FILE__, __LINE__);
    ops->def("rms_norm_forward_off(Tensor x, Tensor weight, float eps) -> Tensor", &forward_off);
    ops->def("rms_norm_backward_off(Tensor x, Tensor weight, float eps) -> Tensor", &backward_off);
    ops->def("rms_norm_slow(Tensor x, Tensor weight, float eps) -> Tensor", &slow);
  }
  for (const char* name : {"rms_norm_forward_off", "rms_norm_backward_off", "rms_norm_slow"}) {
    char descriptor[512];
    std::snprintf(descriptor, sizeof descriptor,
                  R"j({"name": "kmverify/%s", "layer": "RMSNorm", "devices": ["cpu"], "has_backward": true,
                      "op": "kmverify::%s", "description": "test plugin RMSNorm (verify and tune)"})j",
                  name, name);
    char* message = nullptr;
    if (host->register_kernel(descriptor, nullptr, nullptr, &message) != 0) {
      std::snprintf(error, capacity, "%s", message != nullptr ? message : "registration failed");
      host->free_string(message);
      return 1;
    }
  }
  return 0;
}
