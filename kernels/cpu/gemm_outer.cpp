// Outer-product form of small-M matrix products for the grouped backward passes (broadcast a scalar of A,
// multiply a vector of B's row), blocked along the reduction so B streams through the cache once per call
// while the partial sums wait in an fp32 scratch block. Compiled once per instruction-set level.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cpu/amx.h"
#include "kernels/cpu/cache.h"
#include "kernels/cpu/lanes.h"
#include "kernels/cpu/vec.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {
namespace {

constexpr int64_t kPrefetchRows = 8;
// bcast_block's near fetch (B's rows are ldb apart, often a page or more, and the hardware prefetchers do not
// follow them): how many rows ahead, into which cache, and in which reduction blocks. At the AVX-512 levels
// kPrefetchRows into L1, in the first block only (kFetchNextBlock brings each next block whole). At avx2,
// where no block is fetched ahead, in every block, 64 rows ahead into L2 and past the block's end: a step
// there is one row (one line) and 12 multiply-adds, about 6 cycles at two FMA pipes, so 64 rows are about
// one DRAM access ahead; without it the first row block over a panel waited on memory at every row (grad @
// W of 6 rows a group ran 2.5x slower than of 7). 16 and 32 rows, and 32 into L1, ran slower; 96 and 128 no
// faster (docs/performance.md, "gemm_bcast reduction blocks", "Every block's panel fetched ahead at avx2").
// Baseline keeps the first rule: 64 rows ahead made its groups of 12-24 rows slower.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int64_t kNearRows = 64;
constexpr int kNearLocality = 2;
constexpr bool kNearEveryBlock = true;
#else
constexpr int64_t kNearRows = kPrefetchRows;
constexpr int kNearLocality = 3;
constexpr bool kNearEveryBlock = false;
#endif
// Register block: MR x NV accumulators, NV vectors of B's row and A's broadcast scalar fit the level's vector
// registers (an accumulator that spills costs a load and a store per FMA): 4 x 4 + 4 + 1 = 21 of AVX-512's
// 32; 6 x 2 + 2 + 1 = 15 of the 16 below it.
#if defined(__AVX512F__)
constexpr int kBcastRows = 4;
constexpr int kBcastVecs = 4;
#else
constexpr int kBcastRows = 6;
constexpr int kBcastVecs = 2;
#endif
// The register block of outer_blocks' row-order path (fp32 weight gradients with C streamed): two or more
// adjacent cache lines of each of its rows of C. avx2's 6 x 2 writes one line to each of six rows a block,
// and its streamed stores did not overlap the multiply-adds where two lines a row did (docs/performance.md,
// "gemm_bcast reduction blocks", "The row order's register blocks write two cache lines of each row").
// AVX-512's 4 x 4 writes four lines a row.
#if defined(__AVX512F__)
constexpr int kStreamRows = kBcastRows;
constexpr int kStreamVecs = kBcastVecs;
#else
constexpr int kStreamRows = 3;
constexpr int kStreamVecs = 4;
#endif
// Whether bf16 products widen A to fp32 in outer_blocks' copy (no dot-product instruction; gemm_outer): each
// step then broadcasts its scalars from memory, folded into the FMAs, as fp32's do — instead of a scalar
// widening, a move to a vector register and a broadcast per row and step, on the port the FMAs share. The
// same products in the same order: the same bits.
#if defined(__AVX2__) && !defined(__AVX512BF16__)
constexpr bool kWidenBf16A = true;
#else
constexpr bool kWidenBf16A = false;
#endif
// Whether bf16 with A widened to fp32 (avx2: no dot-product instruction, no AVX-512) takes the row order for
// its long reductions too, each column range of B widened to fp32 in its copy: the same products in the same
// order as its blocked reductions, so the same bits. Its register blocks write 32 bf16, one whole line of
// each row, so C is streamed there as fp32's is (gemm_bcast). Faster than the blocked 16-row tasks at every
// group length measured (docs/performance.md, "gemm_bcast reduction blocks", "bf16 in the row order"). The
// AVX-512 levels keep theirs: unmeasured.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool kBf16RowsOuter = true;
#else
constexpr bool kBf16RowsOuter = false;
#endif
static_assert(!kBf16RowsOuter || kWidenBf16A);
// Whether the register blocks of outer_blocks' panel orders (kBcastVecs vectors of a row) write whole cache
// lines of T, which streamed stores need (gemm_bcast); 16-bit types at avx2 write half a line.
template <class T>
inline constexpr bool kBcastWholeLines = kBcastVecs* kBlock * sizeof(T) % 64 == 0;
// Whether blocked reductions (step_p < P) also copy each panel read by 8 or more row blocks (outer_blocks'
// pack_panel): below AVX-512 a panel is one line of each of B's rows, rows that share the level-1 cache's
// sets, so the row blocks after the first read it from L2 and the copy from L1 (faster for grad @ W of groups
// of 48 rows or more); the AVX-512 levels' panels (256 bytes wide) keep reading B in place, where the copy
// ran slower (docs/performance.md, "gemm_bcast reduction blocks", "Long reductions' panels copied").
#if defined(__AVX512F__)
constexpr bool kPackLongPanels = false;
#else
constexpr bool kPackLongPanels = true;
#endif
// The row order's column ranges are at least this many columns: its reduction blocks are as long as that
// leaves within short_reduction_bytes (512 steps on a 512 KiB L2); 64 and 256 were no faster for long groups
// (docs/performance.md, "gemm_bcast reduction blocks", "Long reductions in the row order").
constexpr int64_t kRowOrderMinCols = 128;
// The row-order path's last panel is one of kBcastVecs where Nw leaves part of a kStreamVecs one.
static_assert(kStreamVecs == kBcastVecs || kStreamVecs == 2 * kBcastVecs);

// Bytes of B per block of the reduction (rows of B's full-width column range), in quarters of one core's L2,
// and its most steps: at the AVX-512 levels the level-2 rule of kernels/cpu/cache.h, l2_block_bytes (a
// quarter; the block being computed and the next one, fetched meanwhile in memory order, stay in L2 next to
// the partial sums); below AVX-512 the whole of L2 up to 128 steps, nothing fetched (kFetchNextBlock): there
// the panels are one cache line of a row wide (avx2; half a line at baseline, against AVX-512's four), the
// hardware's prefetchers follow them, and the fetched block (half of L2 at 64 steps of 8 KiB rows, the
// 6144-FMA minimum below) evicted lines of the current one still to be read; past 128 steps the blocks ran
// slower again (docs/performance.md, "gemm_bcast reduction blocks", "Whole-L2 blocks below AVX-512"). The
// step count is a multiple of 8 (even: the paired bf16 steps never straddle two blocks); the block size only
// changes where partial sums are parked, not the order of any sum.
#if defined(__AVX512F__)
constexpr int64_t kBlockL2Quarters = 1;
constexpr bool kFetchNextBlock = true;
constexpr int64_t kMaxBlockSteps = 256;
#else
constexpr int64_t kBlockL2Quarters = 4;
constexpr bool kFetchNextBlock = false;
constexpr int64_t kMaxBlockSteps = 128;
#endif

// Fewest steps of a reduction block: a register block's fixed cost per block (its call, its MR x NV partial
// sums loaded and parked) spread over at least 6144 multiply-adds, 24 steps at AVX-512 (4 x 4 x 16 a step),
// 64 at AVX2 (6 x 2 x 8), 128 at baseline (6 x 2 x 4). The L2 rule alone gives 16 steps of 8 KiB rows on a
// 512 KiB L2, too few for the blocks' fixed cost; on a 1 MiB L2 it gives 32 at AVX-512 (docs/performance.md,
// "gemm_bcast reduction blocks", "At least 6144 multiply-adds a register block per reduction block").
constexpr int64_t kMinBlockSteps = (6144 / (kBcastRows * kBcastVecs * kBlock) + 7) / 8 * 8;
static_assert(kMinBlockSteps <= kMaxBlockSteps);

// The reduction block's steps (rows of B, `row_bytes` of them read, `ld_bytes` apart) by the rules above,
// then at most as many as one core's L2 streamer follows where that count is known (kernels/cpu/cache.h,
// prefetch_streams; Intel: 32 streams, one per 4 KiB page): the panels go down a block's rows a few lines of
// each at a time, so every page the rows cross at one column is a stream of its own (rows under a page apart
// share one), and past that count the hardware fetches none of them ahead. The cap comes before the 6144-FMA
// floor. On an Intel Xeon (2 MiB L2), `grad @ W` of 16-row groups at avx2, rows 8 KiB apart, took 318 ms in
// 128-step blocks, 287 in 48, 218 in 40 and 135-139 in 16-32; rows 3 KiB apart (down_proj) 117-121 in 64-168,
// 58-65 in 32-48 (docs/performance.md, "Reduction blocks within the L2 streamer's streams"). A multiple of 8.
// The rows `ld_bytes` apart that cross at most prefetch_streams() pages at one column; 0 where that count is
// unknown (no cap).
int64_t rows_within_streams(int64_t ld_bytes) {
  return prefetch_streams() * 4096 / std::clamp<int64_t>(ld_bytes, 1, 4096);
}

int64_t reduction_block_steps(int64_t row_bytes, int64_t ld_bytes) {
  const int64_t by_l2 =
      std::clamp<int64_t>(kBlockL2Quarters * l2_block_bytes() / std::max<int64_t>(1, row_bytes) / 8 * 8,
                          kMinBlockSteps, kMaxBlockSteps);
  const int64_t rows = rows_within_streams(ld_bytes);
  return rows > 0 ? std::min(by_l2, std::max<int64_t>(8, rows / 8 * 8)) : by_l2;
}

// bf16 (dot-product instruction): a short reduction's panels (the weight gradients of small groups) are
// interleaved once when at least this many row blocks read them; the long reductions of grad @ W (4 row
// blocks a panel) ran slower interleaved and unpack (docs/performance.md, "gemm_bcast reduction blocks").
constexpr int64_t kInterleaveRowBlocks = 8;

// bf16 (dot-product instruction) with A's pairs in its rows and more reduction steps than this: outer_panels.
constexpr int64_t kPanelMinSteps = 64;

// The partial sums of one register block between reduction blocks: fp32 (fp64 for fp64) rows of ld elements.
template <class Ac>
struct Partial {
  Ac* sums;  // null: the whole reduction in one pass
  int64_t ld;
  bool resume;  // start from the sums (else from zero)
  bool park;    // end by writing the sums back (else round into C)
};

// The calling thread's scratch for partial sums, grown on demand (a task's block: up to a few hundred KiB).
template <class Ac, int Tag = 0>
Ac* scratch(int64_t n) {
  thread_local std::vector<Ac> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// A run of cache lines to prefetch, walked row by row through a region whose rows are `row_lines` lines wide
// and `ld` bytes apart: `lines` lines from line `col` of the row at `row_start`, `per_step` of them each step
// of a block (a pointer walked row by row: no multiply in the register-block loops).
struct Fetch {
  const char* row_start = nullptr;  // the row being walked
  int64_t ld = 0, row_lines = 1, col = 0, lines = 0, per_step = 0;

  // The whole of `rows` rows of `row_bytes` from `first`, `ld` bytes apart (none: nothing to fetch).
  static Fetch rows_of(const void* first, int64_t ld, int64_t row_bytes, int64_t rows) {
    Fetch f;
    f.row_start = static_cast<const char*>(first);
    f.ld = ld;
    f.row_lines = (row_bytes + 63) / 64;
    f.lines = std::max<int64_t>(0, rows) * f.row_lines;
    return f;
  }
  // Share `call` of `calls` equal shares of the run, spread over `steps` steps.
  Fetch share(int64_t call, int64_t calls, int64_t steps) const {
    Fetch f;
    const int64_t per_call = calls > 0 ? (lines + calls - 1) / calls : 0, start = call * per_call;
    if (per_call <= 0 || start >= lines) return f;
    f = *this;
    f.row_start = row_start + start / row_lines * ld;
    f.col = start % row_lines;
    f.lines = std::min(per_call, lines - start);
    f.per_step = (per_call + std::max<int64_t>(1, steps) - 1) / std::max<int64_t>(1, steps);
    return f;
  }
  // Inlined into the register-block loops, which otherwise call it (twice a paired step) with nothing to do.
  // Into the level-2 cache (prefetcht1): the block is read after all of this one, and filling level 1 with it
  // evicted the panels and partial sums in use (docs/performance.md, "gemm_bcast reduction blocks").
  template <int Locality = 2>
  __attribute__((always_inline)) inline void step() {
    if (lines <= 0) return;
    for (int64_t i = 0; i < per_step && lines > 0; ++i, --lines) {
      __builtin_prefetch(row_start + col * 64, 0, Locality);
      if (++col == row_lines) {
        col = 0;
        row_start += ld;
      }
    }
  }
};

// Scalar math: C[m, n] = round(sum_p float(A(m, p)) * float(B[p, n])), p in order.
// Register block: MR rows of C x NV vectors along n, over P steps of p (one block of the reduction).
// ABlock: A is a row block of outer_blocks' copy, A(i, p) at A[p * MR + i] (a_m and a_p unused).
// Later: only row 0 goes to C; rows 1.. are stored as they are (store_native) to `later`, NV vectors a row,
// for the caller to write out (outer_blocks' row order, which streams row i i blocks later). `ahead`: the
// rows of B from this block's first that may be fetched (0: its P).
template <class T, int MR, int NV, bool Stream, class TA = T, class TB = T, bool ABlock = false,
          bool Later = false>
void bcast_block(const TA* A, int64_t a_m, int64_t a_p, const TB* B, int64_t ldb, T* C, int64_t ldc,
                 int64_t P, const Partial<Acc<T>>& part, bool near = true, Fetch fetch = {},
                 Acc<T>* later = nullptr, int64_t ahead = 0) {
  const int64_t fetchable = ahead > 0 ? ahead : P;
  using Ac = Acc<T>;
  using V = Vec<Ac>;
  V acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j)
      acc[i][j] = part.resume ? load_native(part.sums + i * part.ld + j * kBlock) : V{};
  for (int64_t p = 0; p < P; ++p) {
    // `near`: fetch this panel's rows kNearRows ahead (one hint per cache line); `fetch`: a share of the
    // caller's next reduction block, in memory order.
    fetch.step();
    if (near && p + kNearRows < fetchable) {
      for (int64_t off = 0; off < NV * kBlock * int64_t(sizeof(TB)); off += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(B + (p + kNearRows) * ldb) + off, 0, kNearLocality);
    }
    V b[NV];
    for (int j = 0; j < NV; ++j) b[j] = load<Ac>(B + p * ldb + j * kBlock);
    for (int i = 0; i < MR; ++i) {
      const Ac a = to_acc<Ac>(ABlock ? A[p * MR + i] : A[i * a_m + p * a_p]);
      for (int j = 0; j < NV; ++j) acc[i][j] += a * b[j];
    }
  }
  if (part.park) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NV; ++j) store_native(part.sums + i * part.ld + j * kBlock, acc[i][j]);
    return;
  }
  if constexpr (Later) {
    for (int j = 0; j < NV; ++j) store_out<Stream>(C + j * kBlock, acc[0][j]);
    for (int i = 1; i < MR; ++i)
      for (int j = 0; j < NV; ++j) store_native(later + ((i - 1) * NV + j) * kBlock, acc[i][j]);
    return;
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) store_out<Stream>(C + i * ldc + j * kBlock, acc[i][j]);
}

// bcast_block compiled as a function of its own (see its caller).
template <class T, int MR, int NV, bool Stream, class TA, class TB, bool ABlock, bool Later = false>
__attribute__((noinline)) void bcast_block_apart(const TA* A, int64_t a_m, int64_t a_p, const TB* B,
                                                 int64_t ldb, T* C, int64_t ldc, int64_t P,
                                                 const Partial<Acc<T>>& part, bool near, Fetch fetch,
                                                 Acc<T>* later = nullptr) {
  bcast_block<T, MR, NV, Stream, TA, TB, ABlock, Later>(A, a_m, a_p, B, ldb, C, ldc, P, part, near, fetch,
                                                        later);
}

#if defined(__AVX512BF16__)
// bf16 outer products with the dot-product instruction, two steps of p at a time: lane l of a dot product
// adds a[2l] * b[2l] + a[2l+1] * b[2l+1], so the pair (A(m, p), A(m, p+1)) is broadcast to every lane and
// rows p and p+1 of B are interleaved (unpack within 128-bit lanes). The unpacks permute the columns: the low
// half holds columns {0-3, 8-11, 16-19, 24-27} of a 32-column chunk, the high half the others; the final
// stores undo it (partial sums are parked in the permuted order). Products are exact and sums fp32; an odd
// last step pairs with zeros. PairInRow: A(m, p + 1) follows A(m, p) in memory (a_p == 1), one 32-bit load
// per pair. One paired step: rows p and p+1 of B's 64 columns (r0*, r1*), interleaved, times A's pairs of MR
// rows. The products of one paired step with B's rows already interleaved (b0-b3: 32 columns' pairs each).
template <int MR, bool PairInRow>
__attribute__((always_inline)) inline void dp_pairs(__m512 (&acc)[MR][4], __m512bh b0, __m512bh b1,
                                                    __m512bh b2, __m512bh b3, const uint16_t* a, int64_t a_m,
                                                    int64_t a_p, bool pair) {
  for (int i = 0; i < MR; ++i) {
    const uint16_t* ai = a + i * a_m;
    uint32_t bits;
    if (PairInRow && pair)
      std::memcpy(&bits, ai, 4);
    else
      bits = uint32_t(ai[0]) | (pair ? uint32_t(ai[a_p]) << 16 : 0u);
    const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(bits));
    acc[i][0] = _mm512_dpbf16_ps(acc[i][0], av, b0);
    acc[i][1] = _mm512_dpbf16_ps(acc[i][1], av, b1);
    acc[i][2] = _mm512_dpbf16_ps(acc[i][2], av, b2);
    acc[i][3] = _mm512_dpbf16_ps(acc[i][3], av, b3);
  }
}

template <int MR, bool PairInRow>
__attribute__((always_inline)) inline void dp_step(__m512 (&acc)[MR][4], __m512i r0a, __m512i r0b,
                                                   __m512i r1a, __m512i r1b, const uint16_t* a, int64_t a_m,
                                                   int64_t a_p, bool pair) {
  dp_pairs<MR, PairInRow>(acc, (__m512bh)_mm512_unpacklo_epi16(r0a, r1a),
                          (__m512bh)_mm512_unpackhi_epi16(r0a, r1a),
                          (__m512bh)_mm512_unpacklo_epi16(r0b, r1b),
                          (__m512bh)_mm512_unpackhi_epi16(r0b, r1b), a, a_m, a_p, pair);
}

// Word indices pairing two 32-element rows r0, r1 column by column in natural order: (r0[c], r1[c]) for
// c = 0..15 (pair_lo) and 16..31 (pair_hi), for vpermt2w.
inline __m512i pair_lo() {
  return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                          36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
}
inline __m512i pair_hi() {
  return _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54, 22, 53,
                          21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
}

// The interleaved form of a panel of B (P rows x 64 columns, rows ldb apart), written once for all the row
// blocks that read it: per paired step, four vectors of 16 column pairs in natural column order (an odd last
// row paired with zeros), 128 elements a step, so the row blocks store their sums without permuting them
// back. `near`: rows are fetched a few steps ahead.
inline void interleave_panel(const BFloat16* B, int64_t ldb, int64_t P, bool near, uint16_t* out) {
  for (int64_t p = 0; p < P; p += 2, out += 128) {
    if (near)
      for (int64_t q = p + kPrefetchRows; q < std::min(P, p + kPrefetchRows + 2); ++q) {
        __builtin_prefetch(reinterpret_cast<const char*>(B + q * ldb));
        __builtin_prefetch(reinterpret_cast<const char*>(B + q * ldb) + 64);
      }
    const BFloat16* b = B + p * ldb;
    const __m512i r0a = _mm512_loadu_si512(b), r0b = _mm512_loadu_si512(b + 32);
    const __m512i r1a = p + 1 < P ? _mm512_loadu_si512(b + ldb) : _mm512_setzero_si512();
    const __m512i r1b = p + 1 < P ? _mm512_loadu_si512(b + ldb + 32) : _mm512_setzero_si512();
    _mm512_storeu_si512(out, _mm512_permutex2var_epi16(r0a, pair_lo(), r1a));
    _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(r0a, pair_hi(), r1a));
    _mm512_storeu_si512(out + 64, _mm512_permutex2var_epi16(r0b, pair_lo(), r1b));
    _mm512_storeu_si512(out + 96, _mm512_permutex2var_epi16(r0b, pair_hi(), r1b));
  }
}

// Inter: B is an interleave_panel of the P steps (ldb and near unused).
template <int MR, bool Stream, bool PairInRow, bool Inter = false>
void bcast_block_dp(const BFloat16* A, int64_t a_m, int64_t a_p, const BFloat16* B, int64_t ldb, BFloat16* C,
                    int64_t ldc, int64_t P, const Partial<float>& part, bool near, Fetch fetch) {
  constexpr int kChunks = 2;  // 2 x 32 columns
  __m512 acc[MR][2 * kChunks];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2 * kChunks; ++j)
      acc[i][j] = part.resume ? _mm512_loadu_ps(part.sums + i * part.ld + 16 * j) : _mm512_setzero_ps();
  const uint16_t* a16 = reinterpret_cast<const uint16_t*>(A);
  const int64_t Pe = P - P % 2;
  if constexpr (Inter) {
    const uint16_t* b = reinterpret_cast<const uint16_t*>(B);
    for (int64_t p = 0; p < Pe; p += 2, b += 128) {
      fetch.step();
      fetch.step();
      dp_pairs<MR, PairInRow>(acc, (__m512bh)_mm512_loadu_si512(b), (__m512bh)_mm512_loadu_si512(b + 32),
                              (__m512bh)_mm512_loadu_si512(b + 64), (__m512bh)_mm512_loadu_si512(b + 96),
                              a16 + p * a_p, a_m, a_p, true);
    }
    if (Pe < P)
      dp_pairs<MR, PairInRow>(acc, (__m512bh)_mm512_loadu_si512(b), (__m512bh)_mm512_loadu_si512(b + 32),
                              (__m512bh)_mm512_loadu_si512(b + 64), (__m512bh)_mm512_loadu_si512(b + 96),
                              a16 + Pe * a_p, a_m, a_p, false);
  }
  for (int64_t p = 0; !Inter && p < Pe; p += 2) {
    fetch.step();
    fetch.step();
    if (near) {
      for (int64_t q = p + kPrefetchRows; q < std::min(P, p + kPrefetchRows + 2); ++q)
        for (int64_t off = 0; off < kChunks * 64; off += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(B + q * ldb) + off);
    }
    const BFloat16* b = B + p * ldb;
    dp_step<MR, PairInRow>(acc, _mm512_loadu_si512(b), _mm512_loadu_si512(b + 32),
                           _mm512_loadu_si512(b + ldb), _mm512_loadu_si512(b + ldb + 32), a16 + p * a_p, a_m,
                           a_p, true);
  }
  if (!Inter && Pe < P) {
    const BFloat16* b = B + Pe * ldb;
    dp_step<MR, PairInRow>(acc, _mm512_loadu_si512(b), _mm512_loadu_si512(b + 32), _mm512_setzero_si512(),
                           _mm512_setzero_si512(), a16 + Pe * a_p, a_m, a_p, false);
  }
  if (part.park) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 2 * kChunks; ++j) _mm512_storeu_ps(part.sums + i * part.ld + 16 * j, acc[i][j]);
    return;
  }
  if constexpr (Inter) {
    // Natural order: 32 columns rounded in one conversion, one 64-byte store.
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < kChunks; ++c) {
        const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(acc[i][2 * c + 1], acc[i][2 * c]);
        BFloat16* dst = C + i * ldc + 32 * c;
        if (Stream && reinterpret_cast<uintptr_t>(dst) % 64 == 0)
          _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
        else
          _mm512_storeu_si512(dst, v);
      }
    return;
  }
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < kChunks; ++c) {
      const __m512 lo = acc[i][2 * c], hi = acc[i][2 * c + 1];
      store_out<Stream>(C + i * ldc + 32 * c, (VF)_mm512_permutex2var_ps(lo, lo_idx, hi));
      store_out<Stream>(C + i * ldc + 32 * c + 16, (VF)_mm512_permutex2var_ps(lo, hi_idx, hi));
    }
}

// ---- bf16, A's pairs in its rows, long reductions (grad @ W) ---------------------------------------------
// Column tiles of 32: for each block of the reduction, the tile's panel (the block's rows of B, 64 bytes
// each) is interleaved once into a contiguous level-1 buffer (two vectors a paired step), then every row
// block of up to 12 rows (24 accumulators) reads it there: one broadcast and two dot products per row and
// paired step, no unpacks in the inner loop, B read from memory once per call. The products and their order
// are those of bcast_block_dp (each element adds its pairs in order of p), so results match it bit for bit.
constexpr int kPanelCols = 32;
constexpr int kPanelRows = 12;

// Rows [0, P) of B's N columns in tiles of 32 (the last one's columns past N zero), each tile `tstride`
// elements after the previous: per paired step two vectors, unpacklo / unpackhi of rows p and p+1 (an odd
// last row paired with zeros). B is read in memory order, two rows at a time.
inline void interleave_block(const BFloat16* B, int64_t ldb, int64_t P, int64_t N, uint16_t* out,
                             int64_t tstride) {
  const int64_t full = N / kPanelCols, rest = N % kPanelCols;
  const __mmask32 mask = (__mmask32(1) << rest) - 1;
  for (int64_t p = 0; p < P; p += 2, out += 64) {
    const BFloat16* r0 = B + p * ldb;
    const BFloat16* r1 = r0 + ldb;
    const bool two = p + 1 < P;
    uint16_t* o = out;
    for (int64_t t = 0; t < full; ++t, o += tstride) {
      const __m512i a = _mm512_loadu_si512(r0 + t * kPanelCols);
      const __m512i b = two ? _mm512_loadu_si512(r1 + t * kPanelCols) : _mm512_setzero_si512();
      _mm512_store_si512(o, _mm512_unpacklo_epi16(a, b));
      _mm512_store_si512(o + 32, _mm512_unpackhi_epi16(a, b));
    }
    if (rest) {
      const __m512i a = _mm512_maskz_loadu_epi16(mask, r0 + full * kPanelCols);
      const __m512i b = two ? _mm512_maskz_loadu_epi16(mask, r1 + full * kPanelCols) : _mm512_setzero_si512();
      _mm512_store_si512(o, _mm512_unpacklo_epi16(a, b));
      _mm512_store_si512(o + 32, _mm512_unpackhi_epi16(a, b));
    }
  }
}

// MR rows of A (pairs contiguous: a_p == 1) times one interleaved panel of P steps; partial sums parked in
// the permuted column order, results stored in natural order (cols < 32: masked).
template <int MR, bool Stream>
void panel_rows(const uint32_t* A, const uint16_t* panel, int64_t P, const Partial<float>& part, BFloat16* C,
                int64_t ldc, int64_t cols, Fetch fetch) {
  __m512 lo[MR], hi[MR];
  for (int i = 0; i < MR; ++i) {
    lo[i] = part.resume ? _mm512_loadu_ps(part.sums + i * part.ld) : _mm512_setzero_ps();
    hi[i] = part.resume ? _mm512_loadu_ps(part.sums + i * part.ld + 16) : _mm512_setzero_ps();
  }
  const int64_t steps = (P + 1) / 2;
  for (int64_t q = 0; q < steps; ++q, panel += 64, A += MR) {
    fetch.step();
    const __m512bh b0 = (__m512bh)_mm512_load_si512(panel);
    const __m512bh b1 = (__m512bh)_mm512_load_si512(panel + 32);
    for (int i = 0; i < MR; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(A[i]));
      lo[i] = _mm512_dpbf16_ps(lo[i], av, b0);
      hi[i] = _mm512_dpbf16_ps(hi[i], av, b1);
    }
  }
  if (part.park) {
    for (int i = 0; i < MR; ++i) {
      _mm512_storeu_ps(part.sums + i * part.ld, lo[i]);
      _mm512_storeu_ps(part.sums + i * part.ld + 16, hi[i]);
    }
    return;
  }
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < MR; ++i) {
    const VF v0 = (VF)_mm512_permutex2var_ps(lo[i], lo_idx, hi[i]);
    const VF v1 = (VF)_mm512_permutex2var_ps(lo[i], hi_idx, hi[i]);
    BFloat16* c = C + i * ldc;
    if (cols == kPanelCols) {
      store_out<Stream>(c, v0);
      store_out<Stream>(c + 16, v1);
    } else {
      const int64_t c0 = std::min<int64_t>(cols, 16), c1 = cols - c0;
      _mm256_mask_storeu_epi16(c, static_cast<__mmask16>((1u << c0) - 1), pack16(v0, BFloat16{}));
      if (c1 > 0)
        _mm256_mask_storeu_epi16(c + 16, static_cast<__mmask16>((1u << c1) - 1), pack16(v1, BFloat16{}));
    }
  }
}

template <bool Stream>
void panel_rows_any(int mr, const uint32_t* A, const uint16_t* panel, int64_t P, const Partial<float>& part,
                    BFloat16* C, int64_t ldc, int64_t cols, Fetch fetch) {
  switch (mr) {
#define KERNMAP_PANEL_ROWS(R) \
  case R:                     \
    return panel_rows<R, Stream>(A, panel, P, part, C, ldc, cols, fetch);
    KERNMAP_PANEL_ROWS(1)
    KERNMAP_PANEL_ROWS(2)
    KERNMAP_PANEL_ROWS(3)
    KERNMAP_PANEL_ROWS(4)
    KERNMAP_PANEL_ROWS(5)
    KERNMAP_PANEL_ROWS(6)
    KERNMAP_PANEL_ROWS(7)
    KERNMAP_PANEL_ROWS(8)
    KERNMAP_PANEL_ROWS(9)
    KERNMAP_PANEL_ROWS(10)
    KERNMAP_PANEL_ROWS(11)
    KERNMAP_PANEL_ROWS(12)
#undef KERNMAP_PANEL_ROWS
    default:
      std::abort();
  }
}

// Columns in chunks (as even as possible) narrow enough for reduction blocks of at least kPanelMinBlock
// steps: fewer partial-sum round trips and tile switches per step, the same sums; 256 steps were slower for
// down_proj (docs/performance.md, "gemm_bcast reduction blocks").
constexpr int64_t kPanelMinBlock = 128;

// C[M, N] = A[M, P] B[P, N], A's rows contiguous. The reduction goes in blocks of ~l2_block_bytes() of B
// (rows of one column chunk), each block through the chunks in turn, so that every row of B is read whole
// within a block, one chunk after another, while the next (block, chunk) in that order is fetched. Chunks
// outer, each over the whole reduction, read every row of gate_up's weights (4 KiB of bf16 at H 2048) in
// halves 3 MiB apart, which the hardware's prefetchers serve at about half the rate of whole rows
// (grad @ W of 16-row groups at avx512bf16 ran 6-8 % slower; docs/performance.md, "gemm_bcast reduction
// blocks", "Chunks inner"). Rows in as few blocks of up to kPanelRows as cover M, as even as possible.
template <bool Stream>
void outer_panels(const BFloat16* A, int64_t lda, const BFloat16* B, int64_t ldb, BFloat16* C, int64_t ldc,
                  int64_t M, int64_t N, int64_t P) {
  const int64_t widest =
      std::max<int64_t>(kPanelCols, l2_block_bytes() / (2 * kPanelMinBlock) / kPanelCols * kPanelCols);
  const int64_t chunks = (N + widest - 1) / widest;
  const int64_t chunk =
      ((N + chunks - 1) / chunks + kPanelCols - 1) / kPanelCols * kPanelCols;  // as even as possible
  const int64_t nchunks = (N + chunk - 1) / chunk;
  const int64_t ctiles = (chunk + kPanelCols - 1) / kPanelCols, Npc = ctiles * kPanelCols;
  const int64_t block_p = std::clamp<int64_t>(l2_block_bytes() / (chunk * 2) / 8 * 8, 16, 256);
  const int64_t step_p = P <= block_p ? std::max<int64_t>(P, 1) : block_p;
  float* sums = step_p < P ? scratch<float>(nchunks * M * Npc) : nullptr;  // chunk c's at c * M * Npc
  // The interleaved block of one chunk: tiles one line more than their size apart (not all in the same
  // cache sets).
  const int64_t tstride = (step_p + 1) / 2 * 64 + 32;
  uint16_t* panels = scratch<uint16_t, 3>(ctiles * tstride + 32);
  panels = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(panels) + 63) / 64 * 64);
  const int64_t nblocks = (M + kPanelRows - 1) / kPanelRows;
  auto row_block = [&](int64_t blk) { return static_cast<int>(M / nblocks + (blk < M % nblocks ? 1 : 0)); };
  uint32_t* apack = scratch<uint32_t, 4>(M * ((step_p + 1) / 2));
  const uint16_t* a16 = reinterpret_cast<const uint16_t*>(A);
  for (int64_t p0 = 0; p0 < std::max<int64_t>(P, 1); p0 += step_p) {
    const int64_t pn = std::min(step_p, P - p0);
    const bool resume = p0 > 0, park = p0 + pn < P;
    // A's pairs of this block (for all its chunks), per row block in step-major order: [step][row] (an odd
    // last step's second element zero, not read from A).
    const int64_t steps = (pn + 1) / 2;
    for (int64_t blk = 0, m = 0; blk < nblocks; m += row_block(blk), ++blk) {
      const int64_t mr = row_block(blk);
      uint32_t* dst = apack + m * steps;
      for (int64_t i = 0; i < mr; ++i) {
        const uint16_t* a = a16 + (m + i) * lda + p0;
        for (int64_t q = 0; q < pn / 2; ++q)
          dst[q * mr + i] = uint32_t(a[2 * q]) | uint32_t(a[2 * q + 1]) << 16;
        if (pn % 2) dst[(steps - 1) * mr + i] = a[pn - 1];
      }
    }
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t n0 = c * chunk, Nc = std::min(chunk, N - n0);
      const int64_t tiles = (Nc + kPanelCols - 1) / kPanelCols;
      // The next (block, chunk), in memory order, spread over this one's paired steps: this block's next
      // chunk, or the next block's first.
      Fetch next;
      if (c + 1 < nchunks)
        next = Fetch::rows_of(B + p0 * ldb + n0 + chunk, ldb * 2, std::min(chunk, N - n0 - chunk) * 2, pn);
      else if (park)
        next = Fetch::rows_of(B + (p0 + pn) * ldb, ldb * 2, std::min(chunk, N) * 2,
                              std::min(step_p, P - p0 - pn));
      interleave_block(B + p0 * ldb + n0, ldb, pn, Nc, panels, tstride);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n = t * kPanelCols, cols = std::min<int64_t>(kPanelCols, Nc - n);
        const uint16_t* panel = panels + t * tstride;
        int64_t m = 0;
        for (int64_t blk = 0; blk < nblocks; ++blk) {
          const int mr = row_block(blk);
          const Fetch fetch = next.share(t * nblocks + blk, tiles * nblocks, pn / 2);
          const Partial<float> part{sums ? sums + c * M * Npc + m * Npc + n : nullptr, Npc, resume, park};
          panel_rows_any<Stream>(mr, apack + m * steps, panel, pn, part, C + m * ldc + n0 + n, ldc, cols,
                                 fetch);
          m += mr;
        }
      }
    }
  }
}
#endif

// Columns beyond the last full vector: scalar, each product added as the vector columns add theirs (fused
// where the level has FMA). a(m, p): A's element.
template <class T, class AOf>
void bcast_tail(AOf&& a, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t M, int64_t n0, int64_t N,
                int64_t P) {
  using Ac = Acc<T>;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < N; ++n) {
      Ac s = 0;
      for (int64_t p = 0; p < P; ++p) s = madd(to_acc<Ac>(a(m, p)), to_acc<Ac>(B[p * ldb + n]), s);
      C[m * ldc + n] = from_acc<T>(s);
    }
}

// Calls block(std::integral_constant<int, R>{}, m) for the R in [1, Rows) equal to `rows`.
template <int R, int Rows, class Block>
void leftover_block(int64_t rows, int64_t m, Block&& block) {
  if constexpr (R < Rows) {
    if (rows == R) return block(std::integral_constant<int, R>{}, m);
    leftover_block<R + 1, Rows>(rows, m, block);
  }
}

// One column block of NV vectors for rows [0, M): row blocks of Rows (kBcastRows unless named), then one
// block of the remaining rows (a block per leftover row would read B once per row).
template <int Rows = kBcastRows, class Block>
void row_blocks(int64_t M, Block&& block) {
  const int64_t Mb = M - M % Rows;
  for (int64_t m = 0; m < Mb; m += Rows) block(std::integral_constant<int, Rows>{}, m);
  leftover_block<1, Rows>(M - Mb, Mb, block);
}

#if defined(__AMX_BF16__)
// ---- AMX tiles (the amx level, bf16; kernels/cpu/amx.h) --------------------------------------------------
//
// C's tiles are C itself, 16 rows of A by 16 columns of B. A goes in the tiles' A place: A(m, p) packed once
// per call into tiles of 16 rows x 32 steps (zeros past M and P), whatever A's strides. B goes in the B
// place: its rows paired (p, p + 1) column by column, in 16-column blocks, one block of the reduction at a
// time (the level-2 rule of l2_block_bytes, whole rows of B read in memory order), the sums of each tile
// parked in fp32 between blocks. Each element adds its pairs in order of p whatever M's split (its tile's
// rows do not meet). Register plans as gemm_nt's: one 16-row group of A against 3 column blocks (tmm0-2
// sums, tmm3-5 B, tmm6 A), or groups in pairs against 2 blocks (tmm0-3, tmm4-5 B, tmm6-7 A); blocks and
// groups past the edge are zero tiles read with a zero stride.

// A's tiles where A is read across its rows (a_m = 1: the weight gradients' x^T, its element (m, p) at
// x[p][m]): tile (g, s) row r = A(16g + r, 32s + i), i < 32, zero past M and P. Eight columns of m at a time:
// register k holds rows p = 32s + k + 8q of x in lane q (masked: nothing read past M or P), the lanes' 8 x 8
// blocks transposed (kernels/cpu/lanes.h), and register j is then tile row c0 + j whole: one store. Element
// by element the copy took about 3 ms of gate_up's and of down_proj's bf16 weight gradients at E128 k8 H2048
// I768 T256, 2 threads, an Intel Xeon (cut-out builds; docs/performance.md, "AMX tiles").
void pack_tiles_across(const BFloat16* A, int64_t a_p, int64_t M, int64_t P, int64_t groups, int64_t steps,
                       BFloat16* a_tiles) {
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t c0 = g * kTileRows + 8 * h, p0 = s * kTileK;
        const int64_t cols = std::clamp<int64_t>(M - c0, 0, 8);
        const auto cmask = static_cast<__mmask8>((1u << cols) - 1);
        Words a[8], out[8];
        for (int k = 0; k < 8; ++k) {
          auto lane = [&](int q) {
            const int64_t p = p0 + k + 8 * q;
            return p < P && cols > 0 ? _mm_maskz_loadu_epi16(cmask, A + p * a_p + c0) : _mm_setzero_si128();
          };
          a[k] = _mm512_inserti32x4(
              _mm512_inserti32x4(_mm512_inserti32x4(_mm512_zextsi128_si512(lane(0)), lane(1), 1), lane(2), 2),
              lane(3), 3);
        }
        transpose_words_8x8(a, out);
        BFloat16* t = a_tiles + ((g * steps + s) * kTileRows + 8 * h) * kTileK;
        for (int j = 0; j < 8; ++j) _mm512_storeu_si512(t + j * kTileK, out[j]);
      }
}

// Rows [p0, p0 + steps * 32) of B (zero past P and past N) as pairs: block j's pair row q at
// out + (j * steps * 16 + q) * 32, or with `rows_major` at out + (q * blocks + j) * 32 (each pair row's
// blocks side by side, written in the order they are read; a block's tile then has rows blocks * 64 bytes
// apart).
inline void pair_rows(const BFloat16* B, int64_t ldb, int64_t P, int64_t N, int64_t p0, int64_t steps,
                      bool rows_major, BFloat16* out) {
  const int64_t blocks = (N + kTileRows - 1) / kTileRows, pairs = steps * kTileRows;
  for (int64_t q = 0; q < pairs; ++q) {
    const int64_t r0 = p0 + 2 * q;
    const BFloat16* b0 = B + r0 * ldb;
    for (int64_t c = 0; c < N; c += 32) {
      const __mmask32 mask = N - c >= 32 ? ~__mmask32(0) : (__mmask32(1) << (N - c)) - 1;
      const __m512i x0 = r0 < P ? _mm512_maskz_loadu_epi16(mask, b0 + c) : _mm512_setzero_si512();
      const __m512i x1 = r0 + 1 < P ? _mm512_maskz_loadu_epi16(mask, b0 + ldb + c) : _mm512_setzero_si512();
      const int64_t j = c / kTileRows;
      const auto at = [&](int64_t block) {
        return out + (rows_major ? q * blocks + block : block * pairs + q) * 32;
      };
      _mm512_storeu_si512(at(j), _mm512_permutex2var_epi16(x0, pair_lo(), x1));
      if (j + 1 < blocks) _mm512_storeu_si512(at(j + 1), _mm512_permutex2var_epi16(x0, pair_hi(), x1));
    }
  }
}

// One group against three blocks: tile j's sums start from start[j] (null: zero) and end in end[j]. (The two
// plans are written out: tile numbers are immediates.)
void outer_pass_1x3(const TileRun& a, const TileRun (&b)[3], int64_t steps, float* const (&start)[3],
                    float* const (&end)[3]) {
  KERNMAP_TILE_START(0, start[0]);
  KERNMAP_TILE_START(1, start[1]);
  KERNMAP_TILE_START(2, start[2]);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, a.at(s), a.row_bytes);
    _tile_loadd(3, b[0].at(s), b[0].row_bytes);
    _tile_loadd(4, b[1].at(s), b[1].row_bytes);
    _tile_loadd(5, b[2].at(s), b[2].row_bytes);
    _tile_dpbf16ps(0, 6, 3);
    _tile_dpbf16ps(1, 6, 4);
    _tile_dpbf16ps(2, 6, 5);
  }
  _tile_stored(0, end[0], 64);
  _tile_stored(1, end[1], 64);
  _tile_stored(2, end[2], 64);
}

// Two groups against two blocks: tile 2g + j is group g's sums over block j.
void outer_pass_2x2(const TileRun (&a)[2], const TileRun (&b)[2], int64_t steps, float* const (&start)[4],
                    float* const (&end)[4]) {
  KERNMAP_TILE_START(0, start[0]);
  KERNMAP_TILE_START(1, start[1]);
  KERNMAP_TILE_START(2, start[2]);
  KERNMAP_TILE_START(3, start[3]);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, a[0].at(s), a[0].row_bytes);
    _tile_loadd(7, a[1].at(s), a[1].row_bytes);
    _tile_loadd(4, b[0].at(s), b[0].row_bytes);
    _tile_loadd(5, b[1].at(s), b[1].row_bytes);
    _tile_dpbf16ps(0, 6, 4);
    _tile_dpbf16ps(1, 6, 5);
    _tile_dpbf16ps(2, 7, 4);
    _tile_dpbf16ps(3, 7, 5);
  }
  _tile_stored(0, end[0], 64);
  _tile_stored(1, end[1], 64);
  _tile_stored(2, end[2], 64);
  _tile_stored(3, end[3], 64);
}

// Stream: C's rows are written with streaming stores (C aligned as can_stream checks).
template <bool Stream>
void amx_outer(const BFloat16* A, int64_t a_m, int64_t a_p, const BFloat16* B, int64_t ldb, BFloat16* C,
               int64_t ldc, int64_t M, int64_t N, int64_t P) {
  if (P <= 0) {
    for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, N * sizeof(BFloat16));
    return;
  }
  const int64_t groups = (M + kTileRows - 1) / kTileRows, blocks = (N + kTileRows - 1) / kTileRows;
  const int64_t steps = (P + kTileK - 1) / kTileK;
  // Steps of a reduction block: its rows of B (N wide) about l2_block_bytes.
  const int64_t block_steps = std::clamp<int64_t>(
      l2_block_bytes() / std::max<int64_t>(1, N * int64_t(sizeof(BFloat16)) * kTileK), 1, steps);
  BFloat16* a_tiles = scratch<BFloat16, 4>(groups * steps * kTileRows * kTileK + kTileK);
  BFloat16* b_pairs = scratch<BFloat16, 5>(blocks * block_steps * kTileRows * kTileK);
  float* sums = steps > block_steps ? scratch<float, 6>(groups * blocks * kTileRows * kTileRows) : nullptr;
  alignas(64) float out[8 * kTileRows * kTileRows];
  // B's pairs in pair-row order where each of their tiles is loaded once (one or two groups of A: grad @ W
  // of up to 32 rows): pair_rows then writes them in the order it reads B, where the block-by-block order
  // scattered its stores over the blocks; grad @ W of gate_up at 16 rows a group, 2 threads, an Intel Xeon:
  // 72.6-78.0 -> 64.0-67.2 ms. More groups load each tile again, which rows blocks * 64 bytes apart share
  // level-1 sets: the weight gradients (dozens of groups) ran 52.4 against 56.9 ms in the block order.
  const bool rows_major = groups <= 2;
  // A: tile (g, s) row r holds A(16g + r, 32s + i), i < 32; then one zero row (missing groups and blocks).
  if (a_m == 1)
    pack_tiles_across(A, a_p, M, P, groups, steps, a_tiles);
  else
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t r = 0; r < kTileRows; ++r) {
        const int64_t m = g * kTileRows + r;
        for (int64_t s = 0; s < steps; ++s) {
          BFloat16* t = a_tiles + ((g * steps + s) * kTileRows + r) * kTileK;
          for (int64_t i = 0; i < kTileK; ++i) {
            const int64_t p = s * kTileK + i;
            t[i] = m < M && p < P ? A[m * a_m + p * a_p] : BFloat16{};
          }
        }
      }
  const BFloat16* zeros = a_tiles + groups * steps * kTileRows * kTileK;
  std::memset(const_cast<BFloat16*>(zeros), 0, kTileK * sizeof(BFloat16));
  auto a_run = [&](int64_t g, int64_t s0) -> TileRun {
    if (g >= groups) return {zeros, 0, 0};
    return {a_tiles + (g * steps + s0) * kTileRows * kTileK, kTileRows * kTileK * 2, 64};
  };
  auto b_run = [&](int64_t j, int64_t n_steps) -> TileRun {
    if (j >= blocks) return {zeros, 0, 0};
    if (rows_major) return {b_pairs + j * kTileK, kTileRows * blocks * 64, blocks * 64};
    return {b_pairs + j * n_steps * kTileRows * kTileK, kTileRows * kTileK * 2, 64};
  };
  auto park = [&](int64_t g, int64_t j) { return sums + (g * blocks + j) * kTileRows * kTileRows; };
  // Round the sums of `tiles` tiles of group g, blocks j, j + 1, ... (out's tiles t0, t0 + 1, ...) into C,
  // row by row across the tiles (a streamed row of two tiles is one whole cache line, of four tiles two),
  // nothing past the edges: 16 columns in one vcvtneps2bf16, the columns past N masked, so every element is
  // rounded alike whatever the call's N.
  auto write = [&](int t0, int tiles, int64_t g, int64_t j) {
    const int64_t rows = std::min(kTileRows, M - g * kTileRows);
    for (int64_t r = 0; r < rows; ++r)
      for (int t = 0; t < tiles; ++t) {
        const int64_t cols = std::min(kTileRows, N - (j + t) * kTileRows);
        if (cols <= 0) break;
        BFloat16* c = C + (g * kTileRows + r) * ldc + (j + t) * kTileRows;
        const __m256i v =
            (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(out + ((t0 + t) * kTileRows + r) * kTileRows));
        if (Stream && cols == kTileRows)
          _mm256_stream_si256(reinterpret_cast<__m256i*>(c), v);
        else
          _mm256_mask_storeu_epi16(c, static_cast<__mmask16>((1u << cols) - 1), v);
      }
  };
  load_tile_config();
  for (int64_t s0 = 0; s0 < steps; s0 += block_steps) {
    const int64_t n_steps = std::min(block_steps, steps - s0);
    const bool first = s0 == 0, last = s0 + n_steps == steps;
    pair_rows(B, ldb, P, N, s0 * kTileK, n_steps, rows_major, b_pairs);
    memory_barrier();
    // A tile's sums: from zero or its parked sums; to its parked sums, or (the last block) to `out` and C.
    auto from = [&](int64_t g, int64_t j) {
      return first || g >= groups || j >= blocks ? nullptr : park(g, j);
    };
    auto to = [&](int64_t g, int64_t j, int t) {
      return last || g >= groups || j >= blocks ? out + t * kTileRows * kTileRows : park(g, j);
    };
    if (groups == 1) {
      for (int64_t j = 0; j < blocks; j += 3) {
        const TileRun b[3] = {b_run(j, n_steps), b_run(j + 1, n_steps), b_run(j + 2, n_steps)};
        float* const start[3] = {from(0, j), from(0, j + 1), from(0, j + 2)};
        float* const end[3] = {to(0, j, 0), to(0, j + 1, 1), to(0, j + 2, 2)};
        outer_pass_1x3(a_run(0, s0), b, n_steps, start, end);
        if (last) write(0, 3, 0, j);
      }
    } else {
      // Two passes (four blocks of columns) before the last block's sums go to C: group g's in out's tiles
      // 0-3, group g + 1's in 4-7, so each row of C is streamed 64 columns (two cache lines, 128 bytes) at a
      // time, not one line. The weight gradients write C at little more than half the streamed-write rate
      // one line a row (rows 3-4 KiB apart); two lines a row ran near it: bf16 gate_up weight gradient (E128
      // H2048 I768 T256), 2 threads, an Intel Xeon, 50.7-52.8 -> 37.4-38.9 ms (docs/performance.md, "AMX
      // tiles", "AMX weight gradients: two lines a row"). Same passes, same sums: only the order of the
      // passes and where the last block's sums wait change.
      for (int64_t g = 0; g < groups; g += 2)
        for (int64_t j = 0; j < blocks; j += 4) {
          const TileRun a[2] = {a_run(g, s0), a_run(g + 1, s0)};
          const int passes = j + 2 < blocks ? 2 : 1;
          for (int h = 0; h < passes; ++h) {
            const int64_t jh = j + 2 * h;
            const TileRun b[2] = {b_run(jh, n_steps), b_run(jh + 1, n_steps)};
            float* const start[4] = {from(g, jh), from(g, jh + 1), from(g + 1, jh), from(g + 1, jh + 1)};
            const int t = 2 * h;
            float* const end[4] = {to(g, jh, t), to(g, jh + 1, t + 1), to(g + 1, jh, t + 4),
                                   to(g + 1, jh + 1, t + 5)};
            outer_pass_2x2(a, b, n_steps, start, end);
          }
          if (last) {
            write(0, 2 * passes, g, j);
            if (g + 1 < groups) write(4, 2 * passes, g + 1, j);
          }
        }
    }
  }
  _tile_release();
}
#endif

// The register-block form for every type and level: A's elements (as TA: T, or T widened to fp32 in the
// packed copy below) broadcast against vectors of B's rows.
template <class T, bool Stream, class TA>
void outer_blocks(const T* A_in, int64_t a_m, int64_t a_p, const T* B, int64_t ldb, T* C, int64_t ldc,
                  int64_t M, int64_t N, int64_t P) {
  using Ac = Acc<T>;
  const int64_t wide = kBcastVecs * kBlock;
  const int64_t Nw = N - N % wide, Nv = N - N % kBlock;
  // The full-width column blocks go through the reduction in blocks of block_p steps (all column blocks of
  // one reduction block before the next), their partial sums parked in an M x Nw scratch block; fp64 (the
  // gradient checks) in one pass. The sums are the same either way: each element adds its products in order
  // of p.
  const int64_t block_p = reduction_block_steps(Nw * int64_t(sizeof(T)), ldb * int64_t(sizeof(T)));
  // At the AVX-512 levels the next reduction block is fetched by software (below) where fetch_next_block
  // says (kernels/cpu/cache.h): B's rows a page or less apart, or the L2 streamer's streams unknown. Rows
  // further apart the streamer follows within the stream-capped blocks, and the software fetches beside it
  // made them slower (an Intel Xeon, 32-step blocks: 104-106 against 90-92 ms; gate_up's `grad @ W` fp32,
  // rows of 8 KiB, 98-103 against 110). Rows of 4 KiB and less ran faster fetched: `grad @ W` at 16 rows a
  // group, 2 threads, fp32 down_proj (3 KiB) 59-61 -> 45-46 ms; bf16 at avx512 (widened) gate_up (4 KiB)
  // 95-96 -> 83-85, down_proj 51 -> 41 (docs/performance.md, "Reduction blocks within the L2 streamer's
  // streams").
  const bool fetch_next = kFetchNextBlock && fetch_next_block(ldb * int64_t(sizeof(T)));
  const int64_t step_p = std::is_same_v<T, double> || P <= block_p ? std::max<int64_t>(P, 1) : block_p;
#if defined(__AVX512BF16__)
  constexpr bool kDp = std::is_same_v<T, BFloat16> && kBcastVecs * kBlock == 64;
#else
  constexpr bool kDp = false;
#endif
  // A copied once (widened to TA where TA is not T) into M x P elements. Except for the dot-product
  // instruction's bf16 blocks (A's pairs stay in its rows), the copy interleaves each row block's rows step
  // by step (row_blocks' blocks; element i of step p of an MR-row block at p * MR + i): a register block
  // reads its MR scalars at fixed offsets from one pointer. Read in place, MR rows a_m apart took a general
  // register each for their offsets, more than the loop had free, and GCC reloaded them from the stack every
  // step (docs/performance.md, "gemm_bcast reduction blocks"). The dot-product blocks copy A only when read
  // across its rows (the weight gradients' x^T), into M rows of P.
  constexpr bool kABlock = !kDp;
  auto widen = [](auto x) -> TA {
    if constexpr (std::is_same_v<TA, T>)
      return x;
    else
      return to_float(x);
  };
  const int64_t row_blocks_n = (M + kBcastRows - 1) / kBcastRows, calls = Nw / wide * row_blocks_n;
  // A short reduction read by many row blocks (the fp32 weight gradients of small groups) with C streamed,
  // B's full-width rows within short_reduction_bytes (half of L2; kernels/cpu/cache.h): all of B's panels
  // copied once, each contiguous, then row blocks outer and panels inner, in one pass whatever step_p, so C
  // is written along its rows, a row block's lines one after another, by kStreamRows x kStreamVecs blocks.
  // Panels outer streamed each panel's column of C down its rows, every line on another DRAM page, which ran
  // far slower than along the rows. Reading B in place also made every load share its address's low 12 bits
  // with a streamed store where B's and C's rows are both 4 KiB-aligned (two buffers of the large-block
  // cache, as in the experts' backward), and the loads waited on the stores; the copy has no such phase.
  // Streamed fp32 (and bf16's long reductions at avx2, kBf16RowsOuter) only: with plain stores (baseline) the
  // panels-outer order, its panel in L1, ran faster, and the other types' blocks, inlined once more, compiled
  // slower (docs/performance.md, "gemm_bcast reduction blocks", "Streamed fp32 short reductions: row blocks
  // outer, panels inner"). Longer reductions take the same order (their tasks: gemm_bcast_task_rows below),
  // column range by column range, each range's rows of B within short_reduction_bytes, and in reduction
  // blocks where kRowOrderMinCols columns of all of P would not fit: faster than 16-row tasks parking their
  // partial sums at every group length measured (docs/performance.md, "gemm_bcast reduction blocks", "Long
  // reductions in the row order").
  constexpr bool kRowsOuter =
      Stream && (std::is_same_v<T, float> ||
                 (kBf16RowsOuter && std::is_same_v<T, BFloat16> && std::is_same_v<TA, float>));
  using TS = std::conditional_t<kRowsOuter, TA, T>;  // the row order's copy of B (bf16 widened)
  bool rows_outer = false;
  if constexpr (kRowsOuter) {
    rows_outer = P > 0 && Nw > 0 && row_blocks_n >= kInterleaveRowBlocks;
    // bf16's short reductions keep the panels-outer order with plain stores, faster than the row order there
    // (docs/performance.md, "gemm_bcast reduction blocks", "bf16 in the row order").
    if constexpr (std::is_same_v<T, BFloat16>)
      rows_outer = rows_outer && P * Nw * int64_t(sizeof(T)) > short_reduction_bytes(sizeof(T));
  }
  // Streamed, the other orders' register blocks must write whole lines (gemm_bcast): bf16 at avx2 streams in
  // the row order only.
  constexpr bool kWholeLines = kBcastWholeLines<T>;
  if constexpr (Stream && !kWholeLines) {
    if (!rows_outer) return outer_blocks<T, false, TA>(A_in, a_m, a_p, B, ldb, C, ldc, M, N, P);
  }
  constexpr bool kHalfStream = Stream && kWholeLines;  // the row order's half-width last panel
  const TA* A = nullptr;
  if constexpr (std::is_same_v<TA, T>) A = A_in;
  if constexpr (kABlock) {
    if (P > 0) {
      TA* packed = scratch<TA, 1>(M * P);
      auto pack = [&](auto rows, int64_t m) {
        constexpr int R = decltype(rows)::value;
        for (int64_t p = 0; p < P; ++p)
          for (int i = 0; i < R; ++i) packed[m * P + p * R + i] = widen(A_in[(m + i) * a_m + p * a_p]);
      };
      if (rows_outer)  // the row order's register blocks (kStreamRows): A's copy takes the same row blocks
        row_blocks<kStreamRows>(M, pack);
      else
        row_blocks(M, pack);
      A = packed;
    }
  } else if (a_p != 1 && Nw > 0 && P > 0) {  // the dot-product blocks, which read A as T
    TA* packed = scratch<TA, 1>(M * P);
    for (int64_t p = 0; p < P; ++p)
      for (int64_t m = 0; m < M; ++m) packed[m * P + p] = A_in[m * a_m + p * a_p];
    A = packed;
    a_m = P;
    a_p = 1;
  }
  // Rows m.. (a row block of MR rows) from step p.
  auto a_block = [&](int64_t m, int64_t mr, int64_t p) {
    return kABlock ? A + m * P + p * mr : A + m * a_m + p * a_p;
  };
  // bf16 with the dot-product instruction (kDp): a short reduction's panel (P rows x 64 columns) is
  // interleaved once into scratch when kInterleaveRowBlocks or more row blocks read it, instead of unpacking
  // B's row pairs in every row block (the contiguous copy also keeps it in the level-1 cache, as pack_panel
  // does).
  const bool inter = kDp && step_p >= P && row_blocks_n >= kInterleaveRowBlocks;
  const Partial<Ac> whole{nullptr, 0, false, false};  // the whole reduction in one pass
  if constexpr (kRowsOuter) {
    // Register blocks of kStreamRows x kStreamVecs: panels of kStreamVecs vectors (the last of kBcastVecs
    // where Nw leaves part of one), panel n of a column range at slab + n * pn, its pn rows contiguous.
    constexpr int64_t swide = kStreamVecs * kBlock;
    // Reduction blocks: all of P where its rows of kRowOrderMinCols columns fit short_reduction_bytes, else
    // equal blocks that do, the partial sums of a column range (M x its columns) parked between them.
    // Columns of B's copy: all of Nw where a block's rows fit short_reduction_bytes, else the most panels
    // that do, column range after column range.
    constexpr int64_t ts = sizeof(TS);
    const int64_t short_bytes = short_reduction_bytes(ts);
    const int64_t p_blocks =
        rows_outer ? std::max<int64_t>(1, (P * kRowOrderMinCols * ts + short_bytes - 1) / short_bytes) : 1;
    const int64_t bp = (P + p_blocks - 1) / p_blocks;  // steps a block
    const int64_t chunk = !rows_outer || bp * Nw * ts <= short_bytes
                              ? Nw
                              : std::max<int64_t>(1, short_bytes / (bp * ts * swide)) * swide;
    Ac* const range_sums = rows_outer && bp < P ? scratch<Ac>(M * std::min(chunk, Nw)) : nullptr;
    for (int64_t c0 = 0; rows_outer && c0 < Nw; c0 += chunk) {
      const int64_t Nc = std::min(chunk, Nw - c0);
      const int64_t Ns = Nc - Nc % swide;
      for (int64_t p0 = 0; p0 < P; p0 += bp) {
        const int64_t pn = std::min(bp, P - p0);
        TS* slab = scratch<TS, 2>(pn * Nc);
        for (int64_t p = 0; p < pn; ++p)
          for (int64_t n = 0; n < Nc; n += swide) {
            const int64_t w = std::min(swide, Nc - n);  // a multiple of kBlock
            const T* src = B + (p0 + p) * ldb + c0 + n;
            TS* dst = slab + n * pn + p * w;
            if constexpr (std::is_same_v<TS, T>)
              std::memcpy(dst, src, w * sizeof(T));
            else
              for (int64_t v = 0; v < w; v += kBlock) store_native(dst + v, load_native(src + v));
          }
        row_blocks<kStreamRows>(M, [&](auto rows, int64_t m) {
          constexpr int MR = decltype(rows)::value;
          // Everything the column loop reads, in locals: captured by reference, GCC reloaded each from the
          // stack after the streamed stores of every block (it cannot tell that they do not write there),
          // and a load whose address matched a streamed store's low 12 bits waited for that store.
          const TA* a = a_block(m, MR, p0);
          const TS* const sl = slab;
          T* const c = C + m * ldc + c0;
          const int64_t ns = Ns, nw = Nc, steps = pn, ld = ldc, am = a_m, ap = a_p;
          Ac* const ps = range_sums ? range_sums + m * Nc : nullptr;
          const bool resume = p0 > 0;
          const auto part = [ps, nw, resume](int64_t n, bool park) {
            return Partial<Ac>{ps ? ps + n : nullptr, nw, resume, park};
          };
          // The range's whole panels, all rows at once, and its last half-width panel (captured by value,
          // as above).
          const auto panels = [=](bool park) {
            for (int64_t n = 0; n < ns; n += swide)
              bcast_block<T, MR, kStreamVecs, Stream, TA, TS, kABlock>(
                  a, am, ap, sl + n * steps, swide, c + n, ld, steps, part(n, park), false);
          };
          const auto half_panel = [=](bool park) {
            if constexpr (kStreamVecs != kBcastVecs)
              if (ns < nw)
                bcast_block<T, MR, kBcastVecs, kHalfStream, TA, TS, kABlock>(
                    a, am, ap, sl + ns * steps, wide, c + ns, ld, steps, part(ns, park), false);
          };
          if (p0 + pn < P) {  // a block before the last: partial sums only
            panels(true);
            half_panel(true);
            return;
          }
          // Row i of the block is streamed i register blocks after row 0 (from a small buffer that stays in
          // L1): streamed stores to lines with the same low 12 address bits in several rows at once ran far
          // slower than the same stores spread over the page (C rows a multiple of 4 KiB apart — gate_up's
          // weight gradient, rows of 2048 fp32 — put a block's three rows' lines at the same offsets)
          // (docs/performance.md, "gemm_bcast reduction blocks", its entries "Rows of 8 KiB, explained" and
          // "Later rows at avx512").
          if constexpr (MR > 1) {
            alignas(64) Ac later[MR][(MR - 1) * swide];  // block k's rows 1.. in slot k % MR
            Ac* const buf = &later[0][0];
            const auto stream_later = [buf, c, ld](int64_t k, int i) {
              constexpr int64_t w = kStreamVecs * kBlock;
              const Ac* src = buf + (k % MR) * (MR - 1) * w + (i - 1) * w;
              T* dst = c + i * ld + k * w;
              for (int64_t v = 0; v < w; v += kBlock) store_out<Stream>(dst + v, load_native(src + v));
            };
            int64_t blocks = 0;
            for (int64_t n = 0; n < ns; n += swide, ++blocks) {
              // bf16's blocks as calls of their own: inlined here, the bf16 rounding's constants took vector
              // registers for the whole loop and GCC read three of B's four vectors from memory in every
              // multiply-add (15 loads a step for 12 FMAs; docs/performance.md, "gemm_bcast reduction
              // blocks", "bf16 in the row order").
              if constexpr (std::is_same_v<T, BFloat16>)
                bcast_block_apart<T, MR, kStreamVecs, Stream, TA, TS, kABlock, true>(
                    a, am, ap, sl + n * steps, swide, c + n, ld, steps, part(n, false), false, {},
                    later[blocks % MR]);
              else
                bcast_block<T, MR, kStreamVecs, Stream, TA, TS, kABlock, true>(
                    a, am, ap, sl + n * steps, swide, c + n, ld, steps, part(n, false), false, {},
                    later[blocks % MR]);
              for (int i = 1; i < MR && i <= blocks; ++i) stream_later(blocks - i, i);
            }
            for (int64_t k = blocks; k < blocks + MR - 1; ++k)  // the last blocks' later rows
              for (int i = 1; i < MR; ++i)
                if (k - i >= 0 && k - i < blocks) stream_later(k - i, i);
          } else {
            panels(false);
          }
          half_panel(false);
        });
      }
    }
  }
  Ac* const sums = !rows_outer && step_p < P && Nw > 0 ? scratch<Ac>(M * Nw) : nullptr;
  const bool pack_panel = !rows_outer && !inter && ((step_p >= P && P <= 64) || kPackLongPanels) &&
                          M >= 8 * kBcastRows && (ldb * int64_t(sizeof(T))) % 4096 == 0;
  for (int64_t p0 = 0; p0 < (rows_outer ? 0 : std::max<int64_t>(P, 1)); p0 += step_p) {
    const int64_t pn = std::min(step_p, P - p0);
    const bool resume = p0 > 0, park = p0 + pn < P;
    // At the AVX-512 levels (kFetchNextBlock), while this reduction block is computed, the next one is
    // fetched in memory order (whole rows of the column range, which the hardware handles far better than the
    // panel order of the computation), spread evenly over the block's register-block calls (`fetch_next`).
    const Fetch next = park && fetch_next
                           ? Fetch::rows_of(B + (p0 + pn) * ldb, ldb * int64_t(sizeof(T)),
                                            Nw * int64_t(sizeof(T)), std::min(step_p, P - p0 - pn))
                           : Fetch{};
    for (int64_t n = 0; n < Nw; n += wide) {
      // B rows a multiple of 4 KiB apart (the weights' rows of grad @ W, the weight gradients' y rows) all
      // fall into the same sets of the level-1 cache, so the panel (pn rows x 64 columns) does not stay there
      // for the row blocks after the first. Copied to a contiguous buffer when 8 or more row blocks read it:
      // short reductions at every level, blocked ones below AVX-512 (kPackLongPanels); grad @ W of fewer
      // rows (2-5 row blocks, blocked, the next block prefetched) ran slower copied and is not
      // (docs/performance.md, "gemm_bcast reduction blocks").
      const T* panel = B + p0 * ldb + n;
      int64_t ldp = ldb;
      if (pack_panel) {
        T* buf = scratch<T, 2>(pn * wide);
        for (int64_t p = 0; p < pn; ++p) {
          if (p0 == 0 && p + kPrefetchRows < pn)
            for (int64_t off = 0; off < wide * int64_t(sizeof(T)); off += 64)
              __builtin_prefetch(reinterpret_cast<const char*>(panel + (p + kPrefetchRows) * ldb) + off);
          std::memcpy(buf + p * wide, panel + p * ldb, wide * sizeof(T));
        }
        panel = buf;
        ldp = wide;
      }
      // bf16 with A widened (no dot-product instruction) at the AVX-512 levels: the panel widened to fp32
      // once for all the row blocks that read it, instead of in each of them (the weight gradients' panels
      // are read by M / 4 row blocks: hundreds). At avx2 it made no difference (docs/performance.md,
      // "gemm_bcast reduction blocks").
      const float* wpanel = nullptr;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<TA, float>) {
        if (row_blocks_n > 1) {
          float* buf = scratch<float, 5>(pn * wide);
          for (int64_t p = 0; p < pn; ++p) {
            if (p0 == 0 && p + kPrefetchRows < pn && ldp != wide)
              for (int64_t off = 0; off < wide * int64_t(sizeof(T)); off += 64)
                __builtin_prefetch(reinterpret_cast<const char*>(panel + (p + kPrefetchRows) * ldp) + off);
            for (int64_t v = 0; v < wide; v += kBlock)
              store_native(buf + p * wide + v, load_native(panel + p * ldp + v));
          }
          wpanel = buf;
        }
      }
#endif
#if defined(__AVX512BF16__)
      if constexpr (kDp) {
        if (inter) {
          uint16_t* buf = scratch<uint16_t, 3>((pn + 1) / 2 * 128);
          interleave_panel(panel, ldb, pn, p0 == 0, buf);
          panel = reinterpret_cast<const T*>(buf);
        }
      }
#endif
      row_blocks(M, [&](auto rows, int64_t m) {
        constexpr int MR = decltype(rows)::value;
        const Partial<Ac> part{sums ? sums + m * Nw + n : nullptr, Nw, resume, park};
        const TA* a = a_block(m, MR, p0);
        const T* b = panel;
        const int64_t ldb = ldp;
        T* c = C + m * ldc + n;
        // Only the first row block over a panel fetches it near, and only when nothing fetched it before
        // (kNearEveryBlock: nothing does), then past the block's end (near reads B in place).
        const bool near = m == 0 && (p0 == 0 || kNearEveryBlock) && ldp != wide && !inter && !wpanel;
        const int64_t ahead = kNearEveryBlock ? P - p0 : 0;
        const Fetch fetch = next.share(n / wide * row_blocks_n + m / kBcastRows, calls, pn);
#if defined(__AVX512F__)
        if (wpanel) {
          bcast_block_apart<T, MR, kBcastVecs, Stream, TA, float, kABlock>(a, a_m, a_p, wpanel, wide, c, ldc,
                                                                           pn, part, false, fetch);
          return;
        }
#endif
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, BFloat16> && kBcastVecs * kBlock == 64) {
          if (inter && a_p == 1)
            bcast_block_dp<MR, Stream, true, true>(a, a_m, a_p, b, ldb, c, ldc, pn, part, near, fetch);
          else if (inter)
            bcast_block_dp<MR, Stream, false, true>(a, a_m, a_p, b, ldb, c, ldc, pn, part, near, fetch);
          else if (a_p == 1)
            bcast_block_dp<MR, Stream, true>(a, a_m, a_p, b, ldb, c, ldc, pn, part, near, fetch);
          else
            bcast_block_dp<MR, Stream, false>(a, a_m, a_p, b, ldb, c, ldc, pn, part, near, fetch);
          return;
        }
#endif
#if defined(__AVX512F__)
        // Inlined here, GCC 12 kept the widened bf16 blocks' accumulators in memory (an FMA from the stack
        // and a store back per product); as a function of its own it keeps them in registers. The other
        // instantiations ran slower as calls and stay inlined (docs/performance.md, "gemm_bcast reduction
        // blocks").
        if constexpr (std::is_same_v<T, BFloat16>) {
          bcast_block_apart<T, MR, kBcastVecs, Stream, TA, T, kABlock>(a, a_m, a_p, b, ldb, c, ldc, pn, part,
                                                                       near, fetch);
          return;
        }
#endif
        bcast_block<T, MR, kBcastVecs, Stream, TA, T, kABlock>(a, a_m, a_p, b, ldb, c, ldc, pn, part, near,
                                                               fetch, nullptr, ahead);
      });
    }
  }
  // Leftover vectors and columns: one pass over the whole reduction, plain stores, by the row blocks of A's
  // copy.
  auto leftovers = [&](auto rows_c) {
    constexpr int Rows = decltype(rows_c)::value;
    for (int64_t n = Nw; n < Nv; n += kBlock)
      row_blocks<Rows>(M, [&](auto rows, int64_t m) {
        constexpr int MR = decltype(rows)::value;
        bcast_block<T, MR, 1, false, TA, T, kABlock>(a_block(m, MR, 0), a_m, a_p, B + n, ldb, C + m * ldc + n,
                                                     ldc, P, whole);
      });
    if (Nv < N)
      bcast_tail(
          [&](int64_t m, int64_t p) {
            const int64_t m0 = m - m % Rows;
            return kABlock ? a_block(m0, std::min<int64_t>(Rows, M - m0), p)[m - m0] : A[m * a_m + p * a_p];
          },
          B, ldb, C, ldc, M, Nv, N, P);
  };
  if (rows_outer)
    leftovers(std::integral_constant<int, kStreamRows>{});
  else
    leftovers(std::integral_constant<int, kBcastRows>{});
}

template <class T, bool Stream>
void gemm_outer(const T* A, int64_t a_m, int64_t a_p, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t M,
                int64_t N, int64_t P) {
#if defined(__AMX_BF16__)
  if constexpr (std::is_same_v<T, BFloat16>) return amx_outer<Stream>(A, a_m, a_p, B, ldb, C, ldc, M, N, P);
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, BFloat16>) {
    if (a_p == 1 && P > kPanelMinSteps) return outer_panels<Stream>(A, a_m, B, ldb, C, ldc, M, N, P);
  }
#endif
  if constexpr (kWidenBf16A && std::is_same_v<T, BFloat16>)
    return outer_blocks<T, Stream, float>(A, a_m, a_p, B, ldb, C, ldc, M, N, P);
  outer_blocks<T, Stream, T>(A, a_m, a_p, B, ldb, C, ldc, M, N, P);
}

}  // namespace

// Weight gradients (gemm_bcast_task_rows): a call whose kernel copies A and B once for all its rows takes
// kShortReductionRows rows — fewer where A's copy (rows x steps, as outer_blocks keeps it) would pass
// kPackedRowsBytes, down to kMinPackedRows (the row order needs 8 row blocks): fp32 at any length (the row
// order column range by column range; at baseline blocked, its partial sums rows x N), bf16 at any length
// where it takes the row order (kBf16RowsOuter), the other types where the reduction's rows of B fit
// short_reduction_bytes. Other calls keep rows x cols within the partial sums' scratch, l2_block_bytes
// (docs/performance.md, "Grouped products: tasks and routing").
constexpr int64_t kShortReductionRows = 512;
constexpr int64_t kPackedRowsBytes = int64_t(8) << 20;
constexpr int64_t kMinPackedRows = 64;

int64_t gemm_bcast_task_rows(DType dtype, int64_t steps, int64_t cols) {
  int64_t rows = 0;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int64_t es = sizeof(T);
    constexpr bool bf16 = std::is_same_v<T, BFloat16>;
    constexpr bool row_order = std::is_same_v<T, float> || (kBf16RowsOuter && bf16);
    constexpr int64_t copy_es = kWidenBf16A && bf16 ? int64_t(sizeof(float)) : es;
    const int64_t blocked =
        std::max<int64_t>(4, l2_block_bytes() / int64_t(sizeof(float)) / std::max<int64_t>(cols, 1) / 4 * 4);
    const bool short_steps = steps * cols * es <= short_reduction_bytes(es);
    if (!row_order && !short_steps) {
      rows = blocked;
    } else {
      const int64_t packed = std::clamp<int64_t>(kPackedRowsBytes / std::max<int64_t>(1, steps * copy_es),
                                                 kMinPackedRows, kShortReductionRows);
      rows = std::max(blocked, packed);
    }
    // Where the kernel writes this call's C with plain stores, panel by panel down the task's rows (register
    // blocks narrower than a cache line of a row, which gemm_bcast does not stream; and bf16's short
    // reductions at avx2, which keep the panels-outer order): each line of C is read for ownership first, and
    // those reads walk the task's rows as grad @ W's panels walk B's. Where the L2 streamer's streams are
    // known (prefetch_streams) a task takes at most the rows that cross that many pages, whole register
    // blocks (reduction_block_steps has the rule). An Intel Xeon, gate_up's weight gradient at 16 rows a
    // group, 2 threads: bf16 at avx2 332 ms in 512-row tasks, 318 in 64, 125 in 32; fp32 at baseline 678 ->
    // 278 in 32 (docs/performance.md, "Reduction blocks within the L2 streamer's streams").
    constexpr bool plain = !kBcastWholeLines<T>;
    const int64_t within = rows_within_streams(cols * es);
    if (plain && (!kBf16RowsOuter || !bf16 || short_steps) && within > 0)
      rows = std::min(rows, std::max<int64_t>(kBcastRows, within / kBcastRows * kBcastRows));
  });
  return rows;
}

void gemm_bcast(DType dtype, int64_t M, int64_t N, int64_t P, const void* A, int64_t a_m, int64_t a_p,
                const void* B, int64_t ldb, void* C, int64_t ldc, bool stream) {
  if (M <= 0 || N <= 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* a = static_cast<const T*>(A);
    const T* b = static_cast<const T*>(B);
    T* c = static_cast<T*>(C);
    // A register block writes kBcastVecs vectors of each row of C and moves on to other rows; the rest of
    // those cache lines comes a whole column pass later. Streamed in pieces narrower than a line, the
    // write-combining buffers flush them partially: only whole lines are streamed (16-bit types at avx2 are
    // half a line; docs/performance.md, "gemm_bcast reduction blocks"), except by the row order's blocks of
    // bf16 at avx2, which write whole lines (outer_blocks takes plain stores for its other orders).
    constexpr bool whole_lines = kBcastWholeLines<T> || (kBf16RowsOuter && std::is_same_v<T, BFloat16>);
    if (whole_lines && stream && can_stream(c, ldc)) {
      gemm_outer<T, true>(a, a_m, a_p, b, ldb, c, ldc, M, N, P);
      stream_fence();
    } else {
      gemm_outer<T, false>(a, a_m, a_p, b, ldb, c, ldc, M, N, P);
    }
  });
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
