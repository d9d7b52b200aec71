// The plugin loader with real plugin libraries (tests/plugins) in temporary repositories: the good plugin
// loads and runs; every failure case is refused with a clear reason and leaves the process working: truncated
// libraries and one built for another machine, a library swapped after it was hashed, a full disk under
// `kernmap lock`.
#include <elf.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/fanotify.h>
#include <sys/mount.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>
#include <vector>

#include "kernmap/c_api.h"
#include "kernmap/layers.h"
#include "kernmap/plugins.h"
#include "kernmap/registry.h"
#include "tests/cpp/plugin_repo.h"

namespace kernmap {
namespace {

using nlohmann::json;
using testing::entry;
using testing::TempRepo;
namespace fs = std::filesystem;

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in: " << text;
}

LoadOptions options(const std::string& repository, bool strict = false) {
  LoadOptions o;
  o.paths = {repository};
  o.strict = strict;
  return o;
}

// How often kmgood's kernel ran, through its op (kmgood::calls); -1 when kmgood is not loaded.
int64_t kmgood_calls() {
  const auto op = c10::Dispatcher::singleton().findSchema({"kmgood::calls", ""});
  return op ? op->typed<int64_t()>().call() : -1;
}

at::Tensor reference_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor h = x.to(at::kFloat);
  return w * (h * at::rsqrt(h.pow(2).mean(-1, true) + eps)).to(x.scalar_type());
}

// Resolution still works and kernmap's own kernels are untouched.
void expect_registry_works() {
  const Decision d = resolve("RMSNorm", "cpu", Mode::kTraining);
  ASSERT_NE(d.kernel, nullptr);
  EXPECT_EQ(d.kernel->name, "kernmap/rms_norm");
  EXPECT_FALSE(d.fallback);
}

TEST(Plugins, GoodPluginLoadsThroughKernmapPathAndRunsInTheRMSNormLayer) {
  TempRepo repo;
  repo.add("kmgood", "kmgood", "kmgood");
  ASSERT_EQ(setenv("KERNMAP_PATH", ("/nonexistent-kernmap-repo:" + repo.path()).c_str(), 1), 0);
  const LoadReport report = load_plugins_from_env();
  ASSERT_EQ(report.repositories.size(), 2u);
  expect_contains(report.repositories[0].error, "not a folder");
  const PackageReport& p = entry(report, "kmgood");
  ASSERT_EQ(p.state, PackageState::kLoaded) << p.reason;
  EXPECT_EQ(p.name, "kmgood");
  EXPECT_EQ(p.variant, "lib/libkmgood.so");
  EXPECT_EQ(p.score, 2);
  EXPECT_EQ(p.kernels, (std::vector<std::string>{"kmgood/rms_norm", "kmgood/rms_norm_npu"}));
  ASSERT_EQ(p.defaults.size(), 2u);
  expect_contains(p.defaults[0], "RMSNorm on cpu: not applied (kernmap's built-in default stays)");
  expect_contains(p.defaults[1], "RMSNorm on npu: applied");

  // Its npu default applies (kernmap maps nothing there); cpu keeps kernmap's kernel until a user maps it.
  EXPECT_EQ(resolve("RMSNorm", "npu", Mode::kInference).kernel->name, "kmgood/rms_norm_npu");
  expect_registry_works();
  register_mapping(
      {{"RMSNorm",
        {{"cpu", {{Mode::kInference, "kmgood/rms_norm"}, {Mode::kTraining, "kmgood/rms_norm"}}}}}});
  EXPECT_EQ(resolve("RMSNorm", "cpu", Mode::kTraining).kernel->name, "kmgood/rms_norm");

  RMSNorm layer(7, 1e-6);
  {
    at::NoGradGuard no_grad;
    layer.weight().uniform_(0.5, 1.5);
  }
  const Report kr = kernelize(layer, "cpu", Mode::kTraining);
  EXPECT_EQ(layer.kernel().name, "kmgood/rms_norm");
  const int64_t before = kmgood_calls();
  ASSERT_GE(before, 0) << "the plugin library is not loaded";
  const at::Tensor x = at::randn({3, 7}, at::kDouble).to(at::kFloat).requires_grad_(true);
  const at::Tensor y = layer.forward(x);
  EXPECT_EQ(kmgood_calls(), before + 1);
  const at::Tensor x_ref = x.detach().clone().requires_grad_(true);
  const at::Tensor y_ref = reference_rms_norm(x_ref, layer.weight().detach(), 1e-6);
  EXPECT_TRUE(at::allclose(y, y_ref, 1e-6, 1e-6));
  y.pow(2).sum().backward();
  y_ref.pow(2).sum().backward();
  EXPECT_TRUE(at::allclose(x.grad(), x_ref.grad(), 1e-5, 1e-6));

  // Loading again is a no-op, and the history holds the package once.
  const LoadReport again = load_plugins_from_env();
  EXPECT_EQ(entry(again, "kmgood").state, PackageState::kLoaded);
  EXPECT_EQ(entry(again, "kmgood").reason, "already loaded (no-op)");
  EXPECT_TRUE(entry(again, "kmgood").kernels.empty());
  EXPECT_EQ(plugin_report().packages.size(), 1u);
  unsetenv("KERNMAP_PATH");
}

// Writes the manifest after applying `change` to the one `add` wrote.
template <typename Change>
void add_changed(TempRepo& repo, const std::string& folder, const std::string& name,
                 const std::string& plugin, Change change) {
  json m = repo.add(folder, name, plugin);
  change(m);
  repo.write_manifest(folder, m);
}

TEST(Plugins, EveryFailureIsRefusedWithItsReasonAndTheProcessKeepsWorking) {
  TempRepo repo;
  repo.add("a-good", "kmgood", "kmgood");
  add_changed(repo, "missing-library", "kmmissing", "kmzero",
              [](json& m) { m["variants"][0]["library"] = "lib/libgone.so"; });
  add_changed(repo, "wrong-sha", "kmsha", "kmzero",
              [](json& m) { m["variants"][0]["sha256"] = std::string(64, '0'); });
  add_changed(repo, "abi-manifest", "kmabim", "kmzero", [](json& m) { m["plugin_abi"] = 99; });
  repo.add("abi-symbol", "kmbadabi", "kmbadabi");
  repo.add("no-register", "kmnoreg", "kmnoreg");
  repo.add("throws", "kmthrows", "kmthrows");
  repo.add("fails", "kmfails", "kmfails");
  repo.add("z-duplicate", "kmdup", "kmdup");
  repo.add("zero-score", "kmzero", "kmzero");
  testing::write_file(repo.root() / "malformed" / "manifest.json", "{\"name\": \"kmbad\", ");
  add_changed(repo, "unknown-field", "kmunknown", "kmzero", [](json& m) { m["homepage"] = "https://x"; });
  add_changed(repo, "dotdot", "kmdotdot", "kmzero",
              [](json& m) { m["variants"][0]["library"] = "../a-good/lib/libkmgood.so"; });
  add_changed(repo, "absolute", "kmabs", "kmzero",
              [](json& m) { m["variants"][0]["library"] = testing::plugin_library("kmzero"); });
  {
    json m = repo.add("symlink", "kmlink", "kmzero");
    fs::create_symlink(testing::plugin_library("kmzero"), repo.root() / "symlink" / "lib" / "escape.so");
    m["variants"][0]["library"] = "lib/escape.so";
    repo.write_manifest("symlink", m);
  }
  {
    testing::write_file(repo.root() / "not-elf" / "lib" / "libtext.so", "this is not a shared library\n");
    repo.write_manifest(
        "not-elf", testing::manifest_for("kmtext", "lib/libtext.so",
                                         sha256_file((repo.root() / "not-elf/lib/libtext.so").string())));
  }
  testing::write_file(repo.root() / "no-manifest" / "README", "a folder without manifest.json");
  add_changed(repo, "other-torch", "kmold", "kmzero", [](json& m) { m["variants"][0]["torch"] = "1.13"; });

  const LoadReport report = load_plugins(options(repo.path()));
  EXPECT_EQ(entry(report, "a-good").state, PackageState::kLoaded) << entry(report, "a-good").reason;
  const std::pair<std::string, std::vector<std::string>> refused[] = {
      {"missing-library", {"variants[0].library", "lib/libgone.so", "not found"}},
      {"wrong-sha", {"sha256 mismatch", std::string(64, '0'), "the file has"}},
      {"abi-manifest", {"plugin_abi: expected 1", "got 99"}},
      {"abi-symbol", {"kernmap_plugin_abi_version() returned 2", "expected 1"}},
      {"no-register", {"does not export kernmap_plugin_register"}},
      {"throws", {"kernmap_plugin_register threw: boom from kmthrows", "nothing of it was registered"}},
      {"fails", {"returned 3: the acme runtime is missing", "nothing of it was registered"}},
      {"z-duplicate",
       {"package 'kmdup' registers kernel 'kmgood/rms_norm'", "package 'kmgood'", "a-good",
        "nothing of it was registered"}},
      {"malformed", {"malformed/manifest.json: not valid JSON"}},
      {"unknown-field", {"unknown-field/manifest.json: homepage: expected no such field"}},
      {"dotdot", {"variants[0].library", "no '..'"}},
      {"absolute", {"variants[0].library", "not an absolute path"}},
      {"symlink", {"variants[0].library", "a symlink that leaves the folder"}},
      {"not-elf", {"libtext.so: not an ELF file"}},
      {"no-manifest", {"no manifest.json"}},
  };
  for (const auto& [folder, parts] : refused) {
    const PackageReport& p = entry(report, folder);
    EXPECT_EQ(p.state, PackageState::kRefused) << folder << ": " << p.reason;
    for (const std::string& part : parts) expect_contains(p.reason, part);
  }
  EXPECT_EQ(report.refused(), std::size(refused));
  EXPECT_EQ(entry(report, "zero-score").state, PackageState::kSkipped);
  EXPECT_EQ(entry(report, "zero-score").reason, "the plugin's score is 0: no acme NPU on this machine");
  EXPECT_EQ(entry(report, "other-torch").state, PackageState::kSkipped);
  expect_contains(entry(report, "other-torch").reason, "lib/libkmzero.so needs torch 1.13");

  // Nothing of a refused or skipped plugin is registered; the good plugin and kernmap still work.
  for (const char* name :
       {"kmbadabi/rms_norm", "kmthrows/rms_norm", "kmfails/rms_norm", "kmdup/rms_norm", "kmzero/rms_norm"})
    EXPECT_EQ(find_kernel(name), nullptr) << name;
  ASSERT_NE(find_kernel("kmgood/rms_norm"), nullptr);
  EXPECT_EQ(find_kernel("kmgood/rms_norm")->description, "test plugin RMSNorm (ATen ops)");
  expect_registry_works();
  EXPECT_EQ(resolve("RMSNorm", "npu", Mode::kInference).kernel->name, "kmgood/rms_norm_npu");

  // strict: the same refusals become one PluginError that carries the report.
  try {
    load_plugins(options(repo.path(), /*strict=*/true));
    ADD_FAILURE() << "strict load did not throw";
  } catch (const PluginError& e) {
    expect_contains(e.what(), "plugin package(s) refused");
    expect_contains(e.what(), "boom from kmthrows");
    EXPECT_EQ(e.report().refused(), std::size(refused));
  }
  expect_registry_works();
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A package whose library is a test plugin's changed by `change`, with a manifest that gives the changed
// file's sha256: only the checks of the library itself can refuse it.
template <typename Change>
void add_changed_library(TempRepo& repo, const std::string& folder, const std::string& name,
                         const std::string& plugin, Change change) {
  json m = repo.add(folder, name, plugin);
  const fs::path library = repo.root() / folder / "lib" / ("lib" + plugin + ".so");
  std::string bytes = read_bytes(library);
  change(bytes);
  testing::write_file(library, bytes);
  m["variants"][0]["sha256"] = sha256_file(library.string());
  repo.write_manifest(folder, m);
}

TEST(Plugins, TruncatedLibrariesAreRefusedBeforeDlopenMapsThem) {
  TempRepo repo;
  const uintmax_t size = fs::file_size(testing::plugin_library("kmgood"));
  const std::pair<std::string, uintmax_t> cuts[] = {
      {"cut-1k", 1024}, {"cut-8k", 8192}, {"cut-half", size / 2}};
  for (const auto& [folder, keep] : cuts)
    add_changed_library(repo, folder, "km" + folder, "kmgood",
                        [keep = keep](std::string& b) { b.resize(keep); });
  // Before the check, dlopen mapped segments past the end of these files and the process died of SIGBUS.
  const LoadReport report = load_plugins(options(repo.path()));
  for (const auto& [folder, keep] : cuts) {
    const PackageReport& p = entry(report, folder);
    EXPECT_EQ(p.state, PackageState::kRefused) << folder << ": " << p.reason;
    expect_contains(p.reason, "lib/libkmgood.so: ");
    expect_contains(p.reason, "but the file has " + std::to_string(keep) + " bytes (truncated?)");
  }
  expect_registry_works();
}

TEST(Plugins, ALibraryBuiltForAnotherMachineIsRefusedNamingBoth) {
  TempRepo repo;
  const std::string bytes = read_bytes(testing::plugin_library("kmzero"));
  uint16_t machine = 0;
  std::memcpy(&machine, bytes.data() + offsetof(Elf64_Ehdr, e_machine), sizeof machine);
  const uint16_t other = machine == EM_AARCH64 ? EM_X86_64 : EM_AARCH64;
  add_changed_library(repo, "other-machine", "kmother", "kmzero", [other](std::string& b) {
    std::memcpy(b.data() + offsetof(Elf64_Ehdr, e_machine), &other, sizeof other);
  });
  const PackageReport p = entry(load_plugins(options(repo.path())), "other-machine");
  EXPECT_EQ(p.state, PackageState::kRefused) << p.reason;
  // Before, dlopen's own message: "cannot open shared object file: No such file or directory".
  expect_contains(p.reason, std::string("lib/libkmzero.so: built for ") +
                                (other == EM_AARCH64 ? "aarch64" : "x86_64") + ", this machine is " +
                                process_info().arch);
}

// Replaces `target` by `replacement` (a rename over it) the moment something first opens `target`, before
// that open returns: the opener reads the original, every later open of the path finds the replacement.
// The race a local attacker can try to win between hashing a library and opening it again, made certain
// with fanotify permission events (root with CAP_SYS_ADMIN; error() says why not when unavailable).
class SwapOnFirstOpen {
 public:
  SwapOnFirstOpen(const fs::path& target, const fs::path& replacement) {
    fan_ = fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC, O_RDONLY | O_CLOEXEC);
    if (fan_ < 0 || fanotify_mark(fan_, FAN_MARK_ADD, FAN_OPEN_PERM, AT_FDCWD, target.c_str()) != 0) {
      error_ = std::string("fanotify: ") + std::strerror(errno);
      return;
    }
    watcher_ = std::thread([this, target, replacement] {
      while (!stop_) {
        pollfd ready{fan_, POLLIN, 0};
        if (poll(&ready, 1, 20) <= 0) continue;
        alignas(fanotify_event_metadata) char buffer[4096];
        ssize_t length = read(fan_, buffer, sizeof buffer);
        for (auto* event = reinterpret_cast<fanotify_event_metadata*>(buffer); FAN_EVENT_OK(event, length);
             event = FAN_EVENT_NEXT(event, length)) {
          if (!swapped_) swapped_ = std::rename(replacement.c_str(), target.c_str()) == 0;
          const fanotify_response allow{event->fd, FAN_ALLOW};
          if (write(fan_, &allow, sizeof allow) != sizeof allow) ADD_FAILURE() << "fanotify response failed";
          close(event->fd);
        }
      }
    });
  }
  ~SwapOnFirstOpen() {
    stop_ = true;
    if (watcher_.joinable()) watcher_.join();
    if (fan_ >= 0) close(fan_);
  }
  SwapOnFirstOpen(const SwapOnFirstOpen&) = delete;
  SwapOnFirstOpen& operator=(const SwapOnFirstOpen&) = delete;

  const std::string& error() const { return error_; }
  bool swapped() const { return swapped_; }

 private:
  int fan_ = -1;
  std::string error_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> swapped_{false};
  std::thread watcher_;
};

TEST(Plugins, ALibrarySwappedAfterHashingNeverRuns) {
  TempRepo repo;
  repo.add("swapped", "kmswap", "kmzero");
  write_lock(repo.path());  // pins kmzero's sha256
  const fs::path library = repo.root() / "swapped" / "lib" / "libkmzero.so";
  const fs::path replacement = repo.root() / "replacement.so";  // a plain file: not a package
  fs::copy_file(testing::plugin_library("kmfails"), replacement);
  SwapOnFirstOpen swap(library, replacement);
  if (!swap.error().empty()) GTEST_SKIP() << "the swap cannot be timed here: " << swap.error();
  const PackageReport p = entry(load_plugins(options(repo.path())), "swapped");
  ASSERT_TRUE(swap.swapped()) << "the loader never opened " << library;
  EXPECT_EQ(sha256_file(library.string()), sha256_file(testing::plugin_library("kmfails")));
  // The code that ran is the hashed kmzero's (its score skips it), not kmfails' (it would register and fail
  // with "the acme runtime is missing"): before, 3 opens of the path let the third load the replacement.
  EXPECT_EQ(p.state, PackageState::kSkipped) << p.reason;
  EXPECT_EQ(p.reason, "the plugin's score is 0: no acme NPU on this machine");
  EXPECT_EQ(find_kernel("kmfails/rms_norm"), nullptr);
}

TEST(Plugins, LockPinsNameVersionAndHash) {
  TempRepo repo;
  repo.add("kmgood", "kmgood", "kmgood");
  const auto lock_path = repo.root() / "kernmap.lock";
  const auto load_state = [&] {
    const PackageReport p = entry(load_plugins(options(repo.path())), "kmgood");
    return std::make_pair(p.state, p.reason);
  };
  const std::string digest = sha256_file((repo.root() / "kmgood/lib/libkmgood.so").string());
  testing::write_file(
      lock_path,
      R"({"lock_version": 1, "packages": {"kmother": {"version": "1.0.0", "sha256": [")" + digest + "\"]}}}");
  auto [state, reason] = load_state();
  EXPECT_EQ(state, PackageState::kRefused);
  expect_contains(reason, "kernmap.lock does not pin package 'kmgood'");
  testing::write_file(
      lock_path,
      R"({"lock_version": 1, "packages": {"kmgood": {"version": "0.9", "sha256": [")" + digest + "\"]}}}");
  std::tie(state, reason) = load_state();
  EXPECT_EQ(state, PackageState::kRefused);
  expect_contains(reason, "pins 'kmgood' version 0.9, the manifest has 1.0.0");
  testing::write_file(lock_path,
                      R"({"lock_version": 1, "packages": {"kmgood": {"version": "1.0.0", "sha256": [")" +
                          std::string(64, 'e') + "\"]}}}");
  std::tie(state, reason) = load_state();
  EXPECT_EQ(state, PackageState::kRefused);
  expect_contains(reason, "does not list sha256 " + digest);
  testing::write_file(lock_path, "{\"lock_version\": 1}");
  std::tie(state, reason) = load_state();
  EXPECT_EQ(state, PackageState::kRefused);
  expect_contains(reason, "kernmap.lock: packages: expected a required field");
  EXPECT_EQ(find_kernel("kmgood/rms_norm"), nullptr);

  // write_lock refuses a manifest whose sha256 does not match its file, and writes nothing.
  fs::remove(lock_path);
  json m = repo.add("kmrival", "kmrival", "kmrival");
  m["variants"][0]["sha256"] = std::string(64, '1');
  repo.write_manifest("kmrival", m);
  try {
    write_lock(repo.path());
    ADD_FAILURE() << "write_lock accepted a wrong sha256";
  } catch (const std::invalid_argument& e) {
    expect_contains(e.what(), "not written");
    expect_contains(e.what(), "kmrival/manifest.json: variants[0].sha256: expected the sha256 of");
  }
  EXPECT_FALSE(fs::exists(lock_path));
  repo.add("kmrival", "kmrival", "kmrival");
  const std::string text = write_lock(repo.path());
  expect_contains(text, digest);
  EXPECT_TRUE(fs::exists(lock_path));

  // Locked: both load; kmrival's higher score takes the npu default from kmgood.
  const LoadReport report = load_plugins(options(repo.path()));
  ASSERT_EQ(entry(report, "kmgood").state, PackageState::kLoaded) << entry(report, "kmgood").reason;
  ASSERT_EQ(entry(report, "kmrival").state, PackageState::kLoaded) << entry(report, "kmrival").reason;
  ASSERT_EQ(entry(report, "kmrival").defaults.size(), 1u);
  expect_contains(entry(report, "kmrival").defaults[0],
                  "RMSNorm on npu: applied, replacing package 'kmgood' (score 2 < 5)");
  EXPECT_EQ(resolve("RMSNorm", "npu", Mode::kInference).kernel->name, "kmrival/rms_norm_npu");
}

// A tmpfs on a new folder that fill() fills to its last page: nothing more can be written there. Mounting
// needs CAP_SYS_ADMIN; error() says why not when unavailable.
class FullDisk {
 public:
  FullDisk() : root_(fs::temp_directory_path() / ("kernmap-full-disk-" + std::to_string(::getpid()))) {
    fs::create_directories(root_);
    if (mount("tmpfs", root_.c_str(), "tmpfs", 0, "size=1m") != 0)
      error_ = std::string("mount -t tmpfs: ") + std::strerror(errno);
  }
  ~FullDisk() {
    if (error_.empty()) umount2(root_.c_str(), MNT_DETACH);
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  FullDisk(const FullDisk&) = delete;
  FullDisk& operator=(const FullDisk&) = delete;

  void fill() const {
    const int fd = open((root_ / "filler").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    const std::string block(4096, 'x');
    while (fd >= 0 && write(fd, block.data(), block.size()) > 0) {
    }
    if (fd >= 0) close(fd);
  }
  const fs::path& root() const { return root_; }
  const std::string& error() const { return error_; }

 private:
  fs::path root_;
  std::string error_;
};

TEST(Plugins, AFullDiskFailsTheLockWithTheReasonAndLeavesNoPartialFile) {
  const FullDisk disk;
  if (!disk.error().empty()) GTEST_SKIP() << "no small file system to fill here: " << disk.error();
  const fs::path repo = disk.root() / "repo";
  const fs::path library = repo / "kmzero" / "lib" / "libkmzero.so";
  fs::create_directories(library.parent_path());
  fs::copy_file(testing::plugin_library("kmzero"), library);
  testing::write_file(
      repo / "kmzero" / "manifest.json",
      testing::manifest_for("kmzero", "lib/libkmzero.so", sha256_file(library.string())).dump());
  disk.fill();
  const fs::path lock = repo / "kernmap.lock";
  try {
    write_lock(repo.string());
    ADD_FAILURE() << "write_lock succeeded on a full disk";
  } catch (const std::runtime_error& e) {
    // Before: "kernmap lock: cannot write '.../kernmap.lock.tmp'", no reason, and the .tmp left behind.
    expect_contains(e.what(), "cannot write " + lock.string() + ": write failed: No space left on device");
    expect_contains(e.what(), "the partial " + lock.string() + ".tmp was removed");
    EXPECT_EQ(std::string(e.what()).find("kernmap lock"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(lock));
  EXPECT_FALSE(fs::exists(lock.string() + ".tmp"));
}

TEST(Plugins, VariantNeedsTheProcessToolkit) {
  TempRepo repo;
  json m = repo.add("kmgood", "kmgood", "kmgood");
  json old = m["variants"][0];
  old["torch"] = "1.13";
  m["variants"][0]["toolkits"] = {{"cann", "8.0"}};
  m["variants"].push_back(old);
  repo.write_manifest("kmgood", m);
  unsetenv("KERNMAP_TOOLKITS");
  PackageReport p = entry(load_plugins(options(repo.path())), "kmgood");
  EXPECT_EQ(p.state, PackageState::kSkipped);
  expect_contains(p.reason, "toolkits: none");
  expect_contains(p.reason, "lib/libkmgood.so needs cann 8.0 (this process has no cann)");
  expect_contains(p.reason, "lib/libkmgood.so needs torch 1.13");
  ASSERT_EQ(setenv("KERNMAP_TOOLKITS", "cann=7.0", 1), 0);
  p = entry(load_plugins(options(repo.path())), "kmgood");
  expect_contains(p.reason, "needs cann 8.0 (have 7.0)");
  ASSERT_EQ(setenv("KERNMAP_TOOLKITS", "cuda=12.8,cann=8.0.1", 1), 0);
  p = entry(load_plugins(options(repo.path())), "kmgood");
  EXPECT_EQ(p.state, PackageState::kLoaded) << p.reason;
  ASSERT_EQ(p.offered.size(), 2u);
  expect_contains(p.offered[0], "cann 8.0");
  unsetenv("KERNMAP_TOOLKITS");
}

TEST(Plugins, ConcurrentLoadsLoadEachPackageOnce) {
  TempRepo repo;
  repo.add("kmgood", "kmgood", "kmgood");
  std::vector<LoadReport> reports(4);
  std::vector<std::thread> threads;
  for (LoadReport& r : reports) threads.emplace_back([&r, &repo] { r = load_plugins(options(repo.path())); });
  for (std::thread& t : threads) t.join();
  int first = 0, repeats = 0;
  for (const LoadReport& r : reports) {
    const PackageReport& p = entry(r, "kmgood");
    ASSERT_EQ(p.state, PackageState::kLoaded) << p.reason;
    (p.reason.empty() ? first : repeats) += 1;
  }
  EXPECT_EQ(first, 1);
  EXPECT_EQ(repeats, 3);
  EXPECT_EQ(plugin_report().packages.size(), 1u);
  EXPECT_NE(find_kernel("kmgood/rms_norm"), nullptr);
}

TEST(Plugins, MalformedToolkitsVariableIsAnError) {
  ASSERT_EQ(setenv("KERNMAP_TOOLKITS", "cann8.0", 1), 0);
  try {
    load_plugins(LoadOptions{});
    ADD_FAILURE() << "accepted KERNMAP_TOOLKITS=cann8.0";
  } catch (const std::invalid_argument& e) {
    expect_contains(e.what(), "KERNMAP_TOOLKITS: entry 'cann8.0' is not of the form toolkit=version");
  }
  unsetenv("KERNMAP_TOOLKITS");
}

TEST(Plugins, CApiLoadsReportsAndLocks) {
  TempRepo repo;
  repo.add("kmgood", "kmgood", "kmgood");
  char* out = nullptr;
  char* error = nullptr;
  ASSERT_EQ(kernmap_write_lock(repo.path().c_str(), &out, &error), KERNMAP_OK) << error;
  expect_contains(out, "\"kmgood\"");
  kernmap_free(out);

  EXPECT_EQ(kernmap_load_plugins(R"({"paths": [], "colour": "red"})", &out, &error),
            KERNMAP_INVALID_ARGUMENT);
  expect_contains(error, "unknown field 'colour'");
  kernmap_free(error);
  error = nullptr;

  const std::string request = json{{"paths", {repo.path()}}, {"toolkits", {{"cann", "8.0"}}}}.dump();
  ASSERT_EQ(kernmap_load_plugins(request.c_str(), &out, &error), KERNMAP_OK) << error;
  const json report = json::parse(out);
  kernmap_free(out);
  EXPECT_EQ(report["process"]["toolkits"]["cann"], "8.0");
  EXPECT_EQ(report["repositories"][0]["has_lock"], true);
  EXPECT_EQ(report["packages"][0]["state"], "loaded");
  EXPECT_EQ(report["packages"][0]["kernels"][0], "kmgood/rms_norm");

  // strict with a refusal: an error, and the report still comes back.
  TempRepo bad;
  testing::write_file(bad.root() / "broken" / "manifest.json", "[");
  const std::string strict = json{{"paths", {bad.path()}}, {"strict", true}}.dump();
  out = nullptr;
  EXPECT_EQ(kernmap_load_plugins(strict.c_str(), &out, &error), KERNMAP_INVALID_ARGUMENT);
  expect_contains(error, "broken/manifest.json: not valid JSON");
  ASSERT_NE(out, nullptr);
  EXPECT_EQ(json::parse(out)["packages"][0]["state"], "refused");
  kernmap_free(out);
  kernmap_free(error);

  ASSERT_EQ(kernmap_plugin_report(&out, &error), KERNMAP_OK);
  EXPECT_EQ(json::parse(out)["packages"].size(), 2u);
  kernmap_free(out);
}

}  // namespace
}  // namespace kernmap
