// A LibTorch program using kernmap: a small block made of kernmap's RMSNorm and GatedMLP layers is kernelized
// for CPU training; the program prints which kernel each layer got and why, then runs forward + backward with
// those kernels and again with the reference kernels (the transformers eager math) on the same weights and
// input, and compares outputs and gradients. Exit status: 0 when they agree, 1 when they do not, 2 on an
// error.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "kernmap/layers.h"
#include "kernmap/registry.h"

namespace {

constexpr int64_t kHidden = 64;
constexpr int64_t kIntermediate = 176;

// norm -> gated MLP, with a residual connection, as in a transformer decoder layer's second half.
struct Block : torch::nn::Module {
  Block() {
    norm = register_module("norm", std::make_shared<kernmap::RMSNorm>(kHidden, 1e-6));
    mlp = register_module("mlp", std::make_shared<kernmap::GatedMLP>(kHidden, kIntermediate));
  }
  at::Tensor forward(const at::Tensor& x) { return x + mlp->forward(norm->forward(x)); }
  std::shared_ptr<kernmap::RMSNorm> norm;
  std::shared_ptr<kernmap::GatedMLP> mlp;
};

struct Result {
  at::Tensor y, dx;
  std::vector<at::Tensor> dparams;
};

Result forward_backward(Block& block, const at::Tensor& input, const at::Tensor& dy) {
  block.zero_grad();
  at::Tensor x = input.detach().clone().requires_grad_(true);
  at::Tensor y = block.forward(x);
  y.backward(dy);
  Result r{y.detach(), x.grad(), {}};
  for (const at::Tensor& p : block.parameters()) r.dparams.push_back(p.grad().clone());
  return r;
}

// Prints the largest difference and returns whether every element is within atol + rtol * |expected|.
bool close(const std::string& what, const at::Tensor& actual, const at::Tensor& expected) {
  const double rtol = 1e-4, atol = 1e-5;
  const at::Tensor a = actual.to(at::kDouble), e = expected.to(at::kDouble);
  const double max_diff = (a - e).abs().max().item<double>();
  const bool ok = at::allclose(a, e, rtol, atol);
  std::printf("  %-28s max |difference| %.3e  %s\n", what.c_str(), max_diff, ok ? "ok" : "MISMATCH");
  return ok;
}

int run() {
  at::manual_seed(0);
  Block block;
  {
    at::NoGradGuard no_grad;  // RMSNorm's weight starts at ones; make it non-trivial
    block.norm->weight().uniform_(0.5, 1.5);
  }

  const kernmap::Report report = kernmap::kernelize(block, "cpu", kernmap::Mode::kTraining);
  std::printf("kernelize(block, cpu, training):\n%s\n", report.table().c_str());
  bool all_mapped = true;
  for (const kernmap::ReportEntry& e : report.entries) {
    std::printf("  %s -> %s (%s)\n", e.layer.c_str(), e.kernel.c_str(), e.reason.c_str());
    all_mapped = all_mapped && !e.fallback;
  }

  // The layers now run the kernels the report names (their forward calls the kernel's torch op).
  const std::string bound[] = {block.norm->kernel().name, block.mlp->kernel().name};
  for (size_t i = 0; i < report.entries.size(); ++i)
    if (report.entries[i].kernel != bound[i]) {
      std::printf("FAIL: %s is bound to %s, the report says %s\n", report.entries[i].path.c_str(),
                  bound[i].c_str(), report.entries[i].kernel.c_str());
      return 1;
    }

  const at::Tensor x = at::randn({3, 5, kHidden});
  const at::Tensor dy = at::randn({3, 5, kHidden});
  const Result kernels = forward_backward(block, x, dy);
  kernmap::restore_reference(block);
  const Result reference = forward_backward(block, x, dy);

  std::printf("\nkernelized vs reference (forward + backward, float32):\n");
  bool ok = close("output", kernels.y, reference.y);
  ok = close("grad input", kernels.dx, reference.dx) && ok;
  const auto names = block.named_parameters().keys();
  for (size_t i = 0; i < names.size(); ++i)
    ok = close("grad " + names[i], kernels.dparams[i], reference.dparams[i]) && ok;
  if (!all_mapped) std::printf("\nFAIL: a layer fell back to its reference kernel (see the reasons above)\n");
  std::printf("%s\n", ok && all_mapped ? "\nPASS" : "\nFAIL");
  return ok && all_mapped ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 2;
  }
}
