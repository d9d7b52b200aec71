// `kernmap plan`: the kernelize Report for a model, without running it. The model is built on the meta device
// (structure and shapes, no memory, no weights read), then kernelized for the requested device and mode.
#include <ATen/core/TensorBody.h>

#include <cstdio>
#include <stdexcept>
#include <string>

#include "cli/commands.h"
#include "cli/table.h"
#include "kernmap/models.h"

namespace kernmap::cli {

int plan_command(const std::vector<std::string>& args) {
  std::string preset, model_dir, device = "cpu";
  Mode mode = Mode::kTraining;
  bool json = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size()) throw std::invalid_argument(a + " needs a value");
      return args[++i];
    };
    if (a == "--preset") {
      preset = value();
    } else if (a == "--model") {
      model_dir = value();
    } else if (a == "--mode") {
      mode = parse_mode(value());
    } else if (a == "--device") {
      device = value();
    } else if (a == "--json") {
      json = true;
    } else {
      throw std::invalid_argument("unknown option '" + a +
                                  "' (expected --preset NAME | --model DIR, --mode, --device, --json)");
    }
  }
  if (preset.empty() == model_dir.empty())
    throw std::invalid_argument(
        "give exactly one of --preset NAME (one of qwen2-tiny, qwen2-moe-tiny, "
        "qwen3-moe-tiny) or --model DIR");

  const ModelConfig config = preset.empty() ? ModelConfig::from_dir(model_dir) : preset_config(preset);
  const auto model = make_model(config, at::TensorOptions().device(at::kMeta));
  const Report report = kernelize(*model, device, mode);
  if (json) {
    std::fputs((report.json() + "\n").c_str(), stdout);
    return 0;
  }
  Table table{{"module", "layer", "kernel", "reason"}, {}};
  size_t mapped = 0;
  for (const ReportEntry& e : report.entries) {
    table.rows.push_back({e.path, e.layer, e.kernel, e.reason});
    mapped += e.fallback ? 0 : 1;
  }
  std::printf("%s (%s) on %s, %s: %zu of %zu kernel layers mapped to a kernel, %zu on the reference\n\n",
              preset.empty() ? model_dir.c_str() : preset.c_str(), config.model_type.c_str(),
              report.device.c_str(), to_string(mode).c_str(), mapped, report.entries.size(),
              report.entries.size() - mapped);
  std::fputs(table.render().c_str(), stdout);
  return 0;
}

}  // namespace kernmap::cli
