// Supervised fine-tuning of the kernmap models (DESIGN §6): token-id JSONL data, AdamW and gradient clipping
// with PyTorch's exact semantics, a step loop with per-step loss / grad_norm / time, atomic checkpoints and
// exact resume, and the two runs that prove a kernel mapping: alignment (original vs kernelized, step by
// step) and ablation (step time per kernel, rows interleaved).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernmap/export.h"
#include "kernmap/models.h"

namespace kernmap::train {

/// One supervised example: the loss covers response_ids only.
struct KERNMAP_API Example {
  std::vector<int64_t> prompt_ids;
  std::vector<int64_t> response_ids;
};

/// A data line that could not be used: its 1-based line number and what is wrong with it.
struct KERNMAP_API DataIssue {
  int64_t line = 0;
  std::string problem;
};

/// Examples in file order, and every line that was skipped (with skip_bad_lines).
struct KERNMAP_API Dataset {
  std::string source;  ///< the file, or "synthetic(...)"
  std::vector<Example> examples;
  std::vector<DataIssue> skipped;
};

/// Data that cannot be used: the message lists every malformed line with its number.
class KERNMAP_API DataError : public std::runtime_error {
 public:
  DataError(const std::string& what, std::vector<DataIssue> issues)
      : std::runtime_error(what), issues(std::move(issues)) {}
  std::vector<DataIssue> issues;
};

/// Reads JSONL lines {"prompt_ids": [int...], "response_ids": [int...]} (other keys ignored; whitespace-only
/// lines are not examples). A line is malformed when it is not one JSON object (a NUL byte anywhere in it
/// included), lacks either key, has a non-integer or out-of-[0, vocab_size) id, an empty response, or fewer
/// than 2 tokens in all. Malformed lines throw DataError (all of them listed) unless skip_bad_lines, which
/// records them in Dataset::skipped. A read error (the file's, not the end of it) throws DataError naming the
/// last line read and the error: data is never silently cut short.
KERNMAP_API Dataset read_jsonl(const std::string& path, int64_t vocab_size, bool skip_bad_lines);
/// The same from a stream; `source` names it in messages and Dataset::source. The stream's exception mask is
/// restored on return.
KERNMAP_API Dataset read_jsonl(std::istream& in, const std::string& source, int64_t vocab_size,
                               bool skip_bad_lines);

/// A deterministic synthetic task (the same for a given seed on every machine): prompts of seq_len / 2 random
/// tokens, responses that continue them by a fixed rule, so the loss falls as the model learns it.
KERNMAP_API Dataset synthetic_dataset(int64_t vocab_size, int64_t num_examples, int64_t seq_len,
                                      uint64_t seed = 1234);

/// input_ids [B, S] and labels [B, S] int64: the examples of a step, right-padded to the longest.
struct KERNMAP_API Batch {
  at::Tensor input_ids;
  at::Tensor labels;   ///< the token on response positions, -100 on prompt and padding
  int64_t tokens = 0;  ///< non-padding tokens
};

/// The batch of step `step` (0-based): examples (step * batch_size + b) mod N for b < batch_size, each
/// prompt + response, right-padded with pad_id (labels -100 there). With causal attention, right padding
/// changes no logit of a real token, so a padded batch computes what its examples compute alone.
KERNMAP_API Batch make_batch(const Dataset& data, int64_t step, int64_t batch_size, int64_t pad_id);

/// torch.optim.AdamW hyper-parameters (its defaults, except weight_decay and lr as set by the trainer).
/// AdamW's constructor refuses values torch would train nonsense with: lr and eps must be finite and > 0,
/// beta1 and beta2 in [0, 1), weight_decay finite and >= 0.
struct KERNMAP_API AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

/// AdamW with the arithmetic of torch.optim.AdamW's single-tensor path (foreach=False, the CPU default):
/// decoupled decay p *= 1 - lr*wd; m.lerp_(g, 1-b1); v = v*b2 + (1-b2) g*g; p -= lr/bc1 * m /
/// (sqrt(v)/sqrt(bc2)
/// + eps). State is kept in each parameter's dtype.
class KERNMAP_API AdamW {
 public:
  /// Throws std::invalid_argument naming the option and its value for options outside their ranges (see
  /// AdamWOptions).
  AdamW(std::vector<std::pair<std::string, at::Tensor>> params, AdamWOptions options);
  /// Sets every gradient to none (zero_grad(set_to_none=True)).
  void zero_grad();
  /// One update of every parameter that has a gradient.
  void step();
  int64_t steps() const { return step_; }
  /// State tensors by name ("exp_avg/<param>", "exp_avg_sq/<param>") for checkpoints.
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  /// Restores state() output and the step count. Throws CheckpointError naming the tensor and the problem,
  /// and changes nothing, when a tensor is missing, unknown, of another dtype or shape than its parameter,
  /// exp_avg holds a NaN or infinity, exp_avg_sq one or a negative value (it is a mean of squares), or the
  /// step is outside [0, 2^53].
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, int64_t step);

 private:
  std::vector<std::pair<std::string, at::Tensor>> params_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;
  AdamWOptions options_;
  int64_t step_ = 0;
};

/// torch.nn.utils.clip_grad_norm_(params, max_norm): the 2-norm of the per-tensor 2-norms of the gradients,
/// then every gradient times min(1, max_norm / (norm + 1e-6)). Returns the norm before clipping.
KERNMAP_API double clip_grad_norm(const std::vector<std::pair<std::string, at::Tensor>>& params,
                                  double max_norm);

/// What one optimisation step did.
struct KERNMAP_API StepLog {
  int64_t step = 0;  ///< 1-based
  double loss = 0;
  double grad_norm = 0;
  double seconds = 0;      ///< forward + loss + backward + clip + update, wall clock
  double cpu_seconds = 0;  ///< the same span in process CPU time (all threads): the work done, which other
                           ///< processes on a shared machine disturb far less than the wall clock
  int64_t tokens = 0;
  double tokens_per_s = 0;
  bool skipped = false;  ///< the loss or the gradient norm was not finite (TrainOptions::skip_non_finite):
                         ///< the parameters and optimizer state were left as they were
};

/// A step whose loss or gradient norm is NaN or infinite, when TrainOptions::skip_non_finite is off.
class KERNMAP_API NonFiniteError : public std::runtime_error {
 public:
  NonFiniteError(const std::string& what, int64_t step) : std::runtime_error(what), step(step) {}
  int64_t step;  ///< 1-based: the step that failed (the parameters are those after step - 1)
};

/// The Trainer's constructor refuses batch_size < 1 and max_grad_norm NaN or <= 0 (+inf: no clipping), and
/// AdamW's the adam options it refuses, with std::invalid_argument naming the option and its value.
struct KERNMAP_API TrainOptions {
  int64_t batch_size = 4;
  double max_grad_norm = 1.0;
  AdamWOptions adam;
  /// false: a step whose loss or gradient norm is not finite throws NonFiniteError naming the step. true:
  /// such a step updates nothing (its batch is used up, as with torch's GradScaler), is logged with
  /// StepLog::skipped, and counted in Trainer::skipped_steps().
  bool skip_non_finite = false;
};

/// The SFT step loop over a model and a dataset (held by reference: it must outlive the trainer).
class KERNMAP_API Trainer {
 public:
  Trainer(std::shared_ptr<CausalLM> model, const Dataset& data, TrainOptions options);
  /// forward, loss, backward, clip, update: one step on the next batch. Throws NonFiniteError (nothing
  /// updated) for a NaN or infinite loss or gradient norm, unless options.skip_non_finite.
  StepLog step();
  /// Steps done, skipped ones included (the next batch is make_batch(data, steps())).
  int64_t steps() const { return step_; }
  /// Steps skipped for a non-finite loss or gradient norm (TrainOptions::skip_non_finite), since
  /// construction.
  int64_t skipped_steps() const { return skipped_; }
  CausalLM& model() { return *model_; }
  /// Writes parameters, optimiser state and the step count to dir/checkpoint.safetensors atomically: into a
  /// temporary file that is flushed to disk, then renamed over the previous checkpoint, so an interruption at
  /// any moment leaves the previous checkpoint whole.
  void save_checkpoint(const std::string& dir) const;
  /// Restores what save_checkpoint wrote and returns its step count (steps() from then on); training then
  /// continues the uninterrupted run's sequence exactly. Throws CheckpointError naming the file, the tensor
  /// and the problem, and changes nothing, when the file is not a checkpoint of this model: a tensor missing,
  /// unknown, or of another dtype or shape than the model's (parameters and their optimizer state in the
  /// parameter's dtype, trainer/step one int64), a step outside [0, 2^53], a NaN or infinite parameter, or
  /// optimizer state AdamW::load_state refuses.
  int64_t load_checkpoint(const std::string& dir);

 private:
  std::shared_ptr<CausalLM> model_;
  const Dataset& data_;
  TrainOptions options_;
  std::vector<std::pair<std::string, at::Tensor>> params_;
  AdamW optimizer_;
  int64_t step_ = 0;
  int64_t skipped_ = 0;
};

/// The layers a run kernelizes: a subset of registered_layers() ("RMSNorm", "SiluAndMul", "Experts", ...);
/// the rest stay on their reference kernels.
using LayerSet = std::set<std::string>;
/// "all", "none" or a comma list of layer names; throws std::invalid_argument for an unknown name.
KERNMAP_API LayerSet parse_kernels(const std::string& text);
/// The kernels a run's unselected layers run instead of their references: layer -> kernel name.
using Baseline = std::map<std::string, std::string>;
/// The first batch of a run (make_batch(data, 0, batch_size)) as kernelize's sample step on model: one
/// forward with labels, returning the loss. The model must outlive the Verify.
KERNMAP_API Verify sample_step(CausalLM& model, const Dataset& data, int64_t batch_size);

/// Kernelizes the layers in `layers` for training on the model's device (with verify's step, each kernel
/// verified on it: kernelize with Verify) and binds every other kernel layer to its baseline kernel (when it
/// takes the layer's inputs) or its reference. Returns the kernelize report of the final binding.
KERNMAP_API Report bind_kernels(CausalLM& model, const LayerSet& layers, const Baseline& baseline = {},
                                const Verify& verify = {});

/// Called after each step of a run: (steps done, steps in all).
using Progress = std::function<void(int64_t, int64_t)>;

/// |value - original| / |original| (the denominator at least 1e-30); +inf when not finite.
KERNMAP_API double rel_diff(double value, double original);

/// How far above the measured noise floor a correct kernel's difference may lie (docs/training.md, "The
/// verdict": the measurements behind it). Python's NOISE_FACTOR is the same number.
constexpr double kNoiseFactor = 10.0;

/// One metric's verdict, per step s (0-based here, 1-based in the steps named):
/// diff = rel_diff(kernelized, original); noise = the largest rel_diff(noise run, original) over the noise
/// runs, each 0 when not finite; floor = the largest noise up to s; tolerance = max(rtol, noise_factor *
/// floor). Passed when every diff is within its tolerance (a non-finite diff never is).
struct KERNMAP_API MetricVerdict {
  std::vector<double> diff, noise, floor, tolerance;
  double max_diff = 0;        ///< the largest diff
  int64_t max_diff_step = 0;  ///< its step (the last of equals)
  int64_t worst_step = 0;     ///< the step of the largest diff / tolerance (the first of equals)
  bool passed = true;
};
/// The verdict on loss and grad_norm: passed when both pass.
struct KERNMAP_API Verdict {
  MetricVerdict loss, grad_norm;
  double rtol = 0, noise_factor = kNoiseFactor;
  bool passed = false;
};
/// Throws std::invalid_argument when the series differ in length.
KERNMAP_API MetricVerdict judge_metric(const std::vector<double>& original,
                                       const std::vector<double>& kernelized,
                                       const std::vector<std::vector<double>>& noise_runs, double rtol,
                                       double noise_factor = kNoiseFactor);
KERNMAP_API Verdict judge(const std::vector<StepLog>& original, const std::vector<StepLog>& kernelized,
                          const std::vector<std::vector<StepLog>>& noise_runs, double rtol,
                          double noise_factor = kNoiseFactor);

/// What align's noise runs are, in the words both commands print.
inline constexpr const char* kNoiseRun =
    "the original with the selected layers on their float64 kernels (the reference's math from float64, "
    "rounded where it rounds), and in a model that routes tokens to experts each selected layer alone on its "
    "float64 kernel too; the largest drift of these runs";
/// The same with the original's routing replayed (align's default for a model with routers: no per-layer
/// runs).
inline constexpr const char* kNoiseRunReplayed =
    "the original with the selected layers on their float64 kernels (the reference's math from float64, "
    "rounded where it rounds)";

/// How align's runs after the original route tokens to experts (a model without routers ignores it).
enum class Routing {
  kReplay,  ///< every token to the experts the original run chose for it (RoutingTape); flips are counted
  kFree,    ///< each router by its own top-k, as in training; a model with experts gets per-layer noise runs
};

/// The float64 kernel of a layer (provider "float64": the reference's math from float64, rounded where the
/// reference rounds), or nullptr when the layer has none.
KERNMAP_API const KernelDescriptor* float64_kernel(const std::string& layer);

/// Original (all references) and kernelized runs of the same model, data and seed, step by step, and the
/// noise runs: the original with every selected layer on its float64 kernel, a correct kernel whose rounding
/// differs from the reference's where the kernels' does, so it drifts from the original as correct arithmetic
/// drifts on this machine and this model (docs/training.md, "The verdict"). In a model that routes tokens to
/// experts the runs after the original replay its routing (Routing::kReplay, RoutingTape): a rounding that
/// tips a router's near-tie would otherwise send a token to another expert and part the runs by a discrete
/// step that says nothing of the kernels' arithmetic; the tokens whose experts a run's own routers would
/// have chosen otherwise are counted (docs/training.md, "Routing"). With Routing::kFree such a model gets one
/// more noise run per selected layer (when more than one is selected), that layer alone on its float64
/// kernel, to sample those flips. The runs train one after another, so one model is held at a time.
struct KERNMAP_API AlignResult {
  std::vector<StepLog> original, kernelized, noise;
  /// The per-layer noise runs (layer -> its steps); empty for a model without experts and with replayed
  /// routing.
  std::map<std::string, std::vector<StepLog>> noise_alone;
  /// Whether the model has routers.
  bool routes_tokens = false;
  /// Whether the runs after the original replayed its routing (a model with routers, Routing::kReplay).
  bool routing_replayed = false;
  /// Per step of the kernelized run, the tokens its routers would have sent elsewhere (replayed routing;
  /// empty otherwise); noise_routing: the noise run's, all steps together.
  std::vector<RoutingTape::Flips> routing;
  RoutingTape::Flips noise_routing;
  Report report;        ///< the kernelized run's binding
  Report noise_report;  ///< the noise run's binding: every selected layer on its float64 kernel
  Verdict verdict;
  double max_loss_rel = 0, max_grad_norm_rel = 0;  ///< verdict.loss.max_diff, verdict.grad_norm.max_diff
  int64_t worst_loss_step = 0, worst_grad_norm_step = 0;  ///< their steps
  double rtol = 0;
  bool passed = false;  ///< verdict.passed
};
/// make_model() must return the same initial model each call. verify: the kernelized run's kernels are
/// verified on its first batch (sample_step) before it trains; a kernel that fails runs its reference (report
/// says why).
KERNMAP_API AlignResult align(const std::function<std::shared_ptr<CausalLM>()>& make_model,
                              const Dataset& data, const TrainOptions& options, const LayerSet& layers,
                              int64_t steps, double rtol, const Progress& progress = {}, bool verify = false,
                              Routing routing = Routing::kReplay);

/// transformers' experts implementations an ablation's original rows run ("grouped_mm", transformers 5.23's
/// default; "batched_mm"; "eager", the reference loop): their kernel names; throws std::invalid_argument for
/// another name.
KERNMAP_API std::string experts_baseline_kernel(const std::string& implementation);

/// One row of the ablation table. Every member has a default initializer: a row starts from its name,
/// layers and experts.
struct KERNMAP_API AblationRow {
  std::string name{};  ///< "original", "original (experts eager)", "+RMSNorm", "+Experts", ..., "all"
  LayerSet layers{};
  /// The experts implementation the row's Experts layers run ("grouped_mm", "batched_mm", "eager", or
  /// "kernmap" when it binds the Experts kernel); empty for a model without experts.
  std::string experts{};
  std::vector<double> seconds{};      ///< measured steps (warm-up excluded), wall clock
  std::vector<double> cpu_seconds{};  ///< the same steps in process CPU time
  double median_s = 0, p25_s = 0, p75_s = 0, min_s = 0;
  double median_cpu_s = 0;
  double speedup_pct = 0;      ///< (original median / this median - 1) * 100, wall clock
  double cpu_speedup_pct = 0;  ///< the same on the CPU-time medians
  double peak_bytes = 0;  ///< most CPU memory in tensors during one measured step, above what was held before
                          ///< it (kernmap/memory.h: c10's CPU allocator and kernmap's large blocks)
  double final_loss = 0;
  Report report{};  ///< the row's binding
};
/// Rows original (the references, experts as `experts`: transformers' default), one more original row per
/// implementation in `more_experts`, +each layer the model has (of `layers`), all; rows without the Experts
/// kernel run their experts as the original does. Each row trains its own copy of the model on the same
/// batches. Steps are interleaved (step s of every row before step s+1 of any, rows in a rotating order) so
/// that machine drift hits all rows alike. When the grouped_mm baseline cannot take the model's sizes, its
/// rows run the eager loop (and say so in `experts`). verify: each row that kernelizes a layer verifies its
/// kernels on the first batch (sample_step) first.
KERNMAP_API std::vector<AblationRow> ablate(const std::function<std::shared_ptr<CausalLM>()>& make_model,
                                            const Dataset& data, const TrainOptions& options,
                                            const LayerSet& layers, int64_t warmup, int64_t steps,
                                            const Progress& progress = {},
                                            const std::string& experts = "grouped_mm",
                                            const std::vector<std::string>& more_experts = {},
                                            bool verify = false);

}  // namespace kernmap::train
