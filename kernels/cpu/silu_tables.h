// The bf16 SiLU tables of activation.cpp and the lookups that read them. Included only by activation.cpp,
// inside no namespace.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/vec.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {

// A bfloat16 has 65536 values, so every function of the gate alone that a bf16 row needs is read from a
// table instead of computed: SiLU rounded to bf16 (the forward's), x * sigmoid(x) rounded to bf16 (the
// backward's, which shares its division with the derivative) and the derivative in float. Below AVX-512 the
// bf16 rows were bound by the exp, the division and the roundings done in integer instructions (a 60-cycle
// dependent chain a block; docs/performance.md, "bf16 SiLU tables"). The tables are built once per process,
// at first use, by this level's own block math, so every result has the bits it had when computed: eager's
// roundings and edge values, and a NaN gate still gives a NaN (stored as 0xffff). 640 KiB a level, built only
// by a process that runs a bf16 SiLU row; a row touches the entries of the gates it holds (a layer's
// activations span a few exponents: a few KiB). The AVX-512 levels read them by gathers where that is
// measured faster than computing (gathered_tables below); otherwise `avx512` (AVX-512 without its bf16
// instructions) reads them for silu_and_mul's rows by the scalar lookups (kTabledSilu below: SiLU's own
// compute there), which ran faster so (docs/performance.md, "bf16 SiLU tables"), and the bf16 levels
// (`avx512bf16`, `amx`) compute, rounding in one instruction.
#if !defined(__AVX512BF16__)
inline constexpr bool kSiluTables = true;
#else
inline constexpr bool kSiluTables = false;
#endif

/// The backwards' two values of a gate side by side, so that one 8-byte load fetches both.
struct GradEntry {
  float dsilu;      // sigmoid(x) * (1 + x * (1 - sigmoid(x)))
  float x_sigmoid;  // x * sigmoid(x) rounded to bf16 (its low 16 bits clear)
};
struct SiluTables {
  uint16_t silu[65536];  // round(x / (1 + e^-x)), as the stores write it
  GradEntry grad[65536];
  // grad's dsilu alone, for silu's backward, which gathers no x_sigmoid: 4 bytes an entry where grad's 8 put
  // half of each fetched line to no use (silu fwd+bwd 1-4 % faster at the AVX-512 levels on an Intel Xeon,
  // docs/performance.md "bf16 SiLU rows' 32-gate steps at avx512").
  float dsilu[65536];
  SiluTables() {
    for (uint32_t b = 0; b < 65536; b += kBlock) {
      VF x;
      for (int j = 0; j < kBlock; ++j) x[j] = f32_from_bits((b + j) << 16);
      store_native(reinterpret_cast<BFloat16*>(silu + b), silu_of(x));
      const VF s = sigmoid(x);
      const VF d = s * (1 + x * (1 - s)), xs = round_block_arith<BFloat16>(x * s);
      for (int j = 0; j < kBlock; ++j) {
        grad[b + j] = {d[j], xs[j]};
        dsilu[b + j] = d[j];
      }
    }
  }
};
inline const SiluTables& silu_tables() {
  static const SiluTables tables;
  return tables;
}

/// Whether T's rows go through the tables.
template <class T>
inline constexpr bool kTabled = kSiluTables ? std::is_same_v<T, BFloat16> : false;
/// SiLU's own rows (y = silu(x), dx = dy * silu'(x)) read them below AVX-512 only: at avx512 a lookup an
/// element cost as much as the exp or the sigmoid it replaces, while silu_and_mul's rows, which also save a
/// rounding or two, gained (docs/performance.md, "bf16 SiLU tables"; since then the forward's shorter exp,
/// vec.h one_plus_exp_neg_bf16, made computing faster still there: "SiLU's exp").
template <class T>
inline constexpr bool kTabledSilu =
#if defined(__AVX512F__)
    false;
#else
    kTabled<T>;
#endif

/// Elements of a row looked up at a time: the chunk's entries go into buffers on the stack (2 KiB at most,
/// in L1) by scalar loads, then the block loops read them like any operand. Not gathers: an 8-lane vpgatherdd
/// cost about a cycle an element, more than the scalar loads (docs/performance.md, "bf16 SiLU tables"). A
/// multiple of 16, so that every chunk starts a pair.
inline constexpr int64_t kChunk = 256;

/// A row of n elements through the tables, chunk by chunk: look(c, m) fills the buffers with the entries
/// of elements c .. c + m, then pair(c, j) runs for each 2 kBlock of them below AVX-512 (two blocks, the pair
/// functions' lane order), block(c, j) for each kBlock at avx512, one(c, j) for the rest; j counts within
/// the chunk. pair and block take j as `auto`, so each body is compiled only at the level that runs it.
template <class Look, class Pair, class Block, class One>
inline void tabled_row(int64_t n, Look&& look, Pair&& pair, Block&& block, One&& one) {
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t m = std::min(kChunk, n - c);
    look(c, m);
    int64_t j = 0;
#if !defined(__AVX512F__)
    for (; j + 2 * kBlock <= m; j += 2 * kBlock) pair(c, j);
    (void)block;
#else
    for (; j + kBlock <= m; j += kBlock) block(c, j);
    (void)pair;
#endif
    for (; j < m; ++j) one(c, j);
  }
}

/// The entries of m gates by scalar loads into e, in order: four gates' bits by one 8-byte load (an index
/// loaded by itself ran slower), one store an entry (docs/performance.md, "bf16 SiLU tables").
template <class T, class E>
inline void look_up(const T* g, int64_t m, const E* table, E* e) {
  int64_t j = 0;
  for (; j + 4 <= m; j += 4) {
    uint64_t w;
    std::memcpy(&w, g + j, 8);
    for (int q = 0; q < 4; ++q) e[j + q] = table[(w >> (16 * q)) & 0xffffu];
  }
  for (; j < m; ++j) e[j] = table[g[j].bits];
}
/// The forward's silu entries.
template <class T>
inline void look_up_silu(const T* g, int64_t m, const uint16_t* table, T* e) {
  look_up(g, m, reinterpret_cast<const T*>(table), e);
}
/// The backwards' GradEntry; at avx2 each full group of 16 in load_grad_pair's order (entries 0 1 8 9, 2 3
/// 10 11, 4 5 12 13, 6 7 14 15: each 32 bytes holds four entries that one shuffle of two such registers
/// splits into the pair functions' lane order), the rest in order.
template <class T>
inline void look_up_grad(const T* g, int64_t m, const GradEntry* table, GradEntry* e) {
  int64_t j = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
  constexpr int kSlot[16] = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15};
  for (; j + 16 <= m; j += 16)
    for (int w = 0; w < 4; ++w) {
      uint64_t bits;
      std::memcpy(&bits, g + j + 4 * w, 8);
      for (int q = 0; q < 4; ++q) e[j + kSlot[4 * w + q]] = table[(bits >> (16 * q)) & 0xffffu];
    }
#endif
  look_up(g + j, m - j, table, e + j);
}
/// The same for a block in order (baseline: four entries; avx512: sixteen, split by two two-source permutes).
template <class E>
inline void load_grad_block(const E* p, VF& ds, VF& xs) {
  const float* f = &p->dsilu;
#if defined(__AVX512F__)
  const __m512 a = _mm512_load_ps(f), b = _mm512_load_ps(f + 16);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  ds = _mm512_permutex2var_ps(a, even, b);
  xs = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
#else
  const __m128 a = _mm_load_ps(f), b = _mm_load_ps(f + 4);
  ds = _mm_shuffle_ps(a, b, 0x88);
  xs = _mm_shuffle_ps(a, b, 0xdd);
#endif
}
/// silu' and x * sigmoid(x) of 2 kBlock gates from look_up_grad's buffer, as two blocks each in the pair
/// functions' lane order (below AVX-512; at baseline two blocks in order; a template so that avx512 never
/// compiles its body).
template <class E>
inline void load_grad_pair(const E* p, VF ds[2], VF xs[2]) {
#if !defined(__AVX2__)
  load_grad_block(p, ds[0], xs[0]);
  load_grad_block(p + kBlock, ds[1], xs[1]);
#else
  const float* f = &p->dsilu;
  const __m256 a = _mm256_load_ps(f), b = _mm256_load_ps(f + 8), c = _mm256_load_ps(f + 16),
               d = _mm256_load_ps(f + 24);
  ds[0] = _mm256_shuffle_ps(a, b, 0x88);
  xs[0] = _mm256_shuffle_ps(a, b, 0xdd);
  ds[1] = _mm256_shuffle_ps(c, d, 0x88);
  xs[1] = _mm256_shuffle_ps(c, d, 0xdd);
#endif
}

#if !defined(__AVX512F__)
/// Below AVX-512: 2 kBlock bf16 copied from a buffer (aligned to their width), stored as store_bf16_pair
/// stores them.
template <bool Stream, class T>
inline void copy_pair(T* p, const T* from) {
  PackedPair v;
  std::memcpy(&v, from, sizeof v);
  store_packed_pair<Stream>(p, v);
}
#endif

#if defined(__AVX512F__)
// ---- gathers (the AVX-512 levels) ----------------------------------------------------------------------
// With AVX-512 a block's 16 entries can come by one vpgatherdd, indexed by the gates' bits, with no buffer:
// on an Intel Xeon with AMX that gathers a bf16 silu in 0.14-0.15 ns an element against 0.22 to compute it
// (one thread, in cache; the true division and the exp bound the computing) and 0.38 by the scalar lookups
// below AVX-512 (docs/performance.md, "bf16 SiLU rows by gathers"). Other AVX-512 cores differ: Zen 4
// computes as fast as its scalar lookups, and on Intel cores with the Gather Data Sampling mitigation a
// gather costs several times more. So the rows gather where gathering is measured faster than computing on
// the CPU at hand (gathered_tables), and the tables keep every result's bits: each entry was computed by this
// level's own block math.

/// The gates of a block of 16 bf16 at g, as 32-bit indices into a table.
inline __m512i gate_indices(const BFloat16* g) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
}
/// The bf16 SiLU of 16 gates, packed as store_native writes them (the table's 16-bit entries, read as 32-bit
/// words from 2 idx bytes in; the word's high half, the next entry, dropped by the narrowing; the last
/// entry's word ends in SiluTables::grad, inside the struct).
inline __m256i gather_silu_packed(__m512i idx, const uint16_t* table) {
  return _mm512_cvtepi32_epi16(_mm512_i32gather_epi32(idx, table, 2));
}
/// The same entries widened to float (a bf16 is a float's high half).
inline VF gather_silu(__m512i idx, const uint16_t* table) {
  return (VF)_mm512_slli_epi32(_mm512_i32gather_epi32(idx, table, 2), 16);
}
/// The gates of 32 bf16 at g from one 64-byte load, as the indices of the even gates (0, 2, ..., 30) and of
/// the odd ones: a mask and a shift, where gate_indices widens by a shuffle (vec.h, load_bf16_eo).
inline void gate_indices_eo(const BFloat16* g, __m512i& even, __m512i& odd) {
  const __m512i u = _mm512_loadu_si512(g);
  even = _mm512_and_si512(u, _mm512_set1_epi32(0xffff));
  odd = _mm512_srli_epi32(u, 16);
}
/// The bf16 SiLU of 32 gates (gate_indices_eo), packed in order: each even gate's entry in the low half of
/// its 32-bit word, each odd one's in the high half, by one word blend instead of two narrowings.
inline __m512i gather_silu_packed_eo(__m512i even, __m512i odd, const uint16_t* table) {
  const __m512i e = _mm512_i32gather_epi32(even, table, 2), o = _mm512_i32gather_epi32(odd, table, 2);
  return _mm512_mask_blend_epi16(0xAAAAAAAAu, e, _mm512_slli_epi32(o, 16));
}
#if defined(__AVX512F__)
/// 32 products gather(gate) * v for the gates at g and the bf16 values at v, in even and odd lanes, rounded
/// and stored in order at out (store_bf16_eo: two blocks a conversion at the BF16 levels, each lane rounded
/// in place at avx512); gather(indices) gives 16 gates' table values as floats.
template <bool Stream, class Gather>
inline void store_gathered_products_eo(BFloat16* out, const BFloat16* g, const BFloat16* v, Gather&& gather) {
  __m512i even, odd;
  gate_indices_eo(g, even, odd);
  VF ve, vo;
  load_bf16_eo(v, ve, vo);
  store_bf16_eo<Stream>(out, gather(even) * ve, gather(odd) * vo);
}
#endif
/// One field of 16 GradEntry (8 bytes each), as floats: `field` points at that field of entry 0.
inline VF gather_grad(__m512i idx, const float* field) {
  return (VF)_mm512_i32gather_ps(idx, field, 8);
}
/// 16 gates' dsilu from the dense table (SiluTables::dsilu).
inline VF gather_dsilu(__m512i idx, const float* dsilu) {
  return (VF)_mm512_i32gather_ps(idx, dsilu, 4);
}
/// 16 packed bf16 to p, streamed when Stream (p aligned as can_stream checks).
template <bool Stream>
inline void store_packed_block(BFloat16* p, __m256i v) {
  if constexpr (Stream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
}

/// Whether gathering a block's SiLU beats computing it on this CPU: timed once per process, at the first bf16
/// SiLU row, on 4096 gates spread over [-8, 8) (a layer's activations) in cache, the best of 16 alternated
/// rounds each (the first bf16 SiLU call, tables built and timing done, took about 1 ms on xeon-amx-vm).
inline bool gathers_beat_computing() {
  static const bool faster = [] {
    const SiluTables& t = silu_tables();
    constexpr int n = 4096;
    alignas(64) BFloat16 g[n], out[n];
    for (int i = 0; i < n; ++i) g[i] = to_bf16(static_cast<float>(i * 1031 % n) / 256.0f - 8.0f);
    using Clock = std::chrono::steady_clock;
    auto timed = [&](auto&& body) {
      const auto t0 = Clock::now();
      for (int i = 0; i < n; i += kBlock) body(i);
      asm volatile("" : : "r"(out) : "memory");  // the stores are kept
      return Clock::now() - t0;
    };
    Clock::duration gather = Clock::duration::max(), compute = gather;
    for (int round = 0; round < 16; ++round) {
      gather = std::min(gather, timed([&](int i) {
                          store_packed_block<false>(out + i, gather_silu_packed(gate_indices(g + i), t.silu));
                        }));
      compute =
          std::min(compute, timed([&](int i) { store_native(out + i, silu_bf16_of(load<float>(g + i))); }));
    }
    return gather < compute;
  }();
  return faster;
}
#endif

/// Whether T's rows can gather at this level (the code is compiled for them alone).
template <class T>
inline constexpr bool kGatherable =
#if defined(__AVX512F__)
    std::is_same_v<T, BFloat16>;
#else
    false;
#endif

/// The tables T's rows read by gathers at this level (kernmap::cpu::silu_gathers), or null where they do not:
/// always below AVX-512 and for other types than bf16.
template <class T>
inline const SiluTables* gathered_tables() {
#if defined(__AVX512F__)
  if constexpr (kGatherable<T>) {
    const SiluGathers how = silu_gathers();
    if (how == SiluGathers::kAlways || (how == SiluGathers::kAuto && gathers_beat_computing()))
      return &silu_tables();
  }
#endif
  return nullptr;
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
