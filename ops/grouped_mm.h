// Grouped matrix products shared by the grouped_mm and experts ops (CPU, inputs already checked).
#pragma once

#include <ATen/core/Tensor.h>

namespace kernmap::ops {

/// Checks offs against E groups and T rows: int32 [E] on a's device, non-decreasing, >= 0, offs[E-1] == T.
/// Values are checked only where they can be read (not on Meta tensors).
void check_offs(const char* op, const at::Tensor& offs, int64_t E, int64_t T, const at::Tensor& a);

/// out[offs[e-1]:offs[e]] = a[offs[e-1]:offs[e]] @ b[e]; a [T, K], b [E, K, N] with any strides (a transposed
/// view of [E, N, K] is read in place). Work is spread over (group x row tile x column tile).
at::Tensor grouped_mm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs);

/// out[e] = x[offs[e-1]:offs[e]]^T @ y[offs[e-1]:offs[e]]: [E, M, N] from x [T, M] and y [T, N] (the weight
/// gradient of a grouped product); groups without rows give zeros.
at::Tensor grouped_weight_grad_cpu(const at::Tensor& x, const at::Tensor& y, const at::Tensor& offs);

}  // namespace kernmap::ops
