// kernmap's cache of large CPU buffers (expert layers' weight gradients and intermediates, >= 16 MiB): freed
// blocks are kept and handed out again for the same size on the next training step, as a GPU caching
// allocator does. docs/ops.md, "Memory".
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernmap/export.h"

namespace kernmap {

/// Bytes of freed large blocks the cache holds now.
KERNMAP_API int64_t cached_memory_bytes();
/// Returns every cached block to the system (blocks in use are untouched); returns the bytes released.
KERNMAP_API int64_t release_cached_memory();
/// Backs a large CPU tensor's memory (expert weights) with 2 MiB pages now, contents unchanged; returns
/// whether it did (false when refused, not applicable or KERNMAP_HUGE_PAGES=0). Kernelize does it for the
/// weights of the experts layers it maps on CPU. docs/ops.md, "Memory".
KERNMAP_API bool advise_huge_pages(const at::Tensor& t);

/// CPU memory in tensors: bytes in use now and the most in use at once since the last
/// reset_cpu_memory_peak().
struct KERNMAP_API CpuMemory {
  int64_t in_use = 0;
  int64_t peak = 0;
};
/// Starts counting the CPU memory of tensors (idempotent; for the life of the process): c10's CPU allocator
/// is wrapped by one that counts and forwards, so the count covers the tensors allocated from the first call
/// on, plus kernmap's large blocks in use (counted always). Memory that libraries allocate outside c10 (BLAS
/// and oneDNN scratch) is not counted. ablate reads each step's peak from it. docs/ops.md, "Memory".
KERNMAP_API void count_cpu_memory();
/// The count now (in_use is 0 for c10's allocations until count_cpu_memory() was called).
KERNMAP_API CpuMemory cpu_memory();
/// Sets the peak to what is in use now.
KERNMAP_API void reset_cpu_memory_peak();

}  // namespace kernmap
