// Blocks of one register's worth of floats as GCC/Clang vector types (4 at baseline SSE2, 8 with AVX2, 16
// with AVX-512), plus exact element conversions and a vectorizable exp. Included only by kernels/cpu/*.cpp,
// inside no namespace.
#pragma once

#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/kernels.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {

/// Elements per block: one register of floats at the level (GCC splits wider vector types poorly, scalarizing
/// selects and conversions).
#if defined(__AVX512F__)
inline constexpr int64_t kBlock = 16;
#elif defined(__AVX2__)
inline constexpr int64_t kBlock = 8;
#else
inline constexpr int64_t kBlock = 4;
#endif

typedef float VF __attribute__((vector_size(kBlock * sizeof(float))));
typedef double VD __attribute__((vector_size(kBlock * sizeof(double))));
typedef int32_t VI __attribute__((vector_size(kBlock * sizeof(int32_t))));
typedef uint32_t VU __attribute__((vector_size(kBlock * sizeof(uint32_t))));

struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

/// The accumulation type of an element type, and its block vector.
template <class T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
template <class A>
using Vec = std::conditional_t<std::is_same_v<A, double>, VD, VF>;

// ---- scalar conversions (tails and baseline fp16) ------------------------------------------------------

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bfloat16 is the high half of a float32; rounding is to nearest even as in torch, and a NaN becomes 0xffff,
// the NaN torch's vectorized conversion writes (its scalar one writes 0x7fc0), so that a row's tail has the
// bits of its blocks.
inline float to_float(BFloat16 v) {
  return f32_from_bits(uint32_t(v.bits) << 16);
}
inline BFloat16 to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{0xffffu};
  return BFloat16{static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

// IEEE half <-> float, exact and round-to-nearest-even.
inline float to_float(Float16 v) {
  uint32_t h = v.bits;
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return f32_from_bits(sign | 0x7f800000u | (man << 13));  // inf, NaN
  if (exp != 0) return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
  float mag = static_cast<float>(man) * 5.9604644775390625e-8f;  // subnormal: man * 2^-24, exact
  return sign ? -mag : mag;
}
inline Float16 to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  uint32_t out;
  if (abs > 0x7f800000u) {
    out = 0x7e00u;  // NaN
  } else if (abs >= 0x477ff000u) {
    out = 0x7c00u;  // rounds to infinity
  } else if (abs < 0x38800000u) {
    // Subnormal half or zero: adding 0.5 makes the FPU round the mantissa to nearest even at 2^-24.
    out = f32_bits(f32_from_bits(abs) + 0.5f) - f32_bits(0.5f);
  } else {
    out = (abs + 0xc8000fffu + ((abs >> 13) & 1u)) >> 13;  // rebias the exponent by -112 and round
  }
  return Float16{static_cast<uint16_t>(out | sign)};
}
inline float to_float(float v) {
  return v;
}
inline double to_float(double v) {
  return v;
}

/// Calls f with a value of the element type for dtype (the one switch over dtypes in the kernels).
template <class F>
inline void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat64:
      return f(double{});
    case DType::kBFloat16:
      return f(BFloat16{});
    case DType::kFloat16:
      return f(Float16{});
  }
}

/// Element -> accumulation type, and accumulation type -> element with rounding.
template <class A, class T>
inline A to_acc(T v) {
  return static_cast<A>(to_float(v));
}
template <class T, class A>
inline T from_acc(A v) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return to_bf16(static_cast<float>(v));
  } else if constexpr (std::is_same_v<T, Float16>) {
    return to_f16(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}
/// v rounded to T's precision (the eager math's intermediate casts), kept in the accumulation type.
template <class T, class A>
inline A round_to(A v) {
  return to_acc<A>(from_acc<T>(v));
}

// ---- block loads, stores and rounding ------------------------------------------------------------------
// Written with the level's intrinsics where GCC's generic vector code costs several instructions more (the
// bf16 widening and narrowing, the NaN select).

inline VF load_native(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline VD load_native(const double* p) {
  VD v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// A bf16 is the high half of a float: each 16-bit lane moves to the high half of a 32-bit lane, the low half
// cleared, in one shuffle (not a zero-extension and a shift: the elementwise kernels' bf16 rows are bound by
// their instructions per element, docs/performance.md, "bf16 elementwise rows").
#if defined(__AVX512F__)
inline VF widen_bf16(__m256i v) {
  // Word 2j + 1 of the result takes word j of v; the even words, masked off, are zero.
  const __m512i from = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5,
                                        0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
  return (VF)_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, from, _mm512_castsi256_si512(v));
}
#endif
inline VF load_native(const BFloat16* p) {
#if defined(__AVX512F__)
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__)
  // The eight words in both 128-bit halves (a plain load), then a shuffle within each half: -1 clears a byte.
  const __m256i from = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7, -1, -1, 8, 9,
                                        -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
  return (VF)_mm256_shuffle_epi8(
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), from);
#else
  return (VF)_mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#endif
}
inline VF load_native(const Float16* p) {
  VF v;
#if defined(__AVX512F__)
  v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__) && defined(__F16C__)
  v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  for (int j = 0; j < kBlock; ++j) v[j] = to_float(p[j]);
#endif
  return v;
}

inline void store_native(float* p, VF v) {
  std::memcpy(p, &v, sizeof v);
}
inline void store_native(double* p, VD v) {
  std::memcpy(p, &v, sizeof v);
}
#if defined(__AVX512F__)
// Round to nearest even on the bits, without the NaN lanes (the callers put 0xffff there, the NaN torch's
// vectorized conversion writes, with one masked instruction they need anyway: an and, a permute): u + 0x7fff,
// plus 1 where the tie bit (16) is set, as a vptestmd mask and a masked add, one instruction fewer than the
// shift and the and. Only the high half of each lane is the result.
inline __m512i bf16_round_bits(VF v) {
  const __m512i u = (__m512i)v, up = _mm512_add_epi32(u, _mm512_set1_epi32(0x7fff));
  return _mm512_mask_add_epi32(up, _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x10000)), up,
                               _mm512_set1_epi32(1));
}
/// The lanes that are not NaN.
inline __mmask16 ordered(VF v) {
  return _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
}
#else
// Round to nearest even on the bits; a NaN lane becomes all ones (bf16 0xffff, the NaN torch's vectorized
// conversion writes): the compare's mask ORed in, two instructions, where a select of u | 0x400000 (a quiet
// NaN with its sign) took five with AVX2's blend. Only the high half of each lane is the result (callers
// clear or shift out the low half).
inline VU bf16_round_high(VF v) {
  VU u = (VU)v;
  VU rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return rounded | (VU)(v != v);
}
#endif
// vcvtneps2bf16 (avx512bf16 level) rounds to nearest even like the code below, but keeps a NaN's sign and
// payload (quiet), where torch and the code below write 0xffff, and treats subnormal floats as zero, where
// torch's conversion rounds them (to a bf16 subnormal, or up to FLT_MIN): the price of replacing about seven
// instructions by one. Only results below 1.2e-38 in magnitude differ.
#if defined(__AVX2__)
// A block rounded to bfloat16 / float16, packed into the low bytes of one register (32 bytes with AVX-512, 16
// with AVX2): what store_native writes, also streamed by store_out.
#if defined(__AVX512F__)
using Packed16 = __m256i;
#else
using Packed16 = __m128i;
#endif
#if defined(__AVX512F__)
// A block rounded to bfloat16 with to_bf16's bits (a NaN lane 0xffff, subnormals rounded), packed into 32
// bytes: each lane's high half gathered by one vpermw (a shift and vpmovdw took three micro-ops on Intel
// cores); word l of the result is lane l's, so the ordered mask masks it, NaN lanes keeping the all-ones
// source. pack16's form below the BF16 levels; at them, where its bits must not change (the AMX forward's
// writes, kernels/cpu/gemm_nt.cpp).
inline __m256i pack_bf16_exact(VF v) {
  const __m512i high = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 31, 29, 27,
                                        25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_castsi512_si256(
      _mm512_mask_permutexvar_epi16(_mm512_set1_epi32(-1), ordered(v), high, bf16_round_bits(v)));
}
#endif
inline Packed16 pack16(VF v, BFloat16) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#elif defined(__AVX512F__)
  return pack_bf16_exact(v);
#else
  // Each lane's high half gathered into the low 8 bytes of its 128-bit half, then the two halves' 8 bytes
  // joined: two shuffles (a shift, an extract and a pack took three).
  const __m256i high = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6,
                                        7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i h = _mm256_shuffle_epi8((__m256i)bf16_round_high(v), high);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(h, 0x08));
#endif
}
inline Packed16 pack16(VF v, Float16) {
#if defined(__AVX512F__)
  return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
}
#endif

inline void store_native(BFloat16* p, VF v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), pack16(v, BFloat16{}));
#elif defined(__AVX2__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), pack16(v, BFloat16{}));
#else
  __m128i h = _mm_srai_epi32((__m128i)bf16_round_high(v), 16);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(h, h));
#endif
}
inline void store_native(Float16* p, VF v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), pack16(v, Float16{}));
#elif defined(__AVX2__) && defined(__F16C__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), pack16(v, Float16{}));
#else
  for (int j = 0; j < kBlock; ++j) p[j] = to_f16(v[j]);
#endif
}

/// Whether load_bf16_pair's two blocks hold the row's elements in order (baseline), not interleaved by the
/// 128-bit halves (avx2). The AVX-512 levels have no pairs.
inline constexpr bool kPairLanesInOrder =
#if defined(__AVX2__)
    false;
#else
    true;
#endif

#if !defined(__AVX512F__)
// Two blocks of bfloat16 at once (avx2 and baseline): 2 kBlock elements from one load, widened by one unpack
// each into two float blocks and packed back in order by two shifts and one pack. Two single blocks cost two
// loads and two shuffles to widen and, at avx2, two shuffles and two lane-crossing vpermq to pack; the paired
// loops ran faster (docs/performance.md, "bf16 elementwise rows", "Two blocks at once at avx2", "Pairs at
// baseline"). The blocks come in lane order: at avx2 lo holds elements 0-3 and 8-11, hi 4-7 and 12-15 (the
// unpacks work within each 128-bit half); at baseline lo holds 0-3 and hi 4-7, the order of the row
// (kPairLanesInOrder). For elementwise kernels whose every bf16 input and output goes through these (the
// lanes then line up); the values and bits are those of load and store.
#if defined(__AVX2__)
using PackedPair = __m256i;
inline void load_bf16_pair(const BFloat16* p, VF& lo, VF& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = (VF)_mm256_unpacklo_epi16(_mm256_setzero_si256(), v);
  hi = (VF)_mm256_unpackhi_epi16(_mm256_setzero_si256(), v);
}
/// 16 bf16 packed in order in r, stored; streamed as two 16-byte halves when Stream (p aligned as can_stream
/// checks).
template <bool Stream>
inline void store_packed_pair(BFloat16* p, PackedPair r) {
  if constexpr (Stream) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(r));
    _mm_stream_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_extracti128_si256(r, 1));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), r);
  }
}
/// Rounds lo and hi (lane order, as load_bf16_pair gives them) and stores the 16 elements in order
/// (store_packed_pair).
template <bool Stream>
inline void store_bf16_pair(BFloat16* p, VF lo, VF hi) {
  store_packed_pair<Stream>(p, _mm256_packus_epi32(_mm256_srli_epi32((__m256i)bf16_round_high(lo), 16),
                                                   _mm256_srli_epi32((__m256i)bf16_round_high(hi), 16)));
}
#else
using PackedPair = __m128i;
inline void load_bf16_pair(const BFloat16* p, VF& lo, VF& hi) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = (VF)_mm_unpacklo_epi16(_mm_setzero_si128(), v);
  hi = (VF)_mm_unpackhi_epi16(_mm_setzero_si128(), v);
}
/// 8 bf16 packed in order in r, stored (16-bit types are not streamed at baseline: kStreamable).
template <bool Stream>
inline void store_packed_pair(BFloat16* p, PackedPair r) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), r);
}
/// Rounds lo and hi and stores the 8 elements in order: SSE2 has no unsigned pack, so each lane's rounded
/// high half is shifted down arithmetically (a value within int16) and packed with signed saturation, which
/// leaves it unchanged, as store_native does for one block.
template <bool Stream>
inline void store_bf16_pair(BFloat16* p, VF lo, VF hi) {
  store_packed_pair<Stream>(p, _mm_packs_epi32(_mm_srai_epi32((__m128i)bf16_round_high(lo), 16),
                                               _mm_srai_epi32((__m128i)bf16_round_high(hi), 16)));
}
#endif
#endif

#if defined(__AVX512F__)
/// 32 bf16 packed in order in v to p, streamed as two 32-byte halves when Stream (p aligned as can_stream
/// checks for bf16 blocks).
template <bool Stream>
inline void store_words_32(BFloat16* p, __m512i v) {
  if constexpr (Stream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_castsi512_si256(v));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p + 16), _mm512_extracti64x4_epi64(v, 1));
  } else {
    _mm512_storeu_si512(p, v);
  }
}
#endif

#if defined(__AVX512F__)
/// 32 bf16 elements from one 64-byte load, widened by a shift and a mask: e holds the even elements 0, 2,
/// ..., 30, o the odd ones (no shuffle; described with the steps below).
inline void load_bf16_eo(const BFloat16* p, VF& e, VF& o) {
  const __m512i u = _mm512_loadu_si512(p);
  e = (VF)_mm512_slli_epi32(u, 16);
  o = (VF)_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}
#endif

#if defined(__AVX512BF16__)
// 32 bf16 elements a step at the AVX-512 BF16 levels, for elementwise rows bound by port 5 (the one port that
// shuffles on Intel cores, where vcvtneps2bf16 also takes two micro-ops of it; docs/performance.md, "bf16
// rotary in even and odd lanes"): widened and rounded without the shuffle a block costs otherwise.
// load_bf16_eo widens one 64-byte load by a shift and a mask (e: the even elements 0, 2, ..., 30; o: the odd
// ones); round_bf16_eo rounds two blocks by one vcvtne2ps2bf16 (the conversion of pack16, 32 lanes at once)
// and widens them back by a shift and a mask, which moves each lane (the "q" lanes below: a holds elements
// 0, 4, ..., 28, 1, 5, ..., 29 of a row loaded by load_bf16_eo, b 2, 6, ..., 30, 3, 7, ..., 31);
// store_bf16_q rounds blocks in the q lanes and stores the 32 elements in order (one shuffle). A kernel
// keeps every operand of one operation in the same lanes; the values are those of the single blocks.
/// e and o rounded to bf16 (round_block's values), in the lanes described above (a: from e's lanes 0, 2,
/// ..., 14 and o's 0, 2, ..., 14; b: the odd lanes of each).
inline void round_bf16_eo(VF e, VF o, VF& a, VF& b) {
  const __m512i c = (__m512i)_mm512_cvtne2ps_pbh(o, e);  // words 0-15: e's lanes, 16-31: o's
  a = (VF)_mm512_slli_epi32(c, 16);
  b = (VF)_mm512_and_si512(c, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}
/// e and o rounded to bf16 (round_block_arith's values: round_block's at this level) and kept in their lanes:
/// the conversion's words put in memory order, as store_bf16_eo stores them, and widened as load_bf16_eo
/// widens a load (one shuffle where round_block takes two a block). For rows whose every operand sits in the
/// even and odd lanes (RMSNorm's backward: a rounded product meets operands loaded by load_bf16_eo).
inline void round_bf16_eo_kept(VF& e, VF& o) {
  const __m512i back = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                        22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i u = _mm512_permutexvar_epi16(back, (__m512i)_mm512_cvtne2ps_pbh(o, e));
  e = (VF)_mm512_slli_epi32(u, 16);
  o = (VF)_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}
/// lo and hi rounded by one conversion (lo's lanes to words 0-15, hi's to 16-31), the words put in memory
/// order (element m takes word order[m]) and stored.
template <bool Stream>
inline void store_bf16_words(BFloat16* p, VF lo, VF hi, __m512i order) {
  store_words_32<Stream>(p, _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
}
/// Rounds a and b (q lanes of a row loaded by load_bf16_eo) and stores the 32 elements in order: memory
/// element m is word 8 (m % 4) + m / 4 of the conversion.
template <bool Stream>
inline void store_bf16_q(BFloat16* p, VF a, VF b) {
  store_bf16_words<Stream>(p, a, b,
                           _mm512_set_epi16(31, 23, 15, 7, 30, 22, 14, 6, 29, 21, 13, 5, 28, 20, 12, 4, 27,
                                            19, 11, 3, 26, 18, 10, 2, 25, 17, 9, 1, 24, 16, 8, 0));
}
/// Rounds e and o (the even and odd lanes of load_bf16_eo, not yet rounded) and stores the 32 elements in
/// order: memory element m is word 16 (m % 2) + m / 2 of the conversion.
template <bool Stream>
inline void store_bf16_eo(BFloat16* p, VF e, VF o) {
  store_bf16_words<Stream>(p, e, o,
                           _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23,
                                            7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0));
}
#elif defined(__AVX512F__)
// The even and odd lanes at avx512 (no bf16 conversion): the roundings in integer instructions, as
// round_block_arith and pack16 round a block, each lane in place, so no shuffle at all.
/// e and o rounded to bf16 in their lanes: round_block_arith's values (for blocks computed by arithmetic from
/// bf16 elements and finite constants).
inline void round_bf16_eo_kept(VF& e, VF& o) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  e = (VF)_mm512_and_si512(bf16_round_bits(e), high);
  o = (VF)_mm512_and_si512(bf16_round_bits(o), high);
}
/// Rounds e and o (the even and odd lanes of load_bf16_eo) and stores the 32 elements in order, pack16's bits
/// (a NaN lane 0xffff): element 2l is e's lane l's high half, moved down by a shift, element 2l + 1 o's lane
/// l's high half, joined by one ternary-logic instruction.
template <bool Stream>
inline void store_bf16_eo(BFloat16* p, VF e, VF o) {
  const __m512i ones = _mm512_set1_epi32(-1), high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512i lo = _mm512_mask_srli_epi32(ones, ordered(e), bf16_round_bits(e), 16);
  const __m512i hi = _mm512_mask_mov_epi32(ones, ordered(o), bf16_round_bits(o));
  store_words_32<Stream>(p, _mm512_ternarylogic_epi32(hi, lo, high, 0xe4));
}
#endif

/// The paired blocks of a bf16 row below AVX-512 (load_bf16_pair, store_bf16_pair): calls pair(i) for i = 0,
/// 2 kBlock, ... while two blocks fit below nb and returns where the single blocks resume; at the AVX-512
/// levels and for other types it calls nothing and returns 0. pair takes its index as `auto`, so its body
/// (which names the pair functions) is compiled only where it runs.
template <class T, class Pair>
inline int64_t paired_bf16_blocks(int64_t nb, Pair&& pair) {
#if !defined(__AVX512F__)
  if constexpr (std::is_same_v<T, BFloat16>) {
    int64_t i = 0;
    for (; i + 2 * kBlock <= nb; i += 2 * kBlock) pair(i);
    return i;
  }
#endif
  return 0;
}

#if defined(__AVX512BF16__)
/// The 32-element steps of a bf16 row at the AVX-512 BF16 levels (load_bf16_eo, round_bf16_eo,
/// store_bf16_q): calls quad(i) for i = 0, 32, ... while 32 elements fit below nb and returns where the
/// single blocks resume; for other types it calls nothing and returns 0 (quad's body, taking its index as
/// `auto`, is compiled only where it runs).
template <class T, class Quad>
inline int64_t eo_bf16_blocks(int64_t nb, Quad&& quad) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    int64_t i = 0;
    for (; i + 2 * kBlock <= nb; i += 2 * kBlock) quad(i);
    return i;
  }
  return 0;
}
#endif

/// Asks for the cache line holding p now, to be read soon (a hint: it never faults, and costs one load slot).
/// For the next row of a two-pass row kernel, fetched during the current row's compute-bound pass: the
/// hardware prefetchers run only a few lines ahead of the loads they see, so the next row would otherwise
/// wait on memory with nothing to overlap.
template <class T>
inline void prefetch(const T* p) {
  __builtin_prefetch(p, 0, 3);
}

/// How far ahead of its loads a one-pass row loop fetches its inputs (fetch_ahead): 2 KiB, 32 lines a
/// stream, the middle of the range that ran fastest (2-4 KiB; 512 bytes and 8 KiB slower) on xeon-amx-vm —
/// about what one core moves in a memory latency at the streaming rate (~12 GB/s x ~100 ns), with margin
/// (docs/performance.md, "Inputs fetched ahead").
inline constexpr int64_t kAheadBytes = 2048;
/// Asks for the line kAheadBytes past p, for a loop that streams its inputs once and computes between the
/// loads (the SiLU rows, rotary): on an Intel Xeon the hardware prefetchers fell behind such loops, which ran
/// at half the copy rate or less (bf16 SiLU at avx2 33 ms against 13 with this). One a block, which for
/// 16-bit blocks asks for a line twice. A hint: it never faults, past a row's end included.
template <class T>
inline void fetch_ahead(const T* p) {
  prefetch(reinterpret_cast<const char*>(p) + kAheadBytes);
}

/// kBlock elements of p as a block of A.
template <class A, class T>
inline Vec<A> load(const T* p) {
  auto v = load_native(p);
  if constexpr (std::is_same_v<decltype(v), Vec<A>>) {
    return v;
  } else {
    return __builtin_convertvector(v, Vec<A>);
  }
}
/// Stores a block to p, rounding to T.
template <class T, class V>
inline void store(T* p, V v) {
  using N = decltype(load_native(p));
  if constexpr (std::is_same_v<V, N>) {
    store_native(p, v);
  } else {
    store_native(p, __builtin_convertvector(v, N));
  }
}
// ---- streaming (non-temporal) stores ------------------------------------------------------------------
// For outputs too large to stay in the cache: the block goes to memory without the read-for-ownership of a
// normal store and without evicting the inputs. The values written are those of store(); only the cache
// behaviour differs. Each needs its address aligned to the block's byte width (checked by can_stream), and a
// stream_fence() before another thread reads the data.

/// Whether a block of T can be streamed at this level: float, bfloat16 and float16 from AVX2 on; at baseline
/// float alone (a block of 16 bytes by movntps; the write-combining buffers join a row's consecutive blocks
/// into whole lines), since a 16-bit block there is 8 bytes, whose streaming stores (movnti) ran slower than
/// plain ones (docs/performance.md, "Streaming-store threshold").
template <class T>
inline constexpr bool kStreamable =
#if defined(__AVX2__)
    std::is_same_v<T, float> || std::is_same_v<T, BFloat16> || std::is_same_v<T, Float16>;
#else
    std::is_same_v<T, float>;
#endif

/// True when rows of T starting at p, `stride` elements apart, can all be streamed block by block from
/// their start.
template <class T>
inline bool can_stream(const T* p, int64_t stride) {
  if constexpr (kStreamable<T>) {
    constexpr uintptr_t width = kBlock * sizeof(T);
    return reinterpret_cast<uintptr_t>(p) % width == 0 && (stride * sizeof(T)) % width == 0;
  } else {
    return false;
  }
}

inline void stream_fence() {
  _mm_sfence();
}

/// store(p, v) as a streaming store when Stream (p aligned as can_stream checks); a normal store otherwise.
template <bool Stream, class T, class V>
inline void store_out(T* p, V v) {
  if constexpr (!Stream || !kStreamable<T>) {
    store(p, v);
  } else {
#if defined(__AVX2__)
    VF f = __builtin_convertvector(v, VF);
    if constexpr (std::is_same_v<T, float>) {
#if defined(__AVX512F__)
      _mm512_stream_ps(p, f);
#else
      _mm256_stream_ps(p, f);
#endif
    } else {
#if defined(__AVX512F__)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), pack16(f, T{}));
#else
      _mm_stream_si128(reinterpret_cast<__m128i*>(p), pack16(f, T{}));
#endif
    }
#else
    _mm_stream_ps(p, __builtin_convertvector(v, VF));  // float only (kStreamable)
#endif
  }
}

/// A block rounded to T's precision, kept in its own type.
template <class T, class V>
inline V round_block(V v) {
  if constexpr (std::is_same_v<T, BFloat16>) {
#if defined(__AVX512BF16__)
    // Subnormals become zero, as in store_native.
    return widen_bf16((__m256i)_mm512_cvtneps_pbh(v));
#elif defined(__AVX512F__)
    // The and masked by the ordered lanes: a NaN lane keeps the source, 0xffff0000.
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    return (VF)_mm512_mask_and_epi32(high, ordered(v), bf16_round_bits(v), high);
#else
    return (VF)(bf16_round_high(v) & 0xffff0000u);
#endif
  } else if constexpr (std::is_same_v<T, Float16>) {
#if defined(__AVX512F__)
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__AVX2__) && defined(__F16C__)
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    Float16 tmp[kBlock];
    store_native(tmp, v);
    return load_native(tmp);
#endif
  } else {
    return v;
  }
}

/// round_block for a block computed by arithmetic alone from T elements and finite constants (products,
/// sums, quotients, one_plus_exp_neg below): each of its NaNs is the default NaN or an operand's NaN made
/// quiet, which for a bfloat16 T has its low 16 bits clear, so the rounding add cannot carry out of a NaN's
/// mantissa and needs no NaN select (two instructions of seven below AVX-512, where the elementwise bf16 rows
/// are bound by instructions and latency: docs/performance.md, "bf16 elementwise rows"; at avx512 the ordered
/// compare of five, the and unmasked: "The arithmetic rounding at avx512"). Every lane that is not NaN has
/// round_block's bits; a NaN lane stays a NaN (its payload, not always 0xffff0000: the stores write torch's
/// 0xffff for every NaN). Not for blocks that take an operand of another type (a float weight can hold any
/// NaN). At avx512bf16 it is round_block (one conversion).
template <class T, class V>
inline V round_block_arith(V v) {
#if !defined(__AVX512F__)
  if constexpr (std::is_same_v<T, BFloat16>) {
    const VU u = (VU)v;
    return (VF)((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
  }
#elif !defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, BFloat16>)
    return (VF)_mm512_and_epi32(bf16_round_bits(v), _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
#endif
  return round_block<T>(v);
}

/// Sum of a block's lanes.
template <class V>
inline auto lane_sum(V v) {
  decltype(v[0] + v[0]) s = 0;
  for (int j = 0; j < kBlock; ++j) s += v[j];
  return s;
}

// ---- math ----------------------------------------------------------------------------------------------

/// a * b + c with one rounding where the level has FMA (avx2 and up: the intrinsic, so fused in every file,
/// those compiled with -ffp-contract=off included); at baseline (SSE2 has no FMA) a product and a sum, two
/// roundings. Plain a * b + c in the kernels may be fused at those levels too, by GCC itself
/// (-ffp-contract=fast, its default), except in the files that kernels/CMakeLists.txt compiles with
/// -ffp-contract=off; whether it is, GCC decides per instantiation.
inline VF madd(VF a, VF b, VF c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__AVX2__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}
/// c - a * b, rounded as madd rounds.
inline VF nmadd(VF a, VF b, VF c) {
#if defined(__AVX512F__)
  return _mm512_fnmadd_ps(a, b, c);
#elif defined(__AVX2__)
  return _mm256_fnmadd_ps(a, b, c);
#else
  return c - a * b;
#endif
}
/// madd and nmadd of double blocks and of scalars, rounded as madd rounds (fused where the level has FMA):
/// a kernel whose results must equal another's bit for bit writes its multiply-adds with these, in a file
/// compiled with -ffp-contract=off, instead of leaving the fusing of each to GCC (which fuses the same
/// expression in one instantiation and not in another).
inline VD madd(VD a, VD b, VD c) {
#if defined(__FMA__)
  VD r;
  for (int j = 0; j < kBlock; ++j) r[j] = __builtin_fma(a[j], b[j], c[j]);
  return r;
#else
  return a * b + c;
#endif
}
inline VD nmadd(VD a, VD b, VD c) {
  return madd(-a, b, c);
}
inline float madd(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}
inline double madd(double a, double b, double c) {
#if defined(__FMA__)
  return __builtin_fma(a, b, c);
#else
  return a * b + c;
#endif
}
inline float nmadd(float a, float b, float c) {
  return madd(-a, b, c);
}
inline double nmadd(double a, double b, double c) {
  return madd(-a, b, c);
}
/// Per lane a > b ? a : b (a < b ? a : b) in one instruction (maxps, minps), where a compare and a blend
/// take two to four: b wherever either is NaN, so a NaN in b passes through.
inline VF max_of(VF a, VF b) {
#if defined(__AVX512F__)
  return _mm512_max_ps(a, b);
#elif defined(__AVX2__)
  return _mm256_max_ps(a, b);
#else
  return _mm_max_ps(a, b);
#endif
}
inline VF min_of(VF a, VF b) {
#if defined(__AVX512F__)
  return _mm512_min_ps(a, b);
#elif defined(__AVX2__)
  return _mm256_min_ps(a, b);
#else
  return _mm_min_ps(a, b);
#endif
}
/// x limited to [lo, hi] in two instructions (max_of, min_of). A NaN x becomes lo: only for callers whose
/// result also takes x itself, which carries the NaN.
inline VF clamp_block(VF x, float lo, float hi) {
  return min_of(max_of(x, VF{} + lo), VF{} + hi);
}
/// 1 + e^-x for a float block (the denominator of sigmoid and SiLU, their only need; negating inside saves an
/// instruction), e^-x overflowing to +inf where it exceeds FLT_MAX (x below -88.72), as eager's exp does:
/// SiLU's x / (1 + e^-x) then gives eager's -0 for huge negative x and NaN for -inf. -x = n ln2 + r with |r|
/// <= ln2/2; e^r by a degree-5 minimax polynomial (relative error < 2e-7 for results above FLT_MIN), times
/// 2^n. The polynomial is evaluated as two halves in s^2 (twelve cycles of dependent multiply-adds, not
/// Horner's twenty): below AVX-512 the loops were bound by how many blocks the core keeps in flight times
/// each block's latency, not by instruction count (docs/performance.md, "SiLU's exp"). x is clamped first so
/// that infinities never reach the reduction (inf - inf would make a NaN): past the clamp e^-x is +inf or
/// below 2^-24, where 1 + e^-x is already exact. A NaN x gives a NaN or a finite value: every caller's result
/// also takes x itself, which carries the NaN.
inline VF one_plus_exp_neg(VF x) {
  const float log2e = 1.44269504088896341f;
  const float ln2_hi = 0.693145751953125f;  // ln2 split into a part exact in float (times any n) and the rest
  const float ln2_lo = 1.428606765330187e-06f;
#if defined(__AVX512F__)
  // One instruction for both bounds: the smaller magnitude of x and 104, with x's sign. scalef below takes
  // any n: results past FLT_MAX become +inf, those below FLT_MIN subnormal (below 2^-149, zero).
  x = _mm512_range_ps(x, _mm512_set1_ps(104.0f), 0x02);
  VF n = _mm512_roundscale_ps(x * -log2e, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  constexpr float k = 1.0f;  // the polynomial's scale (below)
#else
  // The integer scaling below builds 2^(n-1), whose exponent field holds n - 1 in [-125, 127]: n <= 128 (x >=
  // -89, e^89 being past FLT_MAX already) and n >= -124 (x <= 85, e^-85 being below 2^-24 already).
  x = clamp_block(x, -89.0f, 85.0f);
  // Adding 1.5 * 2^23 rounds to an integer, which then sits in the low mantissa bits of t.
  VF t = madd(x, VF{} - log2e, VF{} + 12582912.0f);
  VF n = t - 12582912.0f;
  // The polynomial times 2 (every coefficient doubled: exact, the same roundings), so that 2p * 2^(n-1) + 1
  // is one multiply-add: the same bits as rounding p * 2^n (exact for normal results) and adding 1.
  constexpr float k = 2.0f;
#endif
  VF s = madd(n, VF{} + ln2_hi, x);  // s = -r
  s = madd(n, VF{} + ln2_lo, s);
  // e^r = c0 + c1 r + ... + c5 r^5, evaluated in s, so the odd coefficients change sign.
  const VF s2 = s * s;
  const VF p45 = madd(VF{} - k * 8.2976194662806e-3f, s, VF{} + k * 4.1915629250567e-2f);
  const VF p23 = madd(VF{} - k * 1.6667576541808804e-1f, s, VF{} + k * 4.9998892661192695e-1f);
  const VF p01 = madd(VF{} - k * 9.999996910699437e-1f, s, VF{} + k * 1.0000000718663848f);
  const VF p = madd(madd(p45, s2, p23), s2, p01);
#if defined(__AVX512F__)
  return 1 + _mm512_scalef_ps(p, n);
#else
  // t's bits are those of 1.5 * 2^23 plus n; shifted by 23 only n's bits survive, giving n - 1 as an
  // exponent. A product past FLT_MAX rounds to +inf.
  return madd(p, (VF)(((VI)t + 126) << 23), VF{} + 1.0f);
#endif
}
inline VD one_plus_exp_neg(VD x) {
  for (int j = 0; j < kBlock; ++j) x[j] = 1 + std::exp(-x[j]);
  return x;
}
inline float one_plus_exp_neg(float x) {
  VF v = VF{} + x;
  return one_plus_exp_neg(v)[0];
}

// SiLU and sigmoid with eager's arithmetic: true divisions, not a reciprocal estimate. Eager's edge values
// come from the division itself: x / inf is a signed zero (silu(-1e30) = -0), -inf / inf is NaN, and 1 / (1 +
// e^-x) is exactly 1 once e^-x < 2^-24, so silu'(x) = 1 for large x and NaN at +inf (inf * (1 - 1)). A
// Newton-refined estimate gives NaN for 1 / inf and 1 - 2^-24 for 1 / 1 (then silu'(1e30) = 6e22).

/// silu(x) = x / (1 + e^-x), for blocks and scalars.
template <class V>
inline V silu_of(V x) {
  return x / one_plus_exp_neg(x);
}
inline float silu_scalar(float x) {
  return x / one_plus_exp_neg(x);
}
inline double silu_scalar(double x) {
  return x / (1.0 + std::exp(-x));
}

#if defined(__AVX512F__)
/// 2^(j/32) for j = 0..31, rounded to float: one_plus_exp_neg_bf16's table.
alignas(64) inline constexpr float kExp2Of32ths[32] = {
    0x1p+0f,        0x1.059b0ep+0f, 0x1.0b5586p+0f, 0x1.11301ep+0f, 0x1.172b84p+0f, 0x1.1d4874p+0f,
    0x1.2387a6p+0f, 0x1.29e9ep+0f,  0x1.306fep+0f,  0x1.371a74p+0f, 0x1.3dea64p+0f, 0x1.44e086p+0f,
    0x1.4bfdaep+0f, 0x1.5342b6p+0f, 0x1.5ab07ep+0f, 0x1.6247ecp+0f, 0x1.6a09e6p+0f, 0x1.71f75ep+0f,
    0x1.7a1148p+0f, 0x1.82589ap+0f, 0x1.8ace54p+0f, 0x1.93737cp+0f, 0x1.9c4918p+0f, 0x1.a5503cp+0f,
    0x1.ae89fap+0f, 0x1.b7f77p+0f,  0x1.c199bep+0f, 0x1.cb720ep+0f, 0x1.d5818ep+0f, 0x1.dfc974p+0f,
    0x1.ea4afap+0f, 0x1.f50766p+0f};

/// 1 + e^-x for SiLU results rounded to bf16, at the AVX-512 levels: six multiplies and multiply-adds
/// instead of one_plus_exp_neg's nine, on the pipes that bound the bf16 SiLU rows there (docs/performance.md,
/// "SiLU's exp"). -x = (n / 32) ln2 + r with |r| <= ln2/64; 2^(n/32) = 2^floor(n/32) 2^((n mod 32)/32), the
/// second factor read from kExp2Of32ths by one permute indexed by the low five bits of t = 1.5 * 2^23 + n,
/// the first applied by scalef (which floors its exponent); e^r = 1 + c1 r + c2 r^2, minimax in relative
/// error on |r| <= ln2/64 (5.3e-8); ln2/32 in one float (the reduction's error n x 6e-11, at most 2.4e-7
/// where e^-x is finite). SiLU's float32 relative error 4.0e-7 against one_plus_exp_neg's 3.0e-7, so float32
/// rows keep that one; rounded to bf16, the two give the same bits for every one of the 65536 bf16 inputs
/// (the kernel table's bf16_silu_every_gate checks it at every level). Edge values as one_plus_exp_neg's: x
/// clamped to +-104 first (no infinity reaches the reduction), +inf where e^-x passes FLT_MAX (scalef
/// overflows), a NaN x a NaN or a finite value.
inline VF one_plus_exp_neg_bf16(VF x) {
  x = _mm512_range_ps(x, _mm512_set1_ps(104.0f), 0x02);
  const VF t = madd(x, VF{} - 0x1.715476p+5f, VF{} + 12582912.0f);  // 1.5 * 2^23 + round(-32 x log2e)
  const VF n = t - 12582912.0f;
  const VF s = madd(n, VF{} + 0x1.62e43p-6f, x);  // s = -r
  const VF scale =
      _mm512_permutex2var_ps(_mm512_load_ps(kExp2Of32ths), (__m512i)t, _mm512_load_ps(kExp2Of32ths + 16));
  const VF q = s * madd(VF{} + 0x1.000024p-1f, s, VF{} - 0x1.0000f6p+0f);  // e^r - 1 in s = -r
  return 1 + _mm512_scalef_ps(madd(scale, q, scale), n * (1.0f / 32));
}
#endif

/// silu(x) for a result rounded to bf16: with one_plus_exp_neg_bf16 at the AVX-512 levels, silu_of below
/// (whose bf16 rows read tables built by silu_of: silu_tables.h). The scalar form is a block's first lane,
/// so that a row's tail has its blocks' bits.
inline VF silu_bf16_of(VF x) {
#if defined(__AVX512F__)
  return x / one_plus_exp_neg_bf16(x);
#else
  return silu_of(x);
#endif
}
inline float silu_bf16_of(float x) {
  return silu_bf16_of(VF{} + x)[0];
}

/// sigmoid(x) = 1 / (1 + e^-x), for blocks and scalars.
template <class V>
inline V sigmoid(V x) {
  return 1 / one_plus_exp_neg(x);
}
inline float sigmoid_scalar(float x) {
  return 1.0f / one_plus_exp_neg(x);
}
inline double sigmoid_scalar(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
