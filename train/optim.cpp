// AdamW and gradient-norm clipping with the exact arithmetic of torch.optim.AdamW (single-tensor path) and
// torch.nn.utils.clip_grad_norm_ (per-tensor path, the CPU default), so that runs match PyTorch bit for bit
// in the update and to rounding in the norm.
#include <ATen/ops/clamp.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <stdexcept>

#include "kernmap/train.h"

namespace kernmap::train {

AdamW::AdamW(std::vector<std::pair<std::string, at::Tensor>> params, AdamWOptions options)
    : params_(std::move(params)), options_(options) {
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
  auto find = [&](const std::string& name, const at::Tensor& like) -> const at::Tensor& {
    for (const auto& [n, t] : tensors)
      if (n == name) {
        if (!t.sizes().equals(like.sizes()))
          throw std::runtime_error("optimizer state '" + name + "' has the wrong shape");
        return t;
      }
    throw std::runtime_error("optimizer state '" + name + "' is missing");
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    exp_avg_[i].copy_(find("exp_avg/" + params_[i].first, exp_avg_[i]));
    exp_avg_sq_[i].copy_(find("exp_avg_sq/" + params_[i].first, exp_avg_sq_[i]));
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
