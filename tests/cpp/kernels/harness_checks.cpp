// The ops' input errors, the level switch, and the harness's proofs: fresh allocations are poisoned, and a
// kernel that leaves an output element unwritten fails the common check.
#include <gtest/gtest-spi.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include "kernels/cpu/cache.h"
#include "kernmap/cpu.h"
#include "kernmap/ops.h"
#include "tests/cpp/kernels/checks.h"

namespace kernmap::testing {

void ops_name_the_bad_argument(const Case&) {
  const at::Tensor x = at::randn({4, 8});
  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  EXPECT_NE(message([&] { kernmap::rms_norm(x, at::ones({7}), 1e-6); }).find("weight must have shape [8]"),
            std::string::npos);
  EXPECT_NE(
      message([&] { kernmap::rms_norm(x.to(at::kLong), at::ones({8}), 1e-6); }).find("x must be float32"),
      std::string::npos);
  EXPECT_NE(message([&] {
              kernmap::silu_and_mul(x, at::randn({4, 9}));
            }).find("up must have the shape of gate"),
            std::string::npos);
  EXPECT_NE(
      message([&] { kernmap::silu_and_mul(x, x.to(at::kBFloat16)); }).find("up must have the dtype of gate"),
      std::string::npos);
  EXPECT_NE(message([&] {
              kernmap::swiglu(at::randn({4, 7}));
            }).find("even last dimension"),
            std::string::npos);
}

void the_level_is_active(const Case& c) {
  EXPECT_EQ(kernmap::cpu::active_level(), c.level);
  EXPECT_EQ(kernmap::cpu_level(), kernmap::cpu::level_name(c.level));  // libkernmap's copy too
  const std::vector<kernmap::cpu::Level> levels = kernmap::cpu::supported_levels();
  ASSERT_FALSE(levels.empty());
  EXPECT_EQ(levels.front(), kernmap::cpu::Level::kBaseline);
  EXPECT_EQ(kernmap::cpu::parse_level(kernmap::cpu::level_name(c.level)), c.level);
  EXPECT_FALSE(kernmap::cpu::parse_level("sse9").has_value());
}

// kernmap/cpu.h names and sets libkernmap's level; a refused level changes nothing.
void the_public_level_functions_name_and_set_it(const Case&) {
  const std::vector<std::string> levels = kernmap::supported_cpu_levels();
  std::vector<std::string> expected;
  std::string runs;
  for (kernmap::cpu::Level l : kernmap::cpu::supported_levels()) {
    expected.emplace_back(kernmap::cpu::level_name(l));
    runs += (runs.empty() ? "" : ", ") + expected.back();
  }
  EXPECT_EQ(levels, expected);
  const std::string previous = kernmap::cpu_level();
  EXPECT_NE(std::find(levels.begin(), levels.end(), previous), levels.end()) << previous;
  kernmap::set_cpu_level("baseline");
  EXPECT_EQ(kernmap::cpu_level(), "baseline");
  const auto refusal = [](const std::string& level) -> std::string {
    try {
      kernmap::set_cpu_level(level);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(refusal("sse9"), "set_cpu_level: unknown level 'sse9' (this CPU runs: " + runs + ")");
  if (levels.size() < 5) {  // a compiled level this CPU cannot run (none on a CPU with AMX)
    EXPECT_EQ(refusal("amx"), "set_cpu_level: this CPU cannot run level 'amx' (this CPU runs: " + runs + ")");
  }
  EXPECT_EQ(kernmap::cpu_level(), "baseline");  // a refused level changes nothing
  kernmap::set_cpu_level(previous);
  EXPECT_EQ(kernmap::cpu_level(), previous);
}

// The cache reader on a sysfs-shaped folder: data and unified caches by level, the instruction cache skipped,
// sizes in K and M, an unreadable size left 0, the list ending at the first missing index; the public
// functions give cpu0's figures, and the blocking rule reads them.
void the_cache_reader_reads_sysfs(const Case&) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("kernmap_cache_" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto cache = [&](int index, const char* level, const char* type, const char* size,
                   const char* shared = nullptr) {
    const fs::path dir = root / ("index" + std::to_string(index));
    fs::create_directories(dir);
    std::ofstream(dir / "level") << level << "\n";
    std::ofstream(dir / "type") << type << "\n";
    std::ofstream(dir / "size") << size << "\n";
    if (shared) std::ofstream(dir / "shared_cpu_list") << shared << "\n";
  };
  cache(0, "1", "Data", "48K");
  cache(1, "1", "Instruction", "32K");
  cache(2, "2", "Unified", "2048K");
  cache(3, "3", "Unified", "105M", "0-3,8-11");
  cache(5, "4", "Unified", "1K");  // after a gap: not read
  kernmap::cpu::CacheSizes got = kernmap::cpu::read_cache_sizes(root.string(), false);
  EXPECT_EQ(got.l1d, 48 << 10);
  EXPECT_EQ(got.l2, 2048 << 10);
  EXPECT_EQ(got.l3, int64_t{105} << 20);
  EXPECT_EQ(got.l3_cpus, 8);
  // The usable L3: the instance, at most 4 MiB a CPU sharing it; the instance alone where the list is
  // unknown.
  EXPECT_EQ(kernmap::cpu::usable_l3_bytes(got), int64_t{32} << 20);
  cache(3, "3", "Unified", "260M", "0-1");  // a 2-CPU VM listing its host socket's L3
  EXPECT_EQ(kernmap::cpu::usable_l3_bytes(kernmap::cpu::read_cache_sizes(root.string(), false)),
            int64_t{8} << 20);
  cache(3, "3", "Unified", "8M", "0-3");
  EXPECT_EQ(kernmap::cpu::usable_l3_bytes(kernmap::cpu::read_cache_sizes(root.string(), false)),
            int64_t{8} << 20);
  cache(3, "3", "Unified", "32M", "0,x");
  got = kernmap::cpu::read_cache_sizes(root.string(), false);
  EXPECT_EQ(got.l3_cpus, 0);  // malformed: unknown
  EXPECT_EQ(kernmap::cpu::usable_l3_bytes(got), int64_t{32} << 20);
  EXPECT_EQ(kernmap::cpu::usable_l3_bytes(kernmap::cpu::CacheSizes{}), int64_t{32} << 20);
  cache(3, "3", "Unified", "lots");
  EXPECT_EQ(kernmap::cpu::read_cache_sizes(root.string(), false).l3, 0);
  fs::remove_all(root);
  EXPECT_EQ(kernmap::cpu::read_cache_sizes(root.string(), false).l1d, 0);  // no folder: nothing known

  // The streams the L2 streamer follows: Intel's documented 32, else no known limit; KERNMAP_PREFETCH_STREAMS
  // sets it, an empty value leaves the CPU's, anything but a count from 0 is an error naming it and the
  // value.
  {
    const char* name = "KERNMAP_PREFETCH_STREAMS";
    const ScopedEnv env(name, "");
    unsetenv(name);
    const int64_t cpu = kernmap::cpu::prefetch_streams();
    EXPECT_TRUE(cpu == 0 || cpu == 32) << cpu;
    setenv(name, "12", 1);
    EXPECT_EQ(kernmap::cpu::prefetch_streams(), 12);
    setenv(name, "0", 1);
    EXPECT_EQ(kernmap::cpu::prefetch_streams(), 0);
    setenv(name, "", 1);
    EXPECT_EQ(kernmap::cpu::prefetch_streams(), cpu);
    for (const char* bad : {"abc", "-1", "8x", "99999999999999999999", "2000000"}) {
      setenv(name, bad, 1);
      try {
        (void)kernmap::cpu::prefetch_streams();
        ADD_FAILURE() << "no error for " << name << "=" << bad;
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos) << e.what();
      }
    }
  }

  const kernmap::CpuCaches pub = kernmap::cpu_caches();
  const kernmap::cpu::CacheSizes& own = kernmap::cpu::cache_sizes();
  EXPECT_EQ(pub.l1d_bytes, own.l1d);
  EXPECT_EQ(pub.l2_bytes, own.l2);
  EXPECT_EQ(pub.l3_bytes, own.l3);
  EXPECT_FALSE(kernmap::cpu_model().empty());
  // The level-2 blocking rule: a quarter of one core's L2, of 1 MiB where unknown.
  EXPECT_EQ(kernmap::cpu::l2_block_bytes(), (own.l2 > 0 ? own.l2 : int64_t{1} << 20) / 4);
}

void fresh_allocations_are_nan(const Case& c) {
  for (int round = 0; round < 2; ++round) {
    // The second round takes the blocks the first freed (after writing them): poisoned again.
    at::Tensor t = at::empty({1031}, c.dtype), big = at::empty({1 << 18}, c.dtype);
    EXPECT_TRUE(t.isnan().all().item<bool>()) << "round " << round;
    EXPECT_TRUE(big.isnan().all().item<bool>()) << "round " << round;
    t.fill_(1);
    big.fill_(1);
  }
  EXPECT_TRUE(at::empty({7}, at::kLong).eq(-1).all().item<bool>());
}

namespace {

// SiLU into a fresh output, leaving its last element unwritten: the bug the poisoning exists to catch.
at::Tensor silu_missing_the_last_element(const std::vector<at::Tensor>& in) {
  const at::Tensor y = kernmap::silu(in[0].detach());
  at::Tensor out = at::empty_like(y);
  const int64_t n = y.numel();
  out.view(-1).narrow(0, 0, n - 1).copy_(y.reshape(-1).narrow(0, 0, n - 1));
  return out;
}

// Case of the proof (gtest's EXPECT_NONFATAL_FAILURE takes no local variables).
const Case* proof_case = nullptr;

void check_the_broken_kernel() {
  expect_matches_reference(*proof_case,
                           {.inputs = {randn({6, 37}, proof_case->dtype)},
                            .kernel = silu_missing_the_last_element,
                            .reference = [](const auto& in) { return kernmap::reference::silu(in[0]); }});
}

}  // namespace

void an_unwritten_output_element_fails(const Case& c) {
  proof_case = &c;
  EXPECT_NONFATAL_FAILURE(check_the_broken_kernel(), "1 of 222 elements not close");
  proof_case = nullptr;
}

}  // namespace kernmap::testing
