// `kernmap tune`: every eligible kernel of each layer of a model, verified and timed on the model's live
// inputs (the first batch of the data), the fastest verified one per layer written to a mapping file that
// --mapping reads as is (kernmap/tune.h; docs/mapping.md, "Verified and tuned mappings").
#include <ATen/Parallel.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cctype>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "cli/json_output.h"
#include "cli/options.h"
#include "cli/sample.h"
#include "cli/table.h"
#include "kernmap/models.h"
#include "kernmap/train.h"
#include "kernmap/tune.h"

namespace kernmap::cli {
namespace {

struct TuneArgs {
  std::string preset, model_dir, data_path, out, dtype = "float32";
  int64_t batch_size = 4, seq_len = 128, warmup = 3, reps = 10, threads = 0;
  bool json = false;
};

// --out is refused before anything runs: its extension, and a folder that does not exist or is not writable.
void check_out(const std::string& out) {
  namespace fs = std::filesystem;
  const fs::path path(out);
  std::string suffix = path.extension().string();
  for (char& c : suffix) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (suffix != ".toml" && suffix != ".json")
    throw UsageError(bad_value("--out", "a mapping file ending in .toml or .json", out));
  const fs::path folder = path.has_parent_path() ? path.parent_path() : fs::path(".");
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw UsageError(bad_value("--out", "a file, not a folder", out));
  if (!fs::exists(folder, ec))
    throw UsageError("--out " + out + ": the folder " + folder.string() + " does not exist");
  if (!fs::is_directory(folder, ec))
    throw UsageError("--out " + out + ": the folder " + folder.string() + " is not a folder");
  if (::access(folder.c_str(), W_OK) != 0)
    throw UsageError("--out " + out + ": the folder " + folder.string() + " is not writable");
}

int tune_command(const TuneArgs& a) {
  if (a.threads > 0) at::set_num_threads(static_cast<int>(a.threads));
  const SampleModel s = load_sample(a.preset, a.model_dir, a.dtype, a.data_path, a.batch_size, a.seq_len);
  const TuneResult result = tune(*s.model, "cpu", s.step, TuneOptions{a.warmup, a.reps});
  const std::string side = a.out.empty() ? "" : write_tune_files(result, a.out);
  if (a.json) {
    Json doc = Json::parse(result.json());
    doc["path"] = a.out.empty() ? Json() : Json(a.out);
    doc["table_path"] = side.empty() ? Json() : Json(side);
    print_json(doc);
    return 0;
  }
  std::printf(
      "tune %s (%s), data %s, batch %lld; forward+backward medians of %lld runs after %lld warm-up, "
      "candidates interleaved\n\n",
      a.preset.empty() ? a.model_dir.c_str() : a.preset.c_str(), a.dtype.c_str(), s.data_source.c_str(),
      static_cast<long long>(a.batch_size), static_cast<long long>(a.reps), static_cast<long long>(a.warmup));
  std::fputs(result.table().c_str(), stdout);
  if (!a.out.empty())
    std::printf("\nwrote %s (the mapping) and %s (every candidate)\n", a.out.c_str(), side.c_str());
  return 0;
}

}  // namespace

Command add_tune_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "tune",
      "time every eligible kernel of each layer on a model's live inputs (forward+backward, verified), and "
      "write the fastest verified ones as a mapping file");
  auto args = std::make_shared<TuneArgs>();
  add_text(*app, "--preset", args->preset, "NAME", "a preset name (" + join(preset_names()) + ")",
           "a built-in model: " + join(preset_names()));
  add_text(*app, "--model", args->model_dir, "DIR", "a folder (config.json and safetensors)",
           "a checkpoint folder (config.json and safetensors)");
  add_text(*app, "--data", args->data_path, "FILE", "a file (JSONL token ids)",
           "JSONL token ids whose first batch is the sample (default: synthetic data)");
  add_text(*app, "--out", args->out, "FILE", "a mapping file (.toml or .json)",
           "write the winners there (.toml: with the machine and every candidate's figures as comments) and "
           "the comparison as <stem>.tune.json beside it");
  add_choice(*app, "--dtype", args->dtype, {"float32", "bfloat16"}, "the model's parameter dtype");
  add_integer(*app, "--batch-size", args->batch_size, 1, 65'536, "examples in the sample batch");
  add_integer(*app, "--seq-len", args->seq_len, 2, 1 << 20, "tokens per synthetic example");
  add_integer(*app, "--warmup", args->warmup, 0, 1'000'000, "untimed runs of each candidate first");
  add_integer(*app, "--reps", args->reps, 1, 1'000'000, "timed runs of each candidate (their median counts)");
  add_integer(*app, "--threads", args->threads, 0, 1024, "torch intra-op threads, 0 for torch's default");
  app->add_flag("--json", args->json, "one JSON document (the comparison) instead of the table");
  auto check = [args] {
    if (args->preset.empty() == args->model_dir.empty())
      throw UsageError("give exactly one of --preset NAME (" + join(preset_names()) + ") or --model DIR");
    if (!args->out.empty()) check_out(args->out);
  };
  return {app, check, [args] { return tune_command(*args); }};
}

}  // namespace kernmap::cli
