// The plugin loader (include/kernmap/plugins.h): each package folder goes through the phases of load_package
// in order (read the manifest, choose the variant, verify the library, open it, ask its score, register into
// a stage, commit the stage) and stops at the first that refuses it. What is loaded, and which package owns
// which default, is kept here.
#include "kernmap/plugins.h"

#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernmap/plugin.h"
#include "kernmap/registry.h"
#include "registry/mapping_levels.h"
#include "repository/elf_check.h"
#include "repository/folder.h"
#include "repository/host.h"
#include "repository/manifest.h"
#include "repository/sealed_library.h"
#include "repository/variant.h"

namespace kernmap {
namespace {

namespace fs = std::filesystem;
using repository::ElfTarget;
using repository::kLockFile;
using repository::kManifestFile;
using repository::Manifest;
using repository::RepositoryFiles;
using repository::SealedLibrary;
using repository::Stage;
using repository::Variant;

// A package whose library is open. Libraries are never closed: its kernels may run until the process ends.
struct LoadedPackage {
  std::string name;
  std::string version;
  std::string location;  // repository/folder, for messages
  std::string library;   // real path of the library
  int score = 0;
};

struct LoaderState {
  std::mutex mutex;
  std::map<std::string, LoadedPackage> loaded;                               // by package name
  std::map<std::string, std::string> kernel_owner;                           // kernel name -> package name
  std::map<std::pair<std::string, std::string>, std::string> default_owner;  // (layer, device) -> package
  LoadReport history;
};

LoaderState& state() {
  static LoaderState s;
  return s;
}

// The loaded package that registered `kernel`, or a description of where it came from otherwise.
std::string kernel_origin(const std::string& kernel) {
  const LoaderState& s = state();
  const auto it = s.kernel_owner.find(kernel);
  if (it == s.kernel_owner.end()) return "kernmap (built in) or the application";
  const auto pkg = s.loaded.find(it->second);
  return "package '" + it->second + "'" + (pkg == s.loaded.end() ? "" : " (" + pkg->second.location + ")");
}

class Refusal : public std::runtime_error {
 public:
  Refusal(PackageState state, const std::string& reason) : std::runtime_error(reason), state(state) {}
  PackageState state;
};

[[noreturn]] void refuse(const std::string& reason) {
  throw Refusal(PackageState::kRefused, reason);
}

// Applies the plugin's defaults: only to pairs the built-in defaults leave unmapped; between plugins the
// higher score wins. Returns one note per (layer, device). Called with the loader lock held.
std::vector<std::string> apply_defaults(const Mapping& defaults, const std::string& package, int score) {
  LoaderState& s = state();
  std::vector<std::string> notes;
  Mapping accepted;
  for (const auto& [layer, devices] : defaults) {
    for (const auto& [device, modes] : devices) {
      const std::string pair = layer + " on " + device;
      const auto key = std::make_pair(layer, device);
      const auto owner = s.default_owner.find(key);
      if (owner == s.default_owner.end()) {
        if (detail::default_maps(layer, device)) {
          notes.push_back(pair + ": not applied (kernmap's built-in default stays)");
          continue;
        }
        notes.push_back(pair + ": applied");
      } else {
        const int other = s.loaded.at(owner->second).score;
        if (other >= score) {
          notes.push_back(pair + ": not applied (package '" + owner->second + "' has it with score " +
                          std::to_string(other) + " >= " + std::to_string(score) + ")");
          continue;
        }
        notes.push_back(pair + ": applied, replacing package '" + owner->second + "' (score " +
                        std::to_string(other) + " < " + std::to_string(score) + ")");
      }
      accepted[layer][device] = modes;
      s.default_owner[key] = package;
    }
  }
  if (!accepted.empty()) register_default_mapping(accepted);
  return notes;
}

// --- The phases of load_package. Each throws Refusal and fills the report as it learns. ---

// The package's manifest, for this kernmap's plugin ABI.
Manifest read_manifest(const fs::path& dir, PackageReport& out) {
  const fs::path manifest_path = dir / kManifestFile;
  std::error_code ec;
  if (!fs::exists(manifest_path, ec))
    refuse("no " + std::string(kManifestFile) + " in '" + dir.string() + "'");
  Manifest m;
  try {
    m = repository::parse_manifest(repository::read_small_file(manifest_path), manifest_path.string());
  } catch (const std::exception& e) {
    refuse(e.what());
  }
  out.name = m.name;
  out.version = m.version;
  out.description = m.description;
  for (const auto& v : m.variants) out.offered.push_back(repository::describe(v));
  if (m.plugin_abi != KERNMAP_PLUGIN_ABI_VERSION) {
    refuse(manifest_path.string() + ": plugin_abi: expected " + std::to_string(KERNMAP_PLUGIN_ABI_VERSION) +
           " (the plugin ABI of this kernmap), got " + std::to_string(m.plugin_abi));
  }
  return m;
}

// The variant this process loads and its library's real path, which must lie inside the package folder.
// Skips the package when no variant fits.
std::pair<const Variant*, std::string> choose_library(const fs::path& dir, const Manifest& m,
                                                      const ProcessInfo& process, PackageReport& out) {
  std::string why_not;
  const Variant* chosen = repository::choose_variant(m, process, why_not);
  if (chosen == nullptr) {
    throw Refusal(PackageState::kSkipped,
                  "no variant for this process (" + repository::describe(process) + "): " + why_not);
  }
  out.variant = chosen->library;
  const std::string field = "variants[" + std::to_string(chosen - m.variants.data()) + "].library";
  try {
    return {chosen,
            repository::resolve_inside(dir.string(), chosen->library, (dir / kManifestFile).string(), field)};
  } catch (const std::exception& e) {
    refuse(e.what());
  }
}

// A package of this name is loaded once: again from the same library is a no-op, from another one a skip.
void check_not_loaded(const Manifest& m, const std::string& library, bool& repeated) {
  const LoaderState& s = state();
  const auto it = s.loaded.find(m.name);
  if (it == s.loaded.end()) return;
  if (it->second.library == library) {
    repeated = true;
    throw Refusal(PackageState::kLoaded, "already loaded (no-op)");
  }
  throw Refusal(PackageState::kSkipped, "package '" + m.name + "' " + it->second.version +
                                            " is loaded already from " + it->second.location);
}

// What the code of this process is built for: the ELF header of libkernmap itself, mapped at its base.
ElfTarget this_process_target() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&this_process_target), &info) == 0 || info.dli_fbase == nullptr)
    return {};
  const auto* header = static_cast<const ElfW(Ehdr)*>(info.dli_fbase);
  return {header->e_ident[EI_CLASS], header->e_ident[EI_DATA], header->e_machine};
}

// The library's bytes, read once into a sealed copy: every later phase sees exactly these bytes.
std::unique_ptr<SealedLibrary> copy_library(const std::string& library) {
  try {
    return std::make_unique<SealedLibrary>(library);
  } catch (const std::exception& e) {
    refuse(e.what());
  }
}

// The copy's sha256 against the manifest's and, in a locked repository, the lock's; then that it is a
// shared object this process can map. Nothing of the library runs before this passes.
void verify_library(const SealedLibrary& image, const std::string& library, const Variant& variant,
                    const Manifest& m, const fs::path& dir, const RepositoryFiles& repo) {
  const std::string& digest = image.sha256();
  if (digest != variant.sha256) {
    refuse("sha256 mismatch for " + library + ": " + (dir / kManifestFile).string() + " says " +
           variant.sha256 + ", the file has " + digest);
  }
  if (repo.report.has_lock) {
    const std::string lock_file = repo.report.path + "/" + kLockFile;
    if (!repo.lock_ok) refuse("the repository's lock cannot be used: " + repo.report.error);
    const auto it = repo.lock.packages.find(m.name);
    if (it == repo.lock.packages.end()) {
      refuse(lock_file + " does not pin package '" + m.name + "' (review it, then run `kernmap lock " +
             repo.report.path + "`)");
    }
    if (it->second.version != m.version) {
      refuse(lock_file + " pins '" + m.name + "' version " + it->second.version + ", the manifest has " +
             m.version);
    }
    if (it->second.sha256.count(digest) == 0) {
      refuse(lock_file + " does not list sha256 " + digest + " of " + library + " for '" + m.name + "' " +
             m.version);
    }
  }
  if (const std::string why = repository::why_not_loadable(image.bytes(), this_process_target());
      !why.empty())
    refuse(library + ": " + why);
}

// The entry points of an open plugin library.
struct PluginEntry {
  kernmap_plugin_register_fn register_fn = nullptr;
  kernmap_plugin_score_fn score_fn = nullptr;  // optional
};

// `text` with the copy's name replaced by the library's, for the dynamic linker's messages.
std::string named(std::string text, const std::string& fd_path, const std::string& library) {
  for (size_t at = text.find(fd_path); at != std::string::npos; at = text.find(fd_path, at + library.size()))
    text.replace(at, fd_path.size(), library);
  return text;
}

// Opens the sealed copy (never to close it: see LoadedPackage) and checks its plugin ABI version before
// anything else of it is called.
PluginEntry open_library(SealedLibrary& image, const std::string& library) {
  // A loaded library of the same name would be returned instead of the copy (an application closed a
  // descriptor kernmap keeps, and the number came back).
  if (dlopen(image.fd_path().c_str(), RTLD_NOW | RTLD_NOLOAD) != nullptr)
    refuse("cannot open " + library + ": a library named " + image.fd_path() + " is loaded already");
  dlerror();
  void* handle = dlopen(image.fd_path().c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    refuse("cannot open " + library + ": " +
           named(err != nullptr ? err : "dlopen failed", image.fd_path(), library));
  }
  image.keep_open();
  const auto abi =
      reinterpret_cast<kernmap_plugin_abi_version_fn>(dlsym(handle, KERNMAP_PLUGIN_ABI_VERSION_SYMBOL));
  if (abi == nullptr)
    refuse(library + " does not export " + KERNMAP_PLUGIN_ABI_VERSION_SYMBOL + " (not a kernmap plugin)");
  uint32_t plugin_abi = 0;
  try {
    plugin_abi = abi();
  } catch (...) {
    refuse(library + ": " + KERNMAP_PLUGIN_ABI_VERSION_SYMBOL + "() threw");
  }
  if (plugin_abi != KERNMAP_PLUGIN_ABI_VERSION) {
    refuse(library + ": " + KERNMAP_PLUGIN_ABI_VERSION_SYMBOL + "() returned " + std::to_string(plugin_abi) +
           " (expected " + std::to_string(KERNMAP_PLUGIN_ABI_VERSION) + ", the plugin ABI of this kernmap)");
  }
  PluginEntry entry;
  entry.register_fn =
      reinterpret_cast<kernmap_plugin_register_fn>(dlsym(handle, KERNMAP_PLUGIN_REGISTER_SYMBOL));
  if (entry.register_fn == nullptr) refuse(library + " does not export " + KERNMAP_PLUGIN_REGISTER_SYMBOL);
  entry.score_fn = reinterpret_cast<kernmap_plugin_score_fn>(dlsym(handle, KERNMAP_PLUGIN_SCORE_SYMBOL));
  return entry;
}

// The plugin's score, 1 when it has no kernmap_plugin_score. Skips the package for a score <= 0.
int ask_score(const PluginEntry& plugin, const kernmap_plugin_host& host, PackageReport& out) {
  int score = 1;
  if (plugin.score_fn != nullptr) {
    char reason[1024] = {0};
    try {
      score = plugin.score_fn(&host, reason, sizeof reason);
    } catch (const std::exception& e) {
      refuse(std::string(KERNMAP_PLUGIN_SCORE_SYMBOL) + " threw: " + e.what());
    } catch (...) {
      refuse(std::string(KERNMAP_PLUGIN_SCORE_SYMBOL) + " threw a non-standard exception");
    }
    reason[sizeof reason - 1] = '\0';
    out.score = score;
    if (score <= 0) {
      throw Refusal(PackageState::kSkipped, "the plugin's score is " + std::to_string(score) + ": " +
                                                (reason[0] != '\0' ? reason : "(no reason given)"));
    }
  }
  out.score = score;
  return score;
}

// What the plugin registers, staged; refused whole when its registration fails or a kernel name was taken
// meanwhile.
Stage register_into_stage(const PluginEntry& plugin, const kernmap_plugin_host& host,
                          const std::string& package) {
  const std::string nothing = "; nothing of it was registered";
  Stage stage;
  stage.package = package;
  stage.origin = kernel_origin;
  if (const std::string why = repository::call_register(plugin.register_fn, host, stage); !why.empty())
    refuse(why + nothing);
  for (const KernelDescriptor& k : stage.kernels) {
    if (find_kernel(k.name) != nullptr)
      refuse("kernel '" + k.name + "' was registered meanwhile by " + kernel_origin(k.name) + nothing);
  }
  return stage;
}

// Makes the package's registrations visible: its kernels, then the defaults it may have.
void commit(Stage& stage, LoadedPackage package, PackageReport& out) {
  LoaderState& s = state();
  const std::string name = package.name;
  const int score = package.score;
  s.loaded[name] = std::move(package);
  for (KernelDescriptor& k : stage.kernels) {
    out.kernels.push_back(k.name);
    s.kernel_owner[k.name] = name;
    register_kernel(std::move(k));
  }
  out.defaults = apply_defaults(stage.defaults, name, score);
  out.state = PackageState::kLoaded;
}

// One package folder, phase by phase. Throws Refusal; fills `out` as it goes. Called with the loader lock
// held.
void load_package(const fs::path& dir, const RepositoryFiles& repo, const ProcessInfo& process,
                  PackageReport& out, bool& repeated) {
  const Manifest m = read_manifest(dir, out);
  const auto [variant, library] = choose_library(dir, m, process, out);
  check_not_loaded(m, library, repeated);
  const std::unique_ptr<SealedLibrary> image = copy_library(library);
  verify_library(*image, library, *variant, m, dir, repo);
  const PluginEntry plugin = open_library(*image, library);
  const std::string package_dir = fs::canonical(dir).string();
  const kernmap_plugin_host host = repository::make_host(m.name, m.version, package_dir);
  const int score = ask_score(plugin, host, out);
  Stage stage = register_into_stage(plugin, host, m.name);
  commit(stage, LoadedPackage{m.name, m.version, repo.report.path + "/" + out.folder, library, score}, out);
}

std::vector<std::string> split_path_list(const char* text) {
  std::vector<std::string> out;
  if (text == nullptr) return out;
  std::stringstream list(text);
  std::string item;
  while (std::getline(list, item, ':'))
    if (!item.empty()) out.push_back(item);
  return out;
}

}  // namespace

LoadReport load_plugins(const LoadOptions& options) {
  LoadReport report;
  report.process = process_info();
  for (const auto& [name, version] : options.toolkits) report.process.toolkits.emplace(name, version);
  std::vector<std::string> paths;
  if (options.use_env_path) paths = split_path_list(std::getenv("KERNMAP_PATH"));
  paths.insert(paths.end(), options.paths.begin(), options.paths.end());

  LoaderState& s = state();
  {
    std::lock_guard lock(s.mutex);
    s.history.process = report.process;
    for (const std::string& path : paths) {
      RepositoryFiles repo = repository::scan_repository(path);
      report.repositories.push_back(repo.report);
      const bool seen = std::any_of(s.history.repositories.begin(), s.history.repositories.end(),
                                    [&](const RepositoryReport& r) { return r.path == path; });
      if (!seen) s.history.repositories.push_back(repo.report);
      for (const fs::path& dir : repo.package_dirs) {
        PackageReport p;
        p.repository = path;
        p.folder = dir.filename().string();
        bool repeated = false;
        try {
          load_package(dir, repo, report.process, p, repeated);
        } catch (const Refusal& r) {
          p.state = r.state;
          p.reason = r.what();
        } catch (const std::exception& e) {
          p.state = PackageState::kRefused;
          p.reason = std::string("internal error: ") + e.what();
        }
        if (!repeated) s.history.packages.push_back(p);
        report.packages.push_back(std::move(p));
      }
    }
  }
  if (options.strict && report.refused() > 0) {
    std::string message = std::to_string(report.refused()) + " plugin package(s) refused:";
    for (const auto& p : report.packages)
      if (p.state == PackageState::kRefused)
        message += "\n  " + p.repository + "/" + p.folder + ": " + p.reason;
    throw PluginError(message, std::move(report));
  }
  return report;
}

LoadReport load_plugins_from_env() {
  LoadOptions options;
  options.use_env_path = true;
  return load_plugins(options);
}

LoadReport plugin_report() {
  LoaderState& s = state();
  std::lock_guard lock(s.mutex);
  LoadReport out = s.history;
  if (out.process.torch.empty()) out.process = process_info();
  return out;
}

}  // namespace kernmap
