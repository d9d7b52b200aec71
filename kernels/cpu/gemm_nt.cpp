// Small-M matrix products in "NT" form for the grouped expert products of the forward pass: dot products along K,
// both operands K-contiguous (nn.Linear layout). Compiled once per instruction-set level.
#include <algorithm>

#include "kernels/cpu/vec.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {
namespace {

constexpr int kMr = 4;
constexpr int kNr = 4;

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
    V a[MR], b[NR];
    for (int i = 0; i < MR; ++i) a[i] = load<Ac>(A + i * lda + k);
    for (int j = 0; j < NR; ++j) b[j] = load<Ac>(B + j * ldb + k);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] += a[i] * b[j];
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      Ac s = lane_sum(acc[i][j]);
      for (int64_t k = Kb; k < K; ++k) s += to_acc<Ac>(A[i * lda + k]) * to_acc<Ac>(B[j * ldb + k]);
      C[i * ldc + j] = from_acc<T>(s);
    }
}

#if defined(__AVX512BF16__)
// bf16 with the dot-product instruction: each lane adds a[2l] * b[2l] + a[2l+1] * b[2l+1] (exact products,
// fp32 sums) — both operands K-contiguous, so 32 elements of K per instruction and no conversions.
template <int MR, int NR>
void block(const BFloat16* A, int64_t lda, const BFloat16* B, int64_t ldb, BFloat16* C, int64_t ldc, int64_t K) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t Kb = K - K % 32;
  for (int64_t k = 0; k < Kb; k += 32) {
    __m512bh a[MR], b[NR];
    for (int i = 0; i < MR; ++i) a[i] = (__m512bh)_mm512_loadu_si512(A + i * lda + k);
    for (int j = 0; j < NR; ++j) b[j] = (__m512bh)_mm512_loadu_si512(B + j * ldb + k);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a[i], b[j]);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = _mm512_reduce_add_ps(acc[i][j]);
      for (int64_t k = Kb; k < K; ++k) s += to_float(A[i * lda + k]) * to_float(B[j * ldb + k]);
      C[i * ldc + j] = from_acc<BFloat16>(s);
    }
}
#endif

template <class T, int MR, int NR>
void any_block(const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t K) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, BFloat16>) return block<MR, NR>(A, lda, B, ldb, C, ldc, K);
#endif
  block<T, MR, NR>(A, lda, B, ldb, C, ldc, K);
}

// Edge blocks (fewer than kMr rows or kNr columns left) go through narrower blocks.
template <class T>
void gemm(const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t M, int64_t N, int64_t K) {
  const int64_t Mb = M - M % kMr, Nb = N - N % kNr;
  for (int64_t n = 0; n < Nb; n += kNr) {
    for (int64_t m = 0; m < Mb; m += kMr)
      any_block<T, kMr, kNr>(A + m * lda, lda, B + n * ldb, ldb, C + m * ldc + n, ldc, K);
    for (int64_t m = Mb; m < M; ++m)
      any_block<T, 1, kNr>(A + m * lda, lda, B + n * ldb, ldb, C + m * ldc + n, ldc, K);
  }
  for (int64_t n = Nb; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) any_block<T, 1, 1>(A + m * lda, lda, B + n * ldb, ldb, C + m * ldc + n, ldc, K);
}

}  // namespace

void gemm_nt(DType dtype, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const void* B, int64_t ldb,
             void* C, int64_t ldc) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    gemm<T>(static_cast<const T*>(A), lda, static_cast<const T*>(B), ldb, static_cast<T*>(C), ldc, M, N, K);
  });
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
