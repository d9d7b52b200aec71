// glibc gives each block over its mmap threshold (32 MiB at most) a mapping of its own and unmaps it on
// free, and below that threshold its heap reuses a freed block only when the next request fits it: a 155 MB
// output came back as fresh memory on some calls and not others (37,888 page faults, about 3x the call's
// time; a median moved by tens of percent between processes that ran the same cases in another order). The
// benchmark times kernels, not the allocator, so it keeps what its cases free, as training frameworks'
// caching allocators do.
//
// Blocks of 16 MiB and more are also mapped on 2 MiB boundaries with the transparent-huge-page hint (unless
// asked not to): the floors' copy probes run on huge pages, and so do kernmap's own large outputs
// (ops/memory.h), while the cases' inputs came from glibc's heap in 4 KiB pages, which on xeon-amx-vm
// (2026-12-07, THP `madvise`) cost the memory-bound rows up to a third of their time, by how scattered the
// heap's pages were (docs/development.md, "Benchmarks").
#include "cli/bench_alloc.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include <algorithm>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace kernmap::cli {
namespace {

constexpr size_t kKeepFrom = size_t(1) << 20;  // smaller blocks stay glibc's (its heap reuses them)
// Blocks from this size are mapped on huge pages, as ops/memory.h's large blocks are.
constexpr size_t kHugeFrom = size_t(16) << 20;
constexpr size_t kHugePage = size_t(2) << 20;

// A block mapped by itself, its data on a 2 MiB boundary with the huge-page hint; unmapped when freed.
struct Mapping {
  void* map;
  size_t bytes;
};
void unmap(void* ctx) {
  auto* m = static_cast<Mapping*>(ctx);
  munmap(m->map, m->bytes);
  delete m;
}
c10::DataPtr map_huge(size_t n) {
  const size_t bytes = n + kHugePage;
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) throw std::bad_alloc();
  const auto start = reinterpret_cast<uintptr_t>(map);
  void* data = reinterpret_cast<void*>((start + kHugePage - 1) & ~(uintptr_t(kHugePage) - 1));
#if defined(MADV_HUGEPAGE)
  (void)madvise(data, n, MADV_HUGEPAGE);  // a hint: without THP, ordinary pages
#endif
  return {data, new Mapping{map, bytes}, &unmap, c10::Device(c10::DeviceType::CPU)};
}

// Forwards to the allocator it wraps; a freed block of kKeepFrom bytes or more is kept (up to a quarter of
// physical memory) and handed out again for a request of the same size. Each block is its own context (data
// == context, so raw_allocate and raw_deleter work), as in ops/memory_count.cpp.
class KeepingAllocator final : public c10::Allocator {
 public:
  explicit KeepingAllocator(c10::Allocator* base) : base_(base) {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    cap_ =
        pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) / 4 : size_t(1) << 32;
  }

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner;
    if (n >= kKeepFrom) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = kept_.find(n);
      if (it != kept_.end()) {
        inner = std::move(it->second);
        kept_.erase(it);
        kept_bytes_ -= n;
      }
    }
    if (!inner) inner = huge_ && n >= kHugeFrom ? map_huge(n) : base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // zero bytes
    const c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_.emplace(data, Block{std::move(inner), n});
    }
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t release_kept() {
    std::multimap<size_t, c10::DataPtr> kept;  // freed when it leaves scope, unlocked
    {
      std::lock_guard<std::mutex> lock(mu_);
      kept.swap(kept_);
      kept_bytes_ = 0;
    }
    int64_t bytes = 0;
    for (const auto& [n, block] : kept) bytes += static_cast<int64_t>(n);
    return bytes;
  }

  static KeepingAllocator& instance() {
    // Never destroyed: tensors may die during static destruction. Priority 1, as kernmap's counting
    // allocator, which installed later wraps this one.
    static KeepingAllocator* keeping = [] {
      auto* a = new KeepingAllocator(c10::GetCPUAllocator());
      c10::SetCPUAllocator(a, /*priority=*/1);
      return a;
    }();
    return *keeping;
  }

  void set_huge_pages(bool on) { huge_ = on; }

 private:
  struct Block {
    c10::DataPtr inner;
    size_t bytes;
  };
  static void release(void* data) {
    KeepingAllocator& self = instance();
    c10::DataPtr dropped;  // freed when it leaves scope, unlocked
    std::lock_guard<std::mutex> lock(self.mu_);
    auto it = self.live_.find(data);
    if (it == self.live_.end()) return;
    Block block = std::move(it->second);
    self.live_.erase(it);
    if (block.bytes >= kKeepFrom && self.kept_bytes_ + block.bytes <= self.cap_) {
      self.kept_bytes_ += block.bytes;
      self.kept_.emplace(block.bytes, std::move(block.inner));
    } else {
      dropped = std::move(block.inner);
    }
  }

  c10::Allocator* base_;
  bool huge_ = false;
  size_t cap_ = 0, kept_bytes_ = 0;
  std::mutex mu_;
  std::unordered_map<void*, Block> live_;
  std::multimap<size_t, c10::DataPtr> kept_;
};

}  // namespace

bool keep_freed_memory(bool huge_pages) {
  // Smaller blocks: glibc keeps freed memory instead of trimming it (and mmaps only past 1 GiB).
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  const char* env = std::getenv("KERNMAP_HUGE_PAGES");  // =0 drops the hint, as for kernmap's own blocks
  const bool huge = huge_pages && !(env && std::strcmp(env, "0") == 0);
  KeepingAllocator::instance().set_huge_pages(huge);
  return huge;
}

int64_t release_freed_memory() {
  return KeepingAllocator::instance().release_kept();
}

}  // namespace kernmap::cli
