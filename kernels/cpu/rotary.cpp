// The rotary embedding (transformers' apply_rotary_pos_emb, rotate-half convention), forward and backward,
// compiled once per instruction-set level (KERNMAP_CPU_LEVEL names the level). One pass: each row of x is
// read once and each row of y written once; the rows of cos and sin repeat across heads and stay in the
// cache. Compiled with -ffp-contract=off: the products and sums are rounded one by one, as eager computes
// them.
#include "kernels/cpu/vec.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {
namespace {

// Scalar math (R = rounding to X; h = D / 2), the eager `x * cos + rotate_half(x) * sin` with
// rotate_half(x) = cat(-x[h:], x[:h]):
//   y[i]   = R(R(x[i] cos[i])     - R(x[i+h] sin[i]))
//   y[i+h] = R(R(x[i+h] cos[i+h]) + R(x[i] sin[i+h]))
// The backward is the transpose, g * cos + rotate_half^T(g * sin) with rotate_half^T(v) = cat(v[h:], -v[:h]):
//   dx[i]   = R(R(g[i] cos[i])     + R(g[i+h] sin[i+h]))
//   dx[i+h] = R(R(g[i+h] cos[i+h]) - R(g[i] sin[i]))
// which is the forward with sin's halves swapped and negated (negation is exact): sa, sb below.
template <bool Backward, bool Stream, class X>
void rotary_row(const X* x, const X* c, const X* s, X* y, int64_t h) {
  using A = Acc<X>;
  const int64_t hb = h - h % kBlock;
  // One block pair's math (the two output halves), for the paired and the single blocks alike.
  const auto rotate = [](auto x1, auto x2, auto ca, auto cb, auto sa, auto sb, auto& lo, auto& hi) {
    lo = round_block_arith<X>(x1 * ca) - round_block_arith<X>(x2 * sa);
    hi = round_block_arith<X>(x2 * cb) + round_block_arith<X>(x1 * sb);
  };
  // bf16 below AVX-512: two blocks a step, every input and output through the paired load and store (vec.h).
  const int64_t i0 = paired_bf16_blocks<X>(hb, [&](auto i) {
    VF x1[2], x2[2], ca[2], cb[2], sa[2], sb[2];
    fetch_ahead(x + i);
    fetch_ahead(x + h + i);
    load_bf16_pair(x + i, x1[0], x1[1]);
    load_bf16_pair(x + h + i, x2[0], x2[1]);
    load_bf16_pair(c + i, ca[0], ca[1]);
    load_bf16_pair(c + h + i, cb[0], cb[1]);
    load_bf16_pair(s + (Backward ? h + i : i), sa[0], sa[1]);
    load_bf16_pair(s + (Backward ? i : h + i), sb[0], sb[1]);
    VF lo[2], hi[2];
    for (int j = 0; j < 2; ++j) {
      if constexpr (Backward) {
        sa[j] = -sa[j];
        sb[j] = -sb[j];
      }
      rotate(x1[j], x2[j], ca[j], cb[j], sa[j], sb[j], lo[j], hi[j]);
    }
    store_bf16_pair<Stream>(y + i, lo[0], lo[1]);
    store_bf16_pair<Stream>(y + h + i, hi[0], hi[1]);
  });
  for (int64_t i = i0; i < hb; i += kBlock) {
    fetch_ahead(x + i);
    fetch_ahead(x + h + i);
    const Vec<A> x1 = load<A>(x + i), x2 = load<A>(x + h + i);
    const Vec<A> sa = Backward ? -load<A>(s + h + i) : load<A>(s + i);
    const Vec<A> sb = Backward ? -load<A>(s + i) : load<A>(s + h + i);
    Vec<A> lo, hi;
    rotate(x1, x2, load<A>(c + i), load<A>(c + h + i), sa, sb, lo, hi);
    store_out<Stream>(y + i, lo);
    store_out<Stream>(y + h + i, hi);
  }
  for (int64_t i = hb; i < h; ++i) {
    const A x1 = to_acc<A>(x[i]), x2 = to_acc<A>(x[h + i]);
    const A sa = Backward ? -to_acc<A>(s[h + i]) : to_acc<A>(s[i]);
    const A sb = Backward ? -to_acc<A>(s[i]) : to_acc<A>(s[h + i]);
    y[i] = from_acc<X>(round_to<X>(x1 * to_acc<A>(c[i])) - round_to<X>(x2 * sa));
    y[h + i] = from_acc<X>(round_to<X>(x2 * to_acc<A>(c[h + i])) + round_to<X>(x1 * sb));
  }
}

// Walks rows [r0, r1) of the multi-index odometer-style: one division per dimension at the start, then
// additions.
template <bool Backward, bool Stream, class X>
void rotary_rows(const RotaryRows& w, int64_t r0, int64_t r1) {
  const int n = w.ndim;
  int64_t index[RotaryRows::kMaxDims] = {};
  int64_t ox = 0, oc = 0, os = 0, oy = 0;
  for (int64_t d = n - 1, rest = r0; d >= 0; --d) {
    index[d] = rest % w.sizes[d];
    rest /= w.sizes[d];
    ox += index[d] * w.x_strides[d];
    oc += index[d] * w.cos_strides[d];
    os += index[d] * w.sin_strides[d];
    oy += index[d] * w.y_strides[d];
  }
  const X* x = static_cast<const X*>(w.x);
  const X* c = static_cast<const X*>(w.cos);
  const X* s = static_cast<const X*>(w.sin);
  X* y = static_cast<X*>(w.y);
  for (int64_t r = r0; r < r1; ++r) {
    rotary_row<Backward, Stream>(x + ox, c + oc, s + os, y + oy, w.D / 2);
    for (int d = n - 1; d >= 0; --d) {
      ox += w.x_strides[d];
      oc += w.cos_strides[d];
      os += w.sin_strides[d];
      oy += w.y_strides[d];
      if (++index[d] < w.sizes[d]) break;
      ox -= w.sizes[d] * w.x_strides[d];
      oc -= w.sizes[d] * w.cos_strides[d];
      os -= w.sizes[d] * w.sin_strides[d];
      oy -= w.sizes[d] * w.y_strides[d];
      index[d] = 0;
    }
  }
}

// Whether every row half of y starts aligned for streaming stores.
template <class X>
bool can_stream_rows(const RotaryRows& w) {
  X* y = static_cast<X*>(w.y);
  if (!can_stream(y, w.D / 2)) return false;
  for (int d = 0; d < w.ndim; ++d)
    if (!can_stream(y, w.y_strides[d])) return false;
  return true;
}

}  // namespace

void rotary(DType dtype, bool backward, const RotaryRows& rows, int64_t row_begin, int64_t row_end,
            bool stream) {
  if (row_begin >= row_end) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using X = decltype(tag);
    auto run = [&](auto streamed) {
      constexpr bool S = decltype(streamed)::value;
      if (backward) {
        rotary_rows<true, S, X>(rows, row_begin, row_end);
      } else {
        rotary_rows<false, S, X>(rows, row_begin, row_end);
      }
    };
    if (stream && can_stream_rows<X>(rows)) {
      run(std::true_type{});
      stream_fence();
    } else {
      run(std::false_type{});
    }
  });
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
