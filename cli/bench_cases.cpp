// The elementwise cases of `kernmap bench ops` (RMSNorm, SiLU, SiLU-and-mul and its packed form SwiGLU at
// Qwen2-7B sizes) and shared helpers.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "cli/bench.h"
#include "kernmap/ops.h"

namespace kernmap::cli {

at::ScalarType dtype_of(const std::string& name) {
  return name == "bfloat16" ? at::kBFloat16 : at::kFloat;
}

std::string shape_string(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// fwd+bwd of f on inputs that require grad, with a fixed upstream gradient; grads are dropped between runs so
// no accumulation pass is timed.
std::function<void()> fwd_bwd(std::vector<at::Tensor> inputs, at::Tensor grad,
                              std::function<at::Tensor(const std::vector<at::Tensor>&)> f,
                              std::vector<bool> trainable) {
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].is_floating_point() && (trainable.empty() || (i < trainable.size() && trainable[i])))
      inputs[i].requires_grad_(true);
  return [inputs, grad, f] {
    at::Tensor y = f(inputs);
    torch::autograd::backward({y}, {grad});
    for (const auto& t : inputs)
      if (t.is_floating_point()) t.mutable_grad().reset();
  };
}

namespace {

// Both passes of one elementwise op on shared inputs (grads are dropped between runs).
std::vector<Case> both_passes(const std::string& op, const std::string& dtype,
                              const std::vector<at::Tensor>& in, const at::Tensor& dy, double fwd_bytes,
                              double both_bytes, double fwd_written, double both_written,
                              std::function<at::Tensor(const std::vector<at::Tensor>&)> kern,
                              std::function<at::Tensor(const std::vector<at::Tensor>&)> ref) {
  const std::string shape = shape_string(in[0].sizes());
  Case fwd{op,
           "fwd",
           dtype,
           shape,
           fwd_bytes,
           0,
           0,
           {{"kernmap",
             [=] {
               at::NoGradGuard g;
               kern(in);
             }},
            {"reference", [=] {
               at::NoGradGuard g;
               ref(in);
             }}}};
  Case both{op,         "fwd+bwd",
            dtype,      shape,
            both_bytes, 0,
            0,          {{"kernmap", fwd_bwd(in, dy, kern)}, {"reference", fwd_bwd(in, dy, ref)}}};
  fwd.written = fwd_written;
  both.written = both_written;
  return {fwd, both};
}

}  // namespace

std::vector<CaseBuilder> builders_of(std::function<std::vector<Case>()> make, size_t count) {
  auto made = std::make_shared<std::vector<Case>>();
  auto taken = std::make_shared<size_t>(0);
  std::vector<CaseBuilder> out;
  for (size_t i = 0; i < count; ++i)
    out.push_back([=] {
      if (made->empty()) *made = make();
      if (made->size() != count)
        throw std::logic_error("bench: a case family made " + std::to_string(made->size()) +
                               " cases, its builders expected " + std::to_string(count));
      Case c = (*made)[i];
      if (++*taken == made->size()) made->clear();
      return c;
    });
  return out;
}

std::vector<CaseBuilder> rms_norm_cases(const std::string& dtype, const ShapeFilter&) {
  return builders_of([dtype] {
    const at::ScalarType dt = dtype_of(dtype);
    const int64_t T = 4096, H = 3584;  // Qwen2-7B hidden size
    at::Tensor x = at::randn({T, H}).to(dt);
    at::Tensor w = (1 + 0.1 * at::randn({H})).to(dt);
    at::Tensor dy = at::randn({T, H}).to(dt);
    const double e = x.element_size();
    const double fwd_bytes = e * (T * H + H + T * H);
    const double bwd_bytes =
        fwd_bytes + e * (T * H + T * H + H + T * H + H);  // + dy, x, w read; dx, dw written
    return both_passes(
        "rms_norm", dtype, {x, w}, dy, fwd_bytes, bwd_bytes, e * T * H, e * (2 * T * H + H),
        [](const std::vector<at::Tensor>& in) { return kernmap::rms_norm(in[0], in[1], 1e-6); },
        [](const std::vector<at::Tensor>& in) { return kernmap::reference::rms_norm(in[0], in[1], 1e-6); });
  });
}

std::vector<CaseBuilder> silu_and_mul_cases(const std::string& dtype, const ShapeFilter&) {
  return builders_of([dtype] {
    const at::ScalarType dt = dtype_of(dtype);
    const int64_t T = 4096, I = 18944;  // Qwen2-7B intermediate size
    at::Tensor gate = at::randn({T, I}).to(dt);
    at::Tensor up = at::randn({T, I}).to(dt);
    at::Tensor dy = at::randn({T, I}).to(dt);
    const double n = double(T) * I * gate.element_size();
    // Forward: gate and up read, y written. Backward: dy, gate and up read, both gradients written.
    return both_passes(
        "silu_and_mul", dtype, {gate, up}, dy, 3 * n, 8 * n, n, 3 * n,
        [](const std::vector<at::Tensor>& in) { return kernmap::silu_and_mul(in[0], in[1]); },
        [](const std::vector<at::Tensor>& in) { return kernmap::reference::silu_and_mul(in[0], in[1]); });
  });
}

std::vector<CaseBuilder> silu_cases(const std::string& dtype, const ShapeFilter&) {
  return builders_of([dtype] {
    const at::ScalarType dt = dtype_of(dtype);
    const int64_t T = 4096, I = 18944;  // the gated MLP's gate at Qwen2-7B sizes
    at::Tensor x = at::randn({T, I}).to(dt);
    at::Tensor dy = at::randn({T, I}).to(dt);
    const double n = double(T) * I * x.element_size();
    // Forward: x read, y written. Backward: dy and x read, dx written.
    return both_passes(
        "silu", dtype, {x}, dy, 2 * n, 5 * n, n, 2 * n,
        [](const std::vector<at::Tensor>& in) { return kernmap::silu(in[0]); },
        [](const std::vector<at::Tensor>& in) { return kernmap::reference::silu(in[0]); });
  });
}

std::vector<CaseBuilder> swiglu_cases(const std::string& dtype, const ShapeFilter&) {
  return builders_of([dtype] {
    const at::ScalarType dt = dtype_of(dtype);
    const int64_t T = 4096, I = 18944;  // gate and up packed, as MoE experts store them
    at::Tensor gate_up = at::randn({T, 2 * I}).to(dt);
    at::Tensor dy = at::randn({T, I}).to(dt);
    const double n = double(T) * I * gate_up.element_size();
    // Forward: gate_up read (2n), y written. Backward: dy and gate_up read, the packed gradient written (2n).
    return both_passes(
        "swiglu", dtype, {gate_up}, dy, 3 * n, 8 * n, n, 3 * n,
        [](const std::vector<at::Tensor>& in) { return kernmap::swiglu(in[0]); },
        [](const std::vector<at::Tensor>& in) { return kernmap::reference::swiglu(in[0]); });
  });
}

}  // namespace kernmap::cli
