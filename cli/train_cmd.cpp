// `kernmap train`, `kernmap align`, `kernmap ablate`: SFT runs on a preset or a checkpoint, on JSONL token
// ids or the built-in synthetic data, printed as tables (or --json), with a progress bar on a terminal.
#include <ATen/Parallel.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/json_output.h"
#include "cli/options.h"
#include "cli/table.h"
#include "kernmap/train.h"

namespace kernmap::cli {
namespace {

// Upper bounds that keep what a run holds on the host before its first tensor sane, so that no value ends in
// std::bad_alloc or an out-of-memory kill (the tensors themselves are checked by the allocator, which names
// the size it could not get):
// - steps (and ablate's warm-up, and --save-every): a run keeps one StepLog (56 bytes) per step, align two
// and
//   ablate one time per row and step; a million steps is 56 MB of logs and days at the presets' fastest step.
constexpr int64_t kMaxSteps = 1'000'000;
// - batch rows: a step's batch is gathered row by row (an example per row), then padded into [rows, longest].
constexpr int64_t kMaxBatchSize = 65'536;
// - the synthetic dataset is made up front, 8 bytes a token: examples and their length alone, and their
//   product (2^27 tokens, 1 GiB); a step of synthetic rows holds batch x seq-len tokens (2^24, 16 Mi tokens,
//   far beyond any SFT step) twice, and its activations many times over.
constexpr int64_t kMaxExamples = 1 << 20;
constexpr int64_t kMaxSeqLen = 1 << 20;
constexpr int64_t kMaxSyntheticTokens = int64_t(1) << 27;
constexpr int64_t kMaxBatchTokens = int64_t(1) << 24;
// - intra-op threads: more than any machine has cores (the largest have a few hundred hardware threads); each
//   is an OS thread of torch's pool, and set_num_threads takes an int.
constexpr int64_t kMaxThreads = 1024;

struct RunArgs {
  std::string preset, model_dir, data_path, dtype = "float32", kernels = "all";
  std::string save_dir, resume_dir, routing = "replay";
  int64_t threads = 0;
  int64_t steps = 20, warmup = 3, save_every = 0, examples = 64, seq_len = 128;
  std::optional<double> rtol;  ///< align's tolerance; by default 1e-5 for float32, 2e-2 for bfloat16
  std::vector<std::string> experts_baselines;  ///< ablate: more original rows, one per experts implementation
  bool json = false, skip_bad_lines = false, verify = false;
  train::TrainOptions options;

  const std::string& model_name() const { return preset.empty() ? model_dir : preset; }
};

enum class Run { kTrain, kAlign, kAblate };

void add_run_options(CLI::App& app, RunArgs& r, Run run) {
  add_text(app, "--preset", r.preset, "NAME", "a preset name (" + join(preset_names()) + ")",
           "a built-in model: " + join(preset_names()));
  add_text(app, "--model", r.model_dir, "DIR", "a folder (config.json and safetensors)",
           "a checkpoint folder (config.json and safetensors)");
  add_text(app, "--data", r.data_path, "FILE", "a file (JSONL token ids)",
           "JSONL {\"prompt_ids\": [...], \"response_ids\": [...]} lines (default: synthetic data)");
  app.add_flag("--skip-bad-lines", r.skip_bad_lines,
               "skip malformed data lines (each reported) instead of stopping");
  add_integer(app, "--steps", r.steps, 1, kMaxSteps,
              run == Run::kAblate ? "measured steps per row" : "the last step to train, also with --resume");
  add_choice(app, "--dtype", r.dtype, {"float32", "bfloat16"}, "the model's parameter dtype");
  add_text(app, "--kernels", r.kernels, "all|none|LIST", "all, none or a comma list of layers",
           "the layers kernelized, the rest on their reference kernels (default all)");
  add_integer(app, "--batch-size", r.options.batch_size, 1, kMaxBatchSize, "examples per step");
  add_integer(app, "--seq-len", r.seq_len, 2, kMaxSeqLen, "tokens per synthetic example");
  add_integer(app, "--examples", r.examples, 1, kMaxExamples, "synthetic examples");
  add_real(app, "--lr", r.options.adam.lr, Sign::kPositive, "AdamW learning rate");
  add_real(app, "--weight-decay", r.options.adam.weight_decay, Sign::kNonNegative,
           "AdamW decoupled weight decay");
  add_real(app, "--max-grad-norm", r.options.max_grad_norm, Sign::kPositive,
           "gradients are clipped to this total 2-norm");
  add_integer(app, "--threads", r.threads, 0, kMaxThreads, "torch intra-op threads, 0 for torch's default");
  app.add_flag("--skip-non-finite", r.options.skip_non_finite,
               "skip a step whose loss or gradient norm is NaN or infinite (counted) instead of stopping");
  app.add_flag("--json", r.json, "one JSON document instead of the table");
  app.add_flag("--verify", r.verify,
               "check every kernel against its reference on the first batch (forward and backward) before "
               "training: a kernel off by more than its tolerance runs its reference instead; the kernel "
               "report shows each error");
  if (run == Run::kTrain) {
    add_text(app, "--save", r.save_dir, "DIR", "a folder", "write DIR/checkpoint.safetensors at the end");
    add_integer(app, "--save-every", r.save_every, 0, kMaxSteps,
                "with --save, also every N steps (0: only at the end)");
    add_text(app, "--resume", r.resume_dir, "DIR", "a folder",
             "continue from DIR/checkpoint.safetensors up to --steps");
  }
  if (run == Run::kAlign) {
    add_real(
        app, "--rtol", r.rtol, Sign::kPositive,
        "largest relative difference of loss and grad_norm that passes (default 1e-5 for float32, 2e-2 for "
        "bfloat16)");
    add_choice(app, "--routing", r.routing, {"replay", "free"},
               "a model with experts: the noise and kernelized runs send each token to the experts the "
               "original chose (replay, counting the tokens their own routers would send elsewhere) or route "
               "by their own top-k (free)");
  }
  if (run == Run::kAblate) {
    add_integer(app, "--warmup", r.warmup, 0, kMaxSteps, "unmeasured steps per row first");
    add_value(
        app, "--experts-baseline", "LIST", "a comma list of eager, grouped_mm, batched_mm",
        [&r](const std::string& text) {
          std::vector<std::string> names;
          size_t start = 0;
          while (start <= text.size()) {
            const size_t end = std::min(text.find(',', start), text.size());
            const std::string name = text.substr(start, end - start);
            train::experts_baseline_kernel(name);  // throws std::invalid_argument for another name
            names.push_back(name);
            start = end + 1;
          }
          r.experts_baselines = names;
        },
        "more original rows, experts as transformers' eager, grouped_mm or batched_mm run them (the original "
        "runs grouped_mm, transformers' default)");
  }
}

void check(const RunArgs& r) {
  if (r.preset.empty() == r.model_dir.empty())
    throw UsageError("give exactly one of --preset NAME (" + join(preset_names()) + ") or --model DIR");
  if (r.save_every > 0 && r.save_dir.empty())
    throw UsageError("--save-every needs --save DIR (where to save)");
  if (!r.data_path.empty()) return;
  if (r.examples > kMaxSyntheticTokens / r.seq_len)
    throw UsageError("--examples x --seq-len must be at most " + std::to_string(kMaxSyntheticTokens) +
                     " synthetic tokens (held in memory, 8 bytes each), got " + std::to_string(r.examples) +
                     " x " + std::to_string(r.seq_len));
  if (r.options.batch_size > kMaxBatchTokens / r.seq_len)
    throw UsageError("--batch-size x --seq-len must be at most " + std::to_string(kMaxBatchTokens) +
                     " tokens a step, got " + std::to_string(r.options.batch_size) + " x " +
                     std::to_string(r.seq_len));
}

// The settings every run applies before it starts.
void prepare(RunArgs& r) {
  if (r.threads > 0) at::set_num_threads(static_cast<int>(r.threads));
  if (!r.rtol) r.rtol = r.dtype == "float32" ? 1e-5 : 2e-2;
}

train::LayerSet kernel_layers(const RunArgs& r) {
  try {
    return train::parse_kernels(r.kernels);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());  // names --kernels, the layer and the accepted names
  }
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

Json step_json(const train::StepLog& s) {
  return {{"step", s.step},       {"loss", s.loss},     {"grad_norm", s.grad_norm},
          {"seconds", s.seconds}, {"tokens", s.tokens}, {"tokens_per_s", s.tokens_per_s},
          {"skipped", s.skipped}};
}

Json steps_json(const std::vector<train::StepLog>& logs) {
  Json out = Json::array();
  for (const train::StepLog& s : logs) out.push_back(step_json(s));
  return out;
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

// With --verify, the kernel report (each kernel's measured error) ahead of the run's own table.
void print_verified(const RunArgs& r, const Report& report) {
  if (!r.verify) return;
  std::printf("kernels verified on the first batch:\n%s\n", report.table().c_str());
}

int train_command(const RunArgs& r) {
  const train::LayerSet layers = kernel_layers(r);
  auto model = model_factory(r)();
  const train::Dataset data = load_data(r, model->config().vocab_size);
  const Report report = train::bind_kernels(
      *model, layers, {}, r.verify ? train::sample_step(*model, data, r.options.batch_size) : Verify{});
  train::Trainer trainer(model, data, r.options);
  if (!r.resume_dir.empty()) {
    const int64_t resumed = trainer.load_checkpoint(r.resume_dir);
    if (resumed >= r.steps)
      throw UsageError("--steps " + std::to_string(r.steps) + " is not above the step of " + r.resume_dir +
                       "'s checkpoint (" + std::to_string(resumed) + "): --steps is the last step to train");
  }
  const int64_t first = trainer.steps();
  if (!r.json) {
    std::printf("train %s, steps %lld..%lld\n\n", describe(r, model->config(), data).c_str(),
                static_cast<long long>(first + 1), static_cast<long long>(r.steps));
    print_verified(r, report);
  }
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
    Json skipped = Json::array();
    for (const train::DataIssue& issue : data.skipped)
      skipped.push_back({{"line", issue.line}, {"problem", issue.problem}});
    print_json({{"model", r.model_name()},
                {"data", data.source},
                {"skipped", skipped},
                {"kernels", Json::parse(report.json())},
                {"steps", steps_json(logs)}});
    return 0;
  }
  for (const auto& s : logs)
    table.rows.push_back({std::to_string(s.step) + (s.skipped ? " (skipped)" : ""), fixed(s.loss, 6),
                          fixed(s.grad_norm, 6), fixed(s.seconds * 1e3, 1), fixed(s.tokens_per_s, 0)});
  std::fputs(table.render().c_str(), stdout);
  if (trainer.skipped_steps() > 0)
    std::printf("\n%lld steps skipped for a non-finite loss or gradient norm (--skip-non-finite)\n",
                static_cast<long long>(trainer.skipped_steps()));
  return 0;
}

Json metric_json(const train::MetricVerdict& m) {
  return {{"diff", m.diff},
          {"noise", m.noise},
          {"floor", m.floor},
          {"tolerance", m.tolerance},
          {"max_diff", m.max_diff},
          {"max_diff_step", m.max_diff_step},
          {"worst_step", m.worst_step},
          {"passed", m.passed}};
}

// The verdict line, the same in `python -m kernmap align` (kernmap/train/align.py, verdict_line).
std::string verdict_line(const train::Verdict& v) {
  auto closest = [](const train::MetricVerdict& m) {
    const size_t s = static_cast<size_t>(m.worst_step - 1);
    return sci(m.diff[s]) + " of " + sci(m.tolerance[s]) + " (step " + std::to_string(m.worst_step) + ")";
  };
  char factor[32];
  std::snprintf(factor, sizeof factor, "%g", v.noise_factor);
  const std::string no_steps = "no steps";
  const bool any = !v.loss.diff.empty();
  return std::string("verdict: ") + (v.passed ? "PASS" : "FAIL") +
         " \u2014 largest relative difference: loss " + sci(v.loss.max_diff) + " (step " +
         std::to_string(v.loss.max_diff_step) + "), grad_norm " + sci(v.grad_norm.max_diff) + " (step " +
         std::to_string(v.grad_norm.max_diff_step) + "); closest to its tolerance: loss " +
         (any ? closest(v.loss) : no_steps) + ", grad_norm " + (any ? closest(v.grad_norm) : no_steps) +
         "; tolerance max(rtol " + sci(v.rtol) + ", " + factor + " x noise floor), noise floor up to loss " +
         sci(any ? v.loss.floor.back() : 0.0) + ", grad_norm " + sci(any ? v.grad_norm.floor.back() : 0.0);
}

// A model with routers: replayed or free routing, and replayed, the tokens each replaying run's own routers
// would have sent to other experts.
Json routing_json(const train::AlignResult& res) {
  if (!res.routing_replayed) return {{"mode", "free"}};
  auto flips = [](const RoutingTape::Flips& f) {
    return Json{
        {"calls", f.calls}, {"tokens", f.tokens}, {"flipped", f.flipped}, {"max_margin", f.max_margin}};
  };
  Json steps = Json::array();
  for (const RoutingTape::Flips& f : res.routing) steps.push_back(flips(f));
  return {{"mode", "replay"}, {"kernelized", steps}, {"noise", flips(res.noise_routing)}};
}

std::string routing_lines(const train::AlignResult& res) {
  RoutingTape::Flips all;
  std::string at;
  int steps_flipped = 0;
  for (size_t i = 0; i < res.routing.size(); ++i) {
    const RoutingTape::Flips& f = res.routing[i];
    all.add(f);
    if (f.flipped > 0) at += (steps_flipped++ ? ", " : "") + std::to_string(i + 1);
  }
  auto count = [](const RoutingTape::Flips& f) {
    return std::to_string(f.flipped) + " of " + std::to_string(f.tokens) + " routed tokens";
  };
  const bool several = steps_flipped > 1;
  return "routing flips: the kernelized run's own routers would have sent " + count(all) +
         " to other experts" +
         (all.flipped > 0 ? std::string(several ? " (steps " : " (step ") + at + "; largest margin " +
                                sci(all.max_margin) + ")"
                          : "") +
         "; the noise run's " + count(res.noise_routing) +
         (res.noise_routing.flipped > 0 ? " (largest margin " + sci(res.noise_routing.max_margin) + ")"
                                        : "") +
         "\n";
}

int align_command(const RunArgs& r) {
  const train::LayerSet layers = kernel_layers(r);
  const auto factory = model_factory(r);
  const ModelConfig config = factory()->config();
  const train::Dataset data = load_data(r, config.vocab_size);
  const train::AlignResult res = train::align(
      factory, data, r.options, layers, r.steps, *r.rtol, r.json ? train::Progress{} : progress_bar("align"),
      r.verify, r.routing == "free" ? train::Routing::kFree : train::Routing::kReplay);
  const train::Verdict& v = res.verdict;
  if (r.json) {
    Json noise_kernels = Json::object();  // layer -> the kernel the noise run bound (its float64 kernel)
    for (const ReportEntry& e : res.noise_report.entries) noise_kernels[e.layer] = e.kernel;
    Json noise_alone = Json::object();  // layer -> the steps of its own noise run (a model with experts)
    for (const auto& [layer, logs] : res.noise_alone) noise_alone[layer] = steps_json(logs);
    print_json({{"model", r.model_name()},
                {"passed", res.passed},
                {"rtol", res.rtol},
                {"noise_factor", v.noise_factor},
                {"max_loss_rel", res.max_loss_rel},
                {"max_grad_norm_rel", res.max_grad_norm_rel},
                {"kernels", Json::parse(res.report.json())},
                {"noise_kernels", noise_kernels},
                {"verdict",
                 {{"passed", v.passed},
                  {"rtol", v.rtol},
                  {"noise_factor", v.noise_factor},
                  {"loss", metric_json(v.loss)},
                  {"grad_norm", metric_json(v.grad_norm)}}},
                {"original", steps_json(res.original)},
                {"noise", steps_json(res.noise)},
                {"noise_alone", noise_alone},
                {"kernelized", steps_json(res.kernelized)},
                {"routing", res.routes_tokens ? routing_json(res) : Json()}});
    return res.passed ? 0 : 1;
  }
  std::printf("align %s, %lld steps, kernels: ", describe(r, config, data).c_str(),
              static_cast<long long>(r.steps));
  std::string bound;
  for (const ReportEntry& e : res.report.entries)
    if (!e.fallback && bound.find(e.kernel) == std::string::npos)
      bound += (bound.empty() ? "" : ", ") + e.kernel;
  std::printf("%s\noriginal: the reference kernels; noise floor: %s\n",
              bound.empty() ? "none (all reference)" : bound.c_str(),
              res.routing_replayed ? train::kNoiseRunReplayed : train::kNoiseRun);
  if (res.routing_replayed)
    std::printf(
        "routing: the noise and kernelized runs send every token to the experts the original chose "
        "(--routing replay)\n");
  std::printf("\n");
  print_verified(r, res.report);
  Table table{{"step", "loss original", "loss kernelized", "rel diff", "noise", "tolerance",
               "grad_norm original", "grad_norm kernelized", "rel diff", "noise", "tolerance"},
              {}};
  for (size_t i = 0; i < res.original.size(); ++i) {
    const auto &a = res.original[i], &b = res.kernelized[i];
    table.rows.push_back({std::to_string(a.step), fixed(a.loss, 6), fixed(b.loss, 6), sci(v.loss.diff[i]),
                          sci(v.loss.noise[i]), sci(v.loss.tolerance[i]), fixed(a.grad_norm, 6),
                          fixed(b.grad_norm, 6), sci(v.grad_norm.diff[i]), sci(v.grad_norm.noise[i]),
                          sci(v.grad_norm.tolerance[i])});
  }
  std::fputs(table.render().c_str(), stdout);
  if (res.routing_replayed) std::printf("\n%s", routing_lines(res).c_str());
  std::printf("\n%s\n", verdict_line(v).c_str());
  return res.passed ? 0 : 1;
}

int ablate_command(const RunArgs& r) {
  const train::LayerSet layers = kernel_layers(r);
  const auto factory = model_factory(r);
  const ModelConfig config = factory()->config();
  const train::Dataset data = load_data(r, config.vocab_size);
  const auto rows = train::ablate(factory, data, r.options, layers, r.warmup, r.steps,
                                  r.json ? train::Progress{} : progress_bar("ablate"), "grouped_mm",
                                  r.experts_baselines, r.verify);
  const std::string default_experts = rows.front().experts;
  if (r.json) {
    Json out = Json::array();
    for (const train::AblationRow& row : rows) {
      out.push_back({{"name", row.name},
                     {"experts", row.experts.empty() ? Json() : Json(row.experts)},
                     {"median_s", row.median_s},
                     {"p25_s", row.p25_s},
                     {"p75_s", row.p75_s},
                     {"speedup_pct", row.speedup_pct},
                     {"min_s", row.min_s},
                     {"median_cpu_s", row.median_cpu_s},
                     {"cpu_speedup_pct", row.cpu_speedup_pct},
                     {"peak_bytes", static_cast<int64_t>(row.peak_bytes)},  // a count of bytes
                     {"final_loss", row.final_loss},
                     {"seconds", row.seconds}});
      if (r.verify) out.back()["kernels"] = Json::parse(row.report.json());  // each kernel's measured error
    }
    print_json({{"model", r.model_name()},
                {"experts_implementation", default_experts.empty() ? Json() : Json(default_experts)},
                {"rows", out}});
    return 0;
  }
  std::printf("ablate %s; %lld measured steps per row after %lld warm-up, rows interleaved\n",
              describe(r, config, data).c_str(), static_cast<long long>(r.steps),
              static_cast<long long>(r.warmup));
  if (!default_experts.empty())
    std::printf(
        "original: the reference kernels, experts %s (%s); rows without the Experts kernel run their experts "
        "as the original does\n",
        default_experts.c_str(),
        default_experts == "grouped_mm" ? "transformers' default" : "--experts-baseline");
  std::printf("\n");
  auto pct = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%+.1f", v);
    return std::string(buf);
  };
  Table table{{"kernels", "median ms/step", "spread (p25-p75) ms", "min ms", "speedup %", "cpu ms/step",
               "cpu speedup %", "peak MiB", "final loss"},
              {}};
  for (const auto& row : rows)
    table.rows.push_back(
        {row.name + (&row == &rows.front() && !row.experts.empty() ? " (experts " + row.experts + ")" : ""),
         fixed(row.median_s * 1e3, 1), fixed(row.p25_s * 1e3, 1) + "-" + fixed(row.p75_s * 1e3, 1),
         fixed(row.min_s * 1e3, 1), pct(row.speedup_pct), fixed(row.median_cpu_s * 1e3, 1),
         pct(row.cpu_speedup_pct), fixed(row.peak_bytes / (1 << 20), 1), fixed(row.final_loss, 4)});
  std::fputs(table.render().c_str(), stdout);
  if (r.verify) {  // the "all" row binds every kernel the other rows bind
    std::printf("\n");
    print_verified(r, rows.back().report);
  }
  return 0;
}

}  // namespace

std::vector<Command> add_run_commands(CLI::App& parent) {
  struct Spec {
    const char* name;
    const char* help;
    Run run;
    int (*command)(const RunArgs&);
  };
  const Spec specs[] = {
      {"train", "SFT on a preset or a checkpoint: per-step loss, grad_norm, ms, tokens/s", Run::kTrain,
       train_command},
      {"align", "the original and the kernelized model trained side by side, per step, and a verdict",
       Run::kAlign, align_command},
      {"ablate",
       "step time: original, +each kernel, all (interleaved, medians, spread, speedup %, peak memory)",
       Run::kAblate, ablate_command},
  };
  std::vector<Command> out;
  for (const Spec& spec : specs) {
    CLI::App* app = parent.add_subcommand(spec.name, spec.help);
    auto args = std::make_shared<RunArgs>();
    add_run_options(*app, *args, spec.run);
    auto run = [args, command = spec.command] {
      prepare(*args);
      return command(*args);
    };
    out.push_back({app, [args] { check(*args); }, run});
  }
  return out;
}

}  // namespace kernmap::cli
