// Outer-product form of small-M matrix products for the grouped backward passes (broadcast a scalar of A, multiply
// a vector of B's row). Compiled once per instruction-set level.
#include <algorithm>

#include "kernels/cpu/vec.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {
namespace {

constexpr int64_t kPrefetchRows = 8;

// Scalar math: C[m, n] = round(sum_p float(A(m, p)) * float(B[p, n]))
// Register block: MR rows of C x NV vectors along n, accumulated over all of P.
template <class T, int MR, int NV>
void bcast_block(const T* A, int64_t a_m, int64_t a_p, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t P) {
  using Ac = Acc<T>;
  using V = Vec<Ac>;
  V acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = V{};
  for (int64_t p = 0; p < P; ++p) {
    // B's rows are ldb apart (often a page or more): the hardware prefetchers do not follow, so fetch the rows a
    // few iterations ahead (one hint per cache line of the NV vectors).
    if (p + kPrefetchRows < P)
      for (int64_t off = 0; off < NV * kBlock * int64_t(sizeof(T)); off += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(B + (p + kPrefetchRows) * ldb) + off);
    V b[NV];
    for (int j = 0; j < NV; ++j) b[j] = load<Ac>(B + p * ldb + j * kBlock);
    for (int i = 0; i < MR; ++i) {
      const Ac a = to_acc<Ac>(A[i * a_m + p * a_p]);
      for (int j = 0; j < NV; ++j) acc[i][j] += a * b[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) store(C + i * ldc + j * kBlock, acc[i][j]);
}

#if defined(__AVX512BF16__)
// bf16 outer products with the dot-product instruction, two steps of p at a time: lane l of a dot product adds
// a[2l] * b[2l] + a[2l+1] * b[2l+1], so the pair (A(m, p), A(m, p+1)) is broadcast to every lane and rows p and
// p+1 of B are interleaved (unpack within 128-bit lanes). The unpacks permute the columns: the low half holds
// columns {0-3, 8-11, 16-19, 24-27} of a 32-column chunk, the high half the others; the stores undo it.
// Products are exact and sums fp32, as in the dot-product block above; an odd last step pairs with zeros.
template <int MR>
void bcast_block_dp(const BFloat16* A, int64_t a_m, int64_t a_p, const BFloat16* B, int64_t ldb, BFloat16* C,
                    int64_t ldc, int64_t P) {
  constexpr int kChunks = 2;  // 2 x 32 columns
  __m512 acc[MR][2 * kChunks];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2 * kChunks; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* a16 = reinterpret_cast<const uint16_t*>(A);
  auto step = [&](const __m512i (&rows0)[kChunks], const __m512i (&rows1)[kChunks], int64_t p, bool pair) {
    __m512bh b[2 * kChunks];
    for (int c = 0; c < kChunks; ++c) {
      b[2 * c] = (__m512bh)_mm512_unpacklo_epi16(rows0[c], rows1[c]);
      b[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(rows0[c], rows1[c]);
    }
    for (int i = 0; i < MR; ++i) {
      const uint16_t* a = a16 + i * a_m + p * a_p;
      const uint32_t bits = uint32_t(a[0]) | (pair ? uint32_t(a[a_p]) << 16 : 0u);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(bits));
      for (int j = 0; j < 2 * kChunks; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, b[j]);
    }
  };
  const int64_t Pe = P - P % 2;
  for (int64_t p = 0; p < Pe; p += 2) {
    for (int64_t q = p + kPrefetchRows; q < std::min(P, p + kPrefetchRows + 2); ++q)
      for (int64_t off = 0; off < kChunks * 64; off += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(B + q * ldb) + off);
    __m512i r0[kChunks], r1[kChunks];
    for (int c = 0; c < kChunks; ++c) {
      r0[c] = _mm512_loadu_si512(B + p * ldb + 32 * c);
      r1[c] = _mm512_loadu_si512(B + (p + 1) * ldb + 32 * c);
    }
    step(r0, r1, p, true);
  }
  if (Pe < P) {
    __m512i r0[kChunks], r1[kChunks];
    for (int c = 0; c < kChunks; ++c) {
      r0[c] = _mm512_loadu_si512(B + Pe * ldb + 32 * c);
      r1[c] = _mm512_setzero_si512();
    }
    step(r0, r1, Pe, false);
  }
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < kChunks; ++c) {
      const __m512 lo = acc[i][2 * c], hi = acc[i][2 * c + 1];
      store_native(C + i * ldc + 32 * c, (VF)_mm512_permutex2var_ps(lo, lo_idx, hi));
      store_native(C + i * ldc + 32 * c + 16, (VF)_mm512_permutex2var_ps(lo, hi_idx, hi));
    }
}
#endif

// Columns beyond the last full vector: scalar.
template <class T>
void bcast_tail(const T* A, int64_t a_m, int64_t a_p, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t M,
                int64_t n0, int64_t N, int64_t P) {
  using Ac = Acc<T>;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < N; ++n) {
      Ac s = 0;
      for (int64_t p = 0; p < P; ++p) s += to_acc<Ac>(A[m * a_m + p * a_p]) * to_acc<Ac>(B[p * ldb + n]);
      C[m * ldc + n] = from_acc<T>(s);
    }
}

constexpr int kBcastRows = 4;
constexpr int kBcastVecs = 4;

template <class T>
void gemm_outer(const T* A, int64_t a_m, int64_t a_p, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t M,
                int64_t N, int64_t P) {
  const int64_t wide = kBcastVecs * kBlock;
  const int64_t Nw = N - N % wide, Nv = N - N % kBlock, Mb = M - M % kBcastRows;
  for (int64_t n = 0; n < Nw; n += wide) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, BFloat16> && kBcastVecs * kBlock == 64) {
      for (int64_t m = 0; m < Mb; m += kBcastRows)
        bcast_block_dp<kBcastRows>(A + m * a_m, a_m, a_p, B + n, ldb, C + m * ldc + n, ldc, P);
      for (int64_t m = Mb; m < M; ++m) bcast_block_dp<1>(A + m * a_m, a_m, a_p, B + n, ldb, C + m * ldc + n, ldc, P);
      continue;
    }
#endif
    for (int64_t m = 0; m < Mb; m += kBcastRows)
      bcast_block<T, kBcastRows, kBcastVecs>(A + m * a_m, a_m, a_p, B + n, ldb, C + m * ldc + n, ldc, P);
    for (int64_t m = Mb; m < M; ++m) bcast_block<T, 1, kBcastVecs>(A + m * a_m, a_m, a_p, B + n, ldb, C + m * ldc + n, ldc, P);
  }
  for (int64_t n = Nw; n < Nv; n += kBlock)
    for (int64_t m = 0; m < M; ++m) bcast_block<T, 1, 1>(A + m * a_m, a_m, a_p, B + n, ldb, C + m * ldc + n, ldc, P);
  if (Nv < N) bcast_tail(A, a_m, a_p, B, ldb, C, ldc, M, Nv, N, P);
}

}  // namespace

void gemm_bcast(DType dtype, int64_t M, int64_t N, int64_t P, const void* A, int64_t a_m, int64_t a_p,
                const void* B, int64_t ldb, void* C, int64_t ldc) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    gemm_outer<T>(static_cast<const T*>(A), a_m, a_p, static_cast<const T*>(B), ldb, static_cast<T*>(C), ldc, M, N,
                  P);
  });
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
