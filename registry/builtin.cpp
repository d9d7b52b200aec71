// The built-in kernels' descriptors and the default mapping: the one place each built-in kernel is registered
// with the registry (its torch op is registered in ops/).
#include <optional>
#include <string>

#include "kernmap/registry.h"

namespace kernmap {
namespace {

const std::vector<std::string> kFloatDtypes = {"float32", "bfloat16", "float16", "float64"};

std::optional<std::string> needs_rank_at_least_1(const KernelInputs& in) {
  for (const auto& s : in.shapes)
    if (s.empty()) return "0-d input (needs [..., H])";
  return std::nullopt;
}

KernelDescriptor reference(std::string name, std::string layer, std::string op, std::string what) {
  return KernelDescriptor{.name = std::move(name),
                          .layer = std::move(layer),
                          .devices = {"*"},
                          .dtypes = kFloatDtypes,
                          .has_backward = true,
                          .compile_safe = true,
                          .deterministic = true,
                          .op = std::move(op),
                          .description = std::move(what),
                          .supports = {}};
}

KernelDescriptor cpu_kernel(std::string name, std::string layer, std::string op, std::string what) {
  return KernelDescriptor{.name = std::move(name),
                          .layer = std::move(layer),
                          .devices = {"cpu"},
                          .dtypes = kFloatDtypes,
                          .has_backward = true,
                          .compile_safe = true,
                          .deterministic = true,
                          .op = std::move(op),
                          .description = std::move(what),
                          .supports = needs_rank_at_least_1};
}

bool register_builtins() {
  register_kernel(reference("reference/rms_norm", "RMSNorm", "kernmap::reference_rms_norm",
                            "transformers eager RMSNorm (ATen ops)"));
  register_kernel(reference("reference/silu", "SiLU", "kernmap::reference_silu", "torch.nn.functional.silu"));
  register_kernel(reference("reference/silu_and_mul", "SiluAndMul", "kernmap::reference_silu_and_mul",
                            "silu(gate) * up (ATen ops)"));
  // The per-group loops read offs on the host: data-dependent, so not compile-safe.
  KernelDescriptor grouped = reference("reference/grouped_mm", "GroupedMM", "kernmap::reference_grouped_mm",
                                       "one matrix product per group (transformers' fallback loop)");
  grouped.compile_safe = false;
  register_kernel(grouped);
  KernelDescriptor experts = reference("reference/experts", "Experts", "kernmap::reference_experts",
                                       "transformers eager experts loop");
  experts.compile_safe = false;
  register_kernel(experts);
  register_kernel(reference("reference/linear_cross_entropy", "ForCausalLMLoss",
                            "kernmap::reference_linear_cross_entropy",
                            "transformers ForCausalLMLoss of lm_head(hidden) (ATen ops, [N, V] logits)"));
  register_kernel(cpu_kernel("kernmap/rms_norm", "RMSNorm", "kernmap::rms_norm",
                             "fused one-pass RMSNorm, fp32 accumulation, SIMD level chosen at run time"));
  register_kernel(
      cpu_kernel("kernmap/silu", "SiLU", "kernmap::silu", "one-pass SiLU, SIMD level chosen at run time"));
  register_kernel(cpu_kernel("kernmap/silu_and_mul", "SiluAndMul", "kernmap::silu_and_mul",
                             "fused silu(gate) * up, one pass each way"));
  register_kernel(cpu_kernel("kernmap/grouped_mm", "GroupedMM", "kernmap::grouped_mm",
                             "grouped product over (group x tile) tasks on the intra-op pool"));
  register_kernel(cpu_kernel("kernmap/experts", "Experts", "kernmap::experts",
                             "sorted-token grouped products, fused SiLU-and-mul, deterministic combine"));
  register_kernel(cpu_kernel("kernmap/linear_cross_entropy", "ForCausalLMLoss",
                             "kernmap::linear_cross_entropy",
                             "LM head + cross-entropy by chunks of rows, gradients in the forward, no [N, V] "
                             "logits"));

  Mapping defaults;
  for (const auto& [layer, kernel] : {std::pair<std::string, std::string>{"RMSNorm", "kernmap/rms_norm"},
                                      {"SiLU", "kernmap/silu"},
                                      {"SiluAndMul", "kernmap/silu_and_mul"},
                                      {"GroupedMM", "kernmap/grouped_mm"},
                                      {"Experts", "kernmap/experts"},
                                      {"ForCausalLMLoss", "kernmap/linear_cross_entropy"}}) {
    defaults[layer]["cpu"] = {{Mode::kInference, kernel},
                              {Mode::kTraining, kernel},
                              {Mode::kInference | Mode::kCompile, kernel},
                              {Mode::kTraining | Mode::kCompile, kernel}};
  }
  register_default_mapping(defaults);
  return true;
}

// Runs when the library loads, before any resolution can happen.
const bool kRegistered = register_builtins();

}  // namespace
}  // namespace kernmap
