// `kernmap kernels`: the registered kernels, the CPU instruction-set level, what each layer resolves to on
// each device and mode, with the reason, and the kernel repositories: what their packages offer, what was
// loaded and why anything was not. Also the plugin load every command does first.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "cli/json_output.h"
#include "cli/options.h"
#include "cli/table.h"
#include "kernels/cpu/isa.h"
#include "kernmap/plugins.h"
#include "kernmap/registry.h"

namespace kernmap::cli {
namespace {

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

Json kernels_json(const std::string& active, const std::vector<std::string>& levels) {
  Json kernels = Json::array();
  for (const KernelDescriptor* k : registered_kernels())
    kernels.push_back({{"name", k->name},
                       {"layer", k->layer},
                       {"devices", k->devices},
                       {"dtypes", k->dtypes},
                       {"has_backward", k->has_backward},
                       {"compile_safe", k->compile_safe},
                       {"deterministic", k->deterministic},
                       {"op", k->op}});
  Json resolution = Json::array();
  for (const auto& layer : registered_layers())
    for (const auto& dev : kDevices)
      for (Mode m : kModes) {
        const Decision d = resolve(layer, dev, m);
        resolution.push_back({{"layer", layer},
                              {"device", dev},
                              {"mode", to_string(m)},
                              {"kernel", d.kernel ? d.kernel->name : ""},
                              {"fallback", d.fallback},
                              {"reason", d.reason}});
      }
  return {{"cpu", {{"level", active}, {"supported", levels}}},
          {"kernels", kernels},
          {"resolution", resolution},
          {"plugins", Json::parse(plugin_report().to_json())}};
}

int kernels_command(bool json) {
  std::vector<std::string> levels;
  for (cpu::Level l : cpu::supported_levels()) levels.push_back(cpu::level_name(l));
  const std::string active = cpu::level_name(cpu::active_level());

  if (json) {
    print_json(kernels_json(active, levels));
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
  for (const auto& layer : registered_layers())
    for (const auto& dev : kDevices)
      for (Mode m : kModes) {
        const Decision d = resolve(layer, dev, m);
        res.rows.push_back({layer, dev, to_string(m), d.kernel ? d.kernel->name : "-", d.reason});
      }
  std::printf("Resolution on this machine\n%s", res.render().c_str());
  print_plugins(plugin_report());
  return 0;
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

Command add_kernels_command(CLI::App& parent) {
  CLI::App* app =
      parent.add_subcommand("kernels",
                            "registered kernels, what each layer resolves to here, and the plugin "
                            "packages of KERNMAP_PATH: offered, loaded, or why not");
  auto json = std::make_shared<bool>(false);
  app->add_flag("--json", *json, "one JSON document instead of tables");
  return {app, [] {}, [json] { return kernels_command(*json); }};
}

}  // namespace kernmap::cli
