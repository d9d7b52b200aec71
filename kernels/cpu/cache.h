// What the CPU kernels' blocking rules and the benchmark's machine line read about the CPU: the sizes of the
// data caches one core uses, and the model name. Compiled once (not per level).
#pragma once

#include <cstdint>
#include <string>

namespace kernmap::cpu {

/// Bytes of each data-cache level as cpu0 sees it: its own instance of the level (on CPUs that split the
/// level-3 cache between core complexes, one complex's share, not the socket's total); 0 where unknown.
struct CacheSizes {
  int64_t l1d = 0, l2 = 0, l3 = 0;
  int64_t l3_cpus = 0;  ///< CPUs listed as sharing that L3 instance (sysfs shared_cpu_list); 0 where unknown
};

/// Reads a sysfs cache folder's layout under `root` (index*/level, index*/type, index*/size: "48K", "2048K",
/// "32M"); the data and unified caches count, instruction caches do not. A level missing there is filled from
/// sysconf (_SC_LEVEL1_DCACHE_SIZE and the like) when `sysconf_fallback`.
CacheSizes read_cache_sizes(const std::string& root, bool sysconf_fallback = true);

/// cpu0's caches (/sys/devices/system/cpu/cpu0/cache, else sysconf), read once.
const CacheSizes& cache_sizes();

/// The level-3 bytes the CPUs sharing cpu0's instance can count on: the instance, at most 4 MiB for each CPU
/// listed as sharing it (32 MiB where nothing is known). No x86 server core has much more L3 of its own
/// (Xeons 1.25-5 MiB, EPYCs 2-4 MiB), and a virtual machine lists its host socket's whole L3 as shared by its
/// own few CPUs only (docs/performance.md, "Streaming-store threshold").
int64_t usable_l3_bytes(const CacheSizes& sizes);
/// usable_l3_bytes of cpu0's caches, read once: the streaming-store threshold and the fused loss's chunk.
int64_t usable_l3_bytes();

/// The blocking rule for the level-2 cache: the bytes of the operand a blocked kernel streams that it keeps
/// in flight per core, a quarter of one core's L2 (of 1 MiB where the size is unknown). The block being
/// computed and the next one, fetched meanwhile, take half of it; the partial sums beside them and the other
/// operand's lines the rest (at the AVX-512 levels; below them the reduction blocks take all of L2 and
/// nothing is fetched, gemm_outer.cpp's kBlockL2Quarters; on CPUs with a known prefetch_streams, at most that
/// many pages a block). Read by the grouped backward's reduction blocks
/// (kernels/cpu/gemm_outer.cpp) and its task sizes (ops/grouped_mm.cpp); docs/performance.md, "gemm_bcast
/// reduction blocks", has the measurements.
int64_t l2_block_bytes();

/// The most bytes of a weight gradient's reduction (its rows of the second operand over all output columns)
/// computed in one pass over 512-row tasks: half of one core's L2 for 4-byte elements (fp32, and bf16 where
/// the kernel widens its copy), whose streamed blocks read those rows from one contiguous copy made per task
/// (kernels/cpu/gemm_outer.cpp, kRowsOuter), and l2_block_bytes for the other sizes. Longer reductions in the
/// row order go in pieces of this size; the kernel's task sizes (gemm_bcast_task_rows) read the same rule.
int64_t short_reduction_bytes(int64_t elem_size);

/// How many rows a kernel may walk at once, a few cache lines of each in turn (the grouped backward's panels
/// down a reduction block), and still have the hardware fetch every row ahead: the streams one core's L2
/// streamer follows. Intel documents 32 (one per 4 KiB page; the Optimization Reference Manual's "streamer")
/// for its cores since Sandy Bridge; 0 (no known limit) elsewhere, where the L2 rule alone sizes the blocks.
/// KERNMAP_PREFETCH_STREAMS (a count, 0 for none) overrides it (tests, other CPUs; read on every call).
/// docs/performance.md, "Reduction blocks within the L2 streamer's streams".
int64_t prefetch_streams();

/// Whether a kernel that walks B's rows a few lines of each at a time, rows `row_bytes` apart, fetches its
/// next block of rows into L2 by software (in memory order): where prefetch_streams is unknown, and where the
/// rows are a page or less apart — the L2 streamer starts each page anew, and short rows give it no run to
/// follow. Rows more than a page apart it follows on its own, and software fetches beside it ran slower. Read
/// by the forward's blocks (kernels/cpu/gemm_nt.cpp) and by `grad @ W`'s reduction blocks at the AVX-512
/// levels (kernels/cpu/gemm_outer.cpp); docs/performance.md, "Reduction blocks within the L2 streamer's
/// streams".
bool fetch_next_block(int64_t row_bytes);

/// Whether torch's bf16 matrix product (at::mm and friends) runs at least at its fp32 rate: the CPU has bf16
/// dot products (AVX512-BF16, AMX-BF16) or AVX-NE-CONVERT's widening loads, which oneDNN uses. Elsewhere
/// torch's bf16 product is far slower than its fp32 one: a scalar loop without AVX-512, oneDNN's software
/// widening on AVX-512 without BF16 (docs/performance.md, "bf16 products without bf16 BLAS"). Where false,
/// kernmap's large bf16 products compute in fp32 or in its own kernels instead. Read once from cpuid;
/// KERNMAP_BF16_GEMM=native or fp32 overrides it (tests, read on every call).
bool bf16_gemm_native();

/// The first "model name" of /proc/cpuinfo ("AMD EPYC 9654 96-Core Processor"), or "unknown".
std::string cpu_model();

}  // namespace kernmap::cpu
