// Element conversions and math for the per-level CPU kernels, written as short fixed-width loops the compiler
// vectorizes for the level it compiles (baseline SSE2, AVX2, AVX-512). Included only by kernels/cpu/*.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernels/cpu/kernels.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {

/// Elements per block: one AVX-512 register of floats, two AVX2 registers.
inline constexpr int64_t kBlock = 16;

struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

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

// bfloat16 is the high half of a float32.
inline float to_float(BFloat16 v) { return f32_from_bits(uint32_t(v.bits) << 16); }
// Round to nearest even, like torch; NaN stays a (quiet) NaN. Branch-free so it vectorizes.
inline BFloat16 to_bf16(float f) {
  uint32_t u = f32_bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return BFloat16{static_cast<uint16_t>(is_nan ? nan : rounded)};
}

// IEEE half <-> float, exact and round-to-nearest-even (the F16C instructions where the level has them).
inline float to_float(Float16 v) {
  uint32_t h = v.bits;
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return f32_from_bits(sign | 0x7f800000u | (man << 13));  // inf, NaN
  if (exp != 0) return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
  // Zero or subnormal: man * 2^-24 is exact in float.
  float mag = static_cast<float>(man) * 5.9604644775390625e-8f;
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
    // Subnormal half (or zero): adding 0.5 makes the FPU round the mantissa to nearest even at 2^-24.
    float scaled = f32_from_bits(abs) + 0.5f;
    out = f32_bits(scaled) - f32_bits(0.5f);
  } else {
    uint32_t odd = (abs >> 13) & 1u;
    out = (abs + 0xc8000fffu + odd) >> 13;  // rebias exponent (-112 << 23) and round
  }
  return Float16{static_cast<uint16_t>(out | sign)};
}

inline float to_float(float v) { return v; }
inline double to_float(double v) { return v; }

template <class T>
struct Traits;
template <>
struct Traits<float> {
  using Acc = float;
  static float round(float v) { return v; }
  static float store(float v) { return v; }
};
template <>
struct Traits<double> {
  using Acc = double;
  static double round(double v) { return v; }
  static double store(double v) { return v; }
};
template <>
struct Traits<BFloat16> {
  using Acc = float;
  static float round(float v) { return to_float(to_bf16(v)); }
  static BFloat16 store(float v) { return to_bf16(v); }
};
template <>
struct Traits<Float16> {
  using Acc = float;
  static float round(float v) { return to_float(to_f16(v)); }
  static Float16 store(float v) { return to_f16(v); }
};

/// Loads kBlock elements of p as Acc.
template <class T, class Acc>
inline void load_block(const T* p, Acc* out) {
  for (int j = 0; j < kBlock; ++j) out[j] = static_cast<Acc>(to_float(p[j]));
}
/// Stores kBlock Acc values to p, rounding to T.
template <class T, class Acc>
inline void store_block(T* p, const Acc* in) {
  for (int j = 0; j < kBlock; ++j) p[j] = Traits<T>::store(in[j]);
}
template <>
inline void load_block<double, double>(const double* p, double* out) {
  for (int j = 0; j < kBlock; ++j) out[j] = p[j];
}
template <>
inline void store_block<double, double>(double* p, const double* in) {
  for (int j = 0; j < kBlock; ++j) p[j] = in[j];
}
#if defined(__F16C__)
template <>
inline void load_block<Float16, float>(const Float16* p, float* out) {
  for (int j = 0; j < kBlock; j += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j));
    _mm256_storeu_ps(out + j, _mm256_cvtph_ps(h));
  }
}
template <>
inline void store_block<Float16, float>(Float16* p, const float* in) {
  for (int j = 0; j < kBlock; j += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + j), h);
  }
}
#endif

/// Rounds a block of Acc values through T and back (the eager math's intermediate casts).
template <class T, class Acc>
inline void round_block(Acc* v) {
  if constexpr (!std::is_same_v<T, Acc>) {
    T tmp[kBlock];
    store_block(tmp, v);
    load_block(tmp, v);
  }
}

/// exp(x) for float, vectorizable: x = n ln2 + r, |r| <= ln2/2, e^r by its degree-6 Taylor polynomial
/// (relative error < 2e-7), then scaled by 2^n through the exponent bits.
inline float exp_f32(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = x - n * 0.693145751953125f;  // ln2 split in a part exact in float and the rest
  r = r - n * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t e = static_cast<int32_t>(n) + 127;
  return p * f32_from_bits(static_cast<uint32_t>(e) << 23);
}
inline double exp_acc(double x) { return std::exp(x); }
inline float exp_acc(float x) { return exp_f32(x); }

/// sigmoid(x) = 1 / (1 + e^-x), in Acc.
template <class Acc>
inline Acc sigmoid(Acc x) {
  return Acc(1) / (Acc(1) + exp_acc(-x));
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
