// Allocation of large CPU buffers (weight gradients and intermediates of expert layers: up to gigabytes a
// step), through a cache that keeps freed blocks for the next step.
#pragma once

#include <ATen/core/Tensor.h>

namespace kernmap::ops {

/// at::empty, except that a CPU tensor of at least 16 MiB takes its memory from kernmap's large-block cache:
/// 2 MiB-aligned blocks with a transparent-huge-page hint (madvise MADV_HUGEPAGE), kept when freed and handed
/// out again for an equal size. A training step frees and re-allocates the same gradient sizes every step;
/// fresh memory costs a page fault and a clear per 4 KiB page, several times the cost of writing reused
/// memory (docs/performance.md, "Large-block cache and huge pages"). Contents are uninitialized, as with
/// at::empty. Settings (environment, read once): KERNMAP_LARGE_CACHE_MB caps the bytes kept (default: a
/// quarter of physical memory; 0 turns the cache off), KERNMAP_HUGE_PAGES=0 drops the huge-page hint. See
/// docs/ops.md.
at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options);

/// Bytes of freed blocks the cache holds.
int64_t cached_large_bytes();
/// Returns every cached block to the system; returns the bytes released.
int64_t release_large_cache();

/// Backs the whole 2 MiB pages of a CPU tensor's storage (at least 16 MiB) with transparent huge pages, now
/// (madvise MADV_COLLAPSE, Linux 6.1+; contents unchanged): for expert weights, which the grouped products
/// stream through once per pass, rows 4 KiB or more apart, so 4 KiB pages cost a TLB miss every few cache
/// lines (docs/performance.md, "Large-block cache and huge pages"). One-time cost: a copy of the storage.
/// Returns whether it was done; false (nothing changed) when refused or not applicable, or with
/// KERNMAP_HUGE_PAGES=0.
bool advise_huge_pages(const at::Tensor& t);

/// Adds a large block's bytes to the count of CPU memory in use (kernmap/memory.h; negative when freed).
void count_large_block(int64_t bytes);

}  // namespace kernmap::ops
