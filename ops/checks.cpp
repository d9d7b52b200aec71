#include "ops/checks.h"

#include <c10/util/Exception.h>

#include "kernels/cpu/cache.h"

namespace kernmap::ops {

const std::vector<std::string>& floating_dtypes() {
  static const std::vector<std::string> dtypes = {"float32", "bfloat16", "float16", "float64"};
  return dtypes;
}

std::optional<std::string> needs_rank_at_least_1(const KernelInputs& inputs) {
  for (const auto& shape : inputs.shapes)
    if (shape.empty()) return "0-d input (needs [..., H])";
  return std::nullopt;
}

Rows as_rows(const at::Tensor& t) {
  const int64_t d = t.dim();
  const int64_t cols = d == 0 ? 1 : t.size(-1);
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < d; ++i) rows *= t.size(i);
  // One row stride exists when the last dim is contiguous and the leading dims of size > 1 collapse into one.
  // Rows may overlap (an expanded input): the kernels only read them.
  bool viewable = d == 0 || cols <= 1 || t.stride(-1) == 1;
  int64_t stride = cols;
  int64_t inner = -1;  // the innermost leading dim of size > 1 seen so far
  for (int64_t i = d - 2; i >= 0 && viewable; --i) {
    if (t.size(i) == 1) continue;
    if (inner < 0) {
      stride = t.stride(i);
    } else {
      viewable = t.stride(i) == t.stride(inner) * t.size(inner);
    }
    inner = i;
  }
  if (!viewable) return Rows{t.contiguous(), rows, cols, cols};
  return Rows{t, rows, cols, stride};
}

void check_floating(const char* op, const char* arg, const at::Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf || s == at::kDouble, "kernmap.", op,
              ": ", arg, " must be float32, bfloat16, float16 or float64, got ", s);
}

void check_expert_ids(const char* op, const at::Tensor& topk_ids, int64_t E) {
  if (topk_ids.is_meta() || topk_ids.numel() == 0) return;
  const at::Tensor ids = topk_ids.to(at::kCPU, at::kLong).contiguous();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const int64_t k = ids.size(-1);
  for (int64_t j = 0; j < ids.numel(); ++j)
    TORCH_CHECK(id[j] >= 0 && id[j] <= E, "kernmap.", op, ": topk_ids[", j / k, ", ", j % k, "] = ", id[j],
                " is outside [0, ", E, "] (ids below ", E, " name an expert; ", E,
                ", the number of experts, marks a token routed to another rank and is skipped)");
}

void check_same_dtype(const char* op, const char* arg_a, const at::Tensor& a, const char* arg_b,
                      const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "kernmap.", op, ": ", arg_b, " must have the dtype of ",
              arg_a, " (", a.scalar_type(), "), got ", b.scalar_type());
}

void check_same_device(const char* op, const char* arg_a, const at::Tensor& a, const char* arg_b,
                       const at::Tensor& b) {
  TORCH_CHECK(a.device() == b.device(), "kernmap.", op, ": ", arg_b, " must be on the device of ", arg_a,
              " (", a.device(), "), got ", b.device());
}

void check_same_shape(const char* op, const char* arg_a, const at::Tensor& a, const char* arg_b,
                      const at::Tensor& b) {
  TORCH_CHECK(a.sizes() == b.sizes(), "kernmap.", op, ": ", arg_b, " must have the shape of ", arg_a, " ",
              a.sizes(), ", got ", b.sizes());
}

cpu::DType cpu_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return cpu::DType::kFloat32;
    case at::kBFloat16:
      return cpu::DType::kBFloat16;
    case at::kHalf:
      return cpu::DType::kFloat16;
    case at::kDouble:
      return cpu::DType::kFloat64;
    default:
      TORCH_CHECK(false, "kernmap: no CPU kernel for dtype ", t);
  }
}

at::ScalarType acc_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

int64_t row_grain(int64_t cols) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1));
}

// cpu0's level-3 instance, not sysconf's L3 size, which is the whole socket's on CPUs that split it between
// core complexes, where data does not stay cached beyond the thread's own instance; capped per CPU sharing it
// (kernels/cpu/cache.h, usable_l3_bytes: virtual machines list the host's whole L3; docs/performance.md,
// "Streaming-store threshold").
int64_t last_level_cache_bytes() {
  return cpu::usable_l3_bytes();
}

bool stream_outputs(int64_t bytes) {
  return bytes > last_level_cache_bytes();
}

}  // namespace kernmap::ops
