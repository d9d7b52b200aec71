// The load report's text forms (include/kernmap/plugins.h).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>

#include "kernmap/plugins.h"

namespace kernmap {
namespace {

using nlohmann::json;

json to_json(const PackageReport& p) {
  return json{{"repository", p.repository}, {"folder", p.folder},           {"name", p.name},
              {"version", p.version},       {"description", p.description}, {"state", to_string(p.state)},
              {"reason", p.reason},         {"variant", p.variant},         {"offered", p.offered},
              {"score", p.score},           {"kernels", p.kernels},         {"defaults", p.defaults}};
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

}  // namespace kernmap
