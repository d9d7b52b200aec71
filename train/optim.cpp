// AdamW and gradient-norm clipping with the exact arithmetic of torch.optim.AdamW (single-tensor path) and
// torch.nn.utils.clip_grad_norm_ (per-tensor path, the CPU default), so that runs match PyTorch bit for bit
// in the update and to rounding in the norm.
#include <ATen/ops/clamp.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <map>
#include <sstream>
#include <stdexcept>

#include "kernmap/safetensors.h"
#include "kernmap/train.h"
#include "train/checkpoint_format.h"

namespace kernmap::train {
namespace {

namespace cf = checkpoint_format;

std::string number(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

// torch.optim.AdamW raises for lr, eps, betas or weight_decay below 0 but takes NaN, infinities and betas of
// 1 or more, and then trains NaN (or divides by zero in the bias corrections at beta 1).
const AdamWOptions& validated(const AdamWOptions& o) {
  auto require = [](bool ok, const char* name, double v, const char* range) {
    if (!ok)
      throw std::invalid_argument(std::string("AdamW: ") + name + " = " + number(v) + " (must be " + range +
                                  ")");
  };
  require(std::isfinite(o.lr) && o.lr > 0, "lr", o.lr, "finite and > 0");
  require(o.beta1 >= 0 && o.beta1 < 1, "beta1", o.beta1, "in [0, 1)");
  require(o.beta2 >= 0 && o.beta2 < 1, "beta2", o.beta2, "in [0, 1)");
  require(std::isfinite(o.eps) && o.eps > 0, "eps", o.eps, "finite and > 0");
  require(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "weight_decay", o.weight_decay,
          "finite and >= 0");
  return o;
}

// How many elements of t are NaN or infinite.
int64_t non_finite(const at::Tensor& t) {
  return t.numel() - at::isfinite(t).sum().item<int64_t>();
}

}  // namespace

AdamW::AdamW(std::vector<std::pair<std::string, at::Tensor>> params, AdamWOptions options)
    : params_(std::move(params)), options_(validated(options)) {
  for (const auto& [name, p] : params_) {
    exp_avg_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
    exp_avg_sq_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
  }
}

void AdamW::zero_grad() {
  for (auto& [name, p] : params_) p.mutable_grad().reset();
}

void AdamW::step() {
  c10::NoGradGuard no_grad;
  ++step_;
  const AdamWOptions& o = options_;
  // Python floats: the scalars are doubles, as in torch's _single_tensor_adam.
  const double bias_correction1 = 1 - std::pow(o.beta1, static_cast<double>(step_));
  const double bias_correction2 = 1 - std::pow(o.beta2, static_cast<double>(step_));
  const double step_size = o.lr / bias_correction1;
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i].second;
    const at::Tensor& grad = p.grad();
    if (!grad.defined()) continue;
    if (o.weight_decay != 0) p.mul_(1 - o.lr * o.weight_decay);
    exp_avg_[i].lerp_(grad, 1 - o.beta1);
    exp_avg_sq_[i].mul_(o.beta2).addcmul_(grad, grad, 1 - o.beta2);
    const at::Tensor denom = (exp_avg_sq_[i].sqrt() / bias_correction2_sqrt).add_(o.eps);
    p.addcdiv_(exp_avg_[i], denom, -step_size);
  }
}

std::vector<std::pair<std::string, at::Tensor>> AdamW::state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back("exp_avg/" + params_[i].first, exp_avg_[i]);
    out.emplace_back("exp_avg_sq/" + params_[i].first, exp_avg_sq_[i]);
  }
  return out;
}

void AdamW::load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, int64_t step) {
  c10::NoGradGuard no_grad;
  // Names, dtypes and shapes first (torch-free, as the fuzz target checks them), then the values, then the
  // copies: a refused state changes nothing.
  std::vector<cf::TensorSpec> params, found;
  for (const auto& [name, p] : params_)
    params.push_back({name, safetensors_dtype_name(p.scalar_type()), p.sizes().vec()});
  for (const auto& [name, t] : tensors)
    found.push_back({name, safetensors_dtype_name(t.scalar_type()), t.sizes().vec()});
  try {
    cf::check_tensors(found, cf::optimizer_state(params));
    cf::check_step(step);
  } catch (const cf::FormatError& e) {
    throw CheckpointError(std::string("optimizer state: ") + e.what());
  }
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& [name, t] : tensors) by_name[name] = &t;
  for (const auto& [name, t] : tensors) {
    if (const int64_t bad = non_finite(t); bad > 0)
      throw CheckpointError("optimizer state: tensor '" + name + "' holds " + std::to_string(bad) +
                            " NaN or infinite value" + (bad == 1 ? "" : "s"));
    if (name.starts_with("exp_avg_sq/"))
      if (const int64_t negative = (t < 0).sum().item<int64_t>(); negative > 0)
        throw CheckpointError("optimizer state: tensor '" + name + "' holds " + std::to_string(negative) +
                              " negative value" + (negative == 1 ? "" : "s") + " (the smallest " +
                              number(t.min().item<double>()) + "); exp_avg_sq is a running mean of squares");
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    exp_avg_[i].copy_(*by_name.at("exp_avg/" + params_[i].first));
    exp_avg_sq_[i].copy_(*by_name.at("exp_avg_sq/" + params_[i].first));
  }
  step_ = step;
}

double clip_grad_norm(const std::vector<std::pair<std::string, at::Tensor>>& params, double max_norm) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> norms, grads;
  for (const auto& [name, p] : params) {
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad());
    norms.push_back(at::linalg_vector_norm(p.grad(), 2));
  }
  if (grads.empty()) return 0.0;
  const at::Tensor total = at::linalg_vector_norm(at::stack(norms), 2);
  // Python's `max_norm / (total + 1e-6)` is Tensor.__rdiv__: reciprocal, then multiply.
  const at::Tensor coef = at::clamp((total + 1e-6).reciprocal() * max_norm, c10::nullopt, 1.0);
  for (at::Tensor& g : grads) g.mul_(coef);
  return total.item<double>();
}

}  // namespace kernmap::train
