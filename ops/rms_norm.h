// What the RMSNorm op (ops/rms_norm.cpp) and the fused residual add + RMSNorm op (ops/add_rms_norm.cpp)
// share: the input checks, the CPU backward with its fixed-order weight gradient, and the float64 kernel.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace kernmap::ops {

/// Checks RMSNorm's x [..., H], weight [H] and eps for `op` (errors read "kernmap.<op>: ..."); returns the
/// output dtype, promote(x, weight).
at::ScalarType check_rms_norm(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps);
/// x's shape without its last dimension: the shape of rstd.
std::vector<int64_t> row_shape(const at::Tensor& x);
/// Checks the backward's grad_y (the output's shape and dtype) and rstd (fp32, fp64 for fp64 x, row_shape).
void check_rms_norm_backward(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                             const at::Tensor& weight, const at::Tensor& rstd);
/// The RMSNorm backward on CPU: (dx, dw) from grad_y, x (the normalized input), weight and rstd, checked.
/// With grad_sum defined (the fused add's residual-stream gradient, x's shape and dtype), dx = round_x(dx +
/// grad_sum).
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const char* op, const at::Tensor& grad_y,
                                                         const at::Tensor& grad_sum, const at::Tensor& x,
                                                         const at::Tensor& weight, const at::Tensor& rstd);

}  // namespace kernmap::ops

namespace kernmap::float64 {

/// RMSNorm's float64 kernel (ops/rms_norm.cpp): the reference's math from float64, rounded where it rounds.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace kernmap::float64
