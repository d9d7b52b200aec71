#include "tests/cpp/kernels/poison.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace kernmap::testing {
namespace {

// c10's own junk fill (FLAGS_caffe2_cpu_allocator_do_junk_fill) writes 0x7fedbeef: a NaN as float32, but a
// finite number as float64 and in every other element of a bfloat16 or float16 buffer, so a skipped element
// could hold a plausible value. This allocator fills with all-ones instead: NaN in every dtype.
class PoisoningAllocator final : public c10::Allocator {
 public:
  explicit PoisoningAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr block = base_->allocate(n);
    if (n > 0) std::memset(block.get(), 0xFF, n);
    return block;
  }
  c10::DeleterFnPtr raw_deleter() const override { return base_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* base_;
};

}  // namespace

void install_poisoning_allocator() {
  // Read once, when the cache is first used: it must see this before any op runs.
  setenv("KERNMAP_LARGE_CACHE_MB", "0", /*overwrite=*/1);
  static PoisoningAllocator poisoning(c10::GetCPUAllocator());
  // The highest priority: nothing a test links (the ablation's counting allocator) replaces it.
  c10::SetCPUAllocator(&poisoning, UINT8_MAX);
}

}  // namespace kernmap::testing
