// Registers as 128-bit lanes of 16-bit or 32-bit words, and the transposes within each lane (8 x 8 16-bit
// words, 4 x 4 32-bit ones), at the level's vector width: the matrix transpose (kernels/cpu/transpose.cpp),
// the AMX tiles' packing of A read across its rows (kernels/cpu/gemm_outer.cpp) and the AMX forward's
// writes of C^T tiles (kernels/cpu/gemm_nt.cpp). Included by per-level sources only
// (KERNMAP_CPU_LEVEL names the level).
#pragma once

#include <immintrin.h>

#include <cstdint>

// GCC 12 flags its own _mm512_undefined_epi32 in the 32- and 64-bit unpacks (avx512fintrin.h).
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {

// One register as kLanes 128-bit lanes of 16 bytes: 8 16-bit words or 4 32-bit ones. A tile is kRows x kLanes
// rows by kRows columns (kRows = the words of a lane): lane q of register k holds row k + kRows q's words,
// rounds of unpacks (16-bit words, pairs, quads; 32-bit: words, pairs) transpose each lane's kRows x kRows
// block in place, and register j then holds column j's kRows x kLanes words in row order — one row of the
// transpose. No shuffle across lanes.
#if defined(__AVX512F__)
using Words = __m512i;
constexpr int kLanes = 4;
#define KERNMAP_WORDS(op) _mm512_##op
template <class W>
inline Words load_lanes(const W* p, int64_t lane_step) {
  Words v = _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + lane_step)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * lane_step)), 2);
  return _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * lane_step)), 3);
}
inline void store_words(void* p, Words v) {
  _mm512_storeu_si512(p, v);
}
#elif defined(__AVX2__)
using Words = __m256i;
constexpr int kLanes = 2;
#define KERNMAP_WORDS(op) _mm256_##op
template <class W>
inline Words load_lanes(const W* p, int64_t lane_step) {
  const Words v = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_inserti128_si256(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + lane_step)), 1);
}
inline void store_words(void* p, Words v) {
  _mm256_storeu_si256(static_cast<__m256i*>(p), v);
}
#else
using Words = __m128i;
constexpr int kLanes = 1;
#define KERNMAP_WORDS(op) _mm_##op
template <class W>
inline Words load_lanes(const W* p, int64_t) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline void store_words(void* p, Words v) {
  _mm_storeu_si128(static_cast<__m128i*>(p), v);
}
#endif
// The unpacks within 128-bit lanes, at the level's width.
inline Words unpack_lo16(Words a, Words b) {
  return KERNMAP_WORDS(unpacklo_epi16)(a, b);
}
inline Words unpack_hi16(Words a, Words b) {
  return KERNMAP_WORDS(unpackhi_epi16)(a, b);
}
inline Words unpack_lo32(Words a, Words b) {
  return KERNMAP_WORDS(unpacklo_epi32)(a, b);
}
inline Words unpack_hi32(Words a, Words b) {
  return KERNMAP_WORDS(unpackhi_epi32)(a, b);
}
inline Words unpack_lo64(Words a, Words b) {
  return KERNMAP_WORDS(unpacklo_epi64)(a, b);
}
inline Words unpack_hi64(Words a, Words b) {
  return KERNMAP_WORDS(unpackhi_epi64)(a, b);
}
#undef KERNMAP_WORDS

// Eight registers of 8 x 8 blocks of 16-bit words, one block a lane (register k holds row k of each block),
// transposed in every lane: out[j] holds column j of each block, its rows in order.
inline void transpose_words_8x8(const Words (&a)[8], Words (&out)[8]) {
  // Words: b[2m] holds rows 2m, 2m+1 interleaved for columns 0-3, b[2m+1] for columns 4-7.
  Words b[8], c[8];
  for (int m = 0; m < 4; ++m) {
    b[2 * m] = unpack_lo16(a[2 * m], a[2 * m + 1]);
    b[2 * m + 1] = unpack_hi16(a[2 * m], a[2 * m + 1]);
  }
  // Pairs: c[0..3] rows 0-3 of columns (0,1), (2,3), (4,5), (6,7); c[4..7] rows 4-7 of the same.
  for (int h = 0; h < 2; ++h) {
    c[4 * h + 0] = unpack_lo32(b[4 * h + 0], b[4 * h + 2]);
    c[4 * h + 1] = unpack_hi32(b[4 * h + 0], b[4 * h + 2]);
    c[4 * h + 2] = unpack_lo32(b[4 * h + 1], b[4 * h + 3]);
    c[4 * h + 3] = unpack_hi32(b[4 * h + 1], b[4 * h + 3]);
  }
  // Quads: column 2p from c[p] and c[p + 4]'s low halves, column 2p + 1 from their high halves.
  for (int p = 0; p < 4; ++p) {
    out[2 * p] = unpack_lo64(c[p], c[p + 4]);
    out[2 * p + 1] = unpack_hi64(c[p], c[p + 4]);
  }
}

// Four registers of 4 x 4 blocks of 32-bit words, one block a lane (register k holds row k of each block),
// transposed in every lane: out[j] holds column j of each block, its rows in order.
inline void transpose_dwords_4x4(const Words (&a)[4], Words (&out)[4]) {
  // Words: b[0] rows 0, 1 of columns 0, 1; b[1] of columns 2, 3; b[2], b[3] the same of rows 2, 3.
  const Words b[4] = {unpack_lo32(a[0], a[1]), unpack_hi32(a[0], a[1]), unpack_lo32(a[2], a[3]),
                      unpack_hi32(a[2], a[3])};
  // Pairs: column 2p from b[p] and b[p + 2]'s low halves, column 2p + 1 from their high halves.
  for (int p = 0; p < 2; ++p) {
    out[2 * p] = unpack_lo64(b[p], b[p + 2]);
    out[2 * p + 1] = unpack_hi64(b[p], b[p + 2]);
  }
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
