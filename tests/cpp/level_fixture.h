// A gtest fixture for kernel tests parameterised over (instruction-set level, dtype): SetUp switches the CPU
// kernels to the level (restored in TearDown) and seeds torch. The level is set twice: in the test's own copy
// of the kernels (kernels/cpu/isa.h, for calls through kernel_table()) and in libkernmap's (kernmap/cpu.h,
// for the ops), which are separate since libkernmap exports only its public API.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tuple>

#include "kernels/cpu/isa.h"
#include "kernmap/cpu.h"

namespace kernmap::testing {

class LevelDtypeTest : public ::testing::TestWithParam<std::tuple<kernmap::cpu::Level, at::ScalarType>> {
 protected:
  void SetUp() override {
    previous_ = kernmap::cpu::active_level();
    set_level(std::get<0>(GetParam()));
    at::manual_seed(0);
  }
  void TearDown() override { set_level(previous_); }
  at::ScalarType dtype() const { return std::get<1>(GetParam()); }
  kernmap::cpu::Level previous_{};

 private:
  static void set_level(kernmap::cpu::Level level) {
    kernmap::cpu::set_level(level);
    kernmap::set_cpu_level(kernmap::cpu::level_name(level));
  }
};

}  // namespace kernmap::testing
