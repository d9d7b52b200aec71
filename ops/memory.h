// Allocation of large CPU outputs (weight gradients of expert layers: up to gigabytes a step).
#pragma once

#include <ATen/core/Tensor.h>

namespace kernmap::ops {

/// at::empty, and for CPU tensors of at least 16 MiB on Linux a transparent-huge-page hint
/// (madvise MADV_HUGEPAGE) on the 2 MiB-aligned part of the fresh buffer before anything touches it: a fresh
/// multi-gigabyte gradient otherwise costs one page fault and one 4 KiB clear per page (measured: 1.6 GB written
/// after allocation 366 ms with 4 KiB pages, 79 ms with huge pages, 38 ms warm). Set KERNMAP_HUGE_PAGES=0 to
/// turn the hint off (the kernel's THP mode "never" also ignores it). Same tensor, same allocator.
at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace kernmap::ops
