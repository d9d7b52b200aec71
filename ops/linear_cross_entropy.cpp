// kernmap::linear_cross_entropy: transformers' ForCausalLMLoss of a linear LM head without the [N, V] logits.
// Input checks, the CPU implementation (chunks of rows: BLAS products and the kernels/cpu cross-entropy
// rows), Meta shapes, and autograd: when gradients are needed the forward computes them (each chunk's logits
// become its softmax gradient in place, then feed the two gradient products), and the backward scales them by
// the loss's incoming gradient — three products in all, as in Liger's fused linear cross-entropy.
#include "ops/linear_cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/cpu/cache.h"
#include "kernels/cpu/isa.h"
#include "kernmap/ops.h"
#include "ops/checks.h"
#include "ops/memory.h"

namespace kernmap::ops {

void check_linear_cross_entropy(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& labels, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& num_items_in_batch) {
  check_floating(op, "hidden", hidden);
  TORCH_CHECK(hidden.dim() == 2, "kernmap.", op, ": hidden must be [N, H], got shape ", hidden.sizes());
  check_same_dtype(op, "hidden", hidden, "weight", weight);
  check_same_device(op, "hidden", hidden, "weight", weight);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden.size(1) && weight.size(0) >= 1, "kernmap.", op,
              ": weight must be [V, H] with V >= 1 and H = ", hidden.size(1),
              " (hidden's last dimension), got ", weight.sizes());
  check_same_device(op, "hidden", hidden, "labels", labels);
  TORCH_CHECK(labels.scalar_type() == at::kLong, "kernmap.", op, ": labels must be int64, got ",
              labels.scalar_type());
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == hidden.size(0), "kernmap.", op, ": labels must be [",
              hidden.size(0), "] (one per row of hidden), got shape ", labels.sizes());
  if (bias && bias->defined()) {
    check_same_dtype(op, "hidden", hidden, "bias", *bias);
    check_same_device(op, "hidden", hidden, "bias", *bias);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "kernmap.", op, ": bias must be [",
                weight.size(0), "] (weight's rows), got shape ", bias->sizes());
  }
  if (num_items_in_batch && num_items_in_batch->defined()) {
    const at::Tensor& n = *num_items_in_batch;
    TORCH_CHECK(n.numel() == 1, "kernmap.", op,
                ": num_items_in_batch must be a number (a tensor of one element), got shape ", n.sizes());
    TORCH_CHECK(!n.is_complex() && n.scalar_type() != at::kBool, "kernmap.", op,
                ": num_items_in_batch must be a real number, got ", n.scalar_type());
  }
}

namespace {

constexpr const char* kOp = "linear_cross_entropy";

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The loss's dtype: float32, float64 for float64 inputs (transformers upcasts float64 logits to float32; kept
// in float64 so that gradcheck measures the kernel, as for the other references).
at::ScalarType loss_dtype(const at::Tensor& hidden) {
  return acc_dtype(hidden.scalar_type());
}

const at::Tensor* defined(const std::optional<at::Tensor>& t) {
  return t && t->defined() ? &*t : nullptr;
}

// The rows that count (label != ignore_index) and their labels, in row order. Throws for any other label
// outside [0, V), naming the first.
struct Targets {
  std::vector<int64_t> row;
  std::vector<int64_t> label;
};

Targets targets_of(const at::Tensor& labels, int64_t ignore_index, int64_t V) {
  const at::Tensor l = labels.contiguous();
  const int64_t* p = l.const_data_ptr<int64_t>();
  Targets t;
  for (int64_t i = 0; i < l.numel(); ++i) {
    if (p[i] == ignore_index) continue;
    TORCH_CHECK(p[i] >= 0 && p[i] < V, "kernmap.linear_cross_entropy: labels[", i, "] = ", p[i],
                " is neither a class index in [0, ", V, ") (weight's rows) nor ignore_index (", ignore_index,
                ")");
    t.row.push_back(i);
    t.label.push_back(p[i]);
  }
  return t;
}

// A whole number >= 1 from the environment variable `name` (tests, tuning), or nullopt where unset.
std::optional<int64_t> env_count(const char* name, const char* what) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  char* end = nullptr;
  const long long count = std::strtoll(v, &end, 10);
  TORCH_CHECK(end != v && *end == '\0' && count >= 1, "kernmap: ", name, " must be a whole number of ", what,
              " >= 1, got '", v, "'");
  return count;
}

// Fewest rows of a chunk with gradients: the chunk's rows are the reduction of the weight gradient's product
// (z^T h_c) and the rows of the other two, and BLAS runs short ones well below its dense rate, while each
// chunk also streams the weight twice and its gradient in and out. 512 rows ran faster than 256 on the two
// CPU kinds measured, for 155 MB more buffer at V 151936 (docs/ops.md, "Fused linear cross-entropy").
constexpr int64_t kMinChunkRows = 512;
// And at least as many bytes of logits as 512 fp32 rows: 1024 rows for 16-bit products, whose chunk pays the
// same weight traffic (BLAS packing the weight for z W, the weight gradient read and written) beside products
// that can run several times the fp32 rate (bf16 on AMX tiles 6 % faster, neutral where oneDNN runs below the
// tiles; 155 MB more buffer at V 151936: docs/ops.md, "Fused linear cross-entropy").
constexpr int64_t kMinChunkBytesPerClass = kMinChunkRows * 4;

// Rows per chunk with gradients (docs/ops.md, "Fused linear cross-entropy"): as many as the last-level cache
// holds in logits, last-level cache / (V x element size) (the streaming threshold's cache size), and at least
// kMinChunkRows and kMinChunkBytesPerClass / element size. Without gradients, the rows of a pass over the
// weight: all counted rows, at most 4096 (the weight is streamed, and BLAS packs each block of it, once a
// pass: the more rows share that, the nearer the product runs to its dense rate; the bound keeps a gathered
// copy of the rows and the vocabulary block's logits small). KERNMAP_LCE_CHUNK_ROWS sets both (tests,
// tuning).
int64_t chunk_rows(int64_t V, int64_t element_size, bool grad) {
  if (const auto rows = env_count("KERNMAP_LCE_CHUNK_ROWS", "rows")) return *rows;
  const int64_t min_rows = std::max(kMinChunkRows, kMinChunkBytesPerClass / element_size);
  return grad ? std::max(min_rows, last_level_cache_bytes() / (V * element_size)) : 4096;
}

// Classes per block: a block of `rows` rows' logits fills the last-level cache, so that the next pass reads
// it back from there (without gradients the cross-entropy pass; with them, in the 16-bit products by blocks,
// the transpose and the product), at least 256 classes (narrower products run below the dense rate) and a
// whole number of 64. KERNMAP_LCE_VOCAB_BLOCK sets it (tests, tuning).
int64_t vocab_block(int64_t rows, int64_t element_size) {
  if (const auto cols = env_count("KERNMAP_LCE_VOCAB_BLOCK", "classes")) return *cols;
  return std::max<int64_t>(256, last_level_cache_bytes() / (rows * element_size) / 64 * 64);
}

// bf16 where torch's bf16 product is its scalar fallback (kernels/cpu/cache.h, bf16_gemm_native): the
// products in fp32 on fp32 copies of the operands, each result rounded to bf16 where the bf16 product's would
// be.
bool products_in_fp32(const at::Tensor& hidden) {
  return hidden.scalar_type() == at::kBFloat16 && !cpu::bf16_gemm_native();
}

// Counted rows [r0, r0 + c) of hidden (rows: the counted rows' indices): read in place when they are one run
// of consecutive rows, else gathered; widened to fp32 for the fp32 route.
struct RowChunk {
  bool run;
  at::Tensor idx, h;
};
RowChunk rows_of(const at::Tensor& hidden, const Targets& t, const at::Tensor& rows, int64_t r0, int64_t c,
                 bool in_fp32) {
  const bool run = t.row[r0 + c - 1] - t.row[r0] == c - 1;
  const at::Tensor idx = rows.narrow(0, r0, c);
  const at::Tensor h = run ? hidden.narrow(0, t.row[r0], c) : hidden.index_select(0, idx);
  return {run, idx, in_fp32 ? h.to(at::kFloat) : h};
}

// The bias as the products take it: fp32 in the fp32 route, undefined where there is none.
at::Tensor product_bias(const at::Tensor* bias, bool in_fp32) {
  return !bias ? at::Tensor() : in_fp32 ? bias->to(at::kFloat) : *bias;
}

// The loss of each counted row without gradients (evaluation): the logits by blocks of classes against
// passes of counted rows, each block's log-sum-exp folded into a running one per row (cross_entropy_block)
// while the block is still in the cache its product wrote it to; the weight (and in the fp32 route its fp32
// copy) goes block by block. No [rows, V] buffer: a pass holds rows x block logits. Faster than the gradient
// route's chunks and than one whole product (docs/ops.md, "Fused linear cross-entropy").
at::Tensor loss_by_vocab_blocks(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor* bias,
                                const Targets& t, at::ScalarType acc_t) {
  const int64_t n = static_cast<int64_t>(t.row.size()), H = hidden.size(1), V = weight.size(0);
  const at::TensorOptions acc = hidden.options().dtype(acc_t);
  at::Tensor max = at::full({n}, -std::numeric_limits<double>::infinity(), acc);
  at::Tensor sum = at::zeros({n}, acc), label_logit = at::empty({n}, acc);
  if (n == 0) return sum;
  const bool in_fp32 = products_in_fp32(hidden);
  const at::TensorOptions prod = in_fp32 ? hidden.options().dtype(at::kFloat) : hidden.options();
  const int64_t R = std::min(chunk_rows(V, hidden.element_size(), false), n);
  const int64_t B = std::min(vocab_block(R, at::elementSize(prod.dtype().toScalarType())), V);
  // Flat buffers, viewed as contiguous [rows, cols] blocks (a narrowed [R, B] view would make BLAS write
  // through a temporary).
  at::Tensor zp_buf = at::empty({R * B}, prod);
  at::Tensor z_buf = in_fp32 ? at::empty({R * B}, hidden.options()) : zp_buf;
  at::Tensor w_buf = in_fp32 ? at::empty({B, H}, prod) : at::Tensor();
  const at::Tensor b = product_bias(bias, in_fp32);
  const at::Tensor rows = at::from_blob(const_cast<int64_t*>(t.row.data()), {n}, at::kLong);
  const auto& k = cpu::kernel_table();
  const cpu::DType dt = cpu_dtype(hidden.scalar_type());
  const int64_t es = at::elementSize(acc_t);
  for (int64_t r0 = 0; r0 < n; r0 += R) {
    const int64_t c = std::min(R, n - r0);
    const at::Tensor hc = rows_of(hidden, t, rows, r0, c, in_fp32).h;
    for (int64_t v0 = 0; v0 < V; v0 += B) {
      const int64_t cols = std::min(B, V - v0);
      at::Tensor wb = weight.narrow(0, v0, cols);
      if (in_fp32) wb = w_buf.narrow(0, 0, cols).copy_(wb);
      at::Tensor zp = zp_buf.narrow(0, 0, c * cols).view({c, cols});
      if (b.defined()) {
        at::addmm_out(zp, b.narrow(0, v0, cols), hc, wb.t());
      } else {
        at::mm_out(zp, hc, wb.t());
      }
      const at::Tensor z = in_fp32 ? z_buf.narrow(0, 0, c * cols).view({c, cols}).copy_(zp) : zp;
      // Rows of a few thousand classes: small tasks stay on one thread.
      at::parallel_for(0, c, std::max<int64_t>(1, 32768 / cols), [&](int64_t a, int64_t e) {
        k.cross_entropy_block(dt, z.const_data_ptr(), cols, cols, v0, t.label.data() + r0,
                              static_cast<char*>(max.data_ptr()) + r0 * es,
                              static_cast<char*>(sum.data_ptr()) + r0 * es,
                              static_cast<char*>(label_logit.data_ptr()) + r0 * es, a, e);
      });
    }
  }
  // As cross_entropy_rows finishes a row (the same bits where one block holds every class): -((z_y - m) -
  // log(sum)), NaN where the maximum is not finite.
  at::Tensor loss = at::empty({n}, acc);
  auto finish = [&](auto zero) {
    using A = decltype(zero);
    const A *m = max.const_data_ptr<A>(), *s = sum.const_data_ptr<A>(), *zy = label_logit.const_data_ptr<A>();
    A* out = loss.data_ptr<A>();
    for (int64_t i = 0; i < n; ++i)
      out[i] = std::isfinite(m[i]) ? -((zy[i] - m[i]) - std::log(s[i])) : std::numeric_limits<A>::quiet_NaN();
  };
  if (acc_t == at::kDouble) {
    finish(0.0);
  } else {
    finish(0.0f);
  }
  return loss;
}

// The products with gradients by blocks of classes. BLAS runs h w^T, the logits, slower than w h^T (oneDNN's
// bf16 and fp16 products, MKL's fp32), and oneDNN runs z^T h, the weight gradient's product, with z^T a
// transposed view at about half the rate of the same product with z^T's rows contiguous (MKL's fp32 at the
// same rate either way) (docs/performance.md, "Fused loss's products by blocks of classes"); each goes a
// block of B classes at a time through a [B, rows] buffer that `transpose` empties into z or fills from z,
// while it is still in the cache. fp64 (gradcheck, tests) keeps the one products.
bool logits_by_class_blocks(const at::Tensor& hidden) {
  return hidden.scalar_type() == at::kFloat || (hidden.element_size() == 2 && !products_in_fp32(hidden));
}
bool weight_grad_by_class_blocks(const at::Tensor& hidden) {
  return hidden.element_size() == 2 && !products_in_fp32(hidden);
}

// The kernels' transpose of 2- or 4-byte words over the columns [0, cols) of src, split between threads by
// groups of 8 (a whole number of tiles' widths).
void transpose_words(int64_t element_bytes, const void* src, int64_t src_ld, void* dst, int64_t dst_ld,
                     int64_t rows, int64_t cols, bool stream) {
  const auto& k = cpu::kernel_table();
  at::parallel_for(
      0, (cols + 7) / 8, std::max<int64_t>(1, 4096 / std::max<int64_t>(rows, 1)), [&](int64_t a, int64_t e) {
        k.transpose(element_bytes, src, src_ld, dst, dst_ld, rows, a * 8, std::min(e * 8, cols), stream);
      });
}

// z [c, V] = hc w^T (+ b) as t = w[block] hc^T (+ b[block] per row of t), then z[:, block] = t^T.
void logits_by_blocks(const at::Tensor& z, const at::Tensor& hc, const at::Tensor& weight,
                      const at::Tensor& b, const at::Tensor& t_buf, int64_t B) {
  const int64_t c = z.size(0), V = z.size(1), es = z.element_size();
  const at::Tensor hct = hc.t();
  for (int64_t v0 = 0; v0 < V; v0 += B) {
    const int64_t n = std::min(B, V - v0);
    at::Tensor t = t_buf.narrow(0, 0, n * c).view({n, c});
    const at::Tensor wb = weight.narrow(0, v0, n);
    if (b.defined()) {
      at::addmm_out(t, b.narrow(0, v0, n).unsqueeze(1), wb, hct);
    } else {
      at::mm_out(t, wb, hct);
    }
    transpose_words(es, t.const_data_ptr(), c, static_cast<char*>(z.data_ptr()) + v0 * es, V, n, c, true);
  }
}

// gw = z^T hc (accumulate: gw += z^T hc) as gw[block] = t hc with t = z[:, block]^T.
void weight_grad_by_blocks(const at::Tensor& gw, const at::Tensor& z, const at::Tensor& hc,
                           const at::Tensor& t_buf, int64_t B, bool accumulate) {
  const int64_t c = z.size(0), V = z.size(1), es = z.element_size();
  for (int64_t v0 = 0; v0 < V; v0 += B) {
    const int64_t n = std::min(B, V - v0);
    at::Tensor t = t_buf.narrow(0, 0, n * c).view({n, c});
    transpose_words(es, static_cast<const char*>(z.const_data_ptr()) + v0 * es, V, t.data_ptr(), c, c, n,
                    false);
    at::Tensor out = gw.narrow(0, v0, n);
    if (accumulate) {
      out.addmm_(t, hc);
    } else {
      at::mm_out(out, t, hc);
    }
  }
}

// The counted rows' losses summed in row order in float64, then divided in the loss's dtype.
at::Tensor sum_over_rows(const at::Tensor& row_loss, double denominator, const at::Tensor& hidden,
                         at::ScalarType acc_t) {
  double sum = 0;
  const at::Tensor rl = row_loss.to(at::kDouble).contiguous();
  for (int64_t i = 0; i < rl.numel(); ++i) sum += rl.const_data_ptr<double>()[i];
  return at::scalar_tensor(sum, hidden.options().dtype(acc_t)) / denominator;
}

Grads forward_cpu(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                  const std::optional<at::Tensor>& bias_opt, int64_t ignore_index,
                  const std::optional<at::Tensor>& num_items_opt, std::array<bool, 3> output_mask) {
  check_linear_cross_entropy(kOp, hidden, weight, labels, bias_opt, num_items_opt);
  const at::Tensor* bias = defined(bias_opt);
  const at::Tensor* num_items = defined(num_items_opt);
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  const at::ScalarType acc_t = loss_dtype(hidden);
  const bool want_gh = output_mask[0], want_gw = output_mask[1], want_gb = output_mask[2] && bias;
  const bool grad = want_gh || want_gw || want_gb;

  const Targets t = targets_of(labels, ignore_index, V);
  const int64_t n = static_cast<int64_t>(t.row.size());
  // transformers divides the loss by the count (mean) or by num_items_in_batch, in the loss's dtype; the
  // gradient of each counted row's loss is then 1 / that (times the loss's incoming gradient, applied by the
  // backward).
  const double count = num_items ? num_items->item<double>() : static_cast<double>(n);
  const double denominator = acc_t == at::kFloat ? static_cast<double>(static_cast<float>(count)) : count;
  const double scale =
      acc_t == at::kFloat ? static_cast<double>(1.0f / static_cast<float>(denominator)) : 1.0 / denominator;

  if (!grad) {
    const at::Tensor row_loss = loss_by_vocab_blocks(hidden, weight, bias, t, acc_t);
    return {sum_over_rows(row_loss, denominator, hidden, acc_t), {}, {}, {}};
  }
  // The fp32 route (products_in_fp32): the three products' results rounded to bf16 where the bf16 product's
  // would be (the logits; the hidden gradient), the weight gradient summed over the chunks in fp32 and
  // rounded once. Costs fp32 copies of the weight and of its gradient (docs/ops.md, "Fused linear
  // cross-entropy").
  const bool in_fp32 = products_in_fp32(hidden);
  at::Tensor gh = want_gh ? at::zeros({N, H}, hidden.options()) : at::Tensor();
  // The weight gradient and the chunk buffer come from the large-block cache (ops/memory.h): a training step
  // asks for the same sizes again, and fresh memory costs a page fault per 4 KiB (docs/performance.md,
  // "Large-block cache and huge pages"). In the fp32 route the weight gradient is made after the loop.
  at::Tensor gw = want_gw && !in_fp32 ? empty_large({V, H}, weight.options()) : at::Tensor();
  at::Tensor gb_acc = want_gb ? at::zeros({V}, hidden.options().dtype(acc_t)) : at::Tensor();
  if (want_gw && !in_fp32 && n == 0) gw.zero_();
  at::Tensor row_loss = at::empty({n}, hidden.options().dtype(acc_t));

  // The products' element size: the fp32 route's buffers are fp32 (as fp32's chunks).
  const int64_t C = std::min(chunk_rows(V, products_in_fp32(hidden) ? 4 : hidden.element_size(), true), n);
  at::Tensor z_buf = empty_large({C, V}, hidden.options());
  const at::Tensor rows = at::from_blob(const_cast<int64_t*>(t.row.data()), {n}, at::kLong);
  const auto& k = cpu::kernel_table();
  const cpu::DType dt = cpu_dtype(hidden.scalar_type());
  at::Tensor w = in_fp32 ? weight.to(at::kFloat) : weight;
  at::Tensor wt = w.t();
  const at::Tensor b = product_bias(bias, in_fp32);
  at::Tensor gw_acc = want_gw && in_fp32 ? at::empty({V, H}, w.options()) : gw;
  at::Tensor z32_buf = in_fp32 ? at::empty({C, V}, w.options()) : at::Tensor();
  const bool z_by_blocks = logits_by_class_blocks(hidden), gw_by_blocks = weight_grad_by_class_blocks(hidden);
  const int64_t B =
      z_by_blocks ? std::min(vocab_block(std::max<int64_t>(C, 1), hidden.element_size()), V) : 0;
  at::Tensor t_buf = z_by_blocks ? at::empty({B * C}, hidden.options()) : at::Tensor();
  for (int64_t c0 = 0; c0 < n; c0 += C) {
    const int64_t c = std::min(C, n - c0);
    const auto [run, idx, hc] = rows_of(hidden, t, rows, c0, c, in_fp32);
    at::Tensor z = z_buf.narrow(0, 0, c);
    at::Tensor zp = in_fp32 ? z32_buf.narrow(0, 0, c) : z;  // the products' output
    if (z_by_blocks) {
      logits_by_blocks(z, hc, weight, b, t_buf, B);
    } else if (bias) {
      at::addmm_out(zp, b, hc, wt);
    } else {
      at::mm_out(zp, hc, wt);
    }
    if (in_fp32) z.copy_(zp);
    at::parallel_for(0, c, 1, [&](int64_t r0, int64_t r1) {
      k.cross_entropy_rows(dt, z.data_ptr(), V, V, t.label.data() + c0, scale,
                           static_cast<char*>(row_loss.data_ptr()) + c0 * row_loss.element_size(), grad, r0,
                           r1);
    });
    if (in_fp32) zp.copy_(z);  // the softmax gradient, as rounded to bf16 in place
    if (want_gh) {
      if (run && !in_fp32) {
        at::Tensor out = gh.narrow(0, t.row[c0], c);
        at::mm_out(out, z, weight);
      } else {
        gh.index_copy_(0, idx, at::mm(zp, w).to(gh.scalar_type()));
      }
    }
    if (want_gw && gw_by_blocks) {
      weight_grad_by_blocks(gw_acc, z, hc, t_buf, B, c0 > 0);
    } else if (want_gw) {
      if (c0 == 0) {
        at::mm_out(gw_acc, zp.t(), hc);
      } else {
        gw_acc.addmm_(zp.t(), hc);
      }
    }
    if (want_gb) gb_acc.add_(z.sum(0, /*keepdim=*/false, acc_t));
  }
  if (want_gw && in_fp32) {
    // The fp32 weight and logits go first: the route's peak is then the loop's (the fp32 weight, its fp32
    // gradient and the chunk buffers), not that and the bf16 gradient (bf16 fwd+bwd at N2048 H896 V151936:
    // 1603 MB before).
    w = wt = z32_buf = at::Tensor();
    gw = empty_large({V, H}, weight.options());
    if (n > 0) {
      gw.copy_(gw_acc);
    } else {
      gw.zero_();
    }
  }
  const at::Tensor loss = sum_over_rows(row_loss, denominator, hidden, acc_t);
  at::Tensor gb = want_gb ? gb_acc.to(hidden.scalar_type()) : at::Tensor();
  return {loss, gh, gw, gb};
}

Grads forward_meta(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                   const std::optional<at::Tensor>& bias_opt, int64_t ignore_index,
                   const std::optional<at::Tensor>& num_items_opt, std::array<bool, 3> output_mask) {
  check_linear_cross_entropy(kOp, hidden, weight, labels, bias_opt, num_items_opt);
  const at::Tensor* bias = defined(bias_opt);
  return {at::empty({}, hidden.options().dtype(loss_dtype(hidden))),
          output_mask[0] ? at::empty(hidden.sizes(), hidden.options()) : at::Tensor(),
          output_mask[1] ? at::empty(weight.sizes(), weight.options()) : at::Tensor(),
          output_mask[2] && bias ? at::empty(bias->sizes(), bias->options()) : at::Tensor()};
}

at::Tensor loss_cpu(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                    const std::optional<at::Tensor>& bias, int64_t ignore_index,
                    const std::optional<at::Tensor>& num_items) {
  return std::get<0>(
      forward_cpu(hidden, weight, labels, bias, ignore_index, num_items, {false, false, false}));
}
at::Tensor loss_meta(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                     const std::optional<at::Tensor>& bias, int64_t ignore_index,
                     const std::optional<at::Tensor>& num_items) {
  return std::get<0>(
      forward_meta(hidden, weight, labels, bias, ignore_index, num_items, {false, false, false}));
}

auto& forward_op() {
  static auto op = op_handle<Grads(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
      const std::optional<at::Tensor>&, std::array<bool, 3>)>("kernmap::linear_cross_entropy_forward");
  return op;
}

// grad * g, in place in g when both are plain tensors (g is the forward's saved gradient, used only here: a
// second backward through a retained graph then fails autograd's saved-tensor version check instead of seeing
// a scaled gradient), out of place when traced (fake or functional tensors, torch.compile).
at::Tensor scaled(const at::Tensor& g, const at::Tensor& grad) {
  if (!g.defined()) return g;
  if (at::isTensorSubclassLike(g) || at::isTensorSubclassLike(grad)) return g * grad.to(g.scalar_type());
  if (grad.item<double>() != 1.0) g.mul_(grad.to(g.scalar_type()));
  return g;
}

// bias and num_items_in_batch are optionals: an undefined tensor cannot be a custom Function's input.
class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& labels,
                            const std::optional<at::Tensor>& bias, int64_t ignore_index,
                            const std::optional<at::Tensor>& num_items, std::array<bool, 3> mask) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [loss, gh, gw, gb] = forward_op().call(hidden, weight, labels, bias, ignore_index, num_items, mask);
    ctx->save_for_backward({gh, gw, gb});
    return loss;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& grad = grads[0];
    return {scaled(saved[0], grad), scaled(saved[1], grad), at::Tensor(), scaled(saved[2], grad),
            at::Tensor(),           at::Tensor(),           at::Tensor()};
  }
};

at::Tensor loss_autograd(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                         const std::optional<at::Tensor>& bias, int64_t ignore_index,
                         const std::optional<at::Tensor>& num_items) {
  // Gradients are computed only for the inputs that need them, and only when autograd records.
  const bool on = at::GradMode::is_enabled();
  const at::Tensor* b = defined(bias);
  const std::array<bool, 3> mask = {on && hidden.requires_grad(), on && weight.requires_grad(),
                                    on && b && b->requires_grad()};
  return LinearCrossEntropyFunction::apply(hidden, weight, labels, bias, ignore_index, num_items, mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(kernmap, CPU, m) {
  m.impl("linear_cross_entropy", &loss_cpu);
  m.impl("linear_cross_entropy_forward", &forward_cpu);
}
TORCH_LIBRARY_IMPL(kernmap, Meta, m) {
  m.impl("linear_cross_entropy", &loss_meta);
  m.impl("linear_cross_entropy_forward", &forward_meta);
}
TORCH_LIBRARY_IMPL(kernmap, Autograd, m) {
  m.impl("linear_cross_entropy", &loss_autograd);
}

}  // namespace kernmap::ops

// ---- reference kernel: the transformers eager math in ATen ops (any device, autograd through ATen) ----

namespace kernmap::reference {

// transformers' ForCausalLMLoss (loss/loss_utils.py) of lm_head(hidden), labels already shifted: the logits
// in the input dtype, .float(), cross_entropy with ignore_index, mean, or sum / num_items_in_batch (cast to
// the loss's dtype, as an integer count is in transformers' division). float64 stays float64 (see rms_norm).
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                const std::optional<at::Tensor>& bias, int64_t ignore_index,
                                const std::optional<at::Tensor>& num_items_in_batch) {
  ops::check_linear_cross_entropy("reference_linear_cross_entropy", hidden, weight, labels, bias,
                                  num_items_in_batch);
  const at::Tensor logits =
      at::linear(hidden, weight, bias).to(at::promote_types(at::kFloat, hidden.scalar_type()));
  if (!num_items_in_batch || !num_items_in_batch->defined())
    return at::cross_entropy_loss(logits, labels, std::nullopt, at::Reduction::Mean, ignore_index);
  const at::Tensor sum =
      at::cross_entropy_loss(logits, labels, std::nullopt, at::Reduction::Sum, ignore_index);
  return sum / num_items_in_batch->reshape({}).to(sum.device(), sum.scalar_type());
}

}  // namespace kernmap::reference

namespace kernmap::float64 {

// The reference's math from float64, rounded where it rounds (the logits to the input dtype, the loss to its
// dtype) and nowhere else: align's noise run binds it (docs/training.md, "The verdict"). It holds the [N, V]
// logits in float64, as a run judged for correctness can afford.
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                const std::optional<at::Tensor>& bias, int64_t ignore_index,
                                const std::optional<at::Tensor>& num_items_in_batch) {
  ops::check_linear_cross_entropy("float64_linear_cross_entropy", hidden, weight, labels, bias,
                                  num_items_in_batch);
  const std::optional<at::Tensor> bias64 =
      bias && bias->defined() ? std::optional<at::Tensor>(bias->to(at::kDouble)) : std::nullopt;
  const at::Tensor logits = at::linear(hidden.to(at::kDouble), weight.to(at::kDouble), bias64)
                                .to(hidden.scalar_type())
                                .to(at::kDouble);
  const at::ScalarType loss_t = at::promote_types(at::kFloat, hidden.scalar_type());
  if (!num_items_in_batch || !num_items_in_batch->defined())
    return at::cross_entropy_loss(logits, labels, std::nullopt, at::Reduction::Mean, ignore_index).to(loss_t);
  const at::Tensor sum =
      at::cross_entropy_loss(logits, labels, std::nullopt, at::Reduction::Sum, ignore_index);
  return (sum / num_items_in_batch->reshape({}).to(sum.device(), at::kDouble)).to(loss_t);
}

}  // namespace kernmap::float64

namespace kernmap::ops {

TORCH_LIBRARY_IMPL(kernmap, CompositeImplicitAutograd, m) {
  m.impl("reference_linear_cross_entropy", &kernmap::reference::linear_cross_entropy);
  m.impl("float64_linear_cross_entropy", &kernmap::float64::linear_cross_entropy);
}

// The layer record (DESIGN §2), under transformers' name for the causal-LM loss of lm_head's output.
const LayerRegistrar kForCausalLMLossLayer(
    "ForCausalLMLoss",
    KernelDescriptor{
        .name = "reference/linear_cross_entropy",
        .devices = {"*"},
        .dtypes = floating_dtypes(),
        .has_backward = true,
        .compile_safe = true,
        .op = "kernmap::reference_linear_cross_entropy",
        .description = "transformers ForCausalLMLoss of lm_head(hidden) (ATen ops, [N, V] logits)"},
    {{KernelDescriptor{
          .name = "kernmap/linear_cross_entropy",
          .devices = {"cpu"},
          .dtypes = floating_dtypes(),
          .has_backward = true,
          .compile_safe = true,
          .op = "kernmap::linear_cross_entropy",
          .description = "LM head + cross-entropy by chunks of rows, gradients in the forward, no "
                         "[N, V] logits"},
      /*default_on=*/{"cpu"}},
     {KernelDescriptor{.name = "float64/linear_cross_entropy",
                       .devices = {"*"},
                       .dtypes = floating_dtypes(),
                       .has_backward = true,
                       .compile_safe = true,
                       .op = "kernmap::float64_linear_cross_entropy",
                       .description = "the reference's math from float64, rounded where it rounds (align's "
                                      "noise run)"},
      /*default_on=*/{}}});

}  // namespace kernmap::ops

namespace kernmap {
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                const std::optional<at::Tensor>& bias, int64_t ignore_index,
                                const std::optional<at::Tensor>& num_items_in_batch) {
  static auto op =
      ops::op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, int64_t, const std::optional<at::Tensor>&)>(
          "kernmap::linear_cross_entropy");
  return op.call(hidden, weight, labels, bias, ignore_index, num_items_in_batch);
}
}  // namespace kernmap
