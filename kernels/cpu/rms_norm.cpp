// RMSNorm forward and backward, alone and fused with the residual add in front of it (one row math for both),
// compiled once per instruction-set level (KERNMAP_CPU_LEVEL names the level).
// Each pass reads a row from memory once; the second read of a row hits the cache (a row of H = 8192 fp32 is
// 32 KiB). Compiled with -ffp-contract=off: every multiply-add is an explicit madd/nmadd, so the fused
// residual add's outputs have the bits of the plain pass's at every level (GCC fused `ss += v * v` in one
// instantiation and not in the other at avx2).
#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/cpu/vec.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {
namespace {

// The row a pass reads: x itself, or with Add (the fused residual add) round_X(x + res). A block with Add is
// x + res before that rounding: the forward stores the sum (store rounds) and rounds it for the norm, and
// the two share one conversion.
template <bool Add, class X>
struct Source {
  const X* x;
  const X* res;
  Vec<Acc<X>> block(int64_t i) const {
    if constexpr (Add) {
      return load<Acc<X>>(x + i) + load<Acc<X>>(res + i);
    } else {
      return load<Acc<X>>(x + i);
    }
  }
  Acc<X> at(int64_t i) const {
    if constexpr (Add) {
      return round_to<X>(to_acc<Acc<X>>(x[i]) + to_acc<Acc<X>>(res[i]));
    } else {
      return to_acc<Acc<X>>(x[i]);
    }
  }
  void prefetch_block(int64_t i) const {
    prefetch(x + i);
    if constexpr (Add) prefetch(res + i);
  }
};

// The calling thread's row buffer in the accumulation type (a row of H = 8192 fp32 is 32 KiB: it stays in
// the level-1 or level-2 cache).
template <class A>
A* row_scratch(int64_t n) {
  thread_local std::vector<A> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// The sum over a row's blocks that each pass's first loop accumulates (a sum of squares, a dot product):
// step(i, acc) adds block i's products into acc by madd. Four accumulators, blocks i, i + 1, i + 2, i + 3 of
// each group into the four (the rest into the first), summed pairwise at the end: one accumulator made the
// loop wait on the multiply-add's latency every block (docs/performance.md, "RMSNorm's row sums"). The order
// depends on the row length alone, so the bits do not depend on threads.
template <class V, class Step>
inline V accumulate_blocks(int64_t Hb, Step&& step) {
  constexpr int kAcc = 4;
  V acc[kAcc] = {};
  int64_t i = 0;
  for (; i + kAcc * kBlock <= Hb; i += kAcc * kBlock) {
#pragma GCC unroll 4
    for (int j = 0; j < kAcc; ++j) step(i + j * kBlock, acc[j]);
  }
  for (; i < Hb; i += kBlock) step(i, acc[0]);
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// accumulate_blocks with each group's blocks taken two at a time in other lanes: pair(i, a0, a1) adds blocks
// i and i + kBlock into two accumulators whose lanes hold, between them, the elements accumulate_blocks' two
// would, each lane always the same element of its group; to_blocks(a0, a1, b0, b1) puts them in
// accumulate_blocks' lanes after the groups (each lane's sum moves whole), and the blocks after the last
// group go to step(i, acc) as there. The same sums, so the same bits. The pairs below AVX-512
// (load_bf16_pair: swap_pair_lanes) and the even and odd lanes of the AVX-512 BF16 levels (load_bf16_eo:
// eo_to_blocks).
template <class Pair, class Step, class ToBlocks>
inline VF accumulate_pairs(int64_t Hb, Pair&& pair, Step&& step, ToBlocks&& to_blocks) {
  VF p[4] = {}, acc[4];
  int64_t i = 0;
  for (; i + 4 * kBlock <= Hb; i += 4 * kBlock) {
    pair(i, p[0], p[1]);
    pair(i + 2 * kBlock, p[2], p[3]);
  }
  to_blocks(p[0], p[1], acc[0], acc[1]);
  to_blocks(p[2], p[3], acc[2], acc[3]);
  for (; i < Hb; i += kBlock) step(i, acc[0]);
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// The paired bf16 blocks below AVX-512 (paired_bf16_blocks), for rows of float kept beside bf16 rows (the
// forward's weight, the backward's g): block i (i below H - H % (2 kBlock)) stored where load_bf16_pair's
// lane order puts it. At avx2 (elements 0-3 and 8-11 of each 16 in the first block, 4-7 and 12-15 in the
// second) block i's lanes 0-3 and 4-7 go to elements 0-3 and 8-11 of its pair (the pair's first block), or
// 4-7 and 12-15 (its second); at baseline the lanes are in the row's order (kPairLanesInOrder) and block i
// stays where it is.
#if !defined(__AVX512F__)
template <class X>
inline constexpr bool kPairedBf16 = std::is_same_v<X, BFloat16>;
inline void store_pair_lanes(float* row, int64_t i, VF v) {
#if defined(__AVX2__)
  float* at = row + (i - i % (2 * kBlock)) + (i % (2 * kBlock) ? 4 : 0);
  _mm_storeu_ps(at, _mm256_castps256_ps128((__m256)v));
  _mm_storeu_ps(at + 8, _mm256_extractf128_ps((__m256)v, 1));
#else
  store(row + i, v);
#endif
}
// Two float blocks a, b (elements 0-7 and 8-15 of a pair at avx2) into the pairs' lane order (u: elements
// 0-3 and 8-11, v: 4-7 and 12-15), and back: the same two lane-crossing shuffles either way. At baseline the
// pairs' lane order is the row's: u = a, v = b.
inline void swap_pair_lanes(VF a, VF b, VF& u, VF& v) {
#if defined(__AVX2__)
  u = _mm256_permute2f128_ps(a, b, 0x20);
  v = _mm256_permute2f128_ps(a, b, 0x31);
#else
  u = a;
  v = b;
#endif
}
// A float row's first n elements (n a multiple of 2 kBlock) into the pairs' lane order or back, in place.
inline void swap_row_pair_lanes(float* row, int64_t n) {
  if constexpr (!kPairLanesInOrder) {
    for (int64_t i = 0; i < n; i += 2 * kBlock) {
      VF u, v;
      swap_pair_lanes(load<float>(row + i), load<float>(row + i + kBlock), u, v);
      store(row + i, u);
      store(row + i + kBlock, v);
    }
  }
}

#else
template <class X>
inline constexpr bool kPairedBf16 = false;
#endif
// The plain forward's bf16 rows at the AVX-512 BF16 levels (x and y bf16, no residual add) in 32-element
// steps (vec.h, load_bf16_eo): the first pass's sums in the even and odd lanes, the second pass's normalized
// values rounded two blocks a conversion into the q lanes, times the weight parked in those lanes (q_order),
// stored in order by store_bf16_q; about a third of the port-5 micro-ops of the single blocks
// (docs/performance.md, "bf16 RMSNorm forward in even and odd lanes"). The same values, so the same bits.
#if defined(__AVX512BF16__)
template <bool Add, class X, class Y>
inline constexpr bool kEoForward = !Add && std::is_same_v<X, BFloat16> && std::is_same_v<Y, BFloat16>;
// The weight in the q lanes of each 32-element step below Hb (store_bf16_q: elements 0, 4, ..., 28, 1, 5,
// ..., 29, then 2, 6, ..., 30, 3, 7, ..., 31), in the calling thread's buffer.
inline const float* q_order(const float* w, int64_t Hb) {
  thread_local std::vector<float> buf;
  const int64_t n = Hb - Hb % (2 * kBlock);
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  for (int64_t i = 0; i < n; i += 2 * kBlock)
    for (int64_t k = 0; k < kBlock; ++k) {
      const int64_t m = k < 8 ? 4 * k : 4 * (k - 8) + 1;
      buf[i + k] = w[i + m];
      buf[i + kBlock + k] = w[i + m + 2];
    }
  return buf.data();
}
#else
template <bool Add, class X, class Y>
inline constexpr bool kEoForward = false;
#endif
#if defined(__AVX512F__)
// Two accumulators of even and odd lanes (elements 2l and 2l + 1 of 32) as accumulate_blocks' two blocks
// (elements 0-15 and 16-31): each lane's sum moves whole, so the sums and their bits are those of the
// single blocks.
inline void eo_to_blocks(VF e, VF o, VF& a, VF& b) {
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  a = _mm512_permutex2var_ps(e, first, o);
  b = _mm512_permutex2var_ps(e, second, o);
}
// The backward's bf16 rows at the AVX-512 levels (x, dy and dx bf16, with the fused residual's d_sum too) in
// 32-element steps: every operand in the even and odd lanes (load_bf16_eo), the weight and dw's row
// parked in those lanes for the call (eo_order, eo_row_order), each rounded product kept in its lanes
// (round_bf16_eo_kept), dx stored by store_bf16_eo. The same values, so the same bits.
template <class X, class Y>
inline constexpr bool kEoBackward = (std::is_same_v<X, BFloat16> && std::is_same_v<Y, BFloat16>);
// A float row's first n elements (n a multiple of 2 kBlock) into the even and odd lanes of load_bf16_eo
// (each 32-element step's even elements, then its odd ones), or back (to_eo false: eo_to_blocks), in place.
inline void eo_row_order(float* row, int64_t n, bool to_eo) {
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odds = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int64_t i = 0; i < n; i += 2 * kBlock) {
    const VF a = load<float>(row + i), b = load<float>(row + i + kBlock);
    VF u, v;
    if (to_eo) {
      u = _mm512_permutex2var_ps(a, evens, b);
      v = _mm512_permutex2var_ps(a, odds, b);
    } else {
      eo_to_blocks(a, b, u, v);
    }
    store(row + i, u);
    store(row + i + kBlock, v);
  }
}
// The weight's first n elements in the even and odd lanes, in the calling thread's buffer.
inline const float* eo_order(const float* w, int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  std::copy(w, w + n, buf.data());
  eo_row_order(buf.data(), n, true);
  return buf.data();
}
#else
template <class X, class Y>
inline constexpr bool kEoBackward = false;
#endif

// The backward's first pass in pairs (accumulate_pairs): bf16 x with dy of its type.
template <class X, class Y>
inline constexpr bool kPairedFirstPass = kPairedBf16<X> ? std::is_same_v<Y, X> : false;

// The rows normalize_row reads in pairs for bf16 x and y: x itself, or the fused residual's float row parked
// in the pairs' lane order; load_pair reads two blocks of either in that order.
template <class X, class S, class Y>
inline constexpr bool kPairedSource = kPairedFirstPass<X, Y> && (std::is_same_v<S, Source<false, BFloat16>> ||
                                                                 std::is_same_v<S, Source<false, float>>);
template <class Pair>
inline void load_pair(const BFloat16* p, Pair& lo, Pair& hi) {
  load_bf16_pair(p, lo, hi);
}
template <class Pair>
inline void load_pair(const float* p, Pair& lo, Pair& hi) {
  lo = load<float>(p);
  hi = load<float>(p + kBlock);
}

// The second pass: y = round_Y(w * round_X(h * r)) for the row h of src (rounding to X), fetching the row
// the first pass reads next (the first pass is light enough to run at memory speed; this one is not). h and
// r are made of X elements and the finite eps alone, so the rounding needs no NaN select (round_block_arith);
// the weight, a float of any value, comes after it. bf16 in and out below AVX-512 (wp: the weight in the
// pairs' lane order, pair_order): two blocks at once, one load and one packing for both (paired_bf16_blocks);
// the same values as the single blocks. The fused residual's float row (bf16 x and y) is read in pairs too,
// parked by its first pass in the pairs' lane order. The plain forward's bf16 rows at the AVX-512 BF16 levels
// go 32 elements a step (kEoForward; wq: the weight in the q lanes).
template <bool Stream, class X, class S, class N, class Y>
void normalize_row(const S& src, const N& next, const Acc<X>* w, const Acc<X>* wp, const Acc<X>* wq, Y* y,
                   Acc<X> rs, int64_t H) {
  const int64_t Hb = H - H % kBlock;
  int64_t i = 0;
#if defined(__AVX512BF16__)
  if constexpr (kEoForward<false, X, Y> && std::is_same_v<S, Source<false, X>>) {
    i = eo_bf16_blocks<Y>(Hb, [&](auto p) {
      next.prefetch_block(p);
      VF e, o, a, b;
      load_bf16_eo(src.x + p, e, o);
      round_bf16_eo(e * rs, o * rs, a, b);
      store_bf16_q<Stream>(y + p, load<float>(wq + p) * a, load<float>(wq + p + kBlock) * b);
    });
  }
#endif
  if constexpr (kPairedSource<X, S, Y>) {
    if (wp) {
      i = paired_bf16_blocks<Y>(Hb, [&](auto p) {
        next.prefetch_block(p);
        VF lo, hi;
        load_pair(src.x + p, lo, hi);
        lo = round_block_arith<X>(lo * rs);
        hi = round_block_arith<X>(hi * rs);
        store_bf16_pair<Stream>(y + p, load<float>(wp + p) * lo, load<float>(wp + p + kBlock) * hi);
      });
    }
  }
  for (; i < Hb; i += kBlock) {
    next.prefetch_block(i);
    Vec<Acc<X>> n = round_block_arith<X>(src.block(i) * rs);
    store_out<Stream>(y + i, load<Acc<X>>(w + i) * n);
  }
  for (int64_t i = Hb; i < H; ++i) y[i] = from_acc<Y>(w[i] * round_to<X>(src.at(i) * rs));
}

// The weight in the pairs' lane order (store_pair_lanes), for normalize_row's paired blocks: for bf16 rows
// below AVX-512, w itself where that order is the row's (baseline), else a copy in the calling thread's
// buffer; null otherwise (no pairs).
template <class X, class Y>
const Acc<X>* pair_order(const Acc<X>* w, int64_t H) {
  if constexpr (kPairedBf16<X> && std::is_same_v<Y, BFloat16>) {
    if constexpr (kPairLanesInOrder) return w;
    thread_local std::vector<float> buf;
    const int64_t n = H - H % (2 * kBlock);
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
    for (int64_t i = 0; i < n; i += kBlock) store_pair_lanes(buf.data(), i, load<float>(w + i));
    return buf.data();
  }
  return nullptr;
}

// Scalar math (h = float(x), or with Add h = float(round_X(x + res)), written to sum):
//   r = 1 / sqrt(sum(h^2) / H + eps); n = round_X(h * r); y = round_Y(w * n)
// With Add, the bits of y and rstd are those of the plain pass over sum. Its second pass reads the sum row
// from the thread's row buffer, where the first pass left it in the accumulation type: no second read of x
// and res, no conversion, and the sum can be streamed out like y. bf16 below AVX-512 (kPairedFirstPass), both
// passes run in pairs, the row buffer in the pairs' lane order; the first pass's sums in accumulate_blocks'
// order (accumulate_pairs), so the bits stay the plain pass's.
template <bool Add, bool Stream, class X, class Y>
void fwd_rows(const X* x, int64_t xs, const X* res, int64_t res_s, const Acc<X>* w, Y* y, X* sum,
              Acc<X>* rstd, int64_t r0, int64_t r1, int64_t H, double eps) {
  using A = Acc<X>;
  using V = Vec<A>;
  const int64_t Hb = H - H % kBlock;
  const int64_t Hp = H - H % (2 * kBlock);  // the paired blocks' end (kPairedBf16)
  A* hrow = Add ? row_scratch<A>(H) : nullptr;
  // The fused residual's passes in pairs (kPairedFirstPass: bf16 x, res, sum and y): the sum row parked in
  // the pairs' lane order, as the weight is (pair_order, null where nothing runs in pairs).
  constexpr bool kPairedAdd = Add && kPairedFirstPass<X, Y>;
  const A* wp = pair_order<X, Y>(w, H);
  const A* wq = nullptr;  // the weight in the q lanes (kEoForward)
#if defined(__AVX512BF16__)
  if constexpr (kEoForward<Add, X, Y>) wq = q_order(w, Hb);
#endif
  for (int64_t r = r0; r < r1; ++r) {
    const Source<Add, X> src{x + r * xs, Add ? res + r * res_s : nullptr};
    const int64_t rn = r + 1 < r1 ? r + 1 : r;  // the next row of the range (the last row again at its end)
    const Source<Add, X> next{x + rn * xs, Add ? res + rn * res_s : nullptr};
    Y* yr = y + r * H;
    X* sr = Add ? sum + r * H : nullptr;
    // The fused residual's rounded sum into the row buffer (kPairedAdd: below Hp in the pairs' lane order).
    const auto park = [&](int64_t i, V h) {
      if constexpr (kPairedAdd) {
        if (i < Hp) return store_pair_lanes(hrow, i, h);
      }
      store(hrow + i, h);
    };
    const auto step = [&](int64_t i, V& a) {
      V h = src.block(i);
      if constexpr (Add) {
        store_out<Stream>(sr + i, h);
        h = round_block_arith<X>(h);
        park(i, h);
      }
      a = madd(h, h, a);
    };
    V acc;
    if constexpr (kPairedAdd) {
      acc = accumulate_pairs(
          Hb,
          [&](auto p, VF& a0, VF& a1) {
            VF xv[2], rv[2], h[2];
            load_bf16_pair(src.x + p, xv[0], xv[1]);
            load_bf16_pair(src.res + p, rv[0], rv[1]);
            for (int k = 0; k < 2; ++k) h[k] = xv[k] + rv[k];
            store_bf16_pair<Stream>(sr + p, h[0], h[1]);
            for (int k = 0; k < 2; ++k) {
              h[k] = round_block_arith<X>(h[k]);
              store(hrow + p + k * kBlock, h[k]);
            }
            a0 = madd(h[0], h[0], a0);
            a1 = madd(h[1], h[1], a1);
          },
          step, [](auto a, auto b, auto& u, auto& v) { swap_pair_lanes(a, b, u, v); });
    } else if constexpr (kEoForward<Add, X, Y>) {
#if defined(__AVX512BF16__)
      acc = accumulate_pairs(
          Hb,
          [&](auto p, VF& a0, VF& a1) {
            VF e, o;
            load_bf16_eo(src.x + p, e, o);
            a0 = madd(e, e, a0);
            a1 = madd(o, o, a1);
          },
          step, eo_to_blocks);
#endif
    } else {
      acc = accumulate_blocks<V>(Hb, step);
    }
    A ss = lane_sum(acc);
    for (int64_t i = Hb; i < H; ++i) {
      A v = src.at(i);
      if constexpr (Add) {
        sr[i] = from_acc<X>(v);
        hrow[i] = v;
      }
      ss = madd(v, v, ss);
    }
    const A rs = A(1) / std::sqrt(ss / static_cast<A>(H) + static_cast<A>(eps));
    rstd[r] = rs;
    if constexpr (Add) {
      normalize_row<Stream, X>(Source<false, A>{hrow, nullptr}, next, w, wp, wq, yr, rs, H);
    } else {
      normalize_row<Stream, X>(src, next, w, wp, wq, yr, rs, H);
    }
  }
}

// The first pass's roundings, g = round_X(dy * w) and round_X(h * r), where y has x's type: the weight's
// values then have x's type too (y's type is the promotion of x's and the weight's), as do dy's and h's, and
// r is made of them (a NaN r is made the default NaN, bwd_rows), so each product is arithmetic on X values
// and its rounding needs no NaN select (round_block_arith, which differs from round_block for bf16 alone). A
// NaN g reaches only the row's dot product and dx, whose stores write every NaN as one; a NaN round_X(h * r)
// reaches dw's partial sums, which the op converts to the weight's type, bf16 here, where torch writes every
// NaN as 0xffff. An fp32 weight can hold any NaN, and dw is then fp32 with its NaNs' payloads: round_block.
template <class X, class Y, class V>
inline V round_grad(V v) {
  if constexpr (std::is_same_v<Y, X>) {
    return round_block_arith<X>(v);
  } else {
    return round_block<X>(v);
  }
}

// Scalar math (g is the gradient reaching round_X(h * r), rounded to X as the eager autograd does):
//   g = round_X(dy * w); dx = round_X(r * g - r^3 * h * sum(g * h) / H); dw += dy * round_X(h * r)
// With Add (the fused residual add's backward), the residual stream's gradient joins as eager's autograd
// accumulates it: dx = round_X(dx + d_sum). The first pass also accumulates dw (r is the forward's); the
// second takes g from a row buffer the first filled (bwd_rows_in_turn) or computes it again from dy
// (bwd_rows_piped). The first pass fetches x and dy kAheadBytes ahead (vec.h, fetch_ahead; past the row's end
// into the next row's), the second reads x and g (or dy) from the cache and fetches nothing: asking for the
// whole next row during the second pass, as the backward did until 2026-12-06, ran slower than no prefetch at
// all on xeon-amx-vm (fp32 [4096, 3584], 2 threads, inputs in its 480 MiB L3: 5.0-6.1 ms next row, 4.4-5.2
// none, 4.2-4.9 ahead; bf16 2.9 -> 2.4-2.5 at avx512bf16); from memory, fwd+bwd fp32 1.10-1.13x faster at
// every level, bf16 1.02-1.08x (docs/performance.md, "Inputs fetched ahead"). The rows go pipelined
// (bwd_rows_piped) except bf16 below AVX-512 (bwd_rows_in_turn); both call the block helpers below.

// One row's pointers.
template <bool Add, class X, class Y>
struct BwdRow {
  const Y* dy;
  const X* d_sum;  // Add only
  const X* x;
  X* dx;
};

// rstd is an input of the backward ops: a NaN of any payload becomes the default NaN, whose low bits the
// arithmetic roundings of its products (round_grad, the residual's dx) cannot carry out of.
template <class A>
inline A bwd_rstd(A r) {
  return r == r ? r : std::numeric_limits<A>::quiet_NaN();
}

// Block i of the first pass: adds g * h into a and dy * round_X(h * r) into dw; returns g.
template <bool Add, class X, class Y, class A, class V = Vec<A>>
__attribute__((always_inline)) inline V bwd_first_block(const BwdRow<Add, X, Y>& row, const A* w, A rs, A* dw,
                                                        int64_t i, V& a) {
  if constexpr (Add) prefetch(row.d_sum + i);
  fetch_ahead(row.x + i);
  fetch_ahead(row.dy + i);
  V h = load<A>(row.x + i);
  V d = load<A>(row.dy + i);
  const V g = round_grad<X, Y>(d * load<A>(w + i));
  a = madd(g, h, a);
  store(dw + i, madd(d, round_grad<X, Y>(h * rs), load<A>(dw + i)));
  return g;
}

// The first pass's columns past the last block (from Hb): adds into dot and dw, g into grow unless null.
template <bool Add, class X, class Y, class A>
inline A bwd_first_tail(const BwdRow<Add, X, Y>& row, const A* w, A rs, A* dw, A* grow, int64_t Hb, int64_t H,
                        A dot) {
  for (int64_t i = Hb; i < H; ++i) {
    A h = to_acc<A>(row.x[i]);
    A d = to_acc<A>(row.dy[i]);
    A g = round_to<X>(d * w[i]);
    dot = madd(g, h, dot);
    dw[i] = madd(d, round_to<X>(h * rs), dw[i]);
    if (grow) grow[i] = g;
  }
  return dot;
}

// g of block i computed again from dy and the weight, as the first pass computed it (the same bits).
template <bool Add, class X, class Y, class A, class V = Vec<A>>
__attribute__((always_inline)) inline V bwd_grad(const BwdRow<Add, X, Y>& row, const A* w, int64_t i) {
  return round_grad<X, Y>(load<A>(row.dy + i) * load<A>(w + i));
}

// Block i of the second pass (c = r^3 * sum(g * h) / H, g the block's): dx = r * g - c * h (plus d_sum with
// Add).
template <bool Add, bool Stream, class X, class Y, class A, class V = Vec<A>>
__attribute__((always_inline)) inline void bwd_second_block(const BwdRow<Add, X, Y>& row, V g, A c, A rs,
                                                            int64_t i) {
  V h = load<A>(row.x + i);
  if constexpr (Add) {  // c, h, r and g hold X values or the default NaN: round_block_arith
    store_out<Stream>(row.dx + i, round_block_arith<X>(nmadd(V{} + c, h, rs * g)) + load<A>(row.d_sum + i));
  } else {
    store_out<Stream>(row.dx + i, nmadd(V{} + c, h, rs * g));
  }
}

// The second pass's columns from `from` on, one at a time; g from grow, or computed again from dy and the
// weight w where grow is null.
template <bool Add, class X, class Y, class A>
inline void bwd_second_tail(const BwdRow<Add, X, Y>& row, const A* grow, const A* w, A c, A rs, int64_t from,
                            int64_t H) {
  for (int64_t i = from; i < H; ++i) {
    const A g = grow ? grow[i] : round_to<X>(to_acc<A>(row.dy[i]) * w[i]);
    A v = nmadd(c, to_acc<A>(row.x[i]), rs * g);
    if constexpr (Add) v = round_to<X>(v) + to_acc<A>(row.d_sum[i]);
    row.dx[i] = from_acc<X>(v);
  }
}

#if defined(__AVX512F__)
// bwd_first_block for elements p to p + 31 in the even and odd lanes (kEoBackward; we and dw in those lanes):
// the dot product's sums of the even elements into a0, of the odd ones into a1.
template <bool Add, class X, class Y>
__attribute__((always_inline)) inline void bwd_first_eo(const BwdRow<Add, X, Y>& row, const float* we,
                                                        float rs, float* dw, int64_t p, VF& a0, VF& a1) {
  if constexpr (Add) prefetch(row.d_sum + p);
  fetch_ahead(row.x + p);
  fetch_ahead(row.dy + p);
  VF h[2], d[2], g[2], n[2];
  load_bf16_eo(row.x + p, h[0], h[1]);
  load_bf16_eo(row.dy + p, d[0], d[1]);
  for (int k = 0; k < 2; ++k) {
    g[k] = d[k] * load<float>(we + p + k * kBlock);
    n[k] = h[k] * rs;
  }
  round_bf16_eo_kept(g[0], g[1]);
  round_bf16_eo_kept(n[0], n[1]);
  a0 = madd(g[0], h[0], a0);
  a1 = madd(g[1], h[1], a1);
  for (int k = 0; k < 2; ++k) {
    float* at = dw + p + k * kBlock;
    store(at, madd(d[k], n[k], load<float>(at)));
  }
}
// bwd_second_block for elements p to p + 31 in the even and odd lanes, g computed again from dy.
template <bool Add, bool Stream, class X, class Y>
__attribute__((always_inline)) inline void bwd_second_eo(const BwdRow<Add, X, Y>& row, const float* we,
                                                         float c, float rs, int64_t p) {
  VF h[2], g[2], v[2];
  load_bf16_eo(row.x + p, h[0], h[1]);
  load_bf16_eo(row.dy + p, g[0], g[1]);
  for (int k = 0; k < 2; ++k) g[k] = g[k] * load<float>(we + p + k * kBlock);
  round_bf16_eo_kept(g[0], g[1]);
  for (int k = 0; k < 2; ++k) v[k] = nmadd(VF{} + c, h[k], rs * g[k]);
  if constexpr (Add) {
    VF ds[2];
    round_bf16_eo_kept(v[0], v[1]);
    load_bf16_eo(row.d_sum + p, ds[0], ds[1]);
    for (int k = 0; k < 2; ++k) v[k] = v[k] + ds[k];
  }
  store_bf16_eo<Stream>(row.dx + p, v[0], v[1]);
}
#endif

// The rows one after the other: bf16 below AVX-512 (kPairedBf16), where g is parked in the pairs' lane order
// (store_pair_lanes), and with bf16 x and dy the first pass runs in pairs too (kPairedFirstPass).
template <bool Add, bool Stream, class X, class Y>
void bwd_rows_in_turn(const Y* dy, int64_t dys, const X* d_sum, int64_t d_sum_s, const X* x, int64_t xs,
                      const Acc<X>* w, const Acc<X>* rstd, X* dx, Acc<X>* dw, int64_t r0, int64_t r1,
                      int64_t H) {
  using A = Acc<X>;
  using V = Vec<A>;
  const int64_t Hb = H - H % kBlock;
  const int64_t Hp = H - H % (2 * kBlock);  // the paired blocks' end (kPairedBf16)
  A* grow = row_scratch<A>(H);
  // The first pass in pairs (kPairedFirstPass): the weight and, for the groups of accumulate_pairs, dw in the
  // pairs' lane order for the call (dw swapped back at its end).
  const int64_t Hg = Hb - Hb % (4 * kBlock);
  const A* wp = nullptr;
  if constexpr (kPairedFirstPass<X, Y>) {
    wp = pair_order<X, Y>(w, H);
    swap_row_pair_lanes(dw, Hg);
  }
  for (int64_t r = r0; r < r1; ++r) {
    const BwdRow<Add, X, Y> row{dy + r * dys, Add ? d_sum + r * d_sum_s : nullptr, x + r * xs, dx + r * H};
    const Y* dyr = row.dy;
    const X* dsr = row.d_sum;
    const X* xr = row.x;
    X* dxr = row.dx;
    const A rs = bwd_rstd(rstd[r]);
    const auto step = [&](int64_t i, V& a) {
      const V g = bwd_first_block<Add, X, Y>(row, w, rs, dw, i, a);
      if constexpr (kPairedBf16<X>) {
        if (i < Hp) return store_pair_lanes(grow, i, g);
      }
      store(grow + i, g);
    };
    V acc;
    if constexpr (kPairedFirstPass<X, Y>) {
      acc = accumulate_pairs(
          Hb,
          [&](auto p, VF& a0, VF& a1) {
            if constexpr (Add) prefetch(dsr + p);
            fetch_ahead(xr + p);
            fetch_ahead(dyr + p);
            VF h[2], d[2], g[2];
            load_bf16_pair(xr + p, h[0], h[1]);
            load_bf16_pair(dyr + p, d[0], d[1]);
            for (int k = 0; k < 2; ++k) g[k] = round_grad<X, Y>(d[k] * load<float>(wp + p + k * kBlock));
            a0 = madd(g[0], h[0], a0);
            a1 = madd(g[1], h[1], a1);
            for (int k = 0; k < 2; ++k) {
              float* at = dw + p + k * kBlock;
              store(at, madd(d[k], round_grad<X, Y>(h[k] * rs), load<float>(at)));
              store(grow + p + k * kBlock, g[k]);
            }
          },
          step, [](auto a, auto b, auto& u, auto& v) { swap_pair_lanes(a, b, u, v); });
    } else {
      acc = accumulate_blocks<V>(Hb, step);
    }
    const A dot = bwd_first_tail(row, w, rs, dw, grow, Hb, H, lane_sum(acc));
    const A c = rs * rs * rs * dot / static_cast<A>(H);
    int64_t i = 0;
    if constexpr (kPairedBf16<X>) {
      i = paired_bf16_blocks<X>(Hb, [&](auto p) {
        VF h[2], v[2];
        load_bf16_pair(xr + p, h[0], h[1]);
        for (int k = 0; k < 2; ++k) v[k] = nmadd(VF{} + c, h[k], rs * load<A>(grow + p + k * kBlock));
        if constexpr (Add) {
          VF ds[2];
          load_bf16_pair(dsr + p, ds[0], ds[1]);
          for (int k = 0; k < 2; ++k) v[k] = round_block_arith<X>(v[k]) + ds[k];
        }
        store_bf16_pair<Stream>(dxr + p, v[0], v[1]);
      });
    }
    for (; i < Hb; i += kBlock) bwd_second_block<Add, Stream>(row, load<A>(grow + i), c, rs, i);
    bwd_second_tail(row, grow, w, c, rs, Hb, H);
  }
  if constexpr (kPairedFirstPass<X, Y>) {
    swap_row_pair_lanes(dw, Hg);
  }
}

// The other types' rows pipelined: row r's first pass (from memory) and row r - 1's second (x and dy from
// the cache) block by block in one loop, so that memory sees the reads and the streamed writes at every
// moment, as in a copy, where one row after the other alternated a read phase (x and dy) with a write phase
// (dx). Each row's sums and dw's are taken in the same order as one row after the other: the same bits. On
// an Intel Xeon, fp32 fwd+bwd [4096, 3584] 4-6 % faster from avx2 up (baseline: mixed), the fused add's bf16
// 8-12 % (docs/performance.md, "RMSNorm's backward rows pipelined"). The second pass computes g = round_X(dy
// * w) again instead of reading it from a row buffer the first pass filled: the buffer's stores and its two
// rows (2 x 14 KiB fp32 at H 3584, beside the weight, dw's row and row r - 1's x and dy) cost more than the
// multiply: the fp32 backward 3-10 % faster at every level, bf16 and the fused add's within the noise
// (docs/performance.md, "RMSNorm's backward: g computed again").
template <bool Add, bool Stream, class X, class Y>
void bwd_rows_piped(const Y* dy, int64_t dys, const X* d_sum, int64_t d_sum_s, const X* x, int64_t xs,
                    const Acc<X>* w, const Acc<X>* rstd, X* dx, Acc<X>* dw, int64_t r0, int64_t r1,
                    int64_t H) {
  using A = Acc<X>;
  using V = Vec<A>;
  const int64_t Hb = H - H % kBlock;
  auto row_at = [&](int64_t r) {
    return BwdRow<Add, X, Y>{dy + r * dys, Add ? d_sum + r * d_sum_s : nullptr, x + r * xs, dx + r * H};
  };
  // The even and odd lanes (kEoBackward): the weight and dw's row below accumulate_pairs' groups (Hg) in
  // those lanes for the call, dw put back at its end; the blocks past Hg single, in the row's order.
  [[maybe_unused]] const int64_t Hg = Hb - Hb % (4 * kBlock);
  [[maybe_unused]] const A* we = nullptr;
#if defined(__AVX512F__)
  if constexpr (kEoBackward<X, Y>) {
    we = eo_order(w, Hg);
    eo_row_order(dw, Hg, true);
  }
#endif
  A prev_c = 0, prev_rs = 0;  // row r - 1's second-pass factors
  for (int64_t r = r0; r <= r1; ++r) {
    const bool first = r<r1, second = r> r0;
    const BwdRow<Add, X, Y> prev = row_at(second ? r - 1 : r);
    const A c = prev_c, prev_r = prev_rs;
    if (first) {
      const BwdRow<Add, X, Y> row = row_at(r);
      const A rs = bwd_rstd(rstd[r]);
      const auto step = [&](int64_t i, V& a) {
        bwd_first_block<Add, X, Y>(row, w, rs, dw, i, a);
        if (second) bwd_second_block<Add, Stream>(prev, bwd_grad(prev, w, i), c, prev_r, i);
      };
      V acc;
      if constexpr (kEoBackward<X, Y>) {
#if defined(__AVX512F__)
        acc = accumulate_pairs(
            Hb,
            [&](auto p, VF& a0, VF& a1) {
              bwd_first_eo(row, we, rs, dw, p, a0, a1);
              if (second) bwd_second_eo<Add, Stream>(prev, we, c, prev_r, p);
            },
            step, eo_to_blocks);
#endif
      } else {
        acc = accumulate_blocks<V>(Hb, step);
      }
      const A dot = bwd_first_tail<Add, X, Y, A>(row, w, rs, dw, nullptr, Hb, H, lane_sum(acc));
      prev_c = rs * rs * rs * dot / static_cast<A>(H);
      prev_rs = rs;
    } else if (second) {
      for (int64_t i = 0; i < Hb; i += kBlock)
        bwd_second_block<Add, Stream>(prev, bwd_grad(prev, w, i), c, prev_r, i);
    }
    if (second) bwd_second_tail<Add, X, Y, A>(prev, nullptr, w, c, prev_r, Hb, H);
  }
#if defined(__AVX512F__)
  if constexpr (kEoBackward<X, Y>) eo_row_order(dw, Hg, false);
#endif
}

template <bool Add, bool Stream, class X, class Y>
void bwd_rows(const Y* dy, int64_t dys, const X* d_sum, int64_t d_sum_s, const X* x, int64_t xs,
              const Acc<X>* w, const Acc<X>* rstd, X* dx, Acc<X>* dw, int64_t r0, int64_t r1, int64_t H) {
  if constexpr (kPairedBf16<X>) {
    bwd_rows_in_turn<Add, Stream, X, Y>(dy, dys, d_sum, d_sum_s, x, xs, w, rstd, dx, dw, r0, r1, H);
  } else {
    bwd_rows_piped<Add, Stream, X, Y>(dy, dys, d_sum, d_sum_s, x, xs, w, rstd, dx, dw, r0, r1, H);
  }
}

// Calls f with values of the (x, y) element types; y is x's dtype, float32 or float64 (the promoted dtype of
// x and the weight), which the op checks before calling.
template <class F>
void dispatch_xy(DType xt, DType yt, F&& f) {
  dispatch_dtype(xt, [&](auto x_tag) {
    using X = decltype(x_tag);
    if (yt == DType::kFloat32) return f(X{}, float{});
    if (yt == DType::kFloat64) return f(X{}, double{});
    return f(X{}, X{});
  });
}

// Runs rows(stream_tag) with streaming stores when asked for and every streamed output's rows are aligned.
template <class F>
void maybe_streamed(bool stream, bool aligned, F&& rows) {
  if (stream && aligned) {
    rows(std::true_type{});
    stream_fence();
  } else {
    rows(std::false_type{});
  }
}

}  // namespace

void rms_norm_fwd(DType x_dtype, DType y_dtype, const void* x, int64_t x_stride, const void* w, void* y,
                  void* rstd, int64_t row_begin, int64_t row_end, int64_t H, double eps, bool stream) {
  dispatch_xy(x_dtype, y_dtype, [&](auto x_tag, auto y_tag) {
    using X = decltype(x_tag);
    using Y = decltype(y_tag);
    maybe_streamed(stream, can_stream(static_cast<Y*>(y), H), [&](auto streamed) {
      fwd_rows<false, decltype(streamed)::value, X, Y>(
          static_cast<const X*>(x), x_stride, nullptr, 0, static_cast<const Acc<X>*>(w), static_cast<Y*>(y),
          nullptr, static_cast<Acc<X>*>(rstd), row_begin, row_end, H, eps);
    });
  });
}

void add_rms_norm_fwd(DType x_dtype, DType y_dtype, const void* x, int64_t x_stride, const void* res,
                      int64_t res_stride, const void* w, void* y, void* sum, void* rstd, int64_t row_begin,
                      int64_t row_end, int64_t H, double eps, bool stream) {
  dispatch_xy(x_dtype, y_dtype, [&](auto x_tag, auto y_tag) {
    using X = decltype(x_tag);
    using Y = decltype(y_tag);
    const bool aligned = can_stream(static_cast<Y*>(y), H) && can_stream(static_cast<X*>(sum), H);
    maybe_streamed(stream, aligned, [&](auto streamed) {
      fwd_rows<true, decltype(streamed)::value, X, Y>(
          static_cast<const X*>(x), x_stride, static_cast<const X*>(res), res_stride,
          static_cast<const Acc<X>*>(w), static_cast<Y*>(y), static_cast<X*>(sum), static_cast<Acc<X>*>(rstd),
          row_begin, row_end, H, eps);
    });
  });
}

void rms_norm_bwd(DType x_dtype, DType y_dtype, const void* dy, int64_t dy_stride, const void* x,
                  int64_t x_stride, const void* w, const void* rstd, void* dx, void* dw_acc,
                  int64_t row_begin, int64_t row_end, int64_t H, bool stream) {
  dispatch_xy(x_dtype, y_dtype, [&](auto x_tag, auto y_tag) {
    using X = decltype(x_tag);
    using Y = decltype(y_tag);
    maybe_streamed(stream, can_stream(static_cast<X*>(dx), H), [&](auto streamed) {
      bwd_rows<false, decltype(streamed)::value, X, Y>(
          static_cast<const Y*>(dy), dy_stride, nullptr, 0, static_cast<const X*>(x), x_stride,
          static_cast<const Acc<X>*>(w), static_cast<const Acc<X>*>(rstd), static_cast<X*>(dx),
          static_cast<Acc<X>*>(dw_acc), row_begin, row_end, H);
    });
  });
}

void add_rms_norm_bwd(DType x_dtype, DType y_dtype, const void* dy, int64_t dy_stride, const void* d_sum,
                      int64_t d_sum_stride, const void* s, int64_t s_stride, const void* w, const void* rstd,
                      void* dx, void* dw_acc, int64_t row_begin, int64_t row_end, int64_t H, bool stream) {
  dispatch_xy(x_dtype, y_dtype, [&](auto x_tag, auto y_tag) {
    using X = decltype(x_tag);
    using Y = decltype(y_tag);
    maybe_streamed(stream, can_stream(static_cast<X*>(dx), H), [&](auto streamed) {
      bwd_rows<true, decltype(streamed)::value, X, Y>(
          static_cast<const Y*>(dy), dy_stride, static_cast<const X*>(d_sum), d_sum_stride,
          static_cast<const X*>(s), s_stride, static_cast<const Acc<X>*>(w), static_cast<const Acc<X>*>(rstd),
          static_cast<X*>(dx), static_cast<Acc<X>*>(dw_acc), row_begin, row_end, H);
    });
  });
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
