// `kernmap kernels`: the registered kernels, the CPU instruction-set level, what each layer resolves to on
// each device and mode, with the reason, and the kernel repositories: what their packages offer, what was
// loaded and why anything was not. Also the plugin load every command does first.
#include <cstdio>
#include <stdexcept>
#include <string>

#include "cli/commands.h"
#include "cli/table.h"
#include "kernmap/cpu.h"
#include "kernmap/plugins.h"
#include "kernmap/registry.h"

namespace kernmap::cli {
namespace {

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

std::vector<std::string> known_layers() {
  std::vector<std::string> out;
  for (const KernelDescriptor* k : registered_kernels())
    if (k->provider() == "reference") out.push_back(k->layer);
  return out;
}

const std::vector<std::string> kDevices = {"cpu", "cuda", "npu"};
const std::vector<Mode> kModes = {Mode::kInference, Mode::kTraining, Mode::kTraining | Mode::kCompile};

std::string join_or_dash(const std::vector<std::string>& v, const char* sep) {
  return v.empty() ? "-" : join(v, sep);
}

void print_plugins(const LoadReport& report) {
  std::printf("\nKernel repositories (KERNMAP_PATH)\n");
  if (report.repositories.empty()) {
    std::printf("none: set KERNMAP_PATH to local kernel repositories (docs/plugins.md)\n");
    return;
  }
  Table repos{{"repository", "lock", "problem"}, {}};
  for (const RepositoryReport& r : report.repositories)
    repos.rows.push_back({r.path, r.has_lock ? "kernmap.lock" : "none", r.error.empty() ? "-" : r.error});
  std::printf("%s\n", repos.render().c_str());
  Table pkgs{{"package", "version", "state", "variant", "kernels", "folder", "why"}, {}};
  for (const PackageReport& p : report.packages) {
    pkgs.rows.push_back({p.name.empty() ? "?" : p.name, p.version.empty() ? "-" : p.version,
                         to_string(p.state), p.variant.empty() ? "-" : p.variant,
                         join_or_dash(p.kernels, ","), p.repository + "/" + p.folder,
                         p.reason.empty() ? "-" : p.reason});
  }
  std::printf("Plugin packages (process: %s, torch %s, %s, %s)\n%s", report.process.os.c_str(),
              report.process.torch.c_str(), report.process.arch.c_str(),
              report.process.cxx11_abi ? "cxx11_abi" : "pre-cxx11 abi", pkgs.render().c_str());
  for (const PackageReport& p : report.packages) {
    if (p.offered.empty() && p.defaults.empty()) continue;
    std::printf("  %s offers: %s\n", p.name.c_str(), join(p.offered, "; ").c_str());
    for (const std::string& d : p.defaults) std::printf("  %s default %s\n", p.name.c_str(), d.c_str());
  }
}

}  // namespace

void load_env_plugins() {
  const LoadReport report = load_plugins_from_env();
  for (const PackageReport& p : report.packages) {
    if (p.state == PackageState::kRefused) {
      std::fprintf(stderr, "kernmap: plugin package %s/%s refused: %s\n", p.repository.c_str(),
                   p.folder.c_str(), p.reason.c_str());
    }
  }
  for (const RepositoryReport& r : report.repositories)
    if (!r.error.empty())
      std::fprintf(stderr, "kernmap: kernel repository %s: %s\n", r.path.c_str(), r.error.c_str());
}

int kernels_command(const std::vector<std::string>& args) {
  bool json = false;
  for (const auto& a : args) {
    if (a == "--json") {
      json = true;
    } else {
      throw std::invalid_argument("unknown option '" + a + "' (expected --json)");
    }
  }
  const std::vector<std::string> levels = supported_cpu_levels();
  const std::string active = cpu_level();

  if (json) {
    std::string out = "{\"cpu\": {\"level\": " + json_string(active) + ", \"supported\": [";
    for (size_t i = 0; i < levels.size(); ++i) out += (i ? ", " : "") + json_string(levels[i]);
    out += "]}, \"kernels\": [";
    bool first = true;
    for (const KernelDescriptor* k : registered_kernels()) {
      std::vector<std::string> devs, dts;
      for (const auto& d : k->devices) devs.push_back(json_string(d));
      for (const auto& d : k->dtypes) dts.push_back(json_string(d));
      out += std::string(first ? "" : ", ") + "{\"name\": " + json_string(k->name) +
             ", \"layer\": " + json_string(k->layer) + ", \"devices\": [" + join(devs, ", ") +
             "], \"dtypes\": [" + join(dts, ", ") +
             "], \"has_backward\": " + (k->has_backward ? "true" : "false") +
             ", \"compile_safe\": " + (k->compile_safe ? "true" : "false") +
             ", \"deterministic\": " + (k->deterministic ? "true" : "false") +
             ", \"op\": " + json_string(k->op) + "}";
      first = false;
    }
    out += "], \"resolution\": [";
    first = true;
    for (const auto& layer : known_layers())
      for (const auto& dev : kDevices)
        for (Mode m : kModes) {
          const Decision d = resolve(layer, dev, m);
          out += std::string(first ? "" : ", ") + "{\"layer\": " + json_string(layer) +
                 ", \"device\": " + json_string(dev) + ", \"mode\": " + json_string(to_string(m)) +
                 ", \"kernel\": " + json_string(d.kernel ? d.kernel->name : "") +
                 ", \"fallback\": " + (d.fallback ? "true" : "false") +
                 ", \"reason\": " + json_string(d.reason) + "}";
          first = false;
        }
    std::printf("%s], \"plugins\": %s}\n", out.c_str(), plugin_report().to_json().c_str());
    return 0;
  }

  std::printf("CPU instruction set: %s (this CPU runs: %s; KERNMAP_CPU_ISA caps it)\n\n", active.c_str(),
              join(levels, ", ").c_str());
  Table kernels{{"kernel", "layer", "devices", "dtypes", "backward", "compile", "deterministic"}, {}};
  for (const KernelDescriptor* k : registered_kernels())
    kernels.rows.push_back({k->name, k->layer, join(k->devices, ","), join(k->dtypes, ","),
                            k->has_backward ? "yes" : "no", k->compile_safe ? "yes" : "no",
                            k->deterministic ? "yes" : "no"});
  std::printf("Registered kernels\n%s\n", kernels.render().c_str());
  Table res{{"layer", "device", "mode", "kernel", "why"}, {}};
  for (const auto& layer : known_layers())
    for (const auto& dev : kDevices)
      for (Mode m : kModes) {
        const Decision d = resolve(layer, dev, m);
        res.rows.push_back({layer, dev, to_string(m), d.kernel ? d.kernel->name : "-", d.reason});
      }
  std::printf("Resolution on this machine\n%s", res.render().c_str());
  print_plugins(plugin_report());
  return 0;
}

}  // namespace kernmap::cli
