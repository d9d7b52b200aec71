// The plugin loader with real plugin libraries (tests/plugins) in temporary repositories: the good plugin
// loads and runs; every failure case is refused with a clear reason and leaves the process working.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdlib>
#include <fstream>
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

int kmgood_calls(const std::string& library) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) return -1;
  const auto fn = reinterpret_cast<int (*)()>(dlsym(handle, "kmgood_calls"));
  const int calls = fn != nullptr ? fn() : -1;
  dlclose(handle);  // drops only the reference RTLD_NOLOAD added
  return calls;
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
  const std::string library = (repo.root() / "kmgood" / "lib" / "libkmgood.so").string();
  const int before = kmgood_calls(fs::canonical(library).string());
  ASSERT_GE(before, 0) << "the plugin library is not loaded";
  const at::Tensor x = at::randn({3, 7}, at::kDouble).to(at::kFloat).requires_grad_(true);
  const at::Tensor y = layer.forward(x);
  EXPECT_EQ(kmgood_calls(fs::canonical(library).string()), before + 1);
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
