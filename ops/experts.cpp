// The Experts layer. kernmap::experts: a MoE layer's expert MLPs in the transformers 5.x layout, as
// sorted-token grouped products: sort the (token, slot) pairs by expert (a stable counting sort:
// deterministic), gather, grouped gate_up product, fused SiLU-and-mul, grouped down product, weighted combine
// in fp32. Forward, backward, Meta, autograd; its reference kernel (the eager loop) and the layer record.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "kernels/cpu/isa.h"
#include "kernmap/ops.h"
#include "ops/checks.h"
#include "ops/experts_transformers.h"
#include "ops/grouped_mm.h"
#include "ops/memory.h"

namespace kernmap::ops {
namespace {

constexpr const char* kOp = "experts";

struct Shapes {
  int64_t T, H, k, E, I;
};

Shapes check_experts(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                     const at::Tensor& gate_up, const at::Tensor& down) {
  check_floating(kOp, "hidden", hidden);
  check_floating(kOp, "topk_weights", topk_weights);
  check_same_dtype(kOp, "hidden", hidden, "gate_up_proj", gate_up);
  check_same_dtype(kOp, "hidden", hidden, "down_proj", down);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"topk_ids", topk_ids},
                                {"topk_weights", topk_weights},
                                {"gate_up_proj", gate_up},
                                {"down_proj", down}})
    check_same_device(kOp, "hidden", hidden, name, t);
  TORCH_CHECK(hidden.dim() == 2, "kernmap.experts: hidden must be 2-D [T, H], got ", hidden.sizes());
  const int64_t T = hidden.size(0), H = hidden.size(1);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T,
              "kernmap.experts: topk_ids must be [T, k] with T = ", T, ", got ", topk_ids.sizes());
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong || topk_ids.scalar_type() == at::kInt,
              "kernmap.experts: topk_ids must be int64 or int32, got ", topk_ids.scalar_type());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(),
              "kernmap.experts: topk_weights must have the shape of topk_ids ", topk_ids.sizes(), ", got ",
              topk_weights.sizes());
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(2) == H && gate_up.size(1) % 2 == 0,
              "kernmap.experts: gate_up_proj must be [E, 2I, H] with H = ", H, ", got ", gate_up.sizes());
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(down.dim() == 3 && down.size(0) == E && down.size(1) == H && down.size(2) == I,
              "kernmap.experts: down_proj must be [E, H, I] = [", E, ", ", H, ", ", I, "], got ",
              down.sizes());
  return {T, H, topk_ids.size(1), E, I};
}

// Stable counting sort of the flattened (token, slot) pairs by expert: order[j] is the flat index of the j-th
// pair in expert order, offs[e] the cumulative end of expert e's pairs. Pairs routed to the expert-parallel
// sentinel E come last, after offs[E-1] (ids were checked to be in [0, E]).
std::tuple<at::Tensor, at::Tensor> sort_by_expert(const at::Tensor& topk_ids, int64_t E) {
  const at::Tensor ids = topk_ids.reshape(-1).to(at::kLong).contiguous();
  const int64_t S = ids.numel();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  std::vector<int64_t> next(E + 2, 0);
  for (int64_t j = 0; j < S; ++j) ++next[id[j] + 1];
  at::Tensor offs = at::empty({E}, topk_ids.options().dtype(at::kInt));
  int32_t* o = offs.data_ptr<int32_t>();
  for (int64_t e = 0; e <= E; ++e) {
    next[e + 1] += next[e];
    if (e < E) o[e] = static_cast<int32_t>(next[e + 1]);
  }
  at::Tensor order = at::empty({S}, topk_ids.options().dtype(at::kLong));
  int64_t* ord = order.data_ptr<int64_t>();
  for (int64_t j = 0; j < S; ++j) ord[next[id[j]]++] = j;
  return {order, offs};
}

// The pairs that have an expert here: offs[E-1] (the rest, sorted last, went to the sentinel).
int64_t routed_pairs(const at::Tensor& offs) {
  return offs.numel() == 0 ? 0 : offs[-1].item<int64_t>();
}

// The grouped product of the routed rows a [R, K] (the pairs with an expert), followed by zero rows up to S:
// the sentinel pairs' rows, which then add nothing in the combines. Only calls with sentinels pay for the
// copy.
at::Tensor grouped_rows(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, int64_t S) {
  const at::Tensor routed = grouped_mm_cpu(a, b, offs);
  if (routed.size(0) == S) return routed;
  return at::cat({routed, at::zeros({S - routed.size(0), routed.size(1)}, routed.options())});
}

// The inverse permutation: position of flat pair j in expert order. order comes back from the caller in the
// backward, so it is checked to be a permutation of [0, S) (the combine kernels index rows with it).
at::Tensor inverse_permutation(const at::Tensor& order) {
  TORCH_CHECK(order.dim() == 1 && order.scalar_type() == at::kLong && order.is_contiguous(),
              "kernmap.experts: order must be a contiguous 1-D int64 tensor, got ", order.scalar_type(), " ",
              order.sizes());
  const int64_t S = order.numel();
  at::Tensor pos = at::full_like(order, -1);
  const int64_t* o = order.const_data_ptr<int64_t>();
  int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t j = 0; j < S; ++j) {
    TORCH_CHECK(o[j] >= 0 && o[j] < S && p[o[j]] < 0, "kernmap.experts: order must be a permutation of [0, ",
                S, "), got ", o[j], " at position ", j);
    p[o[j]] = j;
  }
  return pos;
}

// hidden's rows in expert order, in a buffer of the large-block cache.
at::Tensor gather_rows(const at::Tensor& hidden, const at::Tensor& token) {
  at::Tensor a = empty_large({token.size(0), hidden.size(1)}, hidden.options());
  return at::index_select_out(a, hidden, 0, token);
}

// The fp32 accumulation type of a dtype (fp64 for fp64).
at::ScalarType acc_type(at::ScalarType t) {
  return at::promote_types(at::kFloat, t);
}

// The fused paths below compute weight products in acc_type(rows); a float64 weight on lower-precision rows
// would make transformers' product float64, so such calls keep the ATen composition.
bool fusable(const at::Tensor& rows, const at::Tensor& weights) {
  return weights.scalar_type() != at::kDouble || rows.scalar_type() == at::kDouble;
}

// out[t] = sum over slots, in slot order, of rows[pos[t * k + slot]] * weights[pos[...]] (the product rounded
// to the rows' dtype unless the weights' dtype is wider, as transformers' `rows * weights`; no weights: the
// rows), accumulated in fp32 for reduced precision and rounded once to out_dtype: transformers' reshape + sum
// in one pass (the CPU kernel moe_combine), without gathered or widened copies; deterministic.
at::Tensor combine(const at::Tensor& rows, const at::Tensor& pos, int64_t T, int64_t k,
                   at::ScalarType out_dtype, const at::Tensor& weights = {}) {
  const int64_t H = rows.size(1);
  if (weights.defined() && !fusable(rows, weights)) {
    const at::Tensor weighted = rows * weights.unsqueeze(-1);
    return weighted.index_select(0, pos)
        .view({T, k, H})
        .sum(1, false, acc_type(weighted.scalar_type()))
        .to(out_dtype);
  }
  const at::Tensor r = rows.contiguous(), p = pos.contiguous();
  const at::ScalarType acc = acc_type(rows.scalar_type());
  const bool round_product =
      weights.defined() && at::promote_types(rows.scalar_type(), weights.scalar_type()) == rows.scalar_type();
  const at::Tensor w = weights.defined() ? weights.to(acc).contiguous() : at::Tensor();
  // The kernel writes the rows' dtype or the accumulation type; any other out_dtype is one cast of the
  // latter.
  const at::ScalarType written = out_dtype == rows.scalar_type() ? out_dtype : acc;
  at::Tensor out = at::empty({T, H}, rows.options().dtype(written));
  const auto& kern = cpu::kernel_table();
  const cpu::DType dt = cpu_dtype(r.scalar_type()), out_dt = cpu_dtype(written);
  const int64_t* pp = p.const_data_ptr<int64_t>();
  const void* wp = w.defined() ? w.const_data_ptr() : nullptr;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    kern.moe_combine(dt, out_dt, r.const_data_ptr(), pp, k, wp, round_product, out.data_ptr(), t0, t1, H);
  });
  return written == out_dtype ? out : out.to(out_dtype);
}

// The backward of the weighted combine, per row j of the expert order (token order[j] / k): the gradient of
// the weighted row, d_h2[j] = round(grad[token] * w[j]), and of the weight, d_w[j] = <grad[token], h2[j]>
// summed in fp32 (the CPU kernel moe_combine_bwd, in vector lanes: a fixed order). One pass over grad's rows
// in place of a gathered copy, two widened copies, a product and a sum.
std::tuple<at::Tensor, at::Tensor> combine_backward(const at::Tensor& grad, const at::Tensor& h2,
                                                    const at::Tensor& w, const at::Tensor& order, int64_t k) {
  const int64_t S = h2.size(0), H = h2.size(1);
  if (!fusable(h2, w)) {
    const at::Tensor g = grad.index_select(0, order.div(k, "floor"));
    const at::ScalarType acc = acc_type(h2.scalar_type());
    return {(g * w.unsqueeze(-1)).to(h2.scalar_type()), (g.to(acc) * h2.to(acc)).sum(-1).to(w.scalar_type())};
  }
  const at::Tensor g = grad.to(h2.scalar_type()).contiguous(), hc = h2.contiguous(), oc = order.contiguous();
  const at::Tensor wc = w.to(acc_type(h2.scalar_type())).contiguous();
  at::Tensor d_h2 = empty_large({S, H}, h2.options());
  at::Tensor d_w = at::empty({S}, wc.options());
  const auto& kern = cpu::kernel_table();
  const cpu::DType dt = cpu_dtype(hc.scalar_type());
  const int64_t* ord = oc.const_data_ptr<int64_t>();
  at::parallel_for(0, S, 16, [&](int64_t j0, int64_t j1) {
    kern.moe_combine_bwd(dt, g.const_data_ptr(), hc.const_data_ptr(), wc.const_data_ptr(), ord, k,
                         d_h2.data_ptr(), d_w.data_ptr(), j0, j1, H);
  });
  return {d_h2, d_w.to(w.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_cpu(
    const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const at::Tensor& gate_up, const at::Tensor& down) {
  const Shapes s = check_experts(hidden, topk_ids, topk_weights, gate_up, down);
  check_expert_ids(kOp, topk_ids, s.E);
  auto [order, offs] = sort_by_expert(topk_ids, s.E);
  const int64_t R = routed_pairs(offs);
  const int64_t S = s.T * s.k;
  const at::Tensor token = order.narrow(0, 0, R).div(s.k, "floor");
  const at::Tensor a = gather_rows(hidden, token);                                         // [R, H]
  const at::Tensor h1 = grouped_rows(a, gate_up.transpose(1, 2), offs, S);                 // [S, 2I]
  const at::Tensor act = kernmap::swiglu(h1);                                              // [S, I]
  const at::Tensor h2 = grouped_rows(act.narrow(0, 0, R), down.transpose(1, 2), offs, S);  // [S, H]
  at::Tensor w = topk_weights.reshape(-1).index_select(0, order);
  w.narrow(0, R, w.size(0) - R).zero_();  // sentinel pairs: a zero row times a zero weight adds +0
  const at::Tensor out = combine(h2, inverse_permutation(order), s.T, s.k, hidden.scalar_type(), w);
  return {out, order, offs, h1, h2};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& topk_weights,
    const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& order, const at::Tensor& offs,
    const at::Tensor& h1, const at::Tensor& h2, std::array<bool, 4> output_mask) {
  const int64_t T = hidden.size(0), k = topk_weights.size(1);
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == T && grad.size(1) == hidden.size(1),
              "kernmap.experts: grad must have the shape of hidden ", hidden.sizes(), ", got ", grad.sizes());
  TORCH_CHECK(h2.dim() == 2 && h2.size(0) == T * k && h2.size(1) == hidden.size(1) && order.numel() == T * k,
              "kernmap.experts: h2 must be [T * k, H] = [", T * k, ", ", hidden.size(1), "] and order [",
              T * k, "], got ", h2.sizes(), " and ", order.sizes());
  const at::Tensor pos = inverse_permutation(order);  // checks order before the kernels read rows with it
  const int64_t R = routed_pairs(offs);
  check_offs(kOp, offs, gate_up.size(0), R, h1);
  TORCH_CHECK(R <= T * k, "kernmap.experts: offs[-1] must be at most T * k = ", T * k, ", got ", R);
  at::Tensor w = topk_weights.reshape(-1).index_select(0, order);
  w.narrow(0, R, w.size(0) - R).zero_();
  // d(weighted row j) = grad_out[token of j] * w[j]; d topk_weights: <grad_out[t], h2 row>, in fp32 at least.
  // Sentinel pairs' weights get a zero gradient, as in eager, where they take no part.
  auto [d_h2, dw_sorted] = combine_backward(grad, h2, w, order, k);
  dw_sorted.narrow(0, R, dw_sorted.size(0) - R).zero_();
  // Only the gradients output_mask asks for (hidden, topk_weights, gate_up_proj, down_proj), and only the
  // products they need: frozen expert weights skip both weight-gradient products.
  const bool want_hidden = output_mask[0], want_gate_up = output_mask[2], want_down = output_mask[3];
  at::Tensor d_topk;
  if (output_mask[1]) {
    d_topk = at::empty({T * k}, topk_weights.options());
    d_topk.index_copy_(0, order, dw_sorted);
    d_topk = d_topk.view(topk_weights.sizes());
  }
  const at::Tensor d_h2_routed = d_h2.narrow(0, 0, R);
  at::Tensor d_down, d_gate_up, d_hidden;
  if (want_down) {
    const at::Tensor act = kernmap::swiglu(h1);
    d_down = grouped_weight_grad_cpu(d_h2_routed, act.narrow(0, 0, R), offs);  // [E, H, I]
  }
  if (want_hidden || want_gate_up) {
    const at::Tensor d_act = grouped_rows(d_h2_routed, down, offs, T * k);  // [S, I]
    static auto swiglu_bwd =
        op_handle<at::Tensor(const at::Tensor&, const at::Tensor&)>("kernmap::swiglu_backward");
    const at::Tensor d_h1 = swiglu_bwd.call(d_act, h1);  // [S, 2I]
    const at::Tensor d_h1_routed = d_h1.narrow(0, 0, R);
    if (want_hidden) {
      const at::Tensor d_a = grouped_rows(d_h1_routed, gate_up, offs, T * k);  // [S, H]
      d_hidden = combine(d_a, pos, T, k, hidden.scalar_type());
    }
    if (want_gate_up) {
      const at::Tensor a = gather_rows(hidden, order.narrow(0, 0, R).div(k, "floor"));
      d_gate_up = grouped_weight_grad_cpu(d_h1_routed, a, offs);  // [E, 2I, H]
    }
  }
  return {d_hidden, d_topk, d_gate_up, d_down};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_meta(
    const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const at::Tensor& gate_up, const at::Tensor& down) {
  const Shapes s = check_experts(hidden, topk_ids, topk_weights, gate_up, down);
  const int64_t S = s.T * s.k;
  return {at::empty({s.T, s.H}, hidden.options()), at::empty({S}, topk_ids.options().dtype(at::kLong)),
          at::empty({s.E}, topk_ids.options().dtype(at::kInt)), at::empty({S, 2 * s.I}, hidden.options()),
          at::empty({S, s.H}, hidden.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_meta(
    const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& topk_weights,
    const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& order, const at::Tensor& offs,
    const at::Tensor& h1, const at::Tensor& h2, std::array<bool, 4> output_mask) {
  auto like = [](bool want, const at::Tensor& t) {
    return want ? at::empty(t.sizes(), t.options()) : at::Tensor();
  };
  return {like(output_mask[0], hidden), like(output_mask[1], topk_weights), like(output_mask[2], gate_up),
          like(output_mask[3], down)};
}

at::Tensor experts_cpu(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& gate_up, const at::Tensor& down) {
  return std::get<0>(forward_cpu(hidden, topk_ids, topk_weights, gate_up, down));
}
at::Tensor experts_meta(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                        const at::Tensor& gate_up, const at::Tensor& down) {
  return std::get<0>(forward_meta(hidden, topk_ids, topk_weights, gate_up, down));
}

using Tensors5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Tensors4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

class ExpertsFunction : public torch::autograd::Function<ExpertsFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                            const at::Tensor& gate_up, const at::Tensor& down) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = op_handle<Tensors5(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const at::Tensor&, const at::Tensor&)>("kernmap::experts_forward");
    auto [out, order, offs, h1, h2] = op.call(hidden, topk_ids, topk_weights, gate_up, down);
    ctx->save_for_backward({hidden, topk_weights, gate_up, down, order, offs, h1, h2});
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static auto op =
        op_handle<Tensors4(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, std::array<bool, 4>)>("kernmap::experts_backward");
    const auto v = ctx->get_saved_variables();
    auto [dh, dw, dgu, dd] = op.call(grads[0], v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7],
                                     {ctx->needs_input_grad(0), ctx->needs_input_grad(2),
                                      ctx->needs_input_grad(3), ctx->needs_input_grad(4)});
    return {dh, at::Tensor(), dw, dgu, dd};
  }
};

at::Tensor experts_autograd(const at::Tensor& hidden, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, const at::Tensor& gate_up,
                            const at::Tensor& down) {
  return ExpertsFunction::apply(hidden, topk_ids, topk_weights, gate_up, down);
}

}  // namespace

TORCH_LIBRARY_IMPL(kernmap, CPU, m) {
  m.impl("experts", &experts_cpu);
  m.impl("experts_forward", &forward_cpu);
  m.impl("experts_backward", &backward_cpu);
}
TORCH_LIBRARY_IMPL(kernmap, Meta, m) {
  m.impl("experts", &experts_meta);
  m.impl("experts_forward", &forward_meta);
  m.impl("experts_backward", &backward_meta);
}
TORCH_LIBRARY_IMPL(kernmap, Autograd, m) {
  m.impl("experts", &experts_autograd);
}

}  // namespace kernmap::ops

// ---- reference kernels: the transformers eager math in ATen ops (any device, autograd through ATen) ----

namespace kernmap::reference {

// The eager experts loop of transformers 5.x (Qwen2MoeExperts.forward): per expert hit, gather its tokens in
// (slot, token) order, gate_up product, act(gate) * up, down product, routing weight, index_add. Ids equal to
// E (the expert-parallel sentinel) match no expert and are skipped; ids outside [0, E] are errors, as
// transformers' one_hot over E + 1 classes makes them.
at::Tensor experts(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   const at::Tensor& gate_up_proj, const at::Tensor& down_proj) {
  ops::check_expert_ids("reference_experts", topk_ids, gate_up_proj.size(0));
  at::Tensor out = at::zeros_like(hidden);
  const at::Tensor ids_by_slot = topk_ids.t();  // [k, T], as expert_mask[e] in transformers
  for (int64_t e = 0; e < gate_up_proj.size(0); ++e) {
    const at::Tensor hit = ids_by_slot.eq(e).nonzero();  // rows of (slot, token)
    if (hit.size(0) == 0) continue;
    const at::Tensor slot = hit.select(1, 0), token = hit.select(1, 1);
    const at::Tensor current = hidden.index_select(0, token);
    const auto gate_up = at::linear(current, gate_up_proj.select(0, e)).chunk(2, -1);
    at::Tensor h = at::silu(gate_up[0]) * gate_up[1];
    h = at::linear(h, down_proj.select(0, e));
    h = h * topk_weights.index({token, slot}).unsqueeze(-1);
    out = out.index_add(0, token, h.to(out.scalar_type()));
  }
  return out;
}

}  // namespace kernmap::reference

namespace kernmap::float64 {

// The reference loop from float64, rounded where it rounds (each product, the activation, the gated product,
// the routing weight's product) and summing the experts' rows exactly, rounded once: the most accurate
// kernel of the layer, what align's noise run binds (docs/training.md, "The verdict").
at::Tensor experts(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   const at::Tensor& gate_up_proj, const at::Tensor& down_proj) {
  const at::ScalarType dt = hidden.scalar_type();
  const at::ScalarType weighted_dt = at::promote_types(dt, topk_weights.scalar_type());
  auto rounded = [](const at::Tensor& t, at::ScalarType to) { return t.to(to).to(at::kDouble); };
  const at::Tensor h64 = hidden.to(at::kDouble), w64 = topk_weights.to(at::kDouble);
  at::Tensor out = at::zeros(hidden.sizes(), hidden.options().dtype(at::kDouble));
  const at::Tensor ids_by_slot = topk_ids.t();
  for (int64_t e = 0; e < gate_up_proj.size(0); ++e) {
    const at::Tensor hit = ids_by_slot.eq(e).nonzero();
    if (hit.size(0) == 0) continue;
    const at::Tensor slot = hit.select(1, 0), token = hit.select(1, 1);
    const at::Tensor current = h64.index_select(0, token);
    const auto gate_up =
        rounded(at::linear(current, gate_up_proj.select(0, e).to(at::kDouble)), dt).chunk(2, -1);
    at::Tensor h = rounded(rounded(at::silu(gate_up[0]), dt) * gate_up[1], dt);
    h = rounded(at::linear(h, down_proj.select(0, e).to(at::kDouble)), dt);
    h = rounded(h * w64.index({token, slot}).unsqueeze(-1), weighted_dt);
    out = out.index_add(0, token, h);
  }
  return out.to(dt);
}

}  // namespace kernmap::float64

namespace kernmap::ops {

TORCH_LIBRARY_IMPL(kernmap, CompositeImplicitAutograd, m) {
  m.impl("reference_experts", &kernmap::reference::experts);
  m.impl("float64_experts", &kernmap::float64::experts);
}

// The layer record: every kernel of the layer and where it is the default (DESIGN §2), registered at
// load.
// The eager loop finds each expert's tokens on the host: data-dependent, so the reference is not
// compile-safe.
const LayerRegistrar kExpertsLayer(
    "Experts",
    KernelDescriptor{.name = "reference/experts",
                     .devices = {"*"},
                     .dtypes = floating_dtypes(),
                     .has_backward = true,
                     .compile_safe = false,
                     .op = "kernmap::reference_experts",
                     .description = "transformers eager experts loop"},
    {{KernelDescriptor{
          .name = "kernmap/experts",
          .devices = {"cpu"},
          .dtypes = floating_dtypes(),
          .has_backward = true,
          .compile_safe = true,
          .op = "kernmap::experts",
          .description = "sorted-token grouped products, fused SiLU-and-mul, deterministic combine",
          .supports = needs_rank_at_least_1},
      /*default_on=*/{"cpu"}},
     {KernelDescriptor{
          .name = "float64/experts",
          .devices = {"*"},
          .dtypes = floating_dtypes(),
          .has_backward = true,
          .compile_safe = false,
          .op = "kernmap::float64_experts",
          .description = "the eager loop from float64, rounded where it rounds (align's noise run)"},
      /*default_on=*/{}},
     // transformers' own implementations, mapped nowhere by default: what ablate's original rows run
     // (ops/experts_transformers.cpp). Their ATen ops have Meta implementations, but the sort and histogram
     // sizes are data-dependent, as in transformers under torch.compile: not marked compile-safe.
     {KernelDescriptor{.name = "transformers/experts_grouped_mm",
                       .devices = {"*"},
                       .dtypes = {"float32", "bfloat16", "float16"},
                       .has_backward = true,
                       .compile_safe = false,
                       .op = "kernmap::transformers_experts_grouped_mm",
                       .description = "transformers' grouped_mm experts (its default): sorted pairs, "
                                      "torch._grouped_mm per projection",
                       .supports = transformers_experts::grouped_mm_supports},
      /*default_on=*/{}},
     {KernelDescriptor{.name = "transformers/experts_batched_mm",
                       .devices = {"*"},
                       .dtypes = floating_dtypes(),
                       .has_backward = true,
                       .compile_safe = false,
                       .op = "kernmap::transformers_experts_batched_mm",
                       .description = "transformers' batched_mm experts: a weight copy per (token, slot) "
                                      "pair, torch.bmm per projection"},
      /*default_on=*/{}}});

}  // namespace kernmap::ops

namespace kernmap {
at::Tensor experts(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   const at::Tensor& gate_up_proj, const at::Tensor& down_proj) {
  static auto op = ops::op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, const at::Tensor&)>("kernmap::experts");
  return op.call(hidden, topk_ids, topk_weights, gate_up_proj, down_proj);
}
}  // namespace kernmap
