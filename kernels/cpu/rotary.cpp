// The rotary embedding (transformers' apply_rotary_pos_emb, rotate-half convention), forward and backward,
// compiled once per instruction-set level (KERNMAP_CPU_LEVEL names the level). One pass: each row of x is
// read once and each row of y written once; the rows of cos and sin repeat across heads and stay in the
// cache (16-bit ones widened once for the heads of a position that follow one another). Compiled with
// -ffp-contract=off: the products and sums are rounded one by one, as eager computes them.
#include <algorithm>

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
// which is the forward with sin's halves swapped and negated (negation is exact). So a row reads four halves
// of h: ca = cos[:h], cb = cos[h:], and sa, sb = sin[:h], sin[h:] (forward) or -sin[h:], -sin[:h] (backward).
// They come either from cos and sin themselves (C = X, Negate for the backward) or, for 16-bit X, from
// their values widened once for the rows that share them (C = float, negated already: Widened below).
// Inlined into the run's loop: a head's row is short (128 elements), and GCC left it a call, which cost
// about a tenth of the bf16 row in cache (docs/performance.md, "bf16 rotary in even and odd lanes").
template <bool Negate, bool Stream, class X, class C>
__attribute__((always_inline)) inline void rotary_row(const X* x, const C* ca, const C* cb, const C* sa,
                                                      const C* sb, X* y, int64_t h) {
  using A = Acc<X>;
  const int64_t hb = h - h % kBlock;
  // One block pair's math (the two output halves), for the paired and the single blocks alike.
  const auto rotate = [](auto x1, auto x2, auto ca, auto cb, auto sa, auto sb, auto& lo, auto& hi) {
    if constexpr (Negate) {
      sa = -sa;
      sb = -sb;
    }
    lo = round_block_arith<X>(x1 * ca) - round_block_arith<X>(x2 * sa);
    hi = round_block_arith<X>(x2 * cb) + round_block_arith<X>(x1 * sb);
  };
  // Two blocks of a cos or sin half at p in the lanes `widen` gives a bf16 row in (load_bf16_eo,
  // load_bf16_pair): widened so from bf16, or Widened's two floats, stored in those lanes.
  const auto load_two = [](const auto* p, VF& a, VF& b, auto widen) {
    if constexpr (std::is_same_v<C, float>) {
      a = load<float>(p);
      b = load<float>(p + kBlock);
    } else {
      widen(p, a, b);
    }
  };
  // bf16 at the AVX-512 BF16 levels: 32 elements of each half a step in even and odd lanes (vec.h,
  // load_bf16_eo), the four products rounded two blocks a conversion; cos and sin in the same lanes
  // (Widened's floats are stored so). The sums take the rounded products in their q lanes.
  int64_t iq = 0;
#if defined(__AVX512BF16__)
  const auto eo = [](const auto* p, VF& e, VF& o) { load_bf16_eo(p, e, o); };
  iq = eo_bf16_blocks<X>(hb, [&](auto i) {
    fetch_ahead(x + i);
    fetch_ahead(x + h + i);
    VF x1[2], x2[2], c1[2], c2[2], s1[2], s2[2];
    load_bf16_eo(x + i, x1[0], x1[1]);
    load_bf16_eo(x + h + i, x2[0], x2[1]);
    load_two(ca + i, c1[0], c1[1], eo);
    load_two(cb + i, c2[0], c2[1], eo);
    load_two(sa + i, s1[0], s1[1], eo);
    load_two(sb + i, s2[0], s2[1], eo);
    if constexpr (Negate) {
      for (int j = 0; j < 2; ++j) {
        s1[j] = -s1[j];
        s2[j] = -s2[j];
      }
    }
    VF p1[2], p2[2], p3[2], p4[2];
    round_bf16_eo(x1[0] * c1[0], x1[1] * c1[1], p1[0], p1[1]);
    round_bf16_eo(x2[0] * s1[0], x2[1] * s1[1], p2[0], p2[1]);
    round_bf16_eo(x2[0] * c2[0], x2[1] * c2[1], p3[0], p3[1]);
    round_bf16_eo(x1[0] * s2[0], x1[1] * s2[1], p4[0], p4[1]);
    store_bf16_q<Stream>(y + i, p1[0] - p2[0], p1[1] - p2[1]);
    store_bf16_q<Stream>(y + h + i, p3[0] + p4[0], p3[1] + p4[1]);
  });
#endif
  // bf16 below AVX-512: two blocks a step, every input and output through the paired load and store (vec.h);
  // at most one of the two loops runs.
  const int64_t ip = paired_bf16_blocks<X>(hb, [&](auto i) {
    VF x1[2], x2[2], ca2[2], cb2[2], sa2[2], sb2[2];
    fetch_ahead(x + i);
    fetch_ahead(x + h + i);
    load_bf16_pair(x + i, x1[0], x1[1]);
    load_bf16_pair(x + h + i, x2[0], x2[1]);
    const auto pair = [](const auto* p, VF& lo, VF& hi) { load_bf16_pair(p, lo, hi); };
    load_two(ca + i, ca2[0], ca2[1], pair);
    load_two(cb + i, cb2[0], cb2[1], pair);
    load_two(sa + i, sa2[0], sa2[1], pair);
    load_two(sb + i, sb2[0], sb2[1], pair);
    VF lo[2], hi[2];
    for (int j = 0; j < 2; ++j) rotate(x1[j], x2[j], ca2[j], cb2[j], sa2[j], sb2[j], lo[j], hi[j]);
    store_bf16_pair<Stream>(y + i, lo[0], lo[1]);
    store_bf16_pair<Stream>(y + h + i, hi[0], hi[1]);
  });
  const int64_t i0 = std::max(iq, ip);
  for (int64_t i = i0; i < hb; i += kBlock) {
    fetch_ahead(x + i);
    fetch_ahead(x + h + i);
    Vec<A> lo, hi;
    rotate(load<A>(x + i), load<A>(x + h + i), load<A>(ca + i), load<A>(cb + i), load<A>(sa + i),
           load<A>(sb + i), lo, hi);
    store_out<Stream>(y + i, lo);
    store_out<Stream>(y + h + i, hi);
  }
  for (int64_t i = hb; i < h; ++i) {
    A sai = to_acc<A>(sa[i]), sbi = to_acc<A>(sb[i]);
    if constexpr (Negate) {
      sai = -sai;
      sbi = -sbi;
    }
    const A x1 = to_acc<A>(x[i]), x2 = to_acc<A>(x[h + i]);
    y[i] = from_acc<X>(round_to<X>(x1 * to_acc<A>(ca[i])) - round_to<X>(x2 * sai));
    y[h + i] = from_acc<X>(round_to<X>(x2 * to_acc<A>(cb[i])) + round_to<X>(x1 * sbi));
  }
}

// cos and sin of a position widened to float once for the heads that share it (16-bit X): four halves of h
// (ca, cb, sa, sb as above, negated for the backward), each in the lanes rotary_row reads it in (32-element
// steps in even and odd lanes at the AVX-512 BF16 levels or pairs of load_bf16_pair blocks below AVX-512,
// then single blocks, then the tail). Each head's row then loads them as floats instead of widening four bf16
// halves a row again: at the AVX-512 levels a widening is a shuffle on the port that also rounds, which bound
// the bf16 rows (docs/performance.md, "Rotary: cos and sin widened once
// per position"). The values are those the row would widen itself, so the bits are the same.
template <class X>
struct Widened {
  static constexpr int64_t kMaxHalf = 256;  // head_dim up to 512; wider rows read cos and sin themselves
  alignas(64) float ca[kMaxHalf], cb[kMaxHalf], sa[kMaxHalf], sb[kMaxHalf];

  template <bool Backward>
  void fill(const X* c, const X* s, int64_t h) {
    widen(c, ca, h, false);
    widen(c + h, cb, h, false);
    widen(Backward ? s + h : s, sa, h, Backward);
    widen(Backward ? s : s + h, sb, h, Backward);
  }

 private:
  static void widen(const X* p, float* out, int64_t h, bool negate) {
    const int64_t hb = h - h % kBlock;
    // The AVX-512 BF16 levels' even and odd lanes, the pairs' lanes below AVX-512 (at most one of the two
    // runs), then single blocks in order.
    int64_t iq = 0;
#if defined(__AVX512BF16__)
    iq = eo_bf16_blocks<X>(hb, [&](auto i) {
      VF e, o;
      load_bf16_eo(p + i, e, o);
      store(out + i, negate ? -e : e);
      store(out + i + kBlock, negate ? -o : o);
    });
#endif
    const int64_t ip = paired_bf16_blocks<X>(hb, [&](auto i) {
      VF lo, hi;
      load_bf16_pair(p + i, lo, hi);
      store(out + i, negate ? -lo : lo);
      store(out + i + kBlock, negate ? -hi : hi);
    });
    for (int64_t i = std::max(iq, ip); i < hb; i += kBlock) {
      const VF v = load<float>(p + i);
      store(out + i, negate ? -v : v);
    }
    for (int64_t i = hb; i < h; ++i) out[i] = negate ? -to_float(p[i]) : to_float(p[i]);
  }
};

// Rows j = 0 .. n-1 of a run along the walk's innermost dimension, x + j xs -> y + j ys, with cos and sin at
// c + j cs and s + j ss.
template <bool Backward, bool Stream, class X>
void rotary_run(const X* x, int64_t xs, const X* c, int64_t cs, const X* s, int64_t ss, X* y, int64_t ys,
                int64_t n, int64_t h) {
  if constexpr (!std::is_same_v<X, float> && !std::is_same_v<X, double>) {
    if (cs == 0 && ss == 0 && n > 1 && h <= Widened<X>::kMaxHalf) {
      Widened<X> w;
      w.template fill<Backward>(c, s, h);
      for (int64_t j = 0; j < n; ++j)
        rotary_row<false, Stream>(x + j * xs, w.ca, w.cb, w.sa, w.sb, y + j * ys, h);
      return;
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    const X* cj = c + j * cs;
    const X* sj = s + j * ss;
    rotary_row<Backward, Stream>(x + j * xs, cj, cj + h, Backward ? sj + h : sj, Backward ? sj : sj + h,
                                 y + j * ys, h);
  }
}

// Walks rows [r0, r1) of the multi-index odometer-style: one division per dimension at the start, then
// additions, a run along the innermost dimension at a time.
template <bool Backward, bool Stream, class X>
void rotary_rows(const RotaryRows& w, int64_t r0, int64_t r1) {
  const int n = w.ndim;
  const X* x = static_cast<const X*>(w.x);
  const X* c = static_cast<const X*>(w.cos);
  const X* s = static_cast<const X*>(w.sin);
  X* y = static_cast<X*>(w.y);
  const int64_t h = w.D / 2;
  if (n == 0) {  // one row
    rotary_run<Backward, Stream>(x, 0, c, 0, s, 0, y, 0, r1 - r0, h);
    return;
  }
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
  const int in = n - 1;
  for (int64_t r = r0; r < r1;) {
    const int64_t len = std::min(r1 - r, w.sizes[in] - index[in]);
    rotary_run<Backward, Stream>(x + ox, w.x_strides[in], c + oc, w.cos_strides[in], s + os,
                                 w.sin_strides[in], y + oy, w.y_strides[in], len, h);
    r += len;
    // Step the odometer by len along the innermost dimension, carrying into the outer ones.
    ox += len * w.x_strides[in];
    oc += len * w.cos_strides[in];
    os += len * w.sin_strides[in];
    oy += len * w.y_strides[in];
    index[in] += len;
    for (int d = in; d >= 0 && index[d] == w.sizes[d]; --d) {
      ox -= w.sizes[d] * w.x_strides[d];
      oc -= w.sizes[d] * w.cos_strides[d];
      os -= w.sizes[d] * w.sin_strides[d];
      oy -= w.sizes[d] * w.y_strides[d];
      index[d] = 0;
      if (d == 0) break;
      ox += w.x_strides[d - 1];
      oc += w.cos_strides[d - 1];
      os += w.sin_strides[d - 1];
      oy += w.y_strides[d - 1];
      ++index[d - 1];
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
