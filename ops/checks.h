// Input checks and tensor views shared by the op implementations. Errors name the op, the argument, the
// expected and the actual value.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "kernmap/registry.h"

namespace kernmap::ops {

/// A tensor seen as rows of its last dimension: `rows` rows of `cols` contiguous elements, `stride` elements
/// apart, starting at `data`. Holds a contiguous copy only when the strides do not allow such a view.
struct Rows {
  at::Tensor tensor;  ///< the tensor the pointers refer to (the input, or its contiguous copy)
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t stride = 0;
  const void* data() const { return tensor.const_data_ptr(); }
};
/// The row view of t (a 0-d tensor is one row of one element).
Rows as_rows(const at::Tensor& t);

/// Throws unless t is float32, bfloat16, float16 or float64.
void check_floating(const char* op, const char* arg, const at::Tensor& t);
/// Throws unless a and b have equal dtypes.
void check_same_dtype(const char* op, const char* arg_a, const at::Tensor& a, const char* arg_b,
                      const at::Tensor& b);
/// Throws unless a and b are on the same device.
void check_same_device(const char* op, const char* arg_a, const at::Tensor& a, const char* arg_b,
                       const at::Tensor& b);
/// Throws unless a and b have equal shapes.
void check_same_shape(const char* op, const char* arg_a, const at::Tensor& a, const char* arg_b,
                      const at::Tensor& b);

/// Throws unless every id of topk_ids [T, k] is in [0, E], naming the first one that is not, as transformers'
/// eager experts do: ids below E name an expert, E itself is the expert-parallel sentinel (a token routed to
/// an expert of another rank, which contributes nothing). Values are not checked on Meta tensors.
void check_expert_ids(const char* op, const at::Tensor& topk_ids, int64_t E);

/// The kernels' element type for a checked floating dtype.
cpu::DType cpu_dtype(at::ScalarType t);
/// The accumulation dtype of the CPU kernels for input dtype t: float64 for float64, else float32.
at::ScalarType acc_dtype(at::ScalarType t);
/// A typed handle to a registered op ("kernmap::rms_norm"), for calls through the dispatcher.
template <class Sig>
c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

/// The dtypes every built-in kernel computes in: float32, bfloat16, float16, float64. (A function: the layer
/// records that read it are constructed while the library loads, in no set order across files.)
const std::vector<std::string>& floating_dtypes();
/// A descriptor's supports(): the row kernels need inputs of rank >= 1 ([..., H]).
std::optional<std::string> needs_rank_at_least_1(const KernelInputs& inputs);

/// Rows per at::parallel_for chunk so each chunk has at least ~32 K elements.
int64_t row_grain(int64_t cols);

/// The last-level cache one core can use: the size of cpu0's L3 instance (kernels/cpu/cache.h: sysfs, else
/// sysconf's L3 size), else 32 MiB. Read once.
int64_t last_level_cache_bytes();

/// Whether a call that reads and writes `bytes` in all should write its large outputs with streaming stores:
/// true when they exceed the last-level cache (cpu0's L3 instance from sysfs, else sysconf's L3 size, else 32
/// MiB), so the outputs could not stay cached for their consumer anyway, and streaming saves the
/// read-for-ownership of each written line and keeps the inputs cached (docs/ops.md, "CPU kernels").
bool stream_outputs(int64_t bytes);

}  // namespace kernmap::ops
