// The AMX tiles' set-up, shared by the kernels that use them at the amx level (gemm_nt.cpp, gemm_outer.cpp).
// Empty below the amx level.
//
// TDPBF16PS adds to a tile of 16 x 16 fp32 sums the products of a 16 x 32 bf16 tile ("A", row-major along the
// reduction) and a tile of 16 rows of 16 bf16 pairs ("B", row q holding (B[2q][j], B[2q+1][j]) for j < 16):
// exact products, fp32 sums in order of the pairs, subnormals flushed as vdpbf16ps flushes them. Every tile
// the kernels use is 16 rows of 64 bytes (one configuration).
#pragma once

#if defined(__AMX_BF16__)
#include <immintrin.h>

#include <cstdint>

namespace kernmap::cpu {

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileK = 32;  // bf16 elements of the reduction per tile row (64 bytes)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The operand tile of each step of a reduction: step s at(s) bytes from p, its 16 rows row_bytes apart (0:
// the same row 16 times, a zero tile read from one zero row, with step_bytes 0 too).
struct TileRun {
  const void* p;
  int64_t step_bytes, row_bytes;
  const void* at(int64_t s) const { return static_cast<const char*>(p) + s * step_bytes; }
};

// Loaded on every call: the thread's tile configuration is shared with any other AMX user (oneDNN).
inline void load_tile_config() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = kTileRows;
    }
    return c;
  }();
  _tile_loadconfig(&config);
}

// The tile load/store macros are asm without a memory clobber: this barrier keeps the stores that fill a
// buffer before the tile loads that read it.
inline void memory_barrier() {
  asm volatile("" ::: "memory");
}

}  // namespace kernmap::cpu

// Tile t starts from the 16 x 16 fp32 sums at `src` (64-byte rows), or from zero when src is null.
#define KERNMAP_TILE_START(t, src) \
  do {                             \
    if (src)                       \
      _tile_loadd(t, src, 64);     \
    else                           \
      _tile_zero(t);               \
  } while (0)
#endif
