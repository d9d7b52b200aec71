// Operands placed against a page the process may not touch, for the kernels' edge-read checks: a read past
// an operand's last element faults (the test binary dies, naming the case), where reading into a padded
// tensor would pass unseen.
#pragma once

#include <ATen/core/Tensor.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

namespace kernmap::testing {

// A copy of the first `bytes` of `t` that ends exactly where a page the process may not touch begins: a read
// past its end faults.
class GuardedCopy final {
 public:
  GuardedCopy(const at::Tensor& t, size_t bytes) {
    const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    span_ = (bytes + page - 1) / page * page + page;
    base_ =
        static_cast<char*>(mmap(nullptr, span_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (base_ == MAP_FAILED || mprotect(base_ + span_ - page, page, PROT_NONE) != 0)
      throw std::runtime_error("GuardedCopy: mmap or mprotect failed");
    data_ = base_ + span_ - page - bytes;
    std::memcpy(data_, t.const_data_ptr(), bytes);
  }
  GuardedCopy(const GuardedCopy&) = delete;
  GuardedCopy& operator=(const GuardedCopy&) = delete;
  ~GuardedCopy() { munmap(base_, span_); }
  const void* data() const { return data_; }

 private:
  char* base_ = nullptr;
  char* data_ = nullptr;
  size_t span_ = 0;
};

}  // namespace kernmap::testing
