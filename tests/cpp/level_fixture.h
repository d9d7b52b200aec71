// A gtest fixture for kernel tests parameterised over (instruction-set level, dtype): SetUp switches the CPU
// kernels to the level (restored in TearDown) and seeds torch.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tuple>

#include "kernels/cpu/isa.h"

namespace kernmap::testing {

class LevelDtypeTest : public ::testing::TestWithParam<std::tuple<kernmap::cpu::Level, at::ScalarType>> {
 protected:
  void SetUp() override {
    previous_ = kernmap::cpu::active_level();
    kernmap::cpu::set_level(std::get<0>(GetParam()));
    at::manual_seed(0);
  }
  void TearDown() override { kernmap::cpu::set_level(previous_); }
  at::ScalarType dtype() const { return std::get<1>(GetParam()); }
  kernmap::cpu::Level previous_{};
};

}  // namespace kernmap::testing
