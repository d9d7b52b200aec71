// The large-block cache behind empty_large: an at::Allocator whose blocks are mmap'd (2 MiB aligned,
// huge-page hint), returned to a free list when their tensor dies (taken again for an equal size), the least
// recently freed unmapped when the cap is reached, all on release. Thread-safe (one mutex; allocations are
// few and large).
#include "ops/memory.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <torch/library.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <list>
#include <mutex>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "kernmap/memory.h"

namespace kernmap::ops {
namespace {

constexpr size_t kMinBytes = size_t(16) << 20;
constexpr size_t kAlign = size_t(2) << 20;

bool env_is_zero(const char* name) {
  const char* v = std::getenv(name);
  return v && std::strcmp(v, "0") == 0;
}

// The cap on cached bytes: KERNMAP_LARGE_CACHE_MB, or a quarter of physical memory.
size_t cache_cap() {
  if (const char* v = std::getenv("KERNMAP_LARGE_CACHE_MB")) {
    char* end = nullptr;
    const unsigned long long mb = std::strtoull(v, &end, 10);
    TORCH_CHECK(end != v && *end == '\0',
                "kernmap: KERNMAP_LARGE_CACHE_MB must be a whole number of MiB, got '", v, "'");
    return static_cast<size_t>(mb) << 20;
  }
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) / 4 : size_t(1) << 30;
}

struct Block {
  void* map;         // what mmap returned
  size_t map_bytes;  // what mmap mapped
  void* data;        // kAlign-aligned start
  size_t bytes;      // usable bytes from data (a multiple of kAlign)
};

class LargeBlockCache final : public c10::Allocator {
 public:
  LargeBlockCache() : cap_(cache_cap()), huge_(!env_is_zero("KERNMAP_HUGE_PAGES")) {}

  bool enabled() const { return cap_ > 0; }

  c10::DataPtr allocate(size_t n) override {
    const size_t bytes = (std::max<size_t>(n, 1) + kAlign - 1) / kAlign * kAlign;
    Block* b = take(bytes);
    if (!b) b = map_block(bytes);
    count_large_block(static_cast<int64_t>(b->bytes));
    return {b->data, b, &LargeBlockCache::free_block, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t cached() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(cached_);
  }

  int64_t release() {
    std::vector<Block*> out;
    size_t released = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      out.assign(free_.begin(), free_.end());
      free_.clear();
      released = cached_;
      cached_ = 0;
    }
    for (Block* b : out) unmap(b);
    return static_cast<int64_t>(released);
  }

  static LargeBlockCache& get() {
    // Never destroyed: tensors may die during static destruction.
    static auto* cache = new LargeBlockCache();
    return *cache;
  }

 private:
  static void free_block(void* ctx) {
    auto* b = static_cast<Block*>(ctx);
    count_large_block(-static_cast<int64_t>(b->bytes));
    get().put(b);
  }

  // The most recently freed block of this size (few blocks are cached: a linear search).
  Block* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.rbegin(); it != free_.rend(); ++it)
      if ((*it)->bytes == bytes) {
        Block* b = *it;
        free_.erase(std::next(it).base());
        cached_ -= b->bytes;
        return b;
      }
    return nullptr;
  }

  // Keeps the freed block, giving back the least recently freed ones when the cap would be exceeded: the
  // sizes in use now are the ones the next step asks for (blocks of sizes no longer used, say of an earlier
  // model or dtype, would otherwise hold the cap forever and every new block would be mapped afresh).
  void put(Block* b) {
    std::vector<Block*> out;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (b->bytes > cap_) {
        out.push_back(b);
      } else {
        while (cached_ + b->bytes > cap_) {
          out.push_back(free_.front());
          cached_ -= free_.front()->bytes;
          free_.pop_front();
        }
        free_.push_back(b);
        cached_ += b->bytes;
      }
    }
    for (Block* x : out) unmap(x);
  }

  Block* map_block(size_t bytes) {
    const size_t map_bytes = bytes + kAlign;
    void* map = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
      // Cached blocks of other sizes may be what stands in the way: give them back and try once more.
      release();
      map = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      TORCH_CHECK_WITH(OutOfMemoryError, map != MAP_FAILED, "kernmap: out of memory allocating ", bytes,
                       " bytes for a large CPU buffer");
    }
    const auto start = reinterpret_cast<uintptr_t>(map);
    void* data = reinterpret_cast<void*>((start + kAlign - 1) & ~(uintptr_t(kAlign) - 1));
#if defined(MADV_HUGEPAGE)
    // A hint: an error (no THP support) leaves ordinary pages.
    if (huge_) (void)madvise(data, bytes, MADV_HUGEPAGE);
#endif
    return new Block{map, map_bytes, data, bytes};
  }

  static void unmap(Block* b) {
    munmap(b->map, b->map_bytes);
    delete b;
  }

  const size_t cap_;
  const bool huge_;
  std::mutex mu_;
  std::list<Block*> free_;  // cached blocks, least recently freed first
  size_t cached_ = 0;
};

int64_t cached_bytes_op() {
  return kernmap::cached_memory_bytes();
}
int64_t release_op() {
  return kernmap::release_cached_memory();
}
bool advise_op(const at::Tensor& t) {
  return kernmap::advise_huge_pages(t);
}

#if !defined(MADV_COLLAPSE)
#define MADV_COLLAPSE 25  // Linux 6.1; older kernels answer EINVAL
#endif

}  // namespace

at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
  LargeBlockCache& cache = LargeBlockCache::get();
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
  if (!options.device().is_cpu() || bytes < kMinBytes || !cache.enabled() || options.has_memory_format() ||
      options.pinned_memory())
    return at::empty(sizes, options);
  return at::detail::empty_generic(sizes, &cache, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()), std::nullopt);
}

bool advise_huge_pages(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || !t.has_storage() || env_is_zero("KERNMAP_HUGE_PAGES"))
    return false;
  const c10::Storage& st = t.storage();
  const auto* base = static_cast<const char*>(st.data());
  if (base == nullptr || st.nbytes() < kMinBytes) return false;
  // Whole 2 MiB pages inside the storage only: the memory around it may belong to other allocations.
  const auto start = (reinterpret_cast<uintptr_t>(base) + kAlign - 1) & ~(uintptr_t(kAlign) - 1);
  const auto end = (reinterpret_cast<uintptr_t>(base) + st.nbytes()) & ~(uintptr_t(kAlign) - 1);
  if (end <= start) return false;
  void* p = reinterpret_cast<void*>(start);
  const size_t n = end - start;
#if defined(MADV_HUGEPAGE)
  // Pages faulted here later (after a fork's copy-on-write, say) are huge too; then the existing ones are
  // collapsed now, synchronously (the contents are copied, not changed). Either may be refused (no THP, an
  // older kernel, memory too fragmented, a file mapping): the tensor keeps its pages, nothing else happens.
  (void)madvise(p, n, MADV_HUGEPAGE);
  // EAGAIN is transient (a huge page not available this moment); the pages collapsed so far stay collapsed.
  for (int attempt = 0; attempt < 8; ++attempt) {
    if (madvise(p, n, MADV_COLLAPSE) == 0) return true;
    if (errno != EAGAIN) return false;
  }
  return false;
#else
  return false;
#endif
}

int64_t cached_large_bytes() {
  return LargeBlockCache::get().cached();
}
int64_t release_large_cache() {
  return LargeBlockCache::get().release();
}

TORCH_LIBRARY_IMPL(kernmap, CompositeImplicitAutograd, m) {
  m.impl("cached_memory_bytes", &cached_bytes_op);
  m.impl("release_cached_memory", &release_op);
  m.impl("advise_huge_pages", &advise_op);
}

}  // namespace kernmap::ops

namespace kernmap {
int64_t cached_memory_bytes() {
  return ops::cached_large_bytes();
}
int64_t release_cached_memory() {
  return ops::release_large_cache();
}
bool advise_huge_pages(const at::Tensor& t) {
  return ops::advise_huge_pages(t);
}
}  // namespace kernmap
