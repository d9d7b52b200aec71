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

}  // namespace kernmap
