// The rotary_pos_emb layer: kernmap::apply_rotary, transformers' apply_rotary_pos_emb (checks, the CPU
// implementation over kernels/cpu/rotary.cpp, Meta shapes, autograd), its reference kernel, and the layer
// record.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "kernels/cpu/cache.h"
#include "kernels/cpu/isa.h"
#include "kernmap/ops.h"
#include "ops/checks.h"

namespace kernmap::ops {
namespace {

using Tensor = at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The dtype of x * cos + rotate_half(x) * sin under eager's type promotion.
at::ScalarType out_dtype(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  return at::promote_types(at::promote_types(x.scalar_type(), cos.scalar_type()), sin.scalar_type());
}

// Checks cos and sin and returns them unsqueezed at unsqueeze_dim, as apply_rotary_pos_emb does.
std::pair<Tensor, Tensor> check_cos_sin(const char* op, const Tensor& cos, const Tensor& sin, int64_t dim) {
  check_floating(op, "cos", cos);
  check_floating(op, "sin", sin);
  check_same_shape(op, "cos", cos, "sin", sin);
  check_same_device(op, "cos", cos, "sin", sin);
  const int64_t n = cos.dim();
  TORCH_CHECK(dim >= -n - 1 && dim <= n, "kernmap.", op, ": unsqueeze_dim must be in [", -n - 1, ", ", n,
              "] for cos of ", n, " dimensions, got ", dim);
  return {cos.unsqueeze(dim), sin.unsqueeze(dim)};
}

// x is q or k (or a gradient of the same shape): floating, on cos's device, [..., D] with D even, and the
// unsqueezed cos must broadcast to x's shape with the same D (the output then has x's shape, as in eager).
void check_x(const char* op, const char* arg, const Tensor& x, const Tensor& cos_u) {
  check_floating(op, arg, x);
  check_same_device(op, "cos", cos_u, arg, x);
  constexpr int64_t kMaxRank = cpu::RotaryRows::kMaxDims + 1;
  TORCH_CHECK(x.dim() >= 1 && x.dim() <= kMaxRank, "kernmap.", op, ": ", arg, " must have 1 to ", kMaxRank,
              " dimensions [..., D], got shape ", x.sizes());
  const int64_t D = x.size(-1);
  TORCH_CHECK(D % 2 == 0, "kernmap.", op, ": ", arg, "'s last dimension (head_dim) must be even, got ", D);
  bool broadcasts = cos_u.dim() <= x.dim() && cos_u.size(-1) == D;
  for (int64_t i = 1; broadcasts && i <= cos_u.dim(); ++i)
    broadcasts = cos_u.size(-i) == x.size(-i) || cos_u.size(-i) == 1;
  TORCH_CHECK(broadcasts, "kernmap.", op, ": cos.unsqueeze(unsqueeze_dim) of shape ", cos_u.sizes(),
              " must broadcast to ", arg, "'s shape ", x.sizes(), " (with the same last dimension)");
}

// The output for x, in eager's layout. Forward: x's shape and layout (eager's elementwise ops keep the
// input's strides), with contiguous rows (a contiguous tensor when x's last dimension is strided). Backward:
// contiguous, as eager's gradient is (it accumulates into the zero-filled gradients of rotate_half's slices).
Tensor empty_out(const Tensor& x, at::ScalarType dtype, bool backward) {
  if (!backward) {
    Tensor y = at::empty_like(x, at::TensorOptions().dtype(dtype));
    if (x.size(-1) <= 1 || y.stride(-1) == 1) return y;
  }
  return at::empty(x.sizes(), x.options().dtype(dtype));
}

// Rows of D contiguous elements.
Tensor with_contiguous_rows(const Tensor& t) {
  return t.size(-1) > 1 && t.stride(-1) != 1 ? t.contiguous() : t;
}

// The rows of x, cos and sin (all in y's dtype) and y, walked in x's memory order: the leading dimensions of
// size > 1 sorted by x's strides, outermost first, and neighbours merged where every tensor's strides allow.
// The forward's y has x's layout; the backward's y is contiguous while its incoming gradient may come in
// q_embed's layout (the heads of a position side by side; torch's CPU SDPA hands it over contiguous, other
// attention backwards need not): walked in y's order, that gradient's rows were read 7 KiB apart, about four
// times slower than in its own order (docs/performance.md, "Rotary walk order"). Each row's math is the same
// in any order. Holds the converted inputs the pointers refer to.
struct Walk {
  cpu::RotaryRows rows;
  int64_t count = 1;
  Tensor x, cos, sin;
};

// Where the walk goes through a dimension that cos and sin are broadcast over (the heads) before the
// positions, and the positions' rows of cos and sin pass the level-2 rule's bytes (kernels/cpu/cache.h,
// l2_block_bytes): the positions in blocks that fit it, each block walked head by head ([H, S] becomes
// [S / P, H, P]), so that cos and sin are read from memory once rather than once a head. That is the order of
// a contiguous x ([B, H, S, D]: the backward's gradient from torch's CPU SDPA, or a contiguous q). P divides
// the positions, at least kMinBlockPositions of them (else the walk stays as it is). The same rows with the
// same math in another order: the same bits. fp32 fwd+bwd at Qwen2-7B's sizes 7-11 % faster on an Intel Xeon
// (docs/performance.md, "Rotary: positions in blocks").
constexpr int64_t kMinBlockPositions = 16;
void block_positions(cpu::RotaryRows& r, int64_t elem_size) {
  const int64_t budget = cpu::l2_block_bytes(), row_bytes = 2 * r.D * elem_size;
  for (int i = 0; i + 1 < r.ndim && r.ndim < cpu::RotaryRows::kMaxDims; ++i) {
    const int j = i + 1;
    if (r.cos_strides[i] != 0 || r.sin_strides[i] != 0 || (r.cos_strides[j] == 0 && r.sin_strides[j] == 0))
      continue;
    const int64_t n = r.sizes[j];
    if (n * row_bytes <= budget) continue;
    int64_t p = std::max<int64_t>(1, budget / row_bytes);
    while (p > 1 && n % p != 0) --p;
    if (p < kMinBlockPositions) continue;
    int64_t* strides[4] = {r.x_strides, r.cos_strides, r.sin_strides, r.y_strides};
    for (int d = r.ndim; d > j; --d) {
      r.sizes[d] = r.sizes[d - 1];
      for (int64_t* st : strides) st[d] = st[d - 1];
    }
    ++r.ndim;
    // i: the positions' blocks, i + 1: the heads, i + 2: the positions of a block.
    const int64_t heads = r.sizes[i];
    r.sizes[i] = n / p;
    r.sizes[i + 1] = heads;
    r.sizes[i + 2] = p;
    for (int64_t* st : strides) {
      const int64_t head_stride = st[i], pos_stride = st[i + 2];
      st[i] = pos_stride * p;
      st[i + 1] = head_stride;
      st[i + 2] = pos_stride;
    }
    return;
  }
}

Walk make_walk(const Tensor& x0, const Tensor& cos_u, const Tensor& sin_u, const Tensor& y) {
  Walk w;
  const at::ScalarType dt = y.scalar_type();
  w.x = with_contiguous_rows(x0.to(dt));
  w.cos = with_contiguous_rows(cos_u.to(dt)).expand(x0.sizes());
  w.sin = with_contiguous_rows(sin_u.to(dt)).expand(x0.sizes());
  std::vector<int64_t> dims;
  for (int64_t d = 0; d + 1 < x0.dim(); ++d)
    if (x0.size(d) != 1) dims.push_back(d);
  std::stable_sort(dims.begin(), dims.end(),
                   [&](int64_t a, int64_t b) { return w.x.stride(a) > w.x.stride(b); });
  cpu::RotaryRows& r = w.rows;
  r.D = x0.size(-1);
  const Tensor* tensors[4] = {&w.x, &w.cos, &w.sin, &y};
  int64_t* strides[4] = {r.x_strides, r.cos_strides, r.sin_strides, r.y_strides};
  for (int64_t d : dims) {
    const int64_t n = x0.size(d);
    w.count *= n;
    bool merge = r.ndim > 0;
    for (int t = 0; t < 4 && merge; ++t) merge = strides[t][r.ndim - 1] == tensors[t]->stride(d) * n;
    if (merge) {
      r.sizes[r.ndim - 1] *= n;
      for (int t = 0; t < 4; ++t) strides[t][r.ndim - 1] = tensors[t]->stride(d);
      continue;
    }
    r.sizes[r.ndim] = n;
    for (int t = 0; t < 4; ++t) strides[t][r.ndim] = tensors[t]->stride(d);
    ++r.ndim;
  }
  block_positions(r, y.element_size());
  r.x = w.x.const_data_ptr();
  r.cos = w.cos.const_data_ptr();
  r.sin = w.sin.const_data_ptr();
  r.y = y.data_ptr();
  return w;
}

// The forward (x = q, k) or the backward (x = their gradients) on CPU: one pass over both tensors.
std::tuple<Tensor, Tensor> rotate_cpu(const char* op, bool backward, const Tensor& q, const Tensor& k,
                                      const Tensor& cos, const Tensor& sin, int64_t dim) {
  const auto [cos_u, sin_u] = check_cos_sin(op, cos, sin, dim);
  check_x(op, backward ? "grad_q_embed" : "q", q, cos_u);
  check_x(op, backward ? "grad_k_embed" : "k", k, cos_u);
  Tensor yq = empty_out(q, out_dtype(q, cos, sin), backward);
  Tensor yk = empty_out(k, out_dtype(k, cos, sin), backward);
  if (q.numel() == 0 && k.numel() == 0) return {yq, yk};
  const Walk wq = make_walk(q, cos_u, sin_u, yq);
  const Walk wk = make_walk(k, cos_u, sin_u, yk);
  const auto& kern = cpu::kernel_table();
  const auto tq = cpu_dtype(yq.scalar_type()), tk = cpu_dtype(yk.scalar_type());
  const bool stream = stream_outputs(2 * (yq.nbytes() + yk.nbytes()));
  const int64_t nq = wq.count;
  at::parallel_for(0, nq + wk.count, row_grain(q.size(-1)), [&](int64_t r0, int64_t r1) {
    if (r0 < nq) kern.rotary(tq, backward, wq.rows, r0, std::min(r1, nq), stream);
    if (r1 > nq) kern.rotary(tk, backward, wk.rows, std::max(r0, nq) - nq, r1 - nq, stream);
  });
  return {yq, yk};
}

std::tuple<Tensor, Tensor> rotate_meta(const char* op, bool backward, const Tensor& q, const Tensor& k,
                                       const Tensor& cos, const Tensor& sin, int64_t dim) {
  const auto [cos_u, sin_u] = check_cos_sin(op, cos, sin, dim);
  check_x(op, backward ? "grad_q_embed" : "q", q, cos_u);
  check_x(op, backward ? "grad_k_embed" : "k", k, cos_u);
  return {empty_out(q, out_dtype(q, cos, sin), backward), empty_out(k, out_dtype(k, cos, sin), backward)};
}

std::tuple<Tensor, Tensor> apply_rotary_cpu(const Tensor& q, const Tensor& k, const Tensor& cos,
                                            const Tensor& sin, int64_t dim) {
  return rotate_cpu("apply_rotary", false, q, k, cos, sin, dim);
}
std::tuple<Tensor, Tensor> backward_cpu(const Tensor& grad_q, const Tensor& grad_k, const Tensor& cos,
                                        const Tensor& sin, int64_t dim) {
  return rotate_cpu("apply_rotary_backward", true, grad_q, grad_k, cos, sin, dim);
}
std::tuple<Tensor, Tensor> apply_rotary_meta(const Tensor& q, const Tensor& k, const Tensor& cos,
                                             const Tensor& sin, int64_t dim) {
  return rotate_meta("apply_rotary", false, q, k, cos, sin, dim);
}
std::tuple<Tensor, Tensor> backward_meta(const Tensor& grad_q, const Tensor& grad_k, const Tensor& cos,
                                         const Tensor& sin, int64_t dim) {
  return rotate_meta("apply_rotary_backward", true, grad_q, grad_k, cos, sin, dim);
}

using RotarySig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                             int64_t);

// Gradients for q and k only: the backward saves cos and sin, nothing of q and k.
class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& cos,
                               const Tensor& sin, int64_t dim) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = op_handle<RotarySig>("kernmap::apply_rotary");
    auto [q_embed, k_embed] = op.call(q, k, cos, sin, dim);
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["q_dtype"] = static_cast<int64_t>(q.scalar_type());
    ctx->saved_data["k_dtype"] = static_cast<int64_t>(k.scalar_type());
    return {q_embed, k_embed};
  }
  // Undefined output gradients arrive as zeros (materialize_grads). A q of lower precision than cos
  // (autocast) gets its gradient computed in the promoted dtype and rounded once.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = op_handle<RotarySig>("kernmap::apply_rotary_backward");
    const auto saved = ctx->get_saved_variables();
    auto [dq, dk] = op.call(grads[0], grads[1], saved[0], saved[1], ctx->saved_data["dim"].toInt());
    const auto q_dtype = static_cast<at::ScalarType>(ctx->saved_data["q_dtype"].toInt());
    const auto k_dtype = static_cast<at::ScalarType>(ctx->saved_data["k_dtype"].toInt());
    return {dq.to(q_dtype), dk.to(k_dtype), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> apply_rotary_autograd(const Tensor& q, const Tensor& k, const Tensor& cos,
                                                 const Tensor& sin, int64_t dim) {
  // cos and sin come from the rotary embedding module under no_grad; when they do require a gradient, the
  // eager math in ATen ops computes every gradient.
  if (at::GradMode::is_enabled() && (cos.requires_grad() || sin.requires_grad()))
    return reference::apply_rotary(q, k, cos, sin, dim);
  const variable_list out = RotaryFunction::apply(q, k, cos, sin, dim);
  return {out[0], out[1]};
}

// A descriptor's supports(): q and k ([..., D], the first two shapes) need an even D.
std::optional<std::string> needs_even_head_dim(const KernelInputs& inputs) {
  for (size_t i = 0; i < std::min<size_t>(2, inputs.shapes.size()); ++i) {
    const auto& shape = inputs.shapes[i];
    if (shape.empty()) return std::string(i == 0 ? "q" : "k") + " is 0-d (needs [..., head_dim])";
    if (shape.back() % 2 != 0) return "odd head_dim " + std::to_string(shape.back()) + " (needs even)";
  }
  return std::nullopt;
}

}  // namespace

TORCH_LIBRARY_IMPL(kernmap, CPU, m) {
  m.impl("apply_rotary", &apply_rotary_cpu);
  m.impl("apply_rotary_backward", &backward_cpu);
}
TORCH_LIBRARY_IMPL(kernmap, Meta, m) {
  m.impl("apply_rotary", &apply_rotary_meta);
  m.impl("apply_rotary_backward", &backward_meta);
}
TORCH_LIBRARY_IMPL(kernmap, Autograd, m) {
  m.impl("apply_rotary", &apply_rotary_autograd);
}

}  // namespace kernmap::ops

// ---- reference kernel: the transformers eager math in ATen ops (any device, autograd through ATen) ----

namespace kernmap::reference {
namespace {

// transformers' rotate_half: cat(-x2, x1) of the two halves of the last dimension.
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

}  // namespace

// apply_rotary_pos_emb (transformers 5.23, models/qwen2/modeling_qwen2.py and the other families' copies).
std::tuple<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                int64_t unsqueeze_dim) {
  const at::Tensor c = cos.unsqueeze(unsqueeze_dim), s = sin.unsqueeze(unsqueeze_dim);
  return {q * c + rotate_half(q) * s, k * c + rotate_half(k) * s};
}

}  // namespace kernmap::reference

namespace kernmap::float64 {
namespace {

at::Tensor rounded(const at::Tensor& t, at::ScalarType to) {
  return t.to(to).to(at::kDouble);
}

// x * c + rotate_half(x) * s from float64, rounded where the reference rounds: each product to its eager
// dtype, then the sum.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s) {
  const at::ScalarType xc = at::promote_types(x.scalar_type(), c.scalar_type());
  const at::ScalarType xs = at::promote_types(x.scalar_type(), s.scalar_type());
  const at::Tensor x64 = x.to(at::kDouble);
  const int64_t half = x.size(-1) / 2;
  const at::Tensor rotated = at::cat({-x64.slice(-1, half), x64.slice(-1, 0, half)}, -1);
  return (rounded(x64 * c.to(at::kDouble), xc) + rounded(rotated * s.to(at::kDouble), xs))
      .to(at::promote_types(xc, xs));
}

}  // namespace

// The reference's math from float64, rounded where it rounds (docs/training.md, "The verdict"): align's noise
// run binds it.
std::tuple<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                int64_t unsqueeze_dim) {
  const at::Tensor c = cos.unsqueeze(unsqueeze_dim), s = sin.unsqueeze(unsqueeze_dim);
  return {rotate(q, c, s), rotate(k, c, s)};
}

}  // namespace kernmap::float64

namespace kernmap::ops {

TORCH_LIBRARY_IMPL(kernmap, CompositeImplicitAutograd, m) {
  m.impl("reference_apply_rotary", &kernmap::reference::apply_rotary);
  m.impl("float64_apply_rotary", &kernmap::float64::apply_rotary);
}

// The layer record (DESIGN §2), under transformers' layer name.
const LayerRegistrar kRotaryPosEmbLayer(
    "rotary_pos_emb",
    KernelDescriptor{.name = "reference/apply_rotary",
                     .devices = {"*"},
                     .dtypes = floating_dtypes(),
                     .has_backward = true,
                     .compile_safe = true,
                     .op = "kernmap::reference_apply_rotary",
                     .description = "transformers eager apply_rotary_pos_emb (ATen ops)"},
    {{KernelDescriptor{.name = "kernmap/apply_rotary",
                       .devices = {"cpu"},
                       .dtypes = floating_dtypes(),
                       .has_backward = true,
                       .compile_safe = true,
                       .op = "kernmap::apply_rotary",
                       .description = "rotary embedding of q and k in one pass, eager roundings",
                       .supports = needs_even_head_dim},
      /*default_on=*/{"cpu"}},
     {KernelDescriptor{.name = "float64/apply_rotary",
                       .devices = {"*"},
                       .dtypes = floating_dtypes(),
                       .has_backward = true,
                       .compile_safe = true,
                       .op = "kernmap::float64_apply_rotary",
                       .description = "the reference's math from float64, rounded where it rounds (align's "
                                      "noise run)"},
      /*default_on=*/{}}});

}  // namespace kernmap::ops

namespace kernmap {
std::tuple<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                int64_t unsqueeze_dim) {
  static auto op = ops::op_handle<ops::RotarySig>("kernmap::apply_rotary");
  return op.call(q, k, cos, sin, unsqueeze_dim);
}
}  // namespace kernmap
