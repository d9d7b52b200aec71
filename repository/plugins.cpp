// The plugin loader (include/kernmap/plugins.h): repositories, variant choice, verification, dlopen, the ABI
// check, the score, and staged registration.
#include "kernmap/plugins.h"

#include <dlfcn.h>
#include <sys/utsname.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <utility>

#include "kernmap/c_api.h"
#include "kernmap/plugin.h"
#include "kernmap/registry.h"
#include "repository/json_forms.h"
#include "repository/manifest.h"
#include "registry/mapping_levels.h"
#include "repository/sha256.h"

#ifndef KERNMAP_TORCH_VERSION
#error "KERNMAP_TORCH_VERSION must name the torch version kernmap is built against (CMakeLists.txt sets it)"
#endif
#ifndef KERNMAP_VERSION
#error "KERNMAP_VERSION must name kernmap's version (CMakeLists.txt sets it)"
#endif

namespace kernmap {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kManifestFile = "manifest.json";
constexpr const char* kLockFile = "kernmap.lock";
constexpr std::uintmax_t kMaxMetadataBytes = 1 << 20;  // a manifest or lock larger than this is not one

// A package whose library is open. Libraries are never closed: its kernels may run until the process ends.
struct LoadedPackage {
  std::string name;
  std::string version;
  std::string location;  // repository/folder, for messages
  std::string library;   // real path of the library
  int score = 0;
};

// What a plugin registered during its kernmap_plugin_register call, not yet visible to anyone.
struct Stage {
  std::vector<KernelDescriptor> kernels;
  Mapping defaults;
  std::string error;  // the first failed host call; the plugin is refused even if it returns 0
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

// The stage of the plugin whose kernmap_plugin_register runs on this thread (loads are serialized).
thread_local Stage* current_stage = nullptr;
thread_local const std::string* current_package = nullptr;

char* copy_string(const std::string& text) {
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out != nullptr) std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}

int host_fail(Stage* stage, const std::string& message, char** error) {
  if (stage != nullptr && stage->error.empty()) stage->error = message;
  if (error != nullptr) *error = copy_string(message);
  return KERNMAP_INVALID_ARGUMENT;
}

// The loaded package that registered `kernel`, or a description of where it came from otherwise.
std::string kernel_origin(const std::string& kernel) {
  const LoaderState& s = state();
  const auto it = s.kernel_owner.find(kernel);
  if (it == s.kernel_owner.end()) return "kernmap (built in) or the application";
  const auto pkg = s.loaded.find(it->second);
  return "package '" + it->second + "'" + (pkg == s.loaded.end() ? "" : " (" + pkg->second.location + ")");
}

int host_register_kernel(const char* descriptor_json, kernmap_supports_fn supports, void* user_data,
                         char** error) {
  Stage* stage = current_stage;
  if (stage == nullptr)
    return host_fail(nullptr,
                     "register_kernel: called outside kernmap_plugin_register (or on another thread)", error);
  const std::string who = "package '" + *current_package + "'";
  try {
    if (descriptor_json == nullptr)
      return host_fail(stage, who + ": register_kernel: descriptor_json is NULL", error);
    KernelDescriptor d = detail::descriptor_from_json(json::parse(descriptor_json), supports, user_data);
    for (const KernelDescriptor& staged : stage->kernels) {
      if (staged.name == d.name)
        return host_fail(stage, who + " registers kernel '" + d.name + "' twice", error);
    }
    if (find_kernel(d.name) != nullptr) {
      return host_fail(stage,
                       who + " registers kernel '" + d.name + "', which " + kernel_origin(d.name) +
                           " registered already (kernel names are unique; the first registration stays)",
                       error);
    }
    if (d.provider() == "reference")
      return host_fail(stage, who + ": kernel '" + d.name + "': the provider 'reference' is kernmap's",
                       error);
    stage->kernels.push_back(std::move(d));
    return KERNMAP_OK;
  } catch (const std::exception& e) {
    return host_fail(stage, who + ": register_kernel: " + e.what(), error);
  }
}

int host_register_default_mapping(const char* mapping_json, char** error) {
  Stage* stage = current_stage;
  if (stage == nullptr)
    return host_fail(
        nullptr, "register_default_mapping: called outside kernmap_plugin_register (or on another thread)",
        error);
  const std::string who = "package '" + *current_package + "'";
  try {
    if (mapping_json == nullptr)
      return host_fail(stage, who + ": register_default_mapping: mapping_json is NULL", error);
    const Mapping m = detail::mapping_from_json("register_default_mapping", json::parse(mapping_json));
    for (const auto& [layer, devices] : m) {
      if (reference_kernel(layer) == nullptr)
        return host_fail(stage, who + ": register_default_mapping: " + detail::unknown_layer_message(layer),
                         error);
      for (const auto& [device, modes] : devices) {
        if (device.empty())
          return host_fail(
              stage, who + ": register_default_mapping: layer '" + layer + "' has an empty device", error);
        for (const auto& [mode, kernel] : modes) {
          const KernelDescriptor* k = find_kernel(kernel);
          for (const KernelDescriptor& staged : stage->kernels)
            if (staged.name == kernel) k = &staged;
          if (k == nullptr) {
            return host_fail(stage,
                             who + ": register_default_mapping: kernel '" + kernel + "' for " + layer +
                                 " on " + device + " is neither registered nor registered by this plugin",
                             error);
          }
          if (k->layer != layer) {
            return host_fail(stage,
                             who + ": register_default_mapping: kernel '" + kernel + "' implements layer '" +
                                 k->layer + "' (expected '" + layer + "')",
                             error);
          }
        }
        stage->defaults[layer][device] = modes;
      }
    }
    return KERNMAP_OK;
  } catch (const std::exception& e) {
    return host_fail(stage, who + ": register_default_mapping: " + e.what(), error);
  }
}

void host_free_string(char* text) {
  std::free(text);
}

std::string major_minor(const std::string& version) {
  const auto first = version.find('.');
  if (first == std::string::npos) return version;
  const auto second = version.find_first_not_of("0123456789", first + 1);
  return version.substr(0, second);
}

std::map<std::string, std::string> parse_toolkits(const char* text) {
  std::map<std::string, std::string> out;
  if (text == nullptr) return out;
  std::stringstream list(text);
  std::string item;
  while (std::getline(list, item, ',')) {
    if (item.empty()) continue;
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
      throw std::invalid_argument(
          "KERNMAP_TOOLKITS: entry '" + item +
          "' is not of the form toolkit=version (expected e.g. \"cuda=12.8,cann=8.0\")");
    }
    out[item.substr(0, eq)] = item.substr(eq + 1);
  }
  return out;
}

// "12" accepts 12.x, "12.8" accepts 12.8 and 12.8.x: the needed version's components must prefix the
// process's.
bool version_accepts(const std::string& needed, const std::string& have) {
  return have == needed || (have.size() > needed.size() && have.compare(0, needed.size(), needed) == 0 &&
                            have[needed.size()] == '.');
}

std::string describe(const repository::Variant& v) {
  std::string out = v.library + " (torch " + v.torch + ", " + (v.cxx11_abi ? "cxx11_abi" : "pre-cxx11 abi") +
                    ", " + v.arch + ", " + v.os;
  for (const auto& [name, version] : v.toolkits) out += ", " + name + " " + version;
  return out + ")";
}

std::string describe(const ProcessInfo& p) {
  std::string out = "torch " + p.torch + ", " + (p.cxx11_abi ? "cxx11_abi" : "pre-cxx11 abi") + ", " +
                    p.arch + ", " + p.os + ", toolkits: ";
  if (p.toolkits.empty()) return out + "none";
  bool first = true;
  for (const auto& [name, version] : p.toolkits) {
    out += (first ? "" : ", ") + name + " " + version;
    first = false;
  }
  return out;
}

// Why the variant does not fit the process, or "" when it does.
std::string mismatch(const repository::Variant& v, const ProcessInfo& p) {
  if (v.torch != p.torch) return "needs torch " + v.torch;
  if (v.cxx11_abi != p.cxx11_abi) return v.cxx11_abi ? "needs the C++11 ABI" : "needs the pre-C++11 ABI";
  if (v.arch != p.arch) return "needs arch " + v.arch;
  if (v.os != p.os) return "needs os " + v.os;
  for (const auto& [name, version] : v.toolkits) {
    const auto it = p.toolkits.find(name);
    if (it == p.toolkits.end())
      return "needs " + name + " " + version + " (this process has no " + name + ")";
    if (!version_accepts(version, it->second))
      return "needs " + name + " " + version + " (have " + it->second + ")";
  }
  return "";
}

std::string read_small_file(const fs::path& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) throw repository::FormatError(path.string() + ": cannot read: " + ec.message());
  if (size > kMaxMetadataBytes) {
    throw repository::FormatError(path.string() + ": " + std::to_string(size) + " bytes (expected at most " +
                                  std::to_string(kMaxMetadataBytes) + ")");
  }
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) throw repository::FormatError(path.string() + ": cannot read");
  return text;
}

// Why the file is not an ELF shared object for this process, or "".
std::string not_a_shared_object(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  unsigned char h[20] = {0};
  in.read(reinterpret_cast<char*>(h), sizeof h);
  if (in.gcount() < static_cast<std::streamsize>(sizeof h) || std::memcmp(h,
                                                                          "\x7f"
                                                                          "ELF",
                                                                          4) != 0)
    return "not an ELF file (a shared library starts with \\x7fELF)";
  if (h[4] != (sizeof(void*) == 8 ? 2 : 1)) return "an ELF file of another word size than this process";
  const bool little = h[5] == 1;
  const unsigned type = little ? (h[16] | (h[17] << 8)) : ((h[16] << 8) | h[17]);
  if (type != 3)
    return "an ELF file of type " + std::to_string(type) + " (expected 3, ET_DYN: a shared object)";
  return "";
}

struct RepositoryFiles {
  RepositoryReport report;
  bool lock_ok = true;
  repository::Lock lock;
  std::vector<fs::path> package_dirs;
};

RepositoryFiles scan_repository(const std::string& path) {
  RepositoryFiles r;
  r.report.path = path;
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    r.report.error = "not a folder: '" + path + "'";
    return r;
  }
  const fs::path lock_path = fs::path(path) / kLockFile;
  if (fs::exists(lock_path, ec)) {
    r.report.has_lock = true;
    try {
      r.lock = repository::parse_lock(read_small_file(lock_path), lock_path.string());
    } catch (const std::exception& e) {
      r.lock_ok = false;
      r.report.error = e.what();
    }
  }
  for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    if (it->is_directory(ec)) r.package_dirs.push_back(it->path());
  }
  if (ec) r.report.error = "cannot list '" + path + "': " + ec.message();
  std::sort(r.package_dirs.begin(), r.package_dirs.end());
  return r;
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

// One package folder: everything up to and including its registration. Throws Refusal; fills `out` as it
// goes.
void load_package(const fs::path& dir, const RepositoryFiles& repo, const ProcessInfo& process,
                  PackageReport& out, bool& repeated) {
  LoaderState& s = state();
  const fs::path manifest_path = dir / kManifestFile;
  std::error_code ec;
  if (!fs::exists(manifest_path, ec))
    refuse("no " + std::string(kManifestFile) + " in '" + dir.string() + "'");
  repository::Manifest m;
  try {
    m = repository::parse_manifest(read_small_file(manifest_path), manifest_path.string());
  } catch (const std::exception& e) {
    refuse(e.what());
  }
  out.name = m.name;
  out.version = m.version;
  out.description = m.description;
  for (const auto& v : m.variants) out.offered.push_back(describe(v));
  const std::string location = repo.report.path + "/" + out.folder;

  if (m.plugin_abi != KERNMAP_PLUGIN_ABI_VERSION) {
    refuse(manifest_path.string() + ": plugin_abi: expected " + std::to_string(KERNMAP_PLUGIN_ABI_VERSION) +
           " (the plugin ABI of this kernmap), got " + std::to_string(m.plugin_abi));
  }

  const repository::Variant* chosen = nullptr;
  std::string why_not;
  for (size_t i = 0; i < m.variants.size(); ++i) {
    const std::string miss = mismatch(m.variants[i], process);
    if (miss.empty()) {
      if (chosen == nullptr || m.variants[i].toolkits.size() > chosen->toolkits.size())
        chosen = &m.variants[i];
    } else {
      why_not += (why_not.empty() ? "" : "; ") + m.variants[i].library + " " + miss;
    }
  }
  if (chosen == nullptr) {
    throw Refusal(PackageState::kSkipped,
                  "no variant for this process (" + describe(process) + "): " + why_not);
  }
  out.variant = chosen->library;
  const size_t index = static_cast<size_t>(chosen - m.variants.data());
  const std::string field = "variants[" + std::to_string(index) + "].library";
  std::string library;
  try {
    library = repository::resolve_inside(dir.string(), chosen->library, manifest_path.string(), field);
  } catch (const std::exception& e) {
    refuse(e.what());
  }

  if (const auto it = s.loaded.find(m.name); it != s.loaded.end()) {
    if (it->second.library == library) {
      repeated = true;
      throw Refusal(PackageState::kLoaded, "already loaded (no-op)");
    }
    throw Refusal(PackageState::kSkipped, "package '" + m.name + "' " + it->second.version +
                                              " is loaded already from " + it->second.location);
  }

  std::string digest;
  try {
    digest = sha256_file(library);
  } catch (const std::exception& e) {
    refuse(e.what());
  }
  if (digest != chosen->sha256) {
    refuse("sha256 mismatch for " + library + ": " + manifest_path.string() + " says " + chosen->sha256 +
           ", the file has " + digest);
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
  if (const std::string why = not_a_shared_object(library); !why.empty()) refuse(library + ": " + why);

  dlerror();
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);  // never closed: see LoadedPackage
  if (handle == nullptr) {
    const char* err = dlerror();
    refuse("cannot open " + library + ": " + (err != nullptr ? err : "dlopen failed"));
  }
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
  const auto reg =
      reinterpret_cast<kernmap_plugin_register_fn>(dlsym(handle, KERNMAP_PLUGIN_REGISTER_SYMBOL));
  if (reg == nullptr) refuse(library + " does not export " + KERNMAP_PLUGIN_REGISTER_SYMBOL);
  const auto score_fn = reinterpret_cast<kernmap_plugin_score_fn>(dlsym(handle, KERNMAP_PLUGIN_SCORE_SYMBOL));

  const std::string package_dir = fs::canonical(dir).string();
  kernmap_plugin_host host{};
  host.abi_version = KERNMAP_PLUGIN_ABI_VERSION;
  host.struct_size = sizeof(kernmap_plugin_host);
  host.package = m.name.c_str();
  host.package_version = m.version.c_str();
  host.package_dir = package_dir.c_str();
  host.kernmap_version = KERNMAP_VERSION;
  host.torch_version = KERNMAP_TORCH_VERSION;
  host.register_kernel = &host_register_kernel;
  host.register_default_mapping = &host_register_default_mapping;
  host.free_string = &host_free_string;

  char message[1024] = {0};
  int score = 1;
  if (score_fn != nullptr) {
    try {
      score = score_fn(&host, message, sizeof message);
    } catch (const std::exception& e) {
      refuse(std::string(KERNMAP_PLUGIN_SCORE_SYMBOL) + " threw: " + e.what());
    } catch (...) {
      refuse(std::string(KERNMAP_PLUGIN_SCORE_SYMBOL) + " threw a non-standard exception");
    }
    message[sizeof message - 1] = '\0';
    out.score = score;
    if (score <= 0) {
      throw Refusal(PackageState::kSkipped, "the plugin's score is " + std::to_string(score) + ": " +
                                                (message[0] != '\0' ? message : "(no reason given)"));
    }
  }
  out.score = score;

  Stage stage;
  current_stage = &stage;
  current_package = &m.name;
  int rc = 0;
  std::string thrown;
  try {
    rc = reg(&host, message, sizeof message);
  } catch (const std::exception& e) {
    thrown = std::string(KERNMAP_PLUGIN_REGISTER_SYMBOL) + " threw: " + e.what();
  } catch (...) {
    thrown = std::string(KERNMAP_PLUGIN_REGISTER_SYMBOL) + " threw a non-standard exception";
  }
  current_stage = nullptr;
  current_package = nullptr;
  const std::string nothing = "; nothing of it was registered";
  if (!thrown.empty()) refuse(thrown + nothing);
  message[sizeof message - 1] = '\0';
  if (rc != 0) {
    refuse(std::string(KERNMAP_PLUGIN_REGISTER_SYMBOL) + " returned " + std::to_string(rc) + ": " +
           (message[0] != '\0' ? message : "(no message)") + nothing);
  }
  if (!stage.error.empty()) refuse(stage.error + nothing);
  for (const KernelDescriptor& k : stage.kernels) {
    if (find_kernel(k.name) != nullptr)
      refuse("kernel '" + k.name + "' was registered meanwhile by " + kernel_origin(k.name) + nothing);
  }

  // Commit.
  s.loaded[m.name] = LoadedPackage{m.name, m.version, location, library, score};
  for (KernelDescriptor& k : stage.kernels) {
    out.kernels.push_back(k.name);
    s.kernel_owner[k.name] = m.name;
    register_kernel(std::move(k));
  }
  out.defaults = apply_defaults(stage.defaults, m.name, score);
  out.state = PackageState::kLoaded;
}

json to_json(const PackageReport& p) {
  return json{{"repository", p.repository}, {"folder", p.folder},           {"name", p.name},
              {"version", p.version},       {"description", p.description}, {"state", to_string(p.state)},
              {"reason", p.reason},         {"variant", p.variant},         {"offered", p.offered},
              {"score", p.score},           {"kernels", p.kernels},         {"defaults", p.defaults}};
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

std::string to_string(PackageState state) {
  switch (state) {
    case PackageState::kLoaded:
      return "loaded";
    case PackageState::kSkipped:
      return "skipped";
    case PackageState::kRefused:
      return "refused";
  }
  return "unknown";
}

size_t LoadReport::refused() const {
  return static_cast<size_t>(std::count_if(packages.begin(), packages.end(), [](const PackageReport& p) {
    return p.state == PackageState::kRefused;
  }));
}

std::string LoadReport::to_json() const {
  json repos = json::array();
  for (const auto& r : repositories)
    repos.push_back({{"path", r.path}, {"has_lock", r.has_lock}, {"error", r.error}});
  json pkgs = json::array();
  for (const auto& p : packages) pkgs.push_back(kernmap::to_json(p));
  const json proc{{"torch", process.torch},
                  {"cxx11_abi", process.cxx11_abi},
                  {"arch", process.arch},
                  {"os", process.os},
                  {"toolkits", process.toolkits}};
  return json{{"process", proc}, {"repositories", repos}, {"packages", pkgs}}.dump();
}

ProcessInfo process_info() {
  ProcessInfo p;
  p.torch = major_minor(KERNMAP_TORCH_VERSION);
  p.cxx11_abi = _GLIBCXX_USE_CXX11_ABI != 0;
  struct utsname u {};
  p.arch = uname(&u) == 0 ? u.machine : "unknown";
#if defined(__linux__)
  p.os = "linux";
#else
  p.os = "unknown";
#endif
  p.toolkits = parse_toolkits(std::getenv("KERNMAP_TOOLKITS"));
  return p;
}

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
      RepositoryFiles repo = scan_repository(path);
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

std::string write_lock(const std::string& dir) {
  // An existing lock is replaced, even a malformed one: only the manifests and the files count here.
  const RepositoryFiles repo = scan_repository(dir);
  if (!fs::is_directory(dir)) throw std::invalid_argument("kernmap lock: " + repo.report.error);
  std::vector<std::string> problems;
  repository::Lock lock;
  std::map<std::string, std::string> folder_of;
  for (const fs::path& pkg : repo.package_dirs) {
    const fs::path manifest_path = pkg / kManifestFile;
    try {
      const repository::Manifest m =
          repository::parse_manifest(read_small_file(manifest_path), manifest_path.string());
      if (const auto it = folder_of.find(m.name); it != folder_of.end()) {
        problems.push_back(manifest_path.string() + ": package name '" + m.name + "' is used by folder '" +
                           it->second + "' too");
        continue;
      }
      folder_of[m.name] = pkg.filename().string();
      repository::LockedPackage locked{m.version, {}};
      bool ok = true;
      for (size_t i = 0; i < m.variants.size(); ++i) {
        const auto& v = m.variants[i];
        const std::string field = "variants[" + std::to_string(i) + "]";
        try {
          const std::string library =
              repository::resolve_inside(pkg.string(), v.library, manifest_path.string(), field + ".library");
          const std::string digest = sha256_file(library);
          if (digest != v.sha256) {
            problems.push_back(manifest_path.string() + ": " + field + ".sha256: expected the sha256 of " +
                               library + " (" + digest + "), got " + v.sha256);
            ok = false;
          }
          locked.sha256.insert(digest);
        } catch (const std::exception& e) {
          problems.push_back(e.what());
          ok = false;
        }
      }
      if (ok) lock.packages.emplace(m.name, std::move(locked));
    } catch (const std::exception& e) {
      problems.push_back(e.what());  // names the manifest already
    }
  }
  if (!problems.empty()) {
    std::string message = "kernmap lock: " + dir + "/" + kLockFile + " not written:";
    for (const auto& p : problems) message += "\n  " + p;
    throw std::invalid_argument(message);
  }
  const std::string text = repository::lock_to_json(lock);
  const fs::path target = fs::path(dir) / kLockFile;
  const fs::path temp = fs::path(dir) / (std::string(kLockFile) + ".tmp");
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out.good()) throw std::invalid_argument("kernmap lock: cannot write '" + temp.string() + "'");
  }
  fs::rename(temp, target);
  return text;
}

}  // namespace kernmap
