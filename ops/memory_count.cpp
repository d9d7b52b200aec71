// The count of CPU memory in tensors (kernmap/memory.h): c10 keeps no CPU statistics, so a wrapper around its
// CPU allocator counts what it hands out and forwards; kernmap's large blocks (ops/memory.cpp, mmap'd outside
// c10) add what they hold in use. ablate reads the peak of each training step from it.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernmap/memory.h"
#include "ops/memory.h"

namespace kernmap::ops {
namespace {

std::atomic<int64_t> g_in_use{0}, g_peak{0};

void add(int64_t bytes) {
  const int64_t now = g_in_use.fetch_add(bytes) + bytes;
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

// Forwards to the allocator it wraps and counts the bytes alive. Each block is its own context (data ==
// context), so raw_allocate/raw_deleter work as with c10's allocator; the wrapped allocator's DataPtr waits
// in a table until the block is freed.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    if (data == nullptr) return inner;  // zero bytes: nothing to count
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks_.emplace(data, Block{std::move(inner), n});
    }
    add(static_cast<int64_t>(n));
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static CountingAllocator& instance() {
    // Never destroyed: tensors may die during static destruction. Installed above c10's default (priority
    // 0), so every CPU allocation from now on goes through it.
    static CountingAllocator* counting = [] {
      auto* a = new CountingAllocator(c10::GetCPUAllocator());
      c10::SetCPUAllocator(a, /*priority=*/1);
      return a;
    }();
    return *counting;
  }

 private:
  struct Block {
    c10::DataPtr inner;
    size_t bytes;
  };
  static void release(void* data) {
    CountingAllocator& self = instance();
    c10::DataPtr inner;  // freed through the wrapped allocator's deleter when it leaves scope, unlocked
    size_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(self.mu_);
      auto it = self.blocks_.find(data);
      if (it == self.blocks_.end()) return;
      inner = std::move(it->second.inner);
      bytes = it->second.bytes;
      self.blocks_.erase(it);
    }
    g_in_use.fetch_sub(static_cast<int64_t>(bytes));
  }

  c10::Allocator* base_;
  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;
};

void count_op() {
  kernmap::count_cpu_memory();
}
std::vector<int64_t> memory_op() {
  const CpuMemory m = kernmap::cpu_memory();
  return {m.in_use, m.peak};
}
void reset_op() {
  kernmap::reset_cpu_memory_peak();
}

}  // namespace

void count_large_block(int64_t bytes) {
  if (bytes > 0)
    add(bytes);
  else
    g_in_use.fetch_add(bytes);
}

TORCH_LIBRARY_IMPL(kernmap, CompositeImplicitAutograd, m) {
  m.impl("count_cpu_memory", &count_op);
  m.impl("cpu_memory", &memory_op);
  m.impl("reset_cpu_memory_peak", &reset_op);
}

}  // namespace kernmap::ops

namespace kernmap {
void count_cpu_memory() {
  ops::CountingAllocator::instance();
}
CpuMemory cpu_memory() {
  return {ops::g_in_use.load(), ops::g_peak.load()};
}
void reset_cpu_memory_peak() {
  ops::g_peak.store(ops::g_in_use.load());
}
}  // namespace kernmap
