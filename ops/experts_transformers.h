// transformers' experts implementations as kernels of layer Experts (ops/experts_transformers.cpp): what the
// layer record (ops/experts.cpp) needs to register them.
#pragma once

#include <optional>
#include <string>

#include "kernmap/registry.h"

namespace kernmap::transformers_experts {

/// Whether ATen's CPU grouped product takes these Experts inputs (16-byte aligned rows), else why not.
std::optional<std::string> grouped_mm_supports(const KernelInputs& inputs);

}  // namespace kernmap::transformers_experts
