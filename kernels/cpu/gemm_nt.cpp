// Small-M matrix products in "NT" form for the grouped expert products of the forward pass, both operands
// K-contiguous (nn.Linear layout). Compiled once per instruction-set level.
//
// AVX-512 levels, fp32 and bf16 (bf16 on the tiles at amx): the quads form (below): A's rows packed as quads
// of 4 rows x 4 K elements per 512-bit register, B's rows streamed once, 4 elements at a time broadcast
// against every quad; each row summed in one order whatever the group's size.
//
// AVX2: the transposed ("lanes") form. A's rows (a small group, at most 16 per pass with AVX2's 16 vector
// registers) are packed once per call into a lane layout, 8 rows per 256-bit register; B's rows are streamed
// once, front to back, each element broadcast against all the group's rows: accumulators hold C^T[n, 8 rows],
// fed by one FMA (fp32; bf16 widened a line at a time) per B element and 8-row group. Each weight byte is
// read once from memory, with software prefetch ahead; A stays in cache. amx: bf16 on the tiles. Other
// levels, dtypes and float64: dot products along K in register blocks.
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/cpu/amx.h"
#include "kernels/cpu/cache.h"
#include "kernels/cpu/lanes.h"
#include "kernels/cpu/vec.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {
namespace {

// The dot-product blocks' MR x NR accumulators, plus MR vectors of A and NR of B, fit the level's vector
// registers (an accumulator that spills costs a load and a store per FMA): 4 x 4 + 8 = 24 of AVX-512's 32,
// 3 x 3 + 6 = 15 of the 16 below it. One measured exception: 16-bit elements at baseline, whose 4 x 4 block
// ran faster spilled than the 3 x 3 one, which widens more loads per product (docs/performance.md, "gemm_nt
// lanes form").
#if defined(__AVX512F__)
template <class T>
inline constexpr int kMr = 4;
#elif defined(__AVX2__)
template <class T>
inline constexpr int kMr = 3;
#else
template <class T>
inline constexpr int kMr = sizeof(T) == 2 ? 4 : 3;
#endif
template <class T>
inline constexpr int kNr = kMr<T>;

// Scalar math: C[m, n] = round(sum_k float(A[m, k]) * float(B[n, k]))
template <class T, int MR, int NR>
void block(const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t K) {
  using Ac = Acc<T>;
  using V = Vec<Ac>;
  V acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = V{};
  const int64_t Kb = K - K % kBlock;
  for (int64_t k = 0; k < Kb; k += kBlock) {
    V a[MR];
    for (int i = 0; i < MR; ++i) a[i] = load<Ac>(A + i * lda + k);
    // Each vector of B loaded where it is used: one register for B, not NR (GCC keeps the source order).
    for (int j = 0; j < NR; ++j) {
      const V b = load<Ac>(B + j * ldb + k);
      for (int i = 0; i < MR; ++i) acc[i][j] += a[i] * b;
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      Ac s = lane_sum(acc[i][j]);
      for (int64_t k = Kb; k < K; ++k) s += to_acc<Ac>(A[i * lda + k]) * to_acc<Ac>(B[j * ldb + k]);
      C[i * ldc + j] = from_acc<T>(s);
    }
}

template <class T, int MR, int NR>
void any_block(const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t K) {
  block<T, MR, NR>(A, lda, B, ldb, C, ldc, K);
}

// Edge blocks (fewer than kMr rows or kNr columns left) go through narrower blocks.
template <class T>
void gemm(const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t M, int64_t N,
          int64_t K) {
  constexpr int MR = kMr<T>, NR = kNr<T>;
  const int64_t Mb = M - M % MR, Nb = N - N % NR;
  for (int64_t n = 0; n < Nb; n += NR) {
    for (int64_t m = 0; m < Mb; m += MR)
      any_block<T, MR, NR>(A + m * lda, lda, B + n * ldb, ldb, C + m * ldc + n, ldc, K);
    for (int64_t m = Mb; m < M; ++m)
      any_block<T, 1, NR>(A + m * lda, lda, B + n * ldb, ldb, C + m * ldc + n, ldc, K);
  }
  for (int64_t n = Nb; n < N; ++n)
    for (int64_t m = 0; m < M; ++m)
      any_block<T, 1, 1>(A + m * lda, lda, B + n * ldb, ldb, C + m * ldc + n, ldc, K);
}

#if defined(__AVX2__)
// ---- The lanes form -------------------------------------------------------------------------------------

// Lane registers: 8 rows of A per ymm accumulator (the AVX2 level; the AVX-512 levels run the quads form
// below).
struct Ymm {
  using V = __m256;
  static constexpr int kWidth = 8, kCols = 6;  // kBlockCols below
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_load_ps(p); }
  static V bcast(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static void store(float* p, V v) { _mm256_store_ps(p, v); }
};
// Rows of A per pass over B: the block's kCols x G accumulators, G vectors of A and one broadcast fit the
// level's vector registers: ymm 6 x 4 + 5 = 29 of AVX-512's 32 (32 rows), 6 x 2 + 3 = 15 of AVX2's 16 (16
// rows). A larger group makes a second pass, over B rows the first left in L2.
#if defined(__AVX512F__)
constexpr int kRows = 32, kVectorRegisters = 32;
#else
constexpr int kRows = 16, kVectorRegisters = 16;
#endif
// The rows past the last whole 8-row group that go to the dot-product blocks (kDotRows).
constexpr int kTailLanes = 8;
// Prefetch: each B row kPrefetchBytes ahead into L1, and the same position of the block below (the next
// block, whose rows begin on fresh pages the hardware prefetchers have not seen) into L2 — the latter where
// fetch_next_block says (kernels/cpu/cache.h). Where the L2 streamer's stream count is known
// (prefetch_streams, kernels/cpu/cache.h; Intel: 32) it follows a block's kBlockCols rows of more than a page
// on its own, and the software fetches beside it made the fp32 forward slower: gate_up at 16 rows a group, 2
// threads, an Intel Xeon, avx512 87.2 -> 74.9 ms without them, avx2 106.0 -> 93.8 (docs/performance.md,
// "Reduction blocks within the L2 streamer's streams").
constexpr int kPrefetchBytes = 256;

// The blocks fetch the next block of B's rows into L2 where fetch_next_block (kernels/cpu/cache.h) says:
// down_proj's forward, rows of 768, avx512 bf16 35.8 ms fetched against 44.1 not, avx2 fp32 58.0
// against 67.4.

// B rows per block: 6 streams. B rows of power-of-two length fall into the same L1 set (K = 2048 fp32: 8 KiB
// apart), so more rows than the set has ways evict each other's lines before they are used up
// (docs/performance.md, "gemm_nt lanes form"). With G row groups, 6G accumulators.
constexpr int kBlockCols = 6;

// A per-thread buffer of at least `bytes`, 64-byte aligned, kept between calls.
template <int Slot>
void* scratch(size_t bytes) {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  static thread_local std::unique_ptr<void, Free> buf;
  static thread_local size_t size = 0;
  if (bytes > size) {
    size = (bytes + 4095) / 4096 * 4096;
    buf.reset(std::aligned_alloc(64, size));
    if (!buf) std::abort();
  }
  return buf.get();
}

// Calls f(std::integral_constant<int, i>) for i = 0 .. S-1, unrolled.
template <class F, size_t... I>
inline void unroll_impl(F&& f, std::index_sequence<I...>) {
  (f(std::integral_constant<int, static_cast<int>(I)>{}), ...);
}
template <int S, class F>
inline void unroll(F&& f) {
  unroll_impl(f, std::make_index_sequence<S>{});
}

// The block loop shared by both element kinds: S sets of NB x G accumulators (S > 1 where NB x G alone would
// leave the FMA / dot-product pipes waiting on latency); step s of each 16 uses set s % S, the remainder set
// 0; the sets are added in order at the end, so every result has a fixed summation order. `depth` steps in
// all; each step reads one element (fp32) or pair (bf16) of every B row — 16 steps are one 64-byte line.
template <class R, int G, int NB, int S, class Step, class Last>
void lanes_loop(int64_t depth, const char* const* rows, int64_t row_bytes, int64_t line_step, Step step,
                Last last, float* out, bool fetch_next) {
  using V = typename R::V;
  V acc[S][NB][G];
  for (int s = 0; s < S; ++s)
    for (int j = 0; j < NB; ++j)
      for (int g = 0; g < G; ++g) acc[s][j][g] = R::zero();
  int64_t d = 0;
  // The next block: when B's rows are contiguous, its NB rows are one run of memory, fetched front to back
  // (NB lines a step) — one stream for the memory controller instead of NB (docs/performance.md, "gemm_nt
  // lanes form"); else each row at this step's position.
  const char* next = rows[0] + NB * row_bytes;
  const bool linear = depth * line_step == row_bytes;
  for (; d + 16 <= depth; d += 16) {
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(rows[j] + d * line_step + kPrefetchBytes, _MM_HINT_T0);
      if (fetch_next)
        _mm_prefetch(linear ? next + (d / 16 * NB + j) * 64 : rows[j] + NB * row_bytes + d * line_step,
                     _MM_HINT_T1);
    }
    for (int dd = 0; dd < 16; dd += S) unroll<S>([&](auto s) { step(d + dd + s, acc[s]); });
  }
  for (; d < depth; ++d) step(d, acc[0]);
  last(acc[0]);
  for (int s = 1; s < S; ++s)
    for (int j = 0; j < NB; ++j)
      for (int g = 0; g < G; ++g) acc[0][j][g] = R::add(acc[0][j][g], acc[s][j][g]);
  for (int j = 0; j < NB; ++j)
    for (int g = 0; g < G; ++g) R::store(out + (j * G + g) * R::kWidth, acc[0][j][g]);
}

// One step k of a lanes block: the G vectors of A's lanes at k, each weight b(j) broadcast against them.
template <class R, int G, int NB, class B>
__attribute__((always_inline)) inline void lanes_step(const float* P, int64_t k, typename R::V (&acc)[NB][G],
                                                      B b) {
  typename R::V a[G];
  for (int g = 0; g < G; ++g) a[g] = R::load(P + (k * G + g) * R::kWidth);
  for (int j = 0; j < NB; ++j) {
    const typename R::V bj = R::bcast(b(j));
    for (int g = 0; g < G; ++g) acc[j][g] = R::fma(a[g], bj, acc[j][g]);
  }
}

#if !defined(__AVX512F__)
// fp32 block: out[j][8g + l] = sum_k P[k][8g + l] * W[j][k]. Not inlined: inlined into lanes_rows' many
// instantiations, GCC 12 kept the accumulators in memory, a store of each one per step.
template <class R, int G, int NB, int S>
__attribute__((noinline)) void lanes_block(const float* P, const float* W, int64_t ldw, int64_t K, float* out,
                                           bool fetch_next) {
  using V = typename R::V;
  const float* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = W + j * ldw;
  auto step = [&](int64_t k, V(&acc)[NB][G]) {
    lanes_step<R, G, NB>(P, k, acc, [&](int j) { return w[j][k]; });
  };
  lanes_loop<R, G, NB, S>(
      K, reinterpret_cast<const char* const*>(w), ldw * 4, 4, step, [](V(&)[NB][G]) {}, out, fetch_next);
}

// bf16 weights without the dot-product instruction: each line of a B row (16 steps) is widened to fp32 once
// into a small buffer that stays in L1, and each step broadcasts its element from there as the fp32 block
// broadcasts from B itself — one widening per 16 elements instead of a shuffle per broadcast (the port the
// FMAs share). The next line is widened while this one is multiplied (two buffers): loads right behind the
// stores that fill them ran slower (docs/performance.md, "gemm_nt lanes form"). Sets and sums as lanes_loop:
// step k of each 16 uses set k % S, the steps past the last whole line set 0. Written out, not through
// lanes_loop's lambdas (GCC spilled accumulators there, as for the fp32 zmm loop).
template <class R, int G, int NB, int S>
__attribute__((noinline)) void lanes_block(const float* P, const BFloat16* W, int64_t ldw, int64_t K,
                                           float* out, bool fetch_next) {
  using V = typename R::V;
  const BFloat16* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = W + j * ldw;
  V acc[S][NB][G];
  for (int s = 0; s < S; ++s)
    for (int j = 0; j < NB; ++j)
      for (int g = 0; g < G; ++g) acc[s][j][g] = R::zero();
  alignas(64) float wide[2][NB][16];
  // The next block's rows, one run of memory when B's rows are contiguous (lanes_loop's rule).
  const char* next = reinterpret_cast<const char*>(W + NB * ldw);
  const bool linear = ldw == K;
  auto widen_line = [&](int64_t k0, float(&dst)[NB][16]) {
    for (int j = 0; j < NB; ++j) {
      if (k0 % 32 == 0) {  // once a line of B
        _mm_prefetch(reinterpret_cast<const char*>(w[j] + k0) + kPrefetchBytes, _MM_HINT_T0);
        if (fetch_next)
          _mm_prefetch(
              linear ? next + (k0 / 32 * NB + j) * 64 : reinterpret_cast<const char*>(w[j] + NB * ldw + k0),
              _MM_HINT_T1);
      }
      for (int h = 0; h < 16; h += kBlock) store_native(dst[j] + h, load_native(w[j] + k0 + h));
    }
  };
  const int64_t K16 = K - K % 16;
  if (K16 > 0) widen_line(0, wide[0]);
  for (int64_t k0 = 0; k0 < K16; k0 += 16) {
    const int cur = static_cast<int>(k0 / 16 % 2);
    if (k0 + 16 < K16) widen_line(k0 + 16, wide[1 - cur]);
    for (int dd = 0; dd < 16; dd += S)
      for (int s = 0; s < S; ++s)
        lanes_step<R, G, NB>(P, k0 + dd + s, acc[s], [&](int j) { return wide[cur][j][dd + s]; });
  }
  for (int64_t k = K16; k < K; ++k)
    lanes_step<R, G, NB>(P, k, acc[0], [&](int j) { return to_float(w[j][k]); });
  for (int s = 1; s < S; ++s)
    for (int j = 0; j < NB; ++j)
      for (int g = 0; g < G; ++g) acc[0][j][g] = R::add(acc[0][j][g], acc[s][j][g]);
  for (int j = 0; j < NB; ++j)
    for (int g = 0; g < G; ++g) R::store(out + (j * G + g) * R::kWidth, acc[0][j][g]);
}
#endif

template <class R, int G, int S, class P, class WT, class T>
void lanes_rows(const P* packed, const WT* W, int64_t ldw, int64_t K, int64_t rows, int64_t cols, T* C,
                int64_t ldc, bool fetch_next) {
  alignas(64) float out[R::kCols * G * R::kWidth];
  int64_t n = 0;
  auto run = [&](auto nb) {
    constexpr int NB = decltype(nb)::value;
    for (; n + NB <= cols; n += NB) {
      lanes_block<R, G, NB, S>(packed, W + n * ldw, ldw, K, out, fetch_next);
      for (int64_t r = 0; r < rows; ++r)
        for (int j = 0; j < NB; ++j) C[r * ldc + n + j] = from_acc<T>(out[j * G * R::kWidth + r]);
    }
  };
  run(std::integral_constant<int, R::kCols>{});
  run(std::integral_constant<int, 4>{});
  run(std::integral_constant<int, 2>{});
  run(std::integral_constant<int, 1>{});
}

template <class R, class P, class WT, class T>
void lanes_rows_any(const P* packed, const WT* W, int64_t ldw, int64_t K, int64_t rows, int64_t cols, T* C,
                    int64_t ldc, bool fetch_next) {
  const int G = static_cast<int>((rows + R::kWidth - 1) / R::kWidth);
  if (rows <= 8) return lanes_rows<R, 1, 2>(packed, W, ldw, K, rows, cols, C, ldc, fetch_next);
  if (G <= 1) return lanes_rows<R, 1, 1>(packed, W, ldw, K, rows, cols, C, ldc, fetch_next);
  if constexpr (kRows / R::kWidth == 2) {
    return lanes_rows<R, 2, 1>(packed, W, ldw, K, rows, cols, C, ldc, fetch_next);
  } else {
    switch (G) {
      case 2:
        return lanes_rows<R, 2, 1>(packed, W, ldw, K, rows, cols, C, ldc, fetch_next);
      case 3:
        return lanes_rows<R, 3, 1>(packed, W, ldw, K, rows, cols, C, ldc, fetch_next);
      default:
        return lanes_rows<R, 4, 1>(packed, W, ldw, K, rows, cols, C, ldc, fetch_next);
    }
  }
}

// Rows [r0, r0 + rows) of A packed as [k][L] floats, L = 8G lanes, the padding lanes zero.
template <class T>
void pack_rows(const T* A, int64_t lda, int64_t rows, int64_t L, int64_t K, float* P) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t r = rows; r < L; ++r) P[k * L + r] = 0.0f;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) P[k * L + r] = to_float(A[r * lda + k]);
}
// Dot-product blocks for the last `R` rows (A rows At, stride ldt) over `cols` columns of W.
template <class T, int R>
void dot_rows(const T* At, int64_t ldt, const T* W, int64_t ldw, T* C, int64_t ldc, int64_t cols, int64_t K) {
  int64_t n = 0;
  auto run = [&](auto nb) {
    constexpr int NB = decltype(nb)::value;
    for (; n + NB <= cols; n += NB) any_block<T, R, NB>(At, ldt, W + n * ldw, ldw, C + n, ldc, K);
  };
  // R x NB accumulators, R vectors of A and one of B within the level's vector registers (an accumulator
  // that spills costs a load and a store per FMA): 3 x 6 + 4 = 22 of AVX-512's 32; below it 2 x 6 + 3 = 15,
  // and 3 rows over 4 columns, 3 x 4 + 4 = 16 of 16.
  if constexpr (R * kBlockCols + R + 1 <= kVectorRegisters) run(std::integral_constant<int, kBlockCols>{});
  run(std::integral_constant<int, 4>{});
  run(std::integral_constant<int, 2>{});
  run(std::integral_constant<int, 1>{});
}

// C = A B^T through the lanes form, fp32 or bf16, B read in place. Rows in 8-row groups: a group
// costs the same whatever its rows, so where M leaves 1 to kDotRows rows over, those go through the
// dot-product blocks instead, right after the lanes blocks have brought the same B rows into cache (a group
// of 1 to 3 rows streams them itself; a dot-product row costs an eighth of an 8-row group's FMAs per weight
// element). Four dot-product rows spill registers and run slower than a lane group (docs/performance.md,
// "gemm_nt lanes form").
constexpr int64_t kDotRows = 3;

// The rows of M left to the dot-product blocks. Below AVX-512, two or three only where they would make a
// pass over B of their own (M % kRows: 2, 3, 18, 19 rows), not where they fill the second register of a pass
// the other rows make anyway (10, 11 rows: no faster as dot-product rows, bf16 slower; docs/performance.md,
// "gemm_nt lanes form").
inline int64_t dot_tail(int64_t M) {
  const int64_t t = M % kTailLanes;
  if (t == 0 || t > kDotRows) return 0;
#if !defined(__AVX512F__)
  if (t > 1 && M % kRows != t) return 0;
#endif
  return t;
}

template <class R, class T>
void lanes_gemm_in(const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t M, int64_t N,
                   int64_t K) {
  if (M <= 0 || N <= 0) return;
  const bool fetch_next = fetch_next_block(K * int64_t(sizeof(T)));
  constexpr int64_t kW = R::kWidth;
  const int64_t tail = dot_tail(M);
  const int64_t Ml = M - tail;  // rows through the lanes form
  const int64_t chunks = (Ml + kRows - 1) / kRows;
  // Chunk c covers rows [c * kRows, ...) in ceil(rows / 8) groups, packed one after another.
  std::vector<int64_t> at(chunks + 1, 0);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t rows = std::min<int64_t>(kRows, Ml - c * kRows);
    at[c + 1] = at[c] + K * ((rows + kW - 1) / kW) * kW;
  }
  float* packed = static_cast<float*>(scratch<0>(std::max<int64_t>(1, at[chunks]) * sizeof(float)));
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t rows = std::min<int64_t>(kRows, Ml - c * kRows),
                  L = (at[c + 1] - at[c]) / std::max<int64_t>(1, K);
    pack_rows(A + c * kRows * lda, lda, rows, L, K, packed + at[c]);
  }
  auto pass = [&](const auto* W, int64_t ldw, int64_t n0, int64_t cols) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t rows = std::min<int64_t>(kRows, Ml - c * kRows);
      lanes_rows_any<R>(packed + at[c], W, ldw, K, rows, cols, C + c * kRows * ldc + n0, ldc, fetch_next);
    }
  };
  // The dot-product rows, copied one 64-byte line apart (rows of a power-of-two length would share the L1
  // set of the B rows).
  const int64_t ldt = (K + 63) / 64 * 64 + 64 / static_cast<int64_t>(sizeof(T));
  T* At = static_cast<T*>(scratch<2>(std::max<int64_t>(1, tail * ldt) * sizeof(T)));
  for (int64_t r = 0; r < tail; ++r) std::memcpy(At + r * ldt, A + (Ml + r) * lda, K * sizeof(T));
  T* Ct = C + Ml * ldc;
  for (int64_t n0 = 0; n0 < N; n0 += R::kCols) {
    const int64_t cols = std::min<int64_t>(R::kCols, N - n0);
    const T* W = B + n0 * ldb;
    pass(W, ldb, n0, cols);
    if (tail == 1) dot_rows<T, 1>(At, ldt, W, ldb, Ct + n0, ldc, cols, K);
    if (tail == 2) dot_rows<T, 2>(At, ldt, W, ldb, Ct + n0, ldc, cols, K);
    if (tail == 3) dot_rows<T, 3>(At, ldt, W, ldb, Ct + n0, ldc, cols, K);
  }
}
#if defined(__AVX512F__)
// ---- The quads form (AVX-512 levels: fp32, and bf16 without the dot-product instruction) ------------------
//
// A 512-bit register holds a quad: 4 rows of A by 4 consecutive elements of K, lane 4i + j holding row i's
// products at k = j (mod 4). A step broadcasts 4 elements of a B row to all four 128-bit parts (one load,
// vbroadcastf32x4) and multiplies each quad of the pass by them: Q quads x NB B rows of accumulators. At the
// end each row's 4 lanes are added, (s0 + s1) + (s2 + s3). Against the row lanes (a register of 16 rows
// against one broadcast element): a group uses registers 4 rows at a time instead of 16 (20 rows cost 5
// quads, not 2 registers, one of them a quarter full), and an FMA needs (Q + NB) / (Q NB) loads, not 1 +
// 1/NB. Every row is summed in one order whatever the group's size, pass or register block: a row's result
// has the same bits as the row alone (docs/performance.md, "gemm_nt quads form").
constexpr int64_t kQuadRows = 4;
// At most 6 quads (24 rows) a pass: past it the register block leaves 3 B rows (7 quads) or 2 (8), and
// reading A's quads that much more often made the pass slower than two (docs/performance.md, "gemm_nt quads
// form"). A larger group makes more passes, as even as quads allow, over B rows the first left in L2.
constexpr int kMaxQuads = 6;
// B rows per block: 8 chains where Q alone gives too few to cover the FMA latency, then as many as the 32
// registers allow beside Q vectors of A, the broadcast and (bf16) the widening's index and line: 4 x 6 + 8,
// 6 x 4 + 9 of 32.
constexpr int quad_cols(int Q) {
  return Q <= 2 ? 8 : Q <= 4 ? 6 : 4;
}

// Rows [0, rows) of A (at most 4Q) as Q quads per step: P[(s Q + q) 16 + 4i + j] = A[4q + i][4s + j], zero
// past K and past the rows.
template <class T>
void pack_quads(const T* A, int64_t lda, int64_t rows, int Q, int64_t K, float* P) {
  const int64_t steps = (K + kQuadRows - 1) / kQuadRows;
  std::fill(P, P + steps * Q * 16, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float* p = P + r / kQuadRows * 16 + r % kQuadRows * kQuadRows;
    for (int64_t k = 0; k < K; ++k) p[k / kQuadRows * Q * 16 + k % kQuadRows] = to_float(A[r * lda + k]);
  }
}

// One step: every quad of P times each of the NB broadcasts b(j).
template <int Q, int NB, class B>
__attribute__((always_inline)) inline void quad_step(const float* P, __m512 (&acc)[NB][Q], B b) {
  __m512 a[Q];
  for (int q = 0; q < Q; ++q) a[q] = _mm512_load_ps(P + q * 16);
  for (int j = 0; j < NB; ++j) {
    const __m512 bj = b(j);
    for (int q = 0; q < Q; ++q) acc[j][q] = _mm512_fmadd_ps(a[q], bj, acc[j][q]);
  }
}

// out[(j Q + q) 16 + 4i] = row 4q + i's sum against B row j: its four lanes, (s0 + s1) + (s2 + s3). Whole
// registers stored, in loops GCC unrolls completely (a loop it kept made the accumulators an array in memory,
// stored every step).
template <int Q, int NB>
__attribute__((always_inline)) inline void quad_sums(__m512 (&acc)[NB][Q], float* out) {
#pragma GCC unroll 64
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 8
    for (int q = 0; q < Q; ++q) {
      __m512 s = _mm512_add_ps(acc[j][q], _mm512_shuffle_ps(acc[j][q], acc[j][q], 0xB1));  // s0+s1, s2+s3
      s = _mm512_add_ps(s, _mm512_shuffle_ps(s, s, 0x4E));                                 // + the other pair
      _mm512_store_ps(out + (j * Q + q) * 16, s);
    }
}

// Prefetch for the quads blocks, once per 64-byte line of the B rows: each row kPrefetchBytes ahead into L1,
// and the same position of the next block into L2, its rows as one run when they are contiguous (lanes_loop's
// rule).
template <int NB, class WT>
__attribute__((always_inline)) inline void prefetch_line(WT* const* w, int64_t k, int64_t ldw, int64_t K,
                                                         const char* next) {
  const bool linear = ldw == K;
  const int64_t line = k * static_cast<int64_t>(sizeof(WT)) / 64;
  for (int j = 0; j < NB; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(w[j] + k) + kPrefetchBytes, _MM_HINT_T0);
    if (next)
      _mm_prefetch(linear ? next + (line * NB + j) * 64 : reinterpret_cast<const char*>(w[j] + NB * ldw + k),
                   _MM_HINT_T1);
  }
}

// fp32 block: 4 elements of each B row a step, read in place; the last step of an odd K reads only the
// elements before K (masked: the next row's, or memory past B, never enter a product).
template <int Q, int NB>
__attribute__((noinline)) void quad_block(const float* P, const float* W, int64_t ldw, int64_t K, float* out,
                                          bool fetch_next) {
  __m512 acc[NB][Q];
  for (int j = 0; j < NB; ++j)
    for (int q = 0; q < Q; ++q) acc[j][q] = _mm512_setzero_ps();
  const float* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = W + j * ldw;
  const char* next = fetch_next ? reinterpret_cast<const char*>(W + NB * ldw) : nullptr;
  const int64_t K4 = K - K % kQuadRows;
  int64_t k = 0;
  for (; k < K4; k += kQuadRows, P += Q * 16) {
    if (k % 16 == 0) prefetch_line<NB>(w, k, ldw, K, next);
    quad_step<Q, NB>(P, acc, [&](int j) { return _mm512_broadcast_f32x4(_mm_loadu_ps(w[j] + k)); });
  }
  if (k < K) {
    const __mmask8 m = static_cast<__mmask8>((1u << (K - k)) - 1);
    quad_step<Q, NB>(P, acc, [&](int j) { return _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(m, w[j] + k)); });
  }
  quad_sums<Q, NB>(acc, out);
}

// Elements [k0, k0 + 16) of each B row widened to fp32 into dst[j], zeros past K (a masked load: nothing
// past a row's end is read).
template <int NB>
__attribute__((always_inline)) inline void widen_lines(const BFloat16* const* w, int64_t k0, int64_t K,
                                                       float (&dst)[NB][16]) {
  const int64_t left = K - k0;
  if (left >= 16) {
    for (int j = 0; j < NB; ++j) _mm512_store_ps(dst[j], load_native(w[j] + k0));
  } else {
    const __mmask16 m = static_cast<__mmask16>((1u << left) - 1);
    for (int j = 0; j < NB; ++j) _mm512_store_ps(dst[j], widen_bf16(_mm256_maskz_loadu_epi16(m, w[j] + k0)));
  }
}

// bf16 block: each line of 16 elements of a B row widened to fp32 once into a buffer that stays in L1 (the
// next line while this one is multiplied), the steps broadcasting from there (the lanes form's widening,
// above).
template <int Q, int NB>
__attribute__((noinline)) void quad_block(const float* P, const BFloat16* W, int64_t ldw, int64_t K,
                                          float* out, bool fetch_next) {
  __m512 acc[NB][Q];
  for (int j = 0; j < NB; ++j)
    for (int q = 0; q < Q; ++q) acc[j][q] = _mm512_setzero_ps();
  const BFloat16* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = W + j * ldw;
  const char* next = fetch_next ? reinterpret_cast<const char*>(W + NB * ldw) : nullptr;
  alignas(64) float wide[2][NB][16];
  const int64_t K16 = K - K % 16;
  if (K > 0) widen_lines<NB>(w, 0, K, wide[0]);
  for (int64_t k0 = 0; k0 < K16; k0 += 16, P += 4 * Q * 16) {
    const int cur = static_cast<int>(k0 / 16 % 2);
    if (k0 % 32 == 0) prefetch_line<NB>(w, k0, ldw, K, next);
    if (k0 + 16 < K) widen_lines<NB>(w, k0 + 16, K, wide[1 - cur]);
    for (int d = 0; d < 16; d += kQuadRows)
      quad_step<Q, NB>(P + d * Q * 4, acc,
                       [&](int j) { return _mm512_broadcast_f32x4(_mm_load_ps(&wide[cur][j][d])); });
  }
  // The last, partial line (widened by the loop's last step, or above).
  for (int64_t d = 0; d < K - K16; d += kQuadRows, P += Q * 16)
    quad_step<Q, NB>(P, acc,
                     [&](int j) { return _mm512_broadcast_f32x4(_mm_load_ps(&wide[K16 / 16 % 2][j][d])); });
  quad_sums<Q, NB>(acc, out);
}

// `cols` columns of C for the pass's rows, in blocks of quad_cols(Q) B rows, then 4, 2, 1.
template <int Q, class WT, class T>
void quad_rows(const float* P, const WT* W, int64_t ldw, int64_t K, int64_t rows, int64_t cols, T* C,
               int64_t ldc, bool fetch_next) {
  alignas(64) float out[8 * Q * 16];
  int64_t n = 0;
  auto run = [&](auto nb) {
    constexpr int NB = decltype(nb)::value;
    if constexpr (NB <= quad_cols(Q)) {
      for (; n + NB <= cols; n += NB) {
        quad_block<Q, NB>(P, W + n * ldw, ldw, K, out, fetch_next);
        for (int64_t r = 0; r < rows; ++r)
          for (int j = 0; j < NB; ++j)
            C[r * ldc + n + j] = from_acc<T>(out[(j * Q + r / 4) * 16 + r % 4 * 4]);
      }
    }
  };
  run(std::integral_constant<int, quad_cols(Q)>{});
  run(std::integral_constant<int, 4>{});
  run(std::integral_constant<int, 2>{});
  run(std::integral_constant<int, 1>{});
}

template <class WT, class T>
void quad_rows_any(int Q, const float* P, const WT* W, int64_t ldw, int64_t K, int64_t rows, int64_t cols,
                   T* C, int64_t ldc, bool fetch_next) {
  switch (Q) {
    case 1:
      return quad_rows<1>(P, W, ldw, K, rows, cols, C, ldc, fetch_next);
    case 2:
      return quad_rows<2>(P, W, ldw, K, rows, cols, C, ldc, fetch_next);
    case 3:
      return quad_rows<3>(P, W, ldw, K, rows, cols, C, ldc, fetch_next);
    case 4:
      return quad_rows<4>(P, W, ldw, K, rows, cols, C, ldc, fetch_next);
    case 5:
      return quad_rows<5>(P, W, ldw, K, rows, cols, C, ldc, fetch_next);
    default:
      return quad_rows<6>(P, W, ldw, K, rows, cols, C, ldc, fetch_next);
  }
}

// C = A B^T through the quads form, B read in place.
template <class T>
void quad_gemm(const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t M, int64_t N,
               int64_t K) {
  if (M <= 0 || N <= 0) return;
  const bool fetch_next = fetch_next_block(K * int64_t(sizeof(T)));
  const int64_t quads = (M + kQuadRows - 1) / kQuadRows, passes = (quads + kMaxQuads - 1) / kMaxQuads;
  const int64_t steps = (K + kQuadRows - 1) / kQuadRows;
  // Pass p: quads / passes quads, one more for the first quads % passes; packed one after another.
  std::vector<int64_t> row0(passes + 1, 0);
  for (int64_t p = 0; p < passes; ++p)
    row0[p + 1] = std::min(M, row0[p] + kQuadRows * (quads / passes + (p < quads % passes ? 1 : 0)));
  auto* packed = static_cast<float*>(scratch<0>(std::max<int64_t>(1, quads * steps * 16) * sizeof(float)));
  auto quads_of = [&](int64_t p) {
    return static_cast<int>((row0[p + 1] - row0[p] + kQuadRows - 1) / kQuadRows);
  };
  auto packed_of = [&](int64_t p) { return packed + row0[p] / kQuadRows * steps * 16; };
  for (int64_t p = 0; p < passes; ++p)
    pack_quads(A + row0[p] * lda, lda, row0[p + 1] - row0[p], quads_of(p), K, packed_of(p));
  // More than one pass: each block of B rows (the narrowest of the passes' blocks) is taken by every pass in
  // turn, the later passes reading it from L1. (Groups of 25-32 rows still run slower than the row lanes'
  // single pass did: docs/performance.md, "gemm_nt quads form".)
  int64_t step = N;
  if (passes > 1)
    for (int64_t p = 0; p < passes; ++p) step = std::min<int64_t>(step, quad_cols(quads_of(p)));
  for (int64_t n0 = 0; n0 < N; n0 += step) {
    const int64_t cols = std::min<int64_t>(step, N - n0);
    for (int64_t p = 0; p < passes; ++p)
      quad_rows_any(quads_of(p), packed_of(p), B + n0 * ldb, ldb, K, row0[p + 1] - row0[p], cols,
                    C + row0[p] * ldc + n0, ldc, fetch_next);
  }
}
#endif

// C = A B^T, fp32 or bf16: the quads form at the AVX-512 levels, bf16 included at avx512bf16 (its weights
// widened to fp32, as at avx512: twice the speed of the vdpbf16ps pairs in ymm lanes on xeon-amx-vm, and
// ahead of them on Zen 4 in every table since 2026-12-03; docs/performance.md, "gemm_nt at avx512bf16"); the
// lanes form at avx2.
template <class T>
void lanes_gemm(const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t M, int64_t N,
                int64_t K) {
#if defined(__AVX512F__)
  quad_gemm<T>(A, lda, B, ldb, C, ldc, M, N, K);
#else
  lanes_gemm_in<Ymm>(A, lda, B, ldb, C, ldc, M, N, K);
#endif
}
#endif

#if defined(__AMX_BF16__)
// ---- AMX tiles (the amx level, bf16; kernels/cpu/amx.h) --------------------------------------------------
//
// The weights go in A's place: 16 rows of W, 32 elements of K each, are one tile load straight from memory
// (the rows are K-contiguous, which is what A wants). The activations go in B's place: their pairs packed
// once per call, 16 rows a group (the lanes form's pair packing with 16 lanes). Each tile is then C^T[16
// weight rows, 16 activation rows].
//
// Two register plans: one group of activation rows (M <= 16, the common MoE group) runs 3 weight blocks a
// pass (accumulators tmm0-2, weights tmm3-5, activations tmm6); more rows run 2 weight blocks against 2
// groups a pass (accumulators tmm0-3, weights tmm4-5, activations tmm6-7), the groups in pairs, so a weight
// block is loaded once per pair. Blocks a pass does not have (the last pass's) and a missing second group are
// zeros, read with a zero stride: the tile units have several times the throughput that streaming the weights
// from memory needs. No software prefetch: the hardware's alone streamed the weights faster than with
// prefetches of the next pass into L2 or of each row ahead (docs/performance.md, "AMX tiles").

// 16 rows of a weight block: row i at p + i * ld (ld = 0: the same zero row 16 times).
struct Block {
  const BFloat16* p;
  int64_t ld;
};

// The last, partial step of K: each block's 16 row ends copied into a zero-padded tile, so that no load reads
// past a row (into the next row, whose bits could be Inf or NaN against a zero pair) or past the end of B.
// Sets `out` to the blocks of the step at k0 and `k` to the column their tiles start at: w and k0, or (the
// partial step) the copies and 0.
template <int NB>
inline void step_blocks(const Block (&w)[NB], int64_t k0, int64_t K, BFloat16* buf, Block (&out)[NB],
                        int64_t& k) {
  k = k0;
  for (int j = 0; j < NB; ++j) out[j] = w[j];
  if (k0 + kTileK <= K) return;
  std::memset(buf, 0, NB * kTileRows * kTileK * sizeof(BFloat16));
  for (int j = 0; j < NB; ++j) {
    for (int64_t i = 0; i < kTileRows; ++i)
      std::memcpy(buf + (j * kTileRows + i) * kTileK, w[j].p + i * w[j].ld + k0, (K - k0) * sizeof(BFloat16));
    out[j] = {buf + j * kTileRows * kTileK, kTileK};
  }
  k = 0;
  memory_barrier();
}

// One group, three blocks: out[j * 256 + i * 16 + m] = sum_k W_j[i][k] A[m][k]. (The two plans are written
// out: tile numbers are immediates.)
void amx_pass_1x3(const Block (&w)[3], const TileRun& a, int64_t K, BFloat16* tail, float* out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t s = 0; s * kTileK < K; ++s) {
    Block b[3];
    int64_t k;
    step_blocks<3>(w, s * kTileK, K, tail, b, k);
    _tile_loadd(6, a.at(s), a.row_bytes);
    _tile_loadd(3, b[0].p + k, b[0].ld * 2);
    _tile_loadd(4, b[1].p + k, b[1].ld * 2);
    _tile_loadd(5, b[2].p + k, b[2].ld * 2);
    _tile_dpbf16ps(0, 3, 6);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
  }
  _tile_stored(0, out, 64);
  _tile_stored(1, out + 256, 64);
  _tile_stored(2, out + 512, 64);
}

// Two groups, two blocks: out[(2j + g) * 256 + i * 16 + m] = sum_k W_j[i][k] A_g[m][k].
void amx_pass_2x2(const Block (&w)[2], const TileRun& a0, const TileRun& a1, int64_t K, BFloat16* tail,
                  float* out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s * kTileK < K; ++s) {
    Block b[2];
    int64_t k;
    step_blocks<2>(w, s * kTileK, K, tail, b, k);
    _tile_loadd(6, a0.at(s), a0.row_bytes);
    _tile_loadd(7, a1.at(s), a1.row_bytes);
    _tile_loadd(4, b[0].p + k, b[0].ld * 2);
    _tile_loadd(5, b[1].p + k, b[1].ld * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  _tile_stored(1, out + 256, 64);
  _tile_stored(2, out + 512, 64);
  _tile_stored(3, out + 768, 64);
}

// A tile of C^T (out[i * 16 + m]) written to C's rows m < rows, columns i < cols (c[m * ldc + i]), rounded
// with to_bf16's bits: four column blocks of out transposed in registers (kernels/cpu/lanes.h: register k
// holds rows k, k + 4, k + 8, k + 12 of four columns, one per lane), each column then a row of C, one masked
// store. Element by element (a scalar rounding and a 2-byte store each) the writes took 3 of gate_up's 36 ms
// and 4.5 of down_proj's 22 at E128 k8 H2048 I768 T256 (docs/performance.md, "AMX tiles").
inline void write_transposed(const float* out, int64_t rows, int64_t cols, BFloat16* c, int64_t ldc) {
  const auto* words = reinterpret_cast<const uint32_t*>(out);
  const auto mask = static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t m0 = 0; m0 < rows; m0 += 4) {
    Words a[4], col[4];
    for (int k = 0; k < 4; ++k) a[k] = load_lanes(words + k * kTileRows + m0, 4 * kTileRows);
    transpose_dwords_4x4(a, col);
    for (int64_t j = 0; j < std::min<int64_t>(4, rows - m0); ++j)
      _mm256_mask_storeu_epi16(c + (m0 + j) * ldc, mask, pack_bf16_exact(_mm512_castsi512_ps(col[j])));
  }
}

// bf16 pairs for the activations' tiles: P[p][r] = A[r][2p] | A[r][2p+1] << 16, zero past K and in the
// padding lanes.
inline void pack_pairs(const BFloat16* A, int64_t lda, int64_t rows, int64_t L, int64_t K, uint32_t* P) {
  const int64_t pairs = (K + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t r = rows; r < L; ++r) P[p * L + r] = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const BFloat16* a = A + r * lda;
    for (int64_t p = 0; p < K / 2; ++p)
      P[p * L + r] = uint32_t(a[2 * p].bits) | uint32_t(a[2 * p + 1].bits) << 16;
    if (K % 2) P[(K / 2) * L + r] = a[K - 1].bits;
  }
}

// C = A B^T in bf16 through the tiles.
void amx_gemm(const BFloat16* A, int64_t lda, const BFloat16* B, int64_t ldb, BFloat16* C, int64_t ldc,
              int64_t M, int64_t N, int64_t K) {
  if (M <= 0 || N <= 0) return;
  const int64_t steps = (K + kTileK - 1) / kTileK, Kp = steps * kTileK;
  const int64_t groups = (M + kTileRows - 1) / kTileRows;
  const int64_t group_words = Kp / 2 * kTileRows;  // pair words of one packed group
  // Scratch: the packed groups, then a zero row of Kp elements (missing blocks and groups), then the last
  // block's rows when N is not a multiple of 16 (copied, zero-padded), then the tail tiles.
  const int64_t n_full = N / kTileRows, n_tail = N % kTileRows;
  const size_t pack_bytes = groups * group_words * 4, zero_bytes = Kp * 2 + 64,
               padded_bytes = n_tail ? kTileRows * Kp * 2 : 0, tail_bytes = 3 * kTileRows * kTileK * 2;
  char* buf = static_cast<char*>(scratch<3>(pack_bytes + zero_bytes + padded_bytes + tail_bytes));
  auto* packed = reinterpret_cast<uint32_t*>(buf);
  auto* zeros = reinterpret_cast<BFloat16*>(buf + pack_bytes);
  auto* padded = reinterpret_cast<BFloat16*>(buf + pack_bytes + zero_bytes);
  auto* tail = reinterpret_cast<BFloat16*>(buf + pack_bytes + zero_bytes + padded_bytes);
  for (int64_t g = 0; g < groups; ++g) {
    uint32_t* P = packed + g * group_words;
    pack_pairs(A + g * kTileRows * lda, lda, std::min(kTileRows, M - g * kTileRows), kTileRows, K, P);
    std::fill(P + (K + 1) / 2 * kTileRows, P + group_words, 0u);
  }
  std::memset(zeros, 0, zero_bytes);
  if (n_tail) {
    std::memset(padded, 0, padded_bytes);
    for (int64_t i = 0; i < n_tail; ++i)
      std::memcpy(padded + i * Kp, B + (n_full * kTileRows + i) * ldb, K * sizeof(BFloat16));
  }
  memory_barrier();
  const int64_t blocks = n_full + (n_tail ? 1 : 0);
  auto block = [&](int64_t b) -> Block {
    if (b < n_full) return {B + b * kTileRows * ldb, ldb};
    if (b < blocks) return {padded, Kp};
    return {zeros, 0};
  };
  auto group = [&](int64_t g) -> TileRun {
    if (g < groups) return {packed + g * group_words, kTileRows * kTileRows * 4, 64};
    return {zeros, 0, 0};
  };
  // out[t][i][m] -> C rows m of group g, columns of block b.
  auto write = [&](const float* out, int64_t b, int64_t g) {
    const int64_t cols = std::min(kTileRows, N - b * kTileRows),
                  rows = std::min(kTileRows, M - g * kTileRows);
    if (cols > 0 && rows > 0) write_transposed(out, rows, cols, C + g * kTileRows * ldc + b * kTileRows, ldc);
  };
  load_tile_config();
  alignas(64) float out[4 * kTileRows * kTileRows];
  if (groups == 1) {
    for (int64_t b = 0; b < blocks; b += 3) {
      const Block w[3] = {block(b), block(b + 1), block(b + 2)};
      amx_pass_1x3(w, group(0), K, tail, out);
      for (int j = 0; j < 3; ++j) write(out + j * 256, b + j, 0);
    }
  } else {
    for (int64_t b = 0; b < blocks; b += 2) {
      const Block w[2] = {block(b), block(b + 1)};
      for (int64_t g = 0; g < groups; g += 2) {
        amx_pass_2x2(w, group(g), group(g + 1), K, tail, out);
        for (int j = 0; j < 2; ++j)
          for (int h = 0; h < 2; ++h) write(out + (2 * j + h) * 256, b + j, g + h);
      }
    }
  }
  _tile_release();
}
#endif

}  // namespace

// avx2, fp32 (the lanes form, 16 rows a pass): 256 — gemm_nt for every smaller group ran ahead of BLAS or
// level with it, and only groups of about 500 rows and more ran faster on BLAS. The AVX-512 levels' fp32 (the
// quads form) the same: gemm_nt near the dense rate at every group size up to 1024 rows, larger groups on
// BLAS, whose AVX-512 kernels on Intel cores (unmeasured against the quads form) run faster than on the core
// this was measured on. bf16 at avx512bf16: 128, where the bf16 pairs (the form then) and oneDNN's bf16
// product crossed; the quads form since, unmeasured against oneDNN (amx, on the tiles both ways, keeps 64:
// unmeasured). Elsewhere 64 (baseline; bf16 measured on an AVX512-BF16 core). The figures:
// docs/performance.md, "Grouped products: tasks and routing".
int64_t gemm_nt_blas_rows(DType dtype) {
#if defined(__AVX2__)
  if (dtype == DType::kFloat32) return 256;
#endif
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
  if (dtype == DType::kBFloat16) return 128;
#endif
  (void)dtype;
  return 64;
}

void gemm_nt(DType dtype, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const void* B,
             int64_t ldb, void* C, int64_t ldc) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
#if defined(__AVX2__)
    // fp16 keeps the dot-product blocks (it has no fast path to widen a line in the lanes form's way,
    // measured slower: docs/performance.md, "gemm_nt lanes form").
    constexpr bool kLanesForm = std::is_same_v<T, float> || std::is_same_v<T, BFloat16>;
#if defined(__AMX_BF16__)
    if constexpr (std::is_same_v<T, BFloat16>) {
      amx_gemm(static_cast<const BFloat16*>(A), lda, static_cast<const BFloat16*>(B), ldb,
               static_cast<BFloat16*>(C), ldc, M, N, K);
      return;
    }
#endif
    if constexpr (kLanesForm) {
      lanes_gemm<T>(static_cast<const T*>(A), lda, static_cast<const T*>(B), ldb, static_cast<T*>(C), ldc, M,
                    N, K);
      return;
    }
#endif
    gemm<T>(static_cast<const T*>(A), lda, static_cast<const T*>(B), ldb, static_cast<T*>(C), ldc, M, N, K);
  });
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
