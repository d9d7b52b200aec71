// The plugin part of the C API (include/kernmap/c_api.h): options and reports as JSON, errors as status
// codes.
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "capi/guarded.h"
#include "kernmap/c_api.h"
#include "kernmap/plugins.h"
#include "repository/json_forms.h"

namespace kernmap {
namespace {

using nlohmann::json;

using detail::copy_string;

// Messages of std::invalid_argument from the loader do not name the C function: prefix it.
template <typename Body>
int guarded(const char* function, char** error, Body&& body) {
  return detail::guarded_call(function, error, body, /*name_invalid_argument=*/true);
}

LoadOptions options_from_json(const char* text) {
  LoadOptions options;
  if (text == nullptr) {
    options.use_env_path = true;
    return options;
  }
  const json j = json::parse(text);
  if (!j.is_object()) throw std::invalid_argument("options must be a JSON object, got " + j.dump());
  for (const auto& [key, value] : j.items()) {
    if (key == "paths") {
      options.paths = value.get<std::vector<std::string>>();
    } else if (key == "use_env_path") {
      options.use_env_path = value.get<bool>();
    } else if (key == "toolkits") {
      options.toolkits = value.get<std::map<std::string, std::string>>();
    } else if (key == "strict") {
      options.strict = value.get<bool>();
    } else {
      throw std::invalid_argument("options: unknown field '" + key +
                                  "' (expected paths, use_env_path, toolkits, strict)");
    }
  }
  return options;
}

}  // namespace
}  // namespace kernmap

using namespace kernmap;  // NOLINT(google-build-using-namespace): the C entry points below only forward

extern "C" {

int kernmap_load_plugins(const char* options_json, char** report_json, char** error) {
  return guarded("kernmap_load_plugins", error, [&] {
    if (report_json == nullptr) throw std::invalid_argument("report_json is NULL");
    try {
      *report_json = copy_string(load_plugins(options_from_json(options_json)).to_json());
    } catch (const PluginError& e) {
      *report_json = copy_string(e.report().to_json());
      throw std::invalid_argument(e.what());
    }
  });
}

int kernmap_plugin_report(char** report_json, char** error) {
  return guarded("kernmap_plugin_report", error, [&] {
    if (report_json == nullptr) throw std::invalid_argument("report_json is NULL");
    *report_json = copy_string(plugin_report().to_json());
  });
}

int kernmap_write_lock(const char* dir, char** lock_json, char** error) {
  return guarded("kernmap_write_lock", error, [&] {
    if (dir == nullptr) throw std::invalid_argument("dir is NULL");
    if (lock_json == nullptr) throw std::invalid_argument("lock_json is NULL");
    *lock_json = copy_string(write_lock(dir));
  });
}

}  // extern "C"
