// The cross-entropy rows of the fused linear cross-entropy, compiled once per instruction-set level: the
// log-sum-exp of each row of a chunk of logits, the loss at the row's label and, when asked, the softmax
// gradient written over the logits; and the same log-sum-exp by blocks of classes, for the loss alone
// (linear_cross_entropy without gradients takes the weight's rows a block at a time).
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/vec.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {
namespace {

// e^x for x <= 0 (the kernel's arguments are logits minus their maximum): 2^n e^r with n = round(x log2 e),
// r = x - n ln2 (ln2 in two parts), e^r = 1 + r + r^2 P(r) with Cephes' expf polynomial (about 1 ulp, and
// exactly 1 at 0, so that a row's maximum contributes exactly 1). 0 below -88, where e^x is under 6e-39:
// -inf logits contribute exactly 0, as in torch.
inline VF exp_block(VF x) {
  const float log2e = 1.44269504088896341f;
  const float ln2_hi = 0.693145751953125f;
  const float ln2_lo = 1.428606765330187e-06f;
  // -88 first, so that a NaN x passes through (as a select would let it, in four instructions at baseline).
  const VF xc = max_of(VF{} - 88.0f, x);
#if defined(__AVX512F__)
  const VF n = _mm512_roundscale_ps(xc * log2e, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  // Adding 1.5 * 2^23 rounds to an integer, which then sits in the low mantissa bits of t.
  const VF t = madd(xc, VF{} + log2e, VF{} + 12582912.0f);
  const VF n = t - 12582912.0f;
#endif
  VF r = nmadd(n, VF{} + ln2_hi, xc);
  r = nmadd(n, VF{} + ln2_lo, r);
  VF p = VF{} + 1.9875691500e-4f;
  p = madd(p, r, VF{} + 1.3981999507e-3f);
  p = madd(p, r, VF{} + 8.3334519073e-3f);
  p = madd(p, r, VF{} + 4.1665795894e-2f);
  p = madd(p, r, VF{} + 1.6666665459e-1f);
  p = madd(p, r, VF{} + 5.0000001201e-1f);
  p = madd(p, r * r, r) + 1.0f;
#if !defined(__AVX512F__)
  // t's bits are those of 1.5 * 2^23 plus n; shifted by 23 only n's bits survive, giving n as an exponent (n
  // >= -126 for normal results; smaller n, within 0.7 of -88, give 0 instead of a subnormal). Below -88 the
  // clamp gives n = -127, whose exponent field is 0: e is exactly 0 already, so no select (its four
  // instructions at baseline; a NaN x still gives NaN: docs/performance.md, "Fused loss's exponentials
  // kept").
  return p * (VF)(((VI)t + 127) << 23);
#else
  // vscalefps of n = -127 gives a subnormal, not 0: the lanes below -88 are zeroed.
  return x < -88.0f ? VF{} : _mm512_scalef_ps(p, n);
#endif
}
inline VD exp_block(VD x) {
  for (int j = 0; j < kBlock; ++j) x[j] = std::exp(x[j]);
  return x;
}
inline float exp_scalar(float x) {
  return exp_block(VF{} + x)[0];
}
inline double exp_scalar(double x) {
  return std::exp(x);
}

template <class V>
inline V max_block(V a, V b) {
  return b > a ? b : a;
}

// Independent accumulators of the row passes: the max and the sum are latency-bound otherwise.
constexpr int64_t kUnroll = 4;

// The maximum of z[0, V) in Acc, NaN if any value is NaN (a NaN never wins a comparison, so it is looked for
// apart).
template <class T>
Acc<T> row_max(const T* zr, int64_t V) {
  using A = Acc<T>;
  using W = Vec<A>;
  const int64_t Vb = V - V % kBlock;
  const int64_t Vu = V - V % (kBlock * kUnroll);
  W mx[kUnroll], bad{};
  for (auto& v : mx) v = W{} - std::numeric_limits<A>::infinity();
  for (int64_t i = 0; i < Vu; i += kBlock * kUnroll)
    for (int u = 0; u < kUnroll; ++u) {
      const W v = load<A>(zr + i + u * kBlock);
      mx[u] = max_block(mx[u], v);
      bad = v != v ? W{} + 1 : bad;
    }
  for (int64_t i = Vu; i < Vb; i += kBlock) {
    const W v = load<A>(zr + i);
    mx[0] = max_block(mx[0], v);
    bad = v != v ? W{} + 1 : bad;
  }
  A m = -std::numeric_limits<A>::infinity();
  bool has_nan = false;
  for (int u = 0; u < kUnroll; ++u)
    for (int j = 0; j < kBlock; ++j) m = std::max(m, mx[u][j]);
  for (int j = 0; j < kBlock; ++j) has_nan = has_nan || bad[j] != 0;
  for (int64_t i = Vb; i < V; ++i) {
    const A v = to_acc<A>(zr[i]);
    m = std::max(m, v);
    has_nan = has_nan || v != v;
  }
  return has_nan ? std::numeric_limits<A>::quiet_NaN() : m;
}

// sum_j e^(z_j - m) over z[0, V), for a finite m; with Keep, each e^(z_j - m) is also stored to e[j] (e may
// be z itself when T is Acc<T>). The same sums in the same order either way.
template <bool Keep = false, class T>
Acc<T> row_sum_exp(const T* zr, int64_t V, Acc<T> m, Acc<T>* e = nullptr) {
  using A = Acc<T>;
  using W = Vec<A>;
  const int64_t Vb = V - V % kBlock;
  const int64_t Vu = V - V % (kBlock * kUnroll);
  W sum[kUnroll] = {};
  const auto term = [&](int64_t i) {
    const W t = exp_block(load<A>(zr + i) - m);
    if constexpr (Keep) store(e + i, t);
    return t;
  };
  for (int64_t i = 0; i < Vu; i += kBlock * kUnroll)
    for (int u = 0; u < kUnroll; ++u) sum[u] += term(i + u * kBlock);
  for (int64_t i = Vu; i < Vb; i += kBlock) sum[0] += term(i);
  A s = lane_sum((sum[0] + sum[1]) + (sum[2] + sum[3]));
  for (int64_t i = Vb; i < V; ++i) {
    const A t = exp_scalar(to_acc<A>(zr[i]) - m);
    if constexpr (Keep) e[i] = t;
    s += t;
  }
  return s;
}

// Where the sum pass keeps a row's exponentials for the gradient pass: the row itself when its elements are
// the accumulation type, else a buffer of the thread's, grown to the longest row seen (V floats: 600 KB at
// V = 152K, read back from level 2 while the row is still there).
template <class T>
Acc<T>* kept_exps(T* zr, int64_t V) {
  if constexpr (std::is_same_v<T, Acc<T>>) {
    return zr;
  } else {
    thread_local std::vector<Acc<T>> buffer;
    if (static_cast<int64_t>(buffer.size()) < V) buffer.resize(static_cast<size_t>(V));
    return buffer.data();
  }
}

// Scalar math, for a row z[0, V) with label y, in Acc (bf16 and fp16 logits widen exactly):
//   m = max_j z_j; e_j = e^(z_j - m); ls = log(sum_j e_j); loss = -((z_y - m) - ls)
//   with grad, k = e^-ls * scale: z_j <- round_T(e_j * k), and z_y <- round_T(e_y * k - scale): the eager
//   log_softmax backward of nll_loss's -scale at the label (softmax_j = e_j / sum = e_j e^-ls).
// A row holding a NaN, or whose maximum is infinite, has no finite log-sum-exp: its loss and gradient are
// NaN, as the eager log_softmax makes them. Three passes over a row (max, sum of exponentials, gradient): a
// row of V = 152K fp32 logits is 600 KB, so the second and third read it from level 2. The gradient pass
// multiplies the exponentials the sum pass kept (kept_exps) instead of computing them again: the
// exponential is most of a pass's work, and where the level has no FMA (baseline) more than the pass's
// loads and stores (docs/performance.md, "Fused loss's exponentials kept").
template <class T>
void rows(T* z, int64_t ldz, int64_t V, const int64_t* target, Acc<T> scale, Acc<T>* loss, bool grad,
          int64_t r0, int64_t r1) {
  using A = Acc<T>;
  const A nan = std::numeric_limits<A>::quiet_NaN();
  const int64_t Vb = V - V % kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    T* zr = z + r * ldz;
    const int64_t y = target[r];
    const A zy = to_acc<A>(zr[y]);
    const A m = row_max(zr, V);
    if (!std::isfinite(m)) {
      loss[r] = nan;
      if (grad)
        for (int64_t i = 0; i < V; ++i) zr[i] = from_acc<T>(nan);
      continue;
    }
    if (!grad) {
      loss[r] = -((zy - m) - std::log(row_sum_exp(zr, V, m)));
      continue;
    }
    A* e = kept_exps(zr, V);
    const A ls = std::log(row_sum_exp<true>(zr, V, m, e));
    loss[r] = -((zy - m) - ls);
    // The gradient over the logits, then the label's own term.
    const A k = exp_scalar(-ls) * scale;
    const A ey = e[y];
    for (int64_t i = 0; i < Vb; i += kBlock) store(zr + i, load<A>(e + i) * k);
    for (int64_t i = Vb; i < V; ++i) zr[i] = from_acc<T>(e[i] * k);
    zr[y] = from_acc<T>(ey * k - scale);
  }
}

// One block of classes [v0, v0 + cols) of each row: the running maximum m[r] and sum s[r] = sum e^(z - m[r])
// over the blocks so far take this block's in (s rescaled by e^(old m - new m) when the maximum grows), and
// zy[r] takes the label's logit when the label is in the block. NaN is sticky in m (a NaN logit), and so is
// +inf (an infinite maximum); both leave s as it is. A row's only block gives the same m and s as rows'
// passes.
template <class T>
void block_rows(const T* z, int64_t ldz, int64_t cols, int64_t v0, const int64_t* target, Acc<T>* m,
                Acc<T>* s, Acc<T>* zy, int64_t r0, int64_t r1) {
  using A = Acc<T>;
  for (int64_t r = r0; r < r1; ++r) {
    const T* zr = z + r * ldz;
    const int64_t y = target[r] - v0;
    if (y >= 0 && y < cols) zy[r] = to_acc<A>(zr[y]);
    if (std::isnan(m[r]) || m[r] == std::numeric_limits<A>::infinity()) continue;
    const A mb = row_max(zr, cols);
    if (std::isnan(mb) || mb == std::numeric_limits<A>::infinity()) {
      m[r] = mb;
      continue;
    }
    if (mb == -std::numeric_limits<A>::infinity()) continue;  // e^-inf: the block adds nothing
    if (mb > m[r]) {
      s[r] = s[r] * std::exp(m[r] - mb) + row_sum_exp(zr, cols, mb);  // e^-inf = 0 for the first block
      m[r] = mb;
    } else {
      s[r] += row_sum_exp(zr, cols, m[r]);
    }
  }
}

}  // namespace

void cross_entropy_rows(DType dtype, void* z, int64_t ldz, int64_t V, const int64_t* target, double scale,
                        void* loss, bool grad, int64_t row_begin, int64_t row_end) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    rows<T>(static_cast<T*>(z), ldz, V, target, static_cast<A>(scale), static_cast<A*>(loss), grad, row_begin,
            row_end);
  });
}

void cross_entropy_block(DType dtype, const void* z, int64_t ldz, int64_t cols, int64_t v0,
                         const int64_t* target, void* max, void* sum, void* label_logit, int64_t row_begin,
                         int64_t row_end) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    block_rows<T>(static_cast<const T*>(z), ldz, cols, v0, target, static_cast<A*>(max), static_cast<A*>(sum),
                  static_cast<A*>(label_logit), row_begin, row_end);
  });
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
