#include "ops/memory.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kernmap::ops {
namespace {

constexpr int64_t kMinBytes = int64_t(16) << 20;
constexpr uintptr_t kHugePage = uintptr_t(2) << 20;

bool huge_pages_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("KERNMAP_HUGE_PAGES");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return enabled;
}

}  // namespace

at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (t.is_cpu() && bytes >= kMinBytes && huge_pages_enabled()) {
    const auto start = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t first = (start + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t last = (start + static_cast<uintptr_t>(bytes)) & ~(kHugePage - 1);
    // A hint: an error (no THP support, a region the kernel will not back) leaves ordinary pages.
    if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#endif
  return t;
}

}  // namespace kernmap::ops
