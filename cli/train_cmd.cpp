// `kernmap train`, `kernmap align`, `kernmap ablate`: SFT runs on a preset or a checkpoint, on JSONL token
// ids or the built-in synthetic data, printed as tables (or --json), with a progress bar on a terminal.
#include <ATen/Parallel.h>
#include <unistd.h>

#include <cstdio>
#include <stdexcept>
#include <string>

#include "cli/commands.h"
#include "cli/table.h"
#include "kernmap/train.h"

namespace kernmap::cli {
namespace {

struct RunArgs {
  std::string preset, model_dir, data_path, dtype = "float32", kernels = "all";
  std::string save_dir, resume_dir;
  int64_t threads = 0;
  int64_t steps = 20, warmup = 3, save_every = 0, examples = 64, seq_len = 128;
  double rtol = -1;
  bool json = false, skip_bad_lines = false;
  train::TrainOptions options;
};

constexpr const char* kOptions =
    "--preset NAME | --model DIR, --data FILE, --skip-bad-lines, --steps N, --dtype float32|bfloat16, "
    "--kernels all|none|LIST, --batch-size N, --seq-len N, --examples N, --lr X, --weight-decay X, "
    "--max-grad-norm X, --threads N, --json; train: --save DIR, --save-every N, --resume DIR; align: --rtol "
    "X; "
    "ablate: --warmup N";

RunArgs parse(const std::vector<std::string>& args) {
  RunArgs r;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size()) throw std::invalid_argument(a + " needs a value");
      return args[++i];
    };
    auto integer = [&]() { return std::stoll(value()); };
    auto real = [&]() { return std::stod(value()); };
    if (a == "--preset")
      r.preset = value();
    else if (a == "--model")
      r.model_dir = value();
    else if (a == "--data")
      r.data_path = value();
    else if (a == "--skip-bad-lines")
      r.skip_bad_lines = true;
    else if (a == "--steps")
      r.steps = integer();
    else if (a == "--warmup")
      r.warmup = integer();
    else if (a == "--dtype")
      r.dtype = value();
    else if (a == "--kernels")
      r.kernels = value();
    else if (a == "--batch-size")
      r.options.batch_size = integer();
    else if (a == "--seq-len")
      r.seq_len = integer();
    else if (a == "--examples")
      r.examples = integer();
    else if (a == "--lr")
      r.options.adam.lr = real();
    else if (a == "--weight-decay")
      r.options.adam.weight_decay = real();
    else if (a == "--max-grad-norm")
      r.options.max_grad_norm = real();
    else if (a == "--rtol")
      r.rtol = real();
    else if (a == "--save")
      r.save_dir = value();
    else if (a == "--save-every")
      r.save_every = integer();
    else if (a == "--resume")
      r.resume_dir = value();
    else if (a == "--threads")
      r.threads = integer();
    else if (a == "--json")
      r.json = true;
    else
      throw std::invalid_argument("unknown option '" + a + "' (options: " + kOptions + ")");
  }
  if (r.preset.empty() == r.model_dir.empty())
    throw std::invalid_argument(
        "give exactly one of --preset NAME (qwen2-tiny, qwen2-moe-tiny, qwen3-moe-tiny) or "
        "--model DIR");
  if (r.dtype != "float32" && r.dtype != "bfloat16")
    throw std::invalid_argument("--dtype must be float32 or bfloat16, got '" + r.dtype + "'");
  if (r.steps < 1 || r.warmup < 0 || r.options.batch_size < 1)
    throw std::invalid_argument("--steps and --batch-size must be >= 1, --warmup >= 0");
  if (r.threads > 0) at::set_num_threads(static_cast<int>(r.threads));
  if (r.rtol < 0) r.rtol = r.dtype == "float32" ? 1e-5 : 2e-2;
  return r;
}

std::function<std::shared_ptr<CausalLM>()> model_factory(const RunArgs& r) {
  const at::TensorOptions options =
      at::TensorOptions().dtype(r.dtype == "float32" ? at::kFloat : at::kBFloat16);
  if (!r.preset.empty()) return [=] { return make_preset(r.preset, options); };
  return [=] { return from_pretrained(r.model_dir, options); };
}

train::Dataset load_data(const RunArgs& r, int64_t vocab_size) {
  if (r.data_path.empty()) return train::synthetic_dataset(vocab_size, r.examples, r.seq_len);
  train::Dataset data = train::read_jsonl(r.data_path, vocab_size, r.skip_bad_lines);
  for (const train::DataIssue& issue : data.skipped)
    std::fprintf(stderr, "%s: line %lld skipped: %s\n", r.data_path.c_str(),
                 static_cast<long long>(issue.line), issue.problem.c_str());
  return data;
}

// A one-line bar on stderr, only when it is a terminal.
train::Progress progress_bar(const char* what) {
  if (!::isatty(2)) return {};
  return [what](int64_t done, int64_t total) {
    const int width = 30;
    const int filled = static_cast<int>(width * done / total);
    std::fprintf(stderr, "\r%s [%s%s] %lld/%lld steps", what, std::string(filled, '#').c_str(),
                 std::string(width - filled, ' ').c_str(), static_cast<long long>(done),
                 static_cast<long long>(total));
    if (done == total) std::fputs("\r\033[K", stderr);
    std::fflush(stderr);
  };
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string step_json(const train::StepLog& s) {
  return "{\"step\": " + std::to_string(s.step) + ", \"loss\": " + num(s.loss) +
         ", \"grad_norm\": " + num(s.grad_norm) + ", \"seconds\": " + num(s.seconds) +
         ", \"tokens\": " + std::to_string(s.tokens) + ", \"tokens_per_s\": " + num(s.tokens_per_s) + "}";
}

std::string sci(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2e", v);
  return buf;
}

std::string describe(const RunArgs& r, const ModelConfig& c, const train::Dataset& d) {
  return (r.preset.empty() ? r.model_dir : r.preset) + " (" + c.model_type + ", " + r.dtype + "), data " +
         d.source + " (" + std::to_string(d.examples.size()) + " examples), batch " +
         std::to_string(r.options.batch_size);
}

}  // namespace

int train_command(const std::vector<std::string>& args) {
  const RunArgs r = parse(args);
  auto model = model_factory(r)();
  const train::Dataset data = load_data(r, model->config().vocab_size);
  const Report report = train::bind_kernels(*model, train::parse_kernels(r.kernels));
  train::Trainer trainer(model, data, r.options);
  if (!r.resume_dir.empty()) trainer.load_checkpoint(r.resume_dir);
  const int64_t first = trainer.steps();
  if (!r.json)
    std::printf("train %s, steps %lld..%lld\n\n", describe(r, model->config(), data).c_str(),
                static_cast<long long>(first + 1), static_cast<long long>(r.steps));
  Table table{{"step", "loss", "grad_norm", "ms", "tokens/s"}, {}};
  std::vector<train::StepLog> logs;
  const auto progress = r.json ? train::Progress{} : progress_bar("train");
  while (trainer.steps() < r.steps) {
    const train::StepLog log = trainer.step();
    logs.push_back(log);
    if (!r.save_dir.empty() && ((r.save_every > 0 && log.step % r.save_every == 0) || log.step == r.steps))
      trainer.save_checkpoint(r.save_dir);
    if (progress) progress(log.step - first, r.steps - first);
  }
  if (r.json) {
    std::string out = "{\"model\": " + json_string(r.preset.empty() ? r.model_dir : r.preset) +
                      ", \"data\": " + json_string(data.source) + ", \"skipped\": [";
    for (size_t i = 0; i < data.skipped.size(); ++i)
      out += std::string(i ? ", " : "") + "{\"line\": " + std::to_string(data.skipped[i].line) +
             ", \"problem\": " + json_string(data.skipped[i].problem) + "}";
    out += "], \"kernels\": " + report.json() + ", \"steps\": [";
    for (size_t i = 0; i < logs.size(); ++i) out += (i ? ", " : "") + step_json(logs[i]);
    std::printf("%s]}\n", out.c_str());
    return 0;
  }
  for (const auto& s : logs)
    table.rows.push_back({std::to_string(s.step), fixed(s.loss, 6), fixed(s.grad_norm, 6),
                          fixed(s.seconds * 1e3, 1), fixed(s.tokens_per_s, 0)});
  std::fputs(table.render().c_str(), stdout);
  return 0;
}

int align_command(const std::vector<std::string>& args) {
  const RunArgs r = parse(args);
  const auto factory = model_factory(r);
  const ModelConfig config = factory()->config();
  const train::Dataset data = load_data(r, config.vocab_size);
  const train::AlignResult res =
      train::align(factory, data, r.options, train::parse_kernels(r.kernels), r.steps, r.rtol,
                   r.json ? train::Progress{} : progress_bar("align"));
  if (r.json) {
    std::string out = "{\"model\": " + json_string(r.preset.empty() ? r.model_dir : r.preset) +
                      ", \"passed\": " + (res.passed ? "true" : "false") + ", \"rtol\": " + num(res.rtol) +
                      ", \"max_loss_rel\": " + num(res.max_loss_rel) +
                      ", \"max_grad_norm_rel\": " + num(res.max_grad_norm_rel) +
                      ", \"kernels\": " + res.report.json() + ", \"original\": [";
    for (size_t i = 0; i < res.original.size(); ++i) out += (i ? ", " : "") + step_json(res.original[i]);
    out += "], \"kernelized\": [";
    for (size_t i = 0; i < res.kernelized.size(); ++i) out += (i ? ", " : "") + step_json(res.kernelized[i]);
    std::printf("%s]}\n", out.c_str());
    return res.passed ? 0 : 1;
  }
  std::printf("align %s, %lld steps, kernels: ", describe(r, config, data).c_str(),
              static_cast<long long>(r.steps));
  std::string bound;
  for (const ReportEntry& e : res.report.entries)
    if (!e.fallback && bound.find(e.kernel) == std::string::npos)
      bound += (bound.empty() ? "" : ", ") + e.kernel;
  std::printf("%s\n\n", bound.empty() ? "none (all reference)" : bound.c_str());
  Table table{{"step", "loss original", "loss kernelized", "rel diff", "grad_norm original",
               "grad_norm kernelized", "rel diff"},
              {}};
  for (size_t i = 0; i < res.original.size(); ++i) {
    const auto &a = res.original[i], &b = res.kernelized[i];
    table.rows.push_back({std::to_string(a.step), fixed(a.loss, 6), fixed(b.loss, 6),
                          sci(std::abs(b.loss - a.loss) / std::abs(a.loss)), fixed(a.grad_norm, 6),
                          fixed(b.grad_norm, 6),
                          sci(std::abs(b.grad_norm - a.grad_norm) / std::abs(a.grad_norm))});
  }
  std::fputs(table.render().c_str(), stdout);
  std::printf(
      "\nverdict: %s — largest relative difference: loss %s (step %lld), grad_norm %s (step %lld); "
      "tolerance %s\n",
      res.passed ? "PASS" : "FAIL", sci(res.max_loss_rel).c_str(),
      static_cast<long long>(res.worst_loss_step), sci(res.max_grad_norm_rel).c_str(),
      static_cast<long long>(res.worst_grad_norm_step), sci(res.rtol).c_str());
  return res.passed ? 0 : 1;
}

int ablate_command(const std::vector<std::string>& args) {
  const RunArgs r = parse(args);
  const auto factory = model_factory(r);
  const ModelConfig config = factory()->config();
  const train::Dataset data = load_data(r, config.vocab_size);
  const auto rows = train::ablate(factory, data, r.options, train::parse_kernels(r.kernels), r.warmup,
                                  r.steps, r.json ? train::Progress{} : progress_bar("ablate"));
  if (r.json) {
    std::string out =
        "{\"model\": " + json_string(r.preset.empty() ? r.model_dir : r.preset) + ", \"rows\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& row = rows[i];
      out += std::string(i ? ", " : "") + "{\"name\": " + json_string(row.name) +
             ", \"median_s\": " + num(row.median_s) + ", \"p25_s\": " + num(row.p25_s) +
             ", \"p75_s\": " + num(row.p75_s) + ", \"speedup_pct\": " + num(row.speedup_pct) +
             ", \"min_s\": " + num(row.min_s) + ", \"median_cpu_s\": " + num(row.median_cpu_s) +
             ", \"cpu_speedup_pct\": " + num(row.cpu_speedup_pct) +
             ", \"peak_bytes\": " + num(row.peak_bytes) + ", \"final_loss\": " + num(row.final_loss) +
             ", \"seconds\": [";
      for (size_t j = 0; j < row.seconds.size(); ++j) out += (j ? ", " : "") + num(row.seconds[j]);
      out += "]}";
    }
    std::printf("%s]}\n", out.c_str());
    return 0;
  }
  std::printf("ablate %s; %lld measured steps per row after %lld warm-up, rows interleaved\n\n",
              describe(r, config, data).c_str(), static_cast<long long>(r.steps),
              static_cast<long long>(r.warmup));
  auto pct = [](double v) { return (v >= 0 ? "+" : "") + fixed(v, 1); };
  Table table{{"kernels", "median ms/step", "spread (p25-p75) ms", "min ms", "speedup %", "cpu ms/step",
               "cpu speedup %", "peak MiB", "final loss"},
              {}};
  for (const auto& row : rows)
    table.rows.push_back(
        {row.name, fixed(row.median_s * 1e3, 1), fixed(row.p25_s * 1e3, 1) + "-" + fixed(row.p75_s * 1e3, 1),
         fixed(row.min_s * 1e3, 1), pct(row.speedup_pct), fixed(row.median_cpu_s * 1e3, 1),
         pct(row.cpu_speedup_pct), fixed(row.peak_bytes / (1 << 20), 1), fixed(row.final_loss, 4)});
  std::fputs(table.render().c_str(), stdout);
  return 0;
}

}  // namespace kernmap::cli
