// test_kernels: every row of the table (table.cpp), at every compiled CPU level this machine runs (or the one
// --level=NAME names), in every dtype of the row; each case a gtest test named
// <op>.<sizes>_<layout>/<level>/<dtype>. A compiled level that cannot run is reported by name, as a skipped
// test "levels.<name>" and a line "skipped level <name>: <why>"; with --level=<that level> nothing runs and
// the exit status is 77 (ctest's SKIP_RETURN_CODE). KERNMAP_CPU_ISA caps the levels as it caps the library's.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "kernels/cpu/isa.h"
#include "kernmap/cpu.h"
#include "tests/cpp/kernels/harness.h"
#include "tests/cpp/kernels/poison.h"

namespace kernmap::testing {
namespace {

using kernmap::cpu::Level;

constexpr int kSkipped = 77;
constexpr Level kCompiled[] = {Level::kBaseline, Level::kAvx2, Level::kAvx512, Level::kAvx512Bf16,
                               Level::kAmx};

// Why this process cannot run `level`, or nullopt when it can. The library's first active level is the best
// this CPU runs, capped by KERNMAP_CPU_ISA: levels above it are reported as capped.
std::optional<std::string> why_not(Level level, Level ceiling) {
  const std::vector<Level> supported = kernmap::cpu::supported_levels();
  const std::string name = kernmap::cpu::level_name(level);
  if (std::find(supported.begin(), supported.end(), level) == supported.end())
    return "this CPU lacks " + name;
  if (static_cast<int>(level) > static_cast<int>(ceiling)) {
    const char* cap = std::getenv("KERNMAP_CPU_ISA");
    return std::string("KERNMAP_CPU_ISA=") + (cap ? cap : "") + " caps the levels at " +
           kernmap::cpu::level_name(ceiling);
  }
  return std::nullopt;
}

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return "float64";
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    default:
      return "";
  }
}

std::string shape_label(const Shape& s) {
  std::string out;
  for (const auto& [name, value] : s.sizes) out += (out.empty() ? "" : "_") + name + std::to_string(value);
  if (!s.groups.empty()) out += (out.empty() ? "E" : "_E") + std::to_string(s.groups.size());
  return out;
}

// Makes `level` active in both copies of the kernels: the suite's own (kernels/cpu/isa.h: the raw-kernel
// checks call its kernel_table()) and libkernmap's (kernmap/cpu.h: the ops), separate since libkernmap
// exports only its public API.
void activate(Level level) {
  kernmap::cpu::set_level(level);
  kernmap::set_cpu_level(kernmap::cpu::level_name(level));
}

// One case at one level: SetUp makes the level active (restored in TearDown) and seeds torch.
class KernelCase : public ::testing::Test {
 public:
  KernelCase(Level level, const Row* row, Case c) : level_(level), row_(row), case_(std::move(c)) {}
  void SetUp() override {
    previous_ = kernmap::cpu::active_level();
    activate(level_);
    at::manual_seed(0);
  }
  void TearDown() override { activate(previous_); }
  void TestBody() override { row_->check(case_); }

 private:
  Level level_, previous_{};
  const Row* row_;
  Case case_;
};

class SkippedLevel : public ::testing::Test {
 public:
  explicit SkippedLevel(std::string message) : message_(std::move(message)) {}
  void TestBody() override { GTEST_SKIP() << message_; }

 private:
  std::string message_;
};

void register_cases(Level level) {
  std::set<std::string> names;
  for (const Row& row : kernel_table())
    for (const Shape& shape : row.shapes)
      for (const std::string& layout : shape.layouts.empty() ? row.layouts : shape.layouts)
        for (at::ScalarType dtype : row.dtypes) {
          Case c{&shape, layout, dtype, level};
          if (row.skip && row.skip(c)) continue;
          std::string name = shape_label(shape);
          if (!layout.empty()) name += (name.empty() ? "" : "_") + layout;
          name += std::string(name.empty() ? "" : "/") + kernmap::cpu::level_name(level);
          if (*dtype_name(dtype)) name += std::string("/") + dtype_name(dtype);
          if (!names.insert(row.op + "." + name).second) {
            std::fprintf(stderr, "test_kernels: the table has two cases named %s.%s\n", row.op.c_str(),
                         name.c_str());
            std::exit(2);
          }
          ::testing::RegisterTest(row.op.c_str(), name.c_str(), nullptr, nullptr, __FILE__, __LINE__,
                                  [=, &row]() -> ::testing::Test* { return new KernelCase(level, &row, c); });
        }
}

}  // namespace
}  // namespace kernmap::testing

int main(int argc, char** argv) {
  using namespace kernmap::testing;
  install_poisoning_allocator();
  ::testing::InitGoogleTest(&argc, argv);
  std::optional<Level> only;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::optional<Level> level =
        arg.rfind("--level=", 0) == 0 ? kernmap::cpu::parse_level(arg.substr(8)) : std::nullopt;
    if (!level) {
      std::fprintf(stderr,
                   "test_kernels: unknown argument '%s' (expected gtest flags and --level=baseline, avx2, "
                   "avx512, avx512bf16 or amx)\n",
                   argv[i]);
      return 2;
    }
    only = level;
  }
  const Level ceiling = kernmap::cpu::active_level();
  for (Level level : kCompiled) {
    if (only && level != *only) continue;
    const char* name = kernmap::cpu::level_name(level);
    if (const std::optional<std::string> why = why_not(level, ceiling)) {
      const std::string message = std::string("skipped level ") + name + ": " + *why;
      std::printf("%s\n", message.c_str());
      if (only) return kSkipped;
      ::testing::RegisterTest("levels", name, nullptr, nullptr, __FILE__, __LINE__,
                              [message]() -> ::testing::Test* { return new SkippedLevel(message); });
    } else {
      register_cases(level);
    }
  }
  return RUN_ALL_TESTS();
}
