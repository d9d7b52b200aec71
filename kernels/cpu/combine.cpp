// The MoE combine (each token's expert rows, weighted, summed in slot order) and its backward, compiled once
// per instruction-set level. One pass over the rows each way, accumulators in registers.
#include "kernels/cpu/vec.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {
namespace {

// What a row contributes: itself, times its weight, or times its weight rounded to the element type.
enum class Term { kRow, kWeighted, kRounded };

template <Term M, class T, class V, class A>
inline V term(V r, A w) {
  if constexpr (M == Term::kRow) {
    return r;
  } else if constexpr (M == Term::kWeighted) {
    return r * w;
  } else {
    return round_block<T>(r * w);
  }
}
template <Term M, class T, class A>
inline A term_scalar(A r, A w) {
  if constexpr (M == Term::kRow) {
    return r;
  } else if constexpr (M == Term::kWeighted) {
    return r * w;
  } else {
    return round_to<T>(r * w);
  }
}

// Scalar math, per token t and element h (j_s = pos[t * k + s]):
//   acc = +0; for s < k: acc += term(rows[j_s][h], w[j_s]); out[t][h] = round_O(acc)
// Starting from +0 keeps a sum of negative zeros +0, as the eager sum does. Two blocks per step, each
// element's sum still in slot order.
template <Term M, class T, class O>
void combine_rows(const T* rows, const int64_t* pos, int64_t k, const Acc<T>* w, O* out, int64_t t0,
                  int64_t t1, int64_t H) {
  using A = Acc<T>;
  using V = Vec<A>;
  const A one = 1;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t* p = pos + t * k;
    O* o = out + t * H;
    int64_t i = 0;
    for (; i + 2 * kBlock <= H; i += 2 * kBlock) {
      V a0{}, a1{};
      for (int64_t s = 0; s < k; ++s) {
        const T* r = rows + p[s] * H + i;
        const A ws = M == Term::kRow ? one : w[p[s]];
        a0 += term<M, T>(load<A>(r), ws);
        a1 += term<M, T>(load<A>(r + kBlock), ws);
      }
      store(o + i, a0);
      store(o + i + kBlock, a1);
    }
    if (i + kBlock <= H) {
      V a0{};
      for (int64_t s = 0; s < k; ++s)
        a0 += term<M, T>(load<A>(rows + p[s] * H + i), M == Term::kRow ? one : w[p[s]]);
      store(o + i, a0);
      i += kBlock;
    }
    for (; i < H; ++i) {
      A a = 0;
      for (int64_t s = 0; s < k; ++s)
        a += term_scalar<M, T>(to_acc<A>(rows[p[s] * H + i]), M == Term::kRow ? one : w[p[s]]);
      o[i] = from_acc<O>(a);
    }
  }
}

inline VF fused_madd(VF a, VF b, VF c) {
  return madd(a, b, c);
}
inline VD fused_madd(VD a, VD b, VD c) {
  return a * b + c;
}

// Scalar math, per row j (g = grad[order[j] / k]):
//   d_rows[j][h] = round_T(g[h] * w[j]);  d_w[j] = sum over h of g[h] * rows[j][h]
// d_rows is element-wise, the same bits as the scalar math. d_w is summed in vector lanes: two block
// accumulators (fused multiply-add where the level has it) over whole blocks, added lane-wise, their lanes
// summed in lane order, then the tail elements in order. A fixed order for a given level and H, so the same
// bits across runs and thread counts; not element order, so it differs from a sequential fp32 sum within the
// usual fp32 summation bound.
template <class T>
void combine_bwd_rows(const T* grad, const T* rows, const Acc<T>* w, const int64_t* order, int64_t k,
                      T* d_rows, Acc<T>* d_w, int64_t j0, int64_t j1, int64_t H) {
  using A = Acc<T>;
  using V = Vec<A>;
  for (int64_t j = j0; j < j1; ++j) {
    const T* g = grad + (order[j] / k) * H;
    const T* r = rows + j * H;
    T* d = d_rows + j * H;
    const A wj = w[j];
    V s0{}, s1{};
    int64_t i = 0;
    for (; i + 2 * kBlock <= H; i += 2 * kBlock) {
      const V g0 = load<A>(g + i), g1 = load<A>(g + i + kBlock);
      store(d + i, g0 * wj);
      store(d + i + kBlock, g1 * wj);
      s0 = fused_madd(g0, load<A>(r + i), s0);
      s1 = fused_madd(g1, load<A>(r + i + kBlock), s1);
    }
    if (i + kBlock <= H) {
      const V g0 = load<A>(g + i);
      store(d + i, g0 * wj);
      s0 = fused_madd(g0, load<A>(r + i), s0);
      i += kBlock;
    }
    A dot = lane_sum(s0 + s1);
    for (; i < H; ++i) {
      const A gv = to_acc<A>(g[i]);
      d[i] = from_acc<T>(gv * wj);
      dot += gv * to_acc<A>(r[i]);
    }
    d_w[j] = dot;
  }
}

}  // namespace

void moe_combine(DType dtype, DType out_dtype, const void* rows, const int64_t* pos, int64_t k,
                 const void* weights, bool round_product, void* out, int64_t t_begin, int64_t t_end,
                 int64_t H) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    auto run = [&](auto out_tag) {
      using O = decltype(out_tag);
      const T* r = static_cast<const T*>(rows);
      const A* w = static_cast<const A*>(weights);
      O* o = static_cast<O*>(out);
      if (w == nullptr) {
        combine_rows<Term::kRow, T>(r, pos, k, w, o, t_begin, t_end, H);
      } else if (round_product) {
        combine_rows<Term::kRounded, T>(r, pos, k, w, o, t_begin, t_end, H);
      } else {
        combine_rows<Term::kWeighted, T>(r, pos, k, w, o, t_begin, t_end, H);
      }
    };
    if (out_dtype == dtype) {
      run(T{});
    } else {
      run(A{});
    }
  });
}

void moe_combine_bwd(DType dtype, const void* grad, const void* rows, const void* weights,
                     const int64_t* order, int64_t k, void* d_rows, void* d_weights, int64_t row_begin,
                     int64_t row_end, int64_t H) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    combine_bwd_rows<T>(static_cast<const T*>(grad), static_cast<const T*>(rows),
                        static_cast<const A*>(weights), order, k, static_cast<T*>(d_rows),
                        static_cast<A*>(d_weights), row_begin, row_end, H);
  });
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
