// Loads the example plugin (examples/plugin) as include/kernmap/plugin.h describes — dlopen, ABI version
// first, score, register through a host struct wired to kernmap's C API — and checks what it brings: its two
// kernel descriptors and default mapping, an RMSNorm layer kernelized onto kmexample/rms_norm matching the
// reference forward and backward (fp32, bf16, fp64), the npu op registered for PrivateUse1 only, bad input
// refused with a clear error, and a second registration refused. It stands in for kernmap's loader so that
// the plugin is exercised on its own; usage: plugin_host PACKAGE_DIR. Exit status 0 when every check passes.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <dlfcn.h>

#include <cstddef>
#include <cstdio>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "kernmap/c_api.h"
#include "kernmap/layers.h"
#include "kernmap/ops.h"
#include "kernmap/plugin.h"
#include "kernmap/registry.h"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s  %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Compares in fp64; prints the largest difference.
bool close(const at::Tensor& actual, const at::Tensor& expected, double rtol, double atol,
           std::string& detail) {
  if (actual.sizes() != expected.sizes() || actual.scalar_type() != expected.scalar_type()) {
    detail = "shape/dtype " + std::string(c10::toString(actual.scalar_type())) + " vs " +
             c10::toString(expected.scalar_type());
    return false;
  }
  const at::Tensor a = actual.to(at::kDouble), e = expected.to(at::kDouble);
  char text[64];
  std::snprintf(text, sizeof text, "max |difference| %.3e", (a - e).abs().max().item<double>());
  detail = text;
  return at::allclose(a, e, rtol, atol);
}

// kmexample/rms_norm through a kernelized kernmap::RMSNorm against reference::rms_norm, forward and backward.
void check_layer(at::ScalarType dtype, double rtol, double atol) {
  const std::string name = c10::toString(dtype);
  constexpr int64_t kHidden = 67;  // not a multiple of any vector width
  kernmap::RMSNorm layer(kHidden, 1e-5, at::TensorOptions().dtype(dtype));
  {
    at::NoGradGuard no_grad;
    layer.weight().uniform_(0.5, 1.5);
  }
  const kernmap::Report report = kernmap::kernelize(layer, "cpu", kernmap::Mode::kTraining);
  check(report.entries.size() == 1 && report.entries[0].kernel == "kmexample/rms_norm" &&
            layer.kernel().name == "kmexample/rms_norm",
        name + ": kernelize binds RMSNorm to kmexample/rms_norm (" + report.entries[0].kernel + ": " +
            report.entries[0].reason + ")");

  const at::Tensor input = at::randn({4, 3, kHidden}).to(dtype);
  const at::Tensor dy = at::randn({4, 3, kHidden}).to(dtype);
  at::Tensor x = input.clone().requires_grad_(true);
  at::Tensor y = layer.forward(x);
  y.backward(dy);
  const at::Tensor dw = layer.weight().grad().clone();

  at::Tensor x_ref = input.clone().requires_grad_(true);
  at::Tensor w_ref = layer.weight().detach().clone().requires_grad_(true);
  at::Tensor y_ref = kernmap::reference::rms_norm(x_ref, w_ref, 1e-5);
  y_ref.backward(dy);

  const std::pair<const char*, std::pair<at::Tensor, at::Tensor>> compared[] = {
      {"output", {y, y_ref}}, {"grad x", {x.grad(), x_ref.grad()}}, {"grad weight", {dw, w_ref.grad()}}};
  for (const auto& [what, tensors] : compared) {
    std::string detail;
    const bool ok = close(tensors.first, tensors.second, rtol, atol, detail);
    check(ok, name + ": " + what + " equals the reference's (" + detail + ")");
  }
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

int run(const std::string& package_dir) {
  const std::string library = package_dir + "/lib/libkmexample.so";
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);  // never closed, as kernmap does
  if (handle == nullptr) {
    std::printf("FAIL  dlopen %s: %s\n", library.c_str(), dlerror());
    return 1;
  }
  auto abi =
      reinterpret_cast<kernmap_plugin_abi_version_fn>(dlsym(handle, KERNMAP_PLUGIN_ABI_VERSION_SYMBOL));
  auto score = reinterpret_cast<kernmap_plugin_score_fn>(dlsym(handle, KERNMAP_PLUGIN_SCORE_SYMBOL));
  auto reg = reinterpret_cast<kernmap_plugin_register_fn>(dlsym(handle, KERNMAP_PLUGIN_REGISTER_SYMBOL));
  check(abi != nullptr && reg != nullptr && score != nullptr, "the plugin exports its three entry points");
  if (abi == nullptr || reg == nullptr) return 1;
  check(abi() == KERNMAP_PLUGIN_ABI_VERSION, "ABI version " + std::to_string(abi()));

  kernmap_plugin_host host{};
  host.abi_version = KERNMAP_PLUGIN_ABI_VERSION;
  host.struct_size = sizeof(kernmap_plugin_host);
  host.package = "kmexample";
  host.package_version = "0.1.0";
  host.package_dir = package_dir.c_str();
  host.kernmap_version = KERNMAP_VERSION_STRING;
  host.torch_version = KERNMAP_TORCH_VERSION_STRING;
  host.register_kernel = &kernmap_register_kernel;
  host.register_default_mapping = &kernmap_register_default_mapping;
  host.free_string = &kernmap_free;

  char reason[256] = "";
  if (score != nullptr) {
    check(score(&host, reason, sizeof reason) > 0, "score > 0 on torch " + std::string(host.torch_version));
    kernmap_plugin_host other = host;
    other.torch_version = "1.0.0";
    reason[0] = '\0';
    const int other_score = score(&other, reason, sizeof reason);
    check(other_score <= 0 && contains(reason, "torch 1.0.0"),
          "score <= 0 with a reason on another torch: " + std::string(reason));
  }

  kernmap_plugin_host truncated = host;
  truncated.struct_size = offsetof(kernmap_plugin_host, register_kernel);
  char error[512] = "";
  const int truncated_rc = reg(&truncated, error, sizeof error);
  check(truncated_rc != 0 && contains(error, "host struct"),
        "a host struct without the registration functions is refused: " + std::string(error));
  check(kernmap::find_kernel("kmexample/rms_norm") == nullptr, "... and nothing was registered");

  error[0] = '\0';
  const int rc = reg(&host, error, sizeof error);
  check(rc == 0, "kernmap_plugin_register returns 0" + (rc == 0 ? std::string() : ": " + std::string(error)));
  if (rc != 0) return 1;

  const kernmap::KernelDescriptor* cpu = kernmap::find_kernel("kmexample/rms_norm");
  const kernmap::KernelDescriptor* npu = kernmap::find_kernel("kmexample/rms_norm_npu");
  check(cpu != nullptr && cpu->layer == "RMSNorm" && cpu->devices == std::vector<std::string>{"cpu"} &&
            cpu->has_backward && cpu->op == "kmexample::rms_norm",
        "kmexample/rms_norm: RMSNorm, cpu, with backward, op kmexample::rms_norm");
  check(npu != nullptr && npu->layer == "RMSNorm" && npu->devices == std::vector<std::string>{"npu"} &&
            npu->has_backward && npu->op == "kmexample::npu_rms_norm",
        "kmexample/rms_norm_npu: RMSNorm, npu, with backward, op kmexample::npu_rms_norm");

  const kernmap::Decision on_npu = kernmap::resolve("RMSNorm", "npu", kernmap::Mode::kTraining);
  check(on_npu.kernel->name == "kmexample/rms_norm_npu" && on_npu.source == "default",
        "RMSNorm on npu (training) resolves to the plugin's default: " + on_npu.kernel->name + " (" +
            on_npu.reason + ")");
  const kernmap::Decision on_cpu = kernmap::resolve("RMSNorm", "cpu", kernmap::Mode::kTraining);
  check(on_cpu.kernel->name == "kernmap/rms_norm",
        "RMSNorm on cpu keeps kernmap's default without a mapping: " + on_cpu.kernel->name);

  auto npu_op = c10::Dispatcher::singleton().findSchema({"kmexample::npu_rms_norm", ""});
  check(npu_op.has_value() && npu_op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) &&
            !npu_op->hasKernelForDispatchKey(c10::DispatchKey::CPU),
        "kmexample::npu_rms_norm has a PrivateUse1 kernel and no CPU kernel");

  // A user mapping chooses the plugin's CPU kernel.
  kernmap::register_mapping({{"RMSNorm",
                              {{"cpu",
                                {{kernmap::Mode::kTraining, "kmexample/rms_norm"},
                                 {kernmap::Mode::kInference, "kmexample/rms_norm"}}}}}});
  at::manual_seed(0);
  check_layer(at::kFloat, 1e-5, 1e-6);
  check_layer(at::kDouble, 1e-12, 1e-14);
  check_layer(at::kBFloat16, 2e-2, 2e-2);

  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("kmexample::rms_norm", "")
                .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  const std::string bad = error_of([&] { op.call(at::ones({2, 8}), at::ones({7}), 1e-6); });
  check(contains(bad, "weight must have shape [8]") && contains(bad, "[7]"),
        "a weight of the wrong size is refused: " + bad.substr(0, bad.find('\n')));
  const std::string bad_eps = error_of([&] { op.call(at::ones({2, 8}), at::ones({8}), -1.0); });
  check(contains(bad_eps, "eps must be finite and >= 0"),
        "a negative eps is refused: " + bad_eps.substr(0, bad_eps.find('\n')));
  check(op.call(at::ones({0, 8}), at::ones({8}), 1e-6).sizes() == at::IntArrayRef({0, 8}),
        "no rows: an empty output");

  error[0] = '\0';
  const int again_rc = reg(&host, error, sizeof error);
  check(again_rc != 0 && contains(error, "kmexample/rms_norm"),
        "a second registration is refused (the kernel names exist): " + std::string(error));
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: plugin_host PACKAGE_DIR (the folder with manifest.json and lib/)\n");
    return 2;
  }
  try {
    const int rc = run(argv[1]);
    std::printf("%s\n", rc == 0 ? "PASS" : "FAIL");
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "plugin_host: %s\n", e.what());
    return 2;
  }
}
