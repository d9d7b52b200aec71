// Shared by kernmap::linear_cross_entropy and its reference: the input checks.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace kernmap::ops {

/// Throws unless hidden is [N, H] floating, weight [V, H] (V >= 1) and bias [V] (when given) of hidden's
/// dtype, labels int64 [N], all on hidden's device, and num_items_in_batch (when given) a real number in a
/// one-element tensor. Label values are checked where they are read (the CPU implementation).
void check_linear_cross_entropy(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& labels, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& num_items_in_batch);

}  // namespace kernmap::ops
