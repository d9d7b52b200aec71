// libFuzzer target: arbitrary bytes as a whole mapping file, read both as TOML and as JSON. Each parse must
// either return a mapping or throw mapping_file::Error (anything else, a crash or a sanitizer report, is a
// bug). A mapping parsed from TOML, written out as JSON and parsed again must come back the same, so the two
// parsers agree on every document both can express.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "mapping_file/format.h"

namespace {

namespace mf = kernmap::mapping_file;

// {layer: {device: {mode: kernel}}}, the shorthand spelled out.
nlohmann::json canonical(const mf::ParsedMapping& parsed) {
  nlohmann::json out = nlohmann::json::object();
  for (const mf::LayerEntry& layer : parsed.layers) {
    nlohmann::json& devices = out[layer.layer] = nlohmann::json::object();
    for (const mf::DeviceEntry& device : layer.devices) {
      nlohmann::json& modes = devices[device.device] = nlohmann::json::object();
      for (const mf::ModeEntry& entry : device.modes) modes[entry.mode] = entry.kernel;
    }
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const nlohmann::json from_toml = canonical(mf::parse_mapping_text(text, mf::Format::kToml, "fuzz.toml"));
    const nlohmann::json again =
        canonical(mf::parse_mapping_text(from_toml.dump(), mf::Format::kJson, "again.json"));
    if (from_toml != again) std::abort();
  } catch (const mf::Error&) {
  }
  try {
    canonical(mf::parse_mapping_text(text, mf::Format::kJson, "fuzz.json"));
  } catch (const mf::Error&) {
  }
  return 0;
}
