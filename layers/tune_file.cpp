// What tune writes: the mapping file of the winners with the machine and every candidate's figures as
// comments (the lines Python's kernmap.tune writes), and the whole comparison as <stem>.tune.json beside it.
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernmap/cpu.h"
#include "kernmap/mapping_file.h"
#include "kernmap/tune.h"
#include "layers/tune_file.h"
#include "repository/atomic_file.h"

#ifndef KERNMAP_TORCH_VERSION
#error "KERNMAP_TORCH_VERSION must name the torch version kernmap is built against (CMakeLists.txt sets it)"
#endif
#ifndef KERNMAP_VERSION
#error "KERNMAP_VERSION must name kernmap's version (CMakeLists.txt sets it)"
#endif

namespace kernmap {
namespace {

std::string figure(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2g", v);
  return text;
}

std::string ms(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3f ms", v);
  return text;
}

std::string lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

}  // namespace

TuneMachine tune_machine(const std::string& device) {
  TuneMachine m;
  char host[256] = {};
  m.host = ::gethostname(host, sizeof host - 1) == 0 ? host : "unknown";
  m.cpu = cpu_model();
  utsname u{};
  m.arch = ::uname(&u) == 0 ? u.machine : "unknown";
  m.cores = static_cast<int64_t>(std::thread::hardware_concurrency());
  m.threads = at::get_num_threads();
  m.aten_cpu_level = at::get_cpu_capability();
  m.kernmap_cpu_level = cpu_level();
  const char* cap = std::getenv("KERNMAP_CPU_ISA");
  m.kernmap_cpu_isa_env = cap != nullptr ? cap : "";
  m.torch = KERNMAP_TORCH_VERSION;
  m.kernmap = KERNMAP_VERSION;
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  ::gmtime_r(&now, &utc);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &utc);
  m.date = date;
  (void)device;  // CPU facts only: a C++ process's accelerators are not named (Python names a CUDA device)
  return m;
}

std::string write_tune_files(const TuneResult& result, const std::string& path) {
  const std::filesystem::path file(path);
  const std::string suffix = lower(file.extension().string());
  if (suffix != ".toml" && suffix != ".json")
    throw std::invalid_argument("tune: path must end in .toml or .json (the mapping-file formats), got " +
                                path);
  const TuneMachine& m = result.machine;
  const std::vector<std::string> header = {
      "kernmap tune: the fastest verified kernel of each layer, measured on this machine (docs/mapping.md,",
      "'Verified and tuned mappings'); every candidate's figures are in the side JSON.",
      "machine: " + m.host + ", " + m.cpu + " (" + m.arch + ", " + std::to_string(m.cores) + " cores, " +
          std::to_string(m.threads) + " threads), ATen CPU level " + m.aten_cpu_level +
          ", kernmap CPU level " + m.kernmap_cpu_level +
          ", KERNMAP_CPU_ISA=" + (m.kernmap_cpu_isa_env.empty() ? "(unset)" : m.kernmap_cpu_isa_env),
      "versions: torch " + m.torch + ", transformers (not used: C++), kernmap " + m.kernmap + "; " + m.date};
  std::vector<MappingFileSection> sections;
  for (const TuneLayer& l : result.layers) {
    if (l.winner.empty()) continue;
    std::string shapes;
    for (const std::string& s : l.shapes) shapes += (shapes.empty() ? "" : ", ") + s;
    MappingFileSection section{{l.layer + ": " + std::to_string(l.calls) + " calls, inputs " + shapes +
                                "; forward+backward medians"},
                               l.layer,
                               result.device,
                               {{Mode::kTraining, l.winner}}};
    for (const TuneCandidate& c : l.candidates)
      section.comments.push_back(
          "  " + c.kernel + ": " + (c.median_ms ? ms(*c.median_ms) : "-") +
          (c.error ? ", error " + figure(*c.error) + " (tolerance " + figure(*c.tolerance) + ")" : "") +
          ": " + c.verdict);
    sections.push_back(std::move(section));
  }
  const std::string side = (file.parent_path() / (file.stem().string() + ".tune.json")).string();
  write_mapping_file(path, header, sections);
  repository::write_file_atomically(side, result.json() + "\n");
  return side;
}

}  // namespace kernmap
