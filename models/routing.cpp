// RoutingTape: the routers' expert choices of one run, replayed by another (kernmap/models.h).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>

#include "kernmap/models.h"

namespace kernmap {

void RoutingTape::record() {
  calls_.clear();
  next_ = 0;
  replaying_ = false;
  flips_ = {};
}

void RoutingTape::replay() {
  if (calls_.empty()) throw std::logic_error("RoutingTape::replay: nothing was recorded");
  next_ = 0;
  replaying_ = true;
  flips_ = {};
}

RoutingTape::Flips RoutingTape::take_flips() {
  const Flips out = flips_;
  flips_ = {};
  return out;
}

at::Tensor RoutingTape::route(const at::Tensor& probs, const at::Tensor& ids) {
  if (!replaying_) {
    // 2 bytes an expert id where they fit (every MoE model's expert count does).
    calls_.push_back(ids.detach().to(probs.size(-1) <= 32768 ? at::kShort : at::kInt));
    return ids;
  }
  const size_t call = next_ + 1;
  if (next_ >= calls_.size())
    throw std::runtime_error("routing replay: router call " + std::to_string(call) + " is past the " +
                             std::to_string(calls_.size()) +
                             " calls recorded (the replaying run routes more often than the recorded one)");
  const at::Tensor& recorded = calls_[next_];
  if (recorded.sizes() != ids.sizes()) {
    std::ostringstream msg;
    msg << "routing replay: router call " << call << " routes [tokens, k] = " << ids.sizes()
        << ", the recorded call " << recorded.sizes() << " (the runs must see the same batches)";
    throw std::runtime_error(msg.str());
  }
  ++next_;
  flips_.calls += 1;
  flips_.tokens += ids.size(0);
  at::NoGradGuard no_grad;
  const at::Tensor own = ids.to(recorded.scalar_type());
  if (own.equal(recorded)) return ids;
  const at::Tensor replayed = recorded.to(at::kLong);
  // A flip: the sets of experts differ (the same experts in another order are not one).
  const at::Tensor flipped = std::get<0>(own.sort(-1)).ne(std::get<0>(recorded.sort(-1))).any(-1);
  const int64_t n = flipped.sum().item<int64_t>();
  if (n > 0) {
    const at::Tensor p = probs.detach().to(at::kFloat);
    const at::Tensor kth = p.gather(-1, ids).amin(-1);
    const at::Tensor least = p.gather(-1, replayed).amin(-1);
    const at::Tensor margin = at::where(kth > 0, (kth - least) / kth, at::zeros_like(kth));
    const double worst = margin.masked_select(flipped).max().item<double>();
    flips_.flipped += n;
    if (worst > flips_.max_margin) flips_.max_margin = worst;  // a NaN margin (non-finite probs) is left out
  }
  return replayed;
}

}  // namespace kernmap
