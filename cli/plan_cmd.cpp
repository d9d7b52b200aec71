// `kernmap plan`: the kernelize Report for a model, without running it. The model is built on the meta device
// (structure and shapes, no memory, no weights read), then kernelized for the requested device and mode. With
// --verify the model is built for real (a preset's random weights, a checkpoint's own) and every resolved
// kernel is checked on the first batch of the data (kernelize with Verify): the report shows the errors.
#include <ATen/core/TensorBody.h>
#include <c10/core/DeviceType.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/json_output.h"
#include "cli/options.h"
#include "cli/sample.h"
#include "cli/table.h"
#include "kernmap/models.h"
#include "kernmap/registry.h"
#include "kernmap/train.h"

namespace kernmap::cli {
namespace {

// Every mode kernels resolve for (parse_mode's spellings).
const Mode kModes[] = {Mode::kInference, Mode::kTraining, Mode::kInference | Mode::kCompile,
                       Mode::kTraining | Mode::kCompile, Mode::kFallback};

struct PlanArgs {
  std::string preset, model_dir, device = "cpu", data_path, dtype = "float32";
  Mode mode = Mode::kTraining;
  int64_t batch_size = 4, seq_len = 128;
  bool json = false, verify = false;
};

// The error / tolerance cell of a verified entry ("-" when not verified), as Python's Report prints it.
std::string error_cell(const ReportEntry& e) {
  if (!e.error || !e.tolerance) return "-";
  char text[64];
  std::snprintf(text, sizeof text, "%.2g / %.2g", *e.error, *e.tolerance);
  return text;
}

Report verified_plan(const PlanArgs& a) {
  if (a.device != "cpu")
    throw UsageError("--verify runs the sample step on this machine's CPU: --device must be cpu, got '" +
                     a.device + "'");
  const SampleModel s = load_sample(a.preset, a.model_dir, a.dtype, a.data_path, a.batch_size, a.seq_len);
  return kernelize(*s.model, a.device, a.mode, true, s.step);
}

// The device names plan accepts: torch's device types as torch.device spells them (c10's names, the
// PrivateUse1 backend's registered name included), every device a registered kernel names (plugins included),
// and two that a C++ process's torch does not know: "npu" (torch_npu's PrivateUse1 name, registered only when
// torch_npu is imported) and "rocm" (the Hugging Face `kernels` library's name for AMD GPUs, which torch
// calls cuda).
std::vector<std::string> known_devices() {
  std::set<std::string> out = {"npu", "rocm"};
  for (int t = 0; t < c10::COMPILE_TIME_MAX_DEVICE_TYPES; ++t)
    if (const auto type = static_cast<c10::DeviceType>(t); c10::isValidDeviceType(type))
      out.insert(c10::DeviceTypeName(type, /*lower_case=*/true));
  for (const KernelDescriptor* k : registered_kernels())
    for (const std::string& d : k->devices)
      if (d != "*") out.insert(d);
  return {out.begin(), out.end()};
}

void check_device(const std::string& device) {
  const std::vector<std::string> known = known_devices();
  if (std::find(known.begin(), known.end(), device) == known.end())
    throw UsageError(bad_value("--device", "a torch device type (" + join(known) + ")", device));
}

int plan_command(const PlanArgs& a) {
  check_device(a.device);
  const ModelConfig config = a.preset.empty() ? ModelConfig::from_dir(a.model_dir) : preset_config(a.preset);
  const Report report =
      a.verify ? verified_plan(a)
               : kernelize(*make_model(config, at::TensorOptions().device(at::kMeta)), a.device, a.mode);
  if (a.json) {
    print_json(Json::parse(report.json()));
    return 0;
  }
  Table table{{"module", "layer", "kernel", "reason"}, {}};
  if (a.verify) table.header.insert(table.header.begin() + 3, "error / tolerance");
  size_t mapped = 0;
  for (const ReportEntry& e : report.entries) {
    table.rows.push_back({e.path, e.layer, e.kernel, e.reason});
    if (a.verify) table.rows.back().insert(table.rows.back().begin() + 3, error_cell(e));
    mapped += e.fallback ? 0 : 1;
  }
  std::printf("%s (%s) on %s, %s: %zu of %zu kernel layers mapped to a kernel, %zu on the reference\n\n",
              a.preset.empty() ? a.model_dir.c_str() : a.preset.c_str(), config.model_type.c_str(),
              report.device.c_str(), to_string(a.mode).c_str(), mapped, report.entries.size(),
              report.entries.size() - mapped);
  std::fputs(table.render().c_str(), stdout);
  return 0;
}

}  // namespace

Command add_plan_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "plan",
      "the kernel each layer of a model gets here, and why (the kernelize report), without running it");
  auto args = std::make_shared<PlanArgs>();
  add_text(*app, "--preset", args->preset, "NAME", "a preset name (" + join(preset_names()) + ")",
           "a built-in model: " + join(preset_names()));
  add_text(*app, "--model", args->model_dir, "DIR", "a folder (config.json and safetensors)",
           "a checkpoint folder (config.json and safetensors)");
  std::vector<std::string> modes;
  for (Mode m : kModes) modes.push_back(to_string(m));
  add_value(
      *app, "--mode", "MODE", "one of " + join(modes),
      [args](const std::string& v) {
        for (Mode m : kModes)
          if (v == to_string(m)) {
            args->mode = m;
            return;
          }
        throw std::invalid_argument("not a mode");
      },
      "the mode kernels are resolved for: " + join(modes) + " (default training)");
  add_text(*app, "--device", args->device, "TYPE", "a device type",
           "the device kernels are resolved for, a torch device type (default cpu)");
  app->add_flag("--json", args->json, "the report as one JSON document");
  app->add_flag("--verify", args->verify,
                "build the model and check every resolved kernel against its reference on the first batch "
                "(forward and, in training, backward): a kernel off by more than its tolerance falls back, "
                "the report shows each error");
  add_text(*app, "--data", args->data_path, "FILE", "a file (JSONL token ids)",
           "with --verify: JSONL token ids whose first batch is the sample (default: synthetic data)");
  add_choice(*app, "--dtype", args->dtype, {"float32", "bfloat16"},
             "with --verify: the model's parameter dtype");
  add_integer(*app, "--batch-size", args->batch_size, 1, 65'536,
              "with --verify: examples in the sample batch");
  add_integer(*app, "--seq-len", args->seq_len, 2, 1 << 20, "with --verify: tokens per synthetic example");
  auto check = [args] {
    if (args->preset.empty() == args->model_dir.empty())
      throw UsageError("give exactly one of --preset NAME (one of " + join(preset_names()) +
                       ") or --model DIR");
    if (!args->verify && (!args->data_path.empty() || args->dtype != "float32"))
      throw UsageError("--data and --dtype choose the sample batch of --verify: give --verify too");
  };
  return {app, check, [args] { return plan_command(*args); }};
}

}  // namespace kernmap::cli
