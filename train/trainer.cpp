// The SFT step loop and its checkpoints.
#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <c10/core/GradMode.h>

#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "kernmap/train.h"
#include "train/checkpoint_format.h"

namespace kernmap::train {
namespace {

namespace cf = checkpoint_format;

constexpr const char* kCheckpointFile = "checkpoint.safetensors";

double cpu_now() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

const TrainOptions& validated(const TrainOptions& o) {
  if (o.batch_size < 1)
    throw std::invalid_argument("TrainOptions: batch_size = " + std::to_string(o.batch_size) +
                                " (must be >= 1)");
  // NaN compares false: !(x > 0) refuses it with the non-positive values.
  if (!(o.max_grad_norm > 0)) {
    std::ostringstream msg;
    msg << "TrainOptions: max_grad_norm = " << o.max_grad_norm << " (must be > 0; inf turns clipping off)";
    throw std::invalid_argument(msg.str());
  }
  return o;
}

// A non-finite loss or gradient norm: NonFiniteError, before anything is updated.
[[noreturn]] void stop(int64_t step, const char* what, double value) {
  std::ostringstream msg;
  msg << "step " << step << ": the " << what << " is " << value
      << "; stopped before updating, the parameters are those after step " << step - 1
      << " (a learning rate too high, or NaN in the weights or data? skip_non_finite skips such steps "
         "instead)";
  throw NonFiniteError(msg.str(), step);
}

}  // namespace

Trainer::Trainer(std::shared_ptr<CausalLM> model, const Dataset& data, TrainOptions options)
    : model_(std::move(model)),
      data_(data),
      options_(validated(options)),
      params_([&] {
        std::vector<std::pair<std::string, at::Tensor>> params;
        for (const auto& item : model_->named_parameters()) params.emplace_back(item.key(), item.value());
        return params;
      }()),
      optimizer_(params_, options_.adam) {}

StepLog Trainer::step() {
  const int64_t pad_id = std::max<int64_t>(model_->config().pad_token_id, 0);
  const Batch batch = make_batch(data_, step_, options_.batch_size, pad_id);
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = cpu_now();

  optimizer_.zero_grad();
  const CausalLMOutput out = model_->forward(batch.input_ids, batch.labels);  // forward + loss
  const double loss = out.loss.item<double>();
  double grad_norm = std::nan("");
  if (std::isfinite(loss)) {
    out.loss.backward();                                          // backward
    grad_norm = clip_grad_norm(params_, options_.max_grad_norm);  // clip
  }
  const bool finite = std::isfinite(loss) && std::isfinite(grad_norm);
  if (finite) {
    optimizer_.step();  // update
  } else {
    optimizer_.zero_grad();  // no update: this step's gradients are dropped
    if (!options_.skip_non_finite)
      stop(step_ + 1, std::isfinite(loss) ? "gradient norm" : "loss", std::isfinite(loss) ? grad_norm : loss);
    ++skipped_;
  }

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double cpu_seconds = cpu_now() - cpu_start;
  ++step_;
  return {step_, loss, grad_norm, seconds, cpu_seconds, batch.tokens, batch.tokens / seconds, !finite};
}

void Trainer::save_checkpoint(const std::string& dir) const {
  std::filesystem::create_directories(dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, p] : params_) tensors.emplace_back("param/" + name, p.detach());
  for (const auto& item : optimizer_.state()) tensors.push_back(item);
  tensors.emplace_back("trainer/step", at::full({1}, step_, at::kLong));
  // Whole or not at all (write_safetensors goes through a temporary file, fsync and rename): readers, and a
  // run resumed after a crash, see the previous checkpoint or this one.
  write_safetensors(dir + "/" + kCheckpointFile, tensors,
                    {{"format", "kernmap-train"},
                     {"step", std::to_string(step_)},
                     {"model_type", model_->config().model_type}});
}

int64_t Trainer::load_checkpoint(const std::string& dir) {
  const std::string path = dir + "/" + kCheckpointFile;
  const auto tensors = read_safetensors(path);
  // Names, dtypes and shapes against this model (torch-free, as the fuzz target checks them), then values:
  // nothing is copied until the whole checkpoint has passed.
  std::vector<cf::TensorSpec> params, found;
  for (const auto& [name, p] : params_)
    params.push_back({name, safetensors_dtype_name(p.scalar_type()), p.sizes().vec()});
  std::map<std::string, at::Tensor> by_name;
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (const auto& [name, t] : tensors) {
    found.push_back({name, safetensors_dtype_name(t.scalar_type()), t.sizes().vec()});
    by_name[name] = t;
    if (name.starts_with("exp_avg")) state.emplace_back(name, t);
  }
  int64_t step = 0;
  try {
    cf::check_tensors(found, cf::checkpoint_tensors(params));
    step = by_name.at(cf::kStepTensor).item<int64_t>();
    cf::check_step(step);
  } catch (const cf::FormatError& e) {
    throw CheckpointError(path + ": " + e.what());
  }
  for (const auto& [name, p] : params_) {
    const at::Tensor& t = by_name.at("param/" + name);
    if (const int64_t bad = t.numel() - at::isfinite(t).sum().item<int64_t>(); bad > 0)
      throw CheckpointError(path + ": tensor 'param/" + name + "' holds " + std::to_string(bad) +
                            " NaN or infinite value" + (bad == 1 ? "" : "s"));
  }
  try {
    optimizer_.load_state(state, step);
  } catch (const CheckpointError& e) {
    throw CheckpointError(path + ": " + e.what());
  }
  c10::NoGradGuard no_grad;
  for (auto& [name, p] : params_) p.copy_(by_name.at("param/" + name));
  step_ = step;
  return step;
}

LayerSet parse_kernels(const std::string& text) {
  const std::vector<std::string> layers = registered_layers();
  const LayerSet known(layers.begin(), layers.end());
  if (text == "all") return known;
  if (text == "none") return {};
  LayerSet out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = std::min(text.find(',', start), text.size());
    const std::string name = text.substr(start, end - start);
    if (!known.count(name)) {
      std::string list;
      for (const std::string& layer : layers) list += (list.empty() ? "" : ", ") + layer;
      throw std::invalid_argument("--kernels: unknown layer '" + name +
                                  "' (expected all, none or a comma list of " + list + ")");
    }
    out.insert(name);
    start = end + 1;
  }
  return out;
}

Verify sample_step(CausalLM& model, const Dataset& data, int64_t batch_size) {
  const int64_t pad_id = std::max<int64_t>(model.config().pad_token_id, 0);
  const Batch batch = make_batch(data, 0, batch_size, pad_id);
  return {[&model, batch] { return model.forward(batch.input_ids, batch.labels).loss; }};
}

Report bind_kernels(CausalLM& model, const LayerSet& layers, const Baseline& baseline, const Verify& verify) {
  Report report = kernelize(model, "", Mode::kTraining, true, verify);
  std::map<std::string, KernelLayer*> by_path;
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    if (auto* layer = dynamic_cast<KernelLayer*>(item.value().get())) by_path[item.key()] = layer;
  for (ReportEntry& e : report.entries) {
    if (layers.count(e.layer)) continue;
    KernelLayer* layer = by_path.at(e.path);
    const KernelDescriptor* kernel = reference_kernel(layer->layer_name());
    e.reason = "not selected by --kernels";
    e.error.reset();  // what was verified is not what runs
    e.tolerance.reset();
    if (auto it = baseline.find(layer->layer_name()); it != baseline.end()) {
      const KernelDescriptor* chosen = find_kernel(it->second);
      if (chosen == nullptr)
        throw std::invalid_argument("baseline kernel '" + it->second + "' is not registered");
      const std::optional<std::string> why_not =
          chosen->supports ? chosen->supports(layer->kernel_inputs()) : std::nullopt;
      if (why_not)
        e.reason += "; baseline " + chosen->name + " cannot run it: " + *why_not;
      else
        kernel = chosen;
    }
    layer->bind(*kernel);
    e.kernel = kernel->name;
    e.fallback = true;
    e.source = kernel == reference_kernel(layer->layer_name()) ? "reference" : "baseline";
  }
  return report;
}

}  // namespace kernmap::train
