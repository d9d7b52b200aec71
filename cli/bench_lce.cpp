// The fused linear cross-entropy cases of `kernmap bench ops`: the LM head and transformers' ForCausalLMLoss
// at Qwen2-0.5B (H 896, V 151936) and Qwen2-7B (H 3584, V 152064) with N = 2048 rows, every label counted or
// half the rows at ignore_index (SFT prompts), against the reference (the eager math, [N, V] logits) and the
// bare matrix products the loss needs (one forward, three for forward+backward).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "cli/bench.h"
#include "kernmap/ops.h"

namespace kernmap::cli {
namespace {

struct LceShape {
  int64_t N, H, V;
  bool half_ignored;
};
const LceShape kShapes[] = {
    {2048, 896, 151936, false}, {2048, 896, 151936, true}, {2048, 3584, 152064, false}};

std::string describe(const LceShape& s) {
  // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on "literal" + std::to_string(...).
  std::string out = "N";
  out += std::to_string(s.N);
  out += " H";
  out += std::to_string(s.H);
  out += " V";
  out += std::to_string(s.V);
  if (s.half_ignored) out += " half ignored";
  return out;
}

// Labels of 4 sequences of N / 4 tokens; with half_ignored the first half of each (its prompt) is -100.
at::Tensor labels_of(const LceShape& s) {
  at::Generator gen = at::detail::createCPUGenerator(1234);
  at::Tensor labels = at::randint(s.V, {s.N}, gen);
  if (s.half_ignored) labels.view({4, -1}).narrow(1, 0, s.N / 8).fill_(-100);
  return labels;
}

}  // namespace

std::vector<CaseBuilder> linear_cross_entropy_cases(const std::string& dtype, const ShapeFilter& wanted) {
  std::vector<CaseBuilder> out;
  for (const LceShape& s : kShapes)
    if (wanted(describe(s)))
      for (CaseBuilder& b : builders_of([s, dtype] {
             const at::ScalarType dt = dtype_of(dtype);
             // A final-norm output and a trained head's scale: logits of a few units.
             const at::Tensor hidden = at::randn({s.N, s.H}).to(dt);
             const at::Tensor weight = (at::randn({s.V, s.H}) * (2.0 / std::sqrt(double(s.H)))).to(dt);
             const at::Tensor labels = labels_of(s);
             const at::Tensor grad = at::ones({});
             const double e = hidden.element_size();
             // The rows the loss counts: an ignored row needs no product (the kernel skips it), so the floor
             // and the bare products take the counted rows only.
             const at::Tensor counted = labels.ne(-100).nonzero().squeeze(1);
             const at::Tensor hidden_counted = hidden.index_select(0, counted);
             const double product = 2.0 * static_cast<double>(counted.numel()) * s.H * s.V;
             auto kern = [](const std::vector<at::Tensor>& in) {
               return kernmap::linear_cross_entropy(in[0], in[1], in[2]);
             };
             auto ref = [](const std::vector<at::Tensor>& in) {
               return kernmap::reference::linear_cross_entropy(in[0], in[1], in[2]);
             };
             // The products alone, with the logits' gradient stood in by the logits.
             auto products = [](const std::vector<at::Tensor>& in) {
               const at::Tensor z = at::mm(in[0], in[1].t());
               return at::mm(z, in[1]).sum() + at::mm(z.t(), in[0]).sum();
             };
             const std::vector<at::Tensor> in = {hidden, weight, labels};
             const int reps = s.H > 1024 ? 3 : 5;  // seconds a repetition
             Case fwd{"linear_cross_entropy",      "fwd",   dtype, describe(s),
                      e * (s.N * s.H + s.V * s.H), product, reps,  {}};
             fwd.impls = {{"kernmap",
                           [=] {
                             at::NoGradGuard g;
                             kern(in);
                           }},
                          {"reference",
                           [=] {
                             at::NoGradGuard g;
                             ref(in);
                           }},
                          {"1 product", [=] {
                             at::NoGradGuard g;
                             at::mm(hidden_counted, weight.t());
                           }}};
             Case both{"linear_cross_entropy",
                       "fwd+bwd",
                       dtype,
                       describe(s),
                       e * (2 * s.N * s.H + 3 * s.V * s.H),
                       3 * product,
                       reps,
                       {}};
             both.impls = {{"kernmap", fwd_bwd(in, grad, kern)},
                           {"reference", fwd_bwd(in, grad, ref)},
                           {"3 products", [=] {
                              at::NoGradGuard g;
                              products({hidden_counted, weight});
                            }}};
             // The logits' products go through at::mm (oneDNN's bf16 GEMM at any level).
             fwd.level_bound_flops = both.level_bound_flops = false;
             fwd.written = 0;                       // a loss
             both.written = e * (s.N + s.V) * s.H;  // hidden's and weight's gradients
             return std::vector<Case>{fwd, both};
           }))
        out.push_back(std::move(b));
  return out;
}

}  // namespace kernmap::cli
