// The transpose of a matrix of 16-bit or 32-bit elements (bits moved, never converted), compiled once per
// instruction-set level: the fused linear cross-entropy hands its logits to BLAS's products in the layout
// they run fastest in (ops/linear_cross_entropy.cpp).
#include "kernels/cpu/lanes.h"
#include "kernels/cpu/vec.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {
namespace {

// Streamed where Stream: p aligned to the register's width.
template <bool Stream>
inline void store_row(void* p, Words v) {
  if constexpr (Stream) {
#if defined(__AVX512F__)
    _mm512_stream_si512(static_cast<__m512i*>(p), v);
#elif defined(__AVX2__)
    _mm256_stream_si256(static_cast<__m256i*>(p), v);
#else
    _mm_stream_si128(static_cast<__m128i*>(p), v);
#endif
  } else {
    store_words(p, v);
  }
}

// The shape of W's tiles and bands. A band has a 64-byte line of each transposed row (kBandRows / kTileRows
// tiles), so that streamed stores write whole lines.
template <class W>
struct Shape {
  static constexpr int kRows = 16 / sizeof(W);  // words of a lane: a tile's columns
  static constexpr int64_t kTileRows = kRows * kLanes;
  static constexpr int64_t kBandRows = 64 / sizeof(W);
};

// The tile at (r0, c0) transposed: out[j] holds src[r0 + i][c0 + j] for i < kTileRows, in order of i.
template <class W>
inline void tile(const W* src, int64_t src_ld, int64_t r0, int64_t c0, Words (&out)[Shape<W>::kRows]) {
  constexpr int R = Shape<W>::kRows;
  const W* s = src + r0 * src_ld + c0;
  Words a[R];
  for (int k = 0; k < R; ++k) a[k] = load_lanes(s + k * src_ld, R * src_ld);
  if constexpr (R == 8) {
    transpose_words_8x8(a, out);
  } else {
    transpose_dwords_4x4(a, out);
  }
}

// Bands of kBandRows rows across the columns: a band's rows are read as one stream each (their lines serve
// several tiles while they stay in L1). The band's tiles at a column are transposed first and each transposed
// row's line then stored in one go: streamed stores of a line's parts with other lines' between them ran at a
// fifth of the rate below AVX-512 (docs/performance.md, "Fused loss's products by blocks of classes").
template <class W, bool Stream>
void transpose_bands(const W* src, int64_t src_ld, W* dst, int64_t dst_ld, int64_t rows, int64_t col_begin,
                     int64_t col_end) {
  using S = Shape<W>;
  constexpr int kTiles = S::kBandRows / S::kTileRows;
  const int64_t banded_rows = rows / S::kBandRows * S::kBandRows;
  const int64_t tiled_end = col_begin + (col_end - col_begin) / S::kRows * S::kRows;
  for (int64_t r0 = 0; r0 < banded_rows; r0 += S::kBandRows)
    for (int64_t c0 = col_begin; c0 < tiled_end; c0 += S::kRows) {
      Words out[kTiles][S::kRows];
      for (int t = 0; t < kTiles; ++t) tile(src, src_ld, r0 + t * S::kTileRows, c0, out[t]);
      W* d = dst + c0 * dst_ld + r0;
      for (int j = 0; j < S::kRows; ++j)
        for (int t = 0; t < kTiles; ++t) store_row<Stream>(d + j * dst_ld + t * S::kTileRows, out[t][j]);
    }
  for (int64_t j = tiled_end; j < col_end; ++j)
    for (int64_t i = 0; i < banded_rows; ++i) dst[j * dst_ld + i] = src[i * src_ld + j];
  for (int64_t i = banded_rows; i < rows; ++i)
    for (int64_t j = col_begin; j < col_end; ++j) dst[j * dst_ld + i] = src[i * src_ld + j];
  if constexpr (Stream) _mm_sfence();
}

template <class W>
void transpose_of(const void* src_v, int64_t src_ld, void* dst_v, int64_t dst_ld, int64_t rows,
                  int64_t col_begin, int64_t col_end, bool stream) {
  const auto* src = static_cast<const W*>(src_v);
  auto* dst = static_cast<W*>(dst_v);
  // Streamed where every band's stores fill whole lines: the transposed rows 64-byte aligned.
  if (stream && reinterpret_cast<uintptr_t>(dst) % 64 == 0 && (dst_ld * sizeof(W)) % 64 == 0) {
    transpose_bands<W, true>(src, src_ld, dst, dst_ld, rows, col_begin, col_end);
  } else {
    transpose_bands<W, false>(src, src_ld, dst, dst_ld, rows, col_begin, col_end);
  }
}

}  // namespace

void transpose(int64_t element_bytes, const void* src, int64_t src_ld, void* dst, int64_t dst_ld,
               int64_t rows, int64_t col_begin, int64_t col_end, bool stream) {
  if (element_bytes == 2) {
    transpose_of<uint16_t>(src, src_ld, dst, dst_ld, rows, col_begin, col_end, stream);
  } else {
    transpose_of<uint32_t>(src, src_ld, dst, dst_ld, rows, col_begin, col_end, stream);
  }
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
