// The MoE cases of `kernmap bench ops`: grouped_mm (the experts' gate_up product) against the reference loop,
// torch._grouped_mm and one dense product of equal FLOPs; the Experts layer against the reference loop.
// Shapes: Qwen3-30B-A3B-like (E = 128, k = 8, H = 2048, I = 768) at T = 256 and 2048, Qwen2-MoE-like (E = 60,
// k = 4, H = 2048, I = 1408) at T = 1024. Routing is uniform random top-k from a fixed seed.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstdio>

#include "cli/bench.h"
#include "kernmap/memory.h"
#include "kernmap/ops.h"

namespace kernmap::cli {
namespace {

struct MoeShape {
  int64_t E, k, H, I, T;
};
const MoeShape kShapes[] = {{128, 8, 2048, 768, 256}, {128, 8, 2048, 768, 2048}, {60, 4, 2048, 1408, 1024}};

std::string describe(const MoeShape& s) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "E%lld k%lld H%lld I%lld T%lld", static_cast<long long>(s.E),
                static_cast<long long>(s.k), static_cast<long long>(s.H), static_cast<long long>(s.I),
                static_cast<long long>(s.T));
  return buf;
}

// Each token picks k distinct experts uniformly (a random permutation's first k), as a trained router would
// on average.
at::Tensor routing(const MoeShape& s) {
  at::Generator gen = at::detail::createCPUGenerator(1234);
  return std::get<1>(at::rand({s.T, s.E}, gen).sort(-1)).slice(1, 0, s.k).contiguous();
}

at::Tensor offsets_of(const at::Tensor& ids, int64_t E) {
  return at::bincount(ids.reshape(-1), {}, E).cumsum(0).to(at::kInt);
}

// The layer's weights at a trained model's scale, so activations stay O(1). Expert weights (3-D) are set up
// as kernelize sets up those of the experts layers it maps: on 2 MiB pages (kernmap/memory.h). Every
// implementation of a case reads the same tensors.
at::Tensor weights(std::vector<int64_t> shape, int64_t fan_in, at::ScalarType dt) {
  at::Tensor w = (at::randn(shape) * (1.0 / std::sqrt(double(fan_in)))).to(dt);
  if (w.dim() == 3) (void)advise_huge_pages(w);
  return w;
}

}  // namespace

std::vector<CaseBuilder> grouped_mm_cases(const std::string& dtype, const ShapeFilter& wanted) {
  std::vector<CaseBuilder> out;
  for (const MoeShape& s : kShapes)
    if (wanted(describe(s)))
      for (CaseBuilder& b : builders_of(
               [s, dtype] {
                 const at::ScalarType dt = dtype_of(dtype);
                 const int64_t S = s.T * s.k, N = 2 * s.I;
                 const at::Tensor offs = offsets_of(routing(s), s.E);
                 const at::Tensor a = at::randn({S, s.H}).to(dt);
                 const at::Tensor w =
                     weights({s.E, N, s.H}, s.H, dt);  // gate_up_proj layout; b is its transposed view
                 const at::Tensor dense_b = weights({s.H, N}, s.H, dt);
                 const at::Tensor dy = at::randn({S, N}).to(dt);
                 const double e = a.element_size();
                 const double fwd_bytes = e * (S * s.H + s.E * N * s.H + S * N);
                 const double flops = 2.0 * S * s.H * N;
                 auto kern = [](const std::vector<at::Tensor>& in) {
                   return kernmap::grouped_mm(in[0], in[1].transpose(1, 2), in[2]);
                 };
                 auto ref = [](const std::vector<at::Tensor>& in) {
                   return kernmap::reference::grouped_mm(in[0], in[1].transpose(1, 2), in[2]);
                 };
                 auto dense = [](const std::vector<at::Tensor>& in) { return at::mm(in[0], in[1]); };
                 Case fwd{"grouped_mm", "fwd", dtype, describe(s), fwd_bytes, flops, 5, {}};
                 fwd.impls = {{"kernmap",
                               [=] {
                                 at::NoGradGuard g;
                                 kern({a, w, offs});
                               }},
                              {"reference",
                               [=] {
                                 at::NoGradGuard g;
                                 ref({a, w, offs});
                               }},
                              {"torch._grouped_mm",
                               [=] {
                                 at::NoGradGuard g;
                                 at::_grouped_mm(a, w.transpose(1, 2), offs);
                               }},
                              {"dense", [=] {
                                 at::NoGradGuard g;
                                 dense({a, dense_b});
                               }}};
                 // torch._grouped_mm's CPU backward fails in torch 2.15 ("Invalid strides/sizes"), so it is
                 // timed forward only. fwd+bwd: the forward's bytes, then the backward reads grad, b and a
                 // again and writes a's and b's gradients (b is far larger than any cache: its second read is
                 // memory traffic too).
                 Case both{"grouped_mm",
                           "fwd+bwd",
                           dtype,
                           describe(s),
                           2 * fwd_bytes + e * S * s.H + e * s.E * N * s.H,
                           3 * flops,
                           3,
                           {}};
                 both.impls = {{"kernmap", fwd_bwd({a, w, offs}, dy, kern)},
                               {"reference", fwd_bwd({a, w, offs}, dy, ref)},
                               {"dense", fwd_bwd({a, dense_b}, dy, dense)}};
                 // The weights frozen (LoRA fine-tuning): the backward is `grad @ W` alone, reading grad and
                 // b and writing a's gradient. Aliases of their own (detach), so the case above keeps
                 // trainable ones.
                 const std::vector<bool> frozen_weights = {true, false, false};
                 Case frozen{"grouped_mm",  "fwd+bwd-frozen", dtype, describe(s),
                             2 * fwd_bytes, 2 * flops,        3,     {}};
                 frozen.impls = {{"kernmap", fwd_bwd({a, w.detach(), offs}, dy, kern, frozen_weights)},
                                 {"reference", fwd_bwd({a, w.detach(), offs}, dy, ref, frozen_weights)},
                                 {"dense", fwd_bwd({a, dense_b.detach()}, dy, dense, {true, false})}};
                 // Written: the output; the backward's a and b gradients (a's alone, frozen).
                 fwd.written = e * S * N;
                 both.written = e * (S * N + S * s.H + s.E * N * s.H);
                 frozen.written = e * (S * N + S * s.H);
                 return std::vector<Case>{fwd, both, frozen};
               },
               3))
        out.push_back(std::move(b));
  return out;
}

std::vector<CaseBuilder> experts_cases(const std::string& dtype, const ShapeFilter& wanted) {
  std::vector<CaseBuilder> out;
  for (const MoeShape& s : kShapes)
    if (wanted(describe(s)))
      for (CaseBuilder& b : builders_of(
               [s, dtype] {
                 const at::ScalarType dt = dtype_of(dtype);
                 const at::Tensor ids = routing(s);
                 const at::Tensor topk_w = at::rand({s.T, s.k}).softmax(-1).to(dt);
                 const at::Tensor hidden = at::randn({s.T, s.H}).to(dt);
                 const at::Tensor gate_up = weights({s.E, 2 * s.I, s.H}, s.H, dt);
                 const at::Tensor down = weights({s.E, s.H, s.I}, s.I, dt);
                 const at::Tensor dy = at::randn({s.T, s.H}).to(dt);
                 const double e = hidden.element_size();
                 const double weight_bytes = e * s.E * 3.0 * s.I * s.H;
                 const double act_bytes = e * 2.0 * s.T * s.H;
                 const double flops = 6.0 * s.T * s.k * s.H * s.I;
                 auto kern = [](const std::vector<at::Tensor>& in) {
                   return kernmap::experts(in[0], in[1], in[2], in[3], in[4]);
                 };
                 auto ref = [](const std::vector<at::Tensor>& in) {
                   return kernmap::reference::experts(in[0], in[1], in[2], in[3], in[4]);
                 };
                 Case fwd{"experts", "fwd", dtype, describe(s), weight_bytes + act_bytes, flops, 5, {}};
                 fwd.impls = {{"kernmap",
                               [=] {
                                 at::NoGradGuard g;
                                 kern({hidden, ids, topk_w, gate_up, down});
                               }},
                              {"reference", [=] {
                                 at::NoGradGuard g;
                                 ref({hidden, ids, topk_w, gate_up, down});
                               }}};
                 // fwd+bwd reads the weights in the forward and again in the backward (far larger than any
                 // cache), writes their gradients, and moves the activations and their gradients.
                 Case both{"experts", "fwd+bwd", dtype, describe(s), 3 * weight_bytes + 2 * act_bytes,
                           3 * flops, 3,         {}};
                 both.impls = {{"kernmap", fwd_bwd({hidden, ids, topk_w, gate_up, down}, dy, kern)},
                               {"reference", fwd_bwd({hidden, ids, topk_w, gate_up, down}, dy, ref), 1}};
                 // The expert weights frozen (LoRA fine-tuning): gradients for the hidden states and the
                 // routing weights only. Reads the weights in the forward and in the backward's two
                 // input-gradient products; writes no weight gradient. The weights are aliases of their own
                 // (detach), so the case above keeps its trainable ones.
                 const std::vector<bool> frozen_weights = {true, false, true, false, false};
                 const std::vector<at::Tensor> frozen_in = {hidden.detach(), ids, topk_w.detach(),
                                                            gate_up.detach(), down.detach()};
                 Case frozen{"experts",
                             "fwd+bwd-frozen",
                             dtype,
                             describe(s),
                             2 * weight_bytes + 2 * act_bytes,
                             2 * flops,
                             3,
                             {}};
                 frozen.impls = {{"kernmap", fwd_bwd(frozen_in, dy, kern, frozen_weights)},
                                 {"reference", fwd_bwd(frozen_in, dy, ref, frozen_weights), 1}};
                 // Written: the output; the hidden states' gradient, and the weights' gradients unless
                 // frozen.
                 fwd.written = e * s.T * s.H;
                 both.written = weight_bytes + 2 * e * s.T * s.H;
                 frozen.written = 2 * e * s.T * s.H;
                 return std::vector<Case>{fwd, both, frozen};
               },
               3))
        out.push_back(std::move(b));
  return out;
}

}  // namespace kernmap::cli
