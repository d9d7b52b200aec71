// SiLU and SiLU-and-mul forward and backward, compiled once per instruction-set level. One pass over the data
// each way; the eager module's intermediate roundings are reproduced so low-precision results match it.
#include "kernels/cpu/silu_tables.h"
#include "kernels/cpu/vec.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {
namespace {

// SiLU of a block or a scalar whose result is rounded to T: bf16's by silu_bf16_of (vec.h: a shorter exp at
// the AVX-512 levels, the same bf16 bits for every input), other types' by silu_of and silu_scalar.
template <class T, class V>
inline V silu_rounded_to(V x) {
  if constexpr (std::is_same_v<T, BFloat16>)
    return silu_bf16_of(x);
  else if constexpr (std::is_arithmetic_v<V>)
    return silu_scalar(x);
  else
    return silu_of(x);
}

// Scalar math: y = round(x / (1 + exp(-x)))
template <bool Stream, class T>
void silu_rows(const T* x, int64_t xs, T* y, int64_t r0, int64_t r1, int64_t n) {
  using A = Acc<T>;
  if constexpr (kTabledSilu<T>) {
    const SiluTables& t = silu_tables();
    alignas(64) T e[kChunk];
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * xs;
      T* yr = y + r * n;
      tabled_row(
          n, [&](int64_t c, int64_t m) { look_up_silu(xr + c, m, t.silu, e); },
          [&](int64_t c, auto j) {
            fetch_ahead(xr + c + j);
            copy_pair<Stream>(yr + c + j, e + j);
          },
          [&](int64_t c, auto j) {
            fetch_ahead(xr + c + j);
            std::memcpy(yr + c + j, e + j, kBlock * sizeof(T));
          },
          [&](int64_t c, int64_t j) { yr[c + j] = e[j]; });
    }
    return;
  }
  const int64_t nb = n - n % kBlock;
  const SiluTables* gt = gathered_tables<T>();  // null: no gathers
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * xs;
    T* yr = y + r * n;
    int64_t i = paired_bf16_blocks<T>(nb, [&](auto p) {
      VF v[2];
      fetch_ahead(xr + p);
      load_bf16_pair(xr + p, v[0], v[1]);
      store_bf16_pair<Stream>(yr + p, silu_rounded_to<T>(v[0]), silu_rounded_to<T>(v[1]));
    });
    if constexpr (kGatherable<T>) {
#if defined(__AVX512F__)
      // 32 gates a step in even and odd lanes (no shuffle), then a block of 16.
      for (; gt && i + 2 * kBlock <= nb; i += 2 * kBlock) {
        fetch_ahead(xr + i);
        __m512i even, odd;
        gate_indices_eo(xr + i, even, odd);
        store_words_32<Stream>(yr + i, gather_silu_packed_eo(even, odd, gt->silu));
      }
#endif
      for (; gt && i < nb; i += kBlock) {
        fetch_ahead(xr + i);
        store_packed_block<Stream>(yr + i, gather_silu_packed(gate_indices(xr + i), gt->silu));
      }
    }
    for (; i < nb; i += kBlock) {
      fetch_ahead(xr + i);
      auto v = load<A>(xr + i);
      store_out<Stream>(yr + i, silu_rounded_to<T>(v));
    }
    for (int64_t i = nb; i < n; ++i) {
      A v = to_acc<A>(xr[i]);
      yr[i] = from_acc<T>(silu_rounded_to<T>(v));
    }
  }
}

// dsilu(x) = sigmoid(x) * (1 + x * (1 - sigmoid(x)))
template <class V>
inline V dsilu(V x) {
  V s = sigmoid(x);
  return s * (1 + x * (1 - s));
}
template <class A>
inline A dsilu_scalar(A x) {
  A s = sigmoid_scalar(x);
  return s * (1 + x * (1 - s));
}

// Scalar math: dx = round(dy * dsilu(x))
template <bool Stream, class T>
void silu_bwd_rows(const T* dy, int64_t dys, const T* x, int64_t xs, T* dx, int64_t r0, int64_t r1,
                   int64_t n) {
  using A = Acc<T>;
  if constexpr (kTabledSilu<T>) {
    const SiluTables& t = silu_tables();
    alignas(64) GradEntry e[kChunk];
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * xs;
      const T* dyr = dy + r * dys;
      T* dxr = dx + r * n;
      tabled_row(
          n, [&](int64_t c, int64_t m) { look_up_grad(xr + c, m, t.grad, e); },
          [&](int64_t c, auto j) {
            VF d[2], f[2], unused[2];
            fetch_ahead(xr + c + j);
            fetch_ahead(dyr + c + j);
            load_bf16_pair(dyr + c + j, d[0], d[1]);
            load_grad_pair(e + j, f, unused);
            store_bf16_pair<Stream>(dxr + c + j, d[0] * f[0], d[1] * f[1]);
          },
          [&](int64_t c, auto j) {
            VF f, unused;
            fetch_ahead(xr + c + j);
            fetch_ahead(dyr + c + j);
            load_grad_block(e + j, f, unused);
            store_out<Stream>(dxr + c + j, load<A>(dyr + c + j) * f);
          },
          [&](int64_t c, int64_t j) { dxr[c + j] = from_acc<T>(to_acc<A>(dyr[c + j]) * e[j].dsilu); });
    }
    return;
  }
  const int64_t nb = n - n % kBlock;
  const SiluTables* gt = gathered_tables<T>();  // null: no gathers
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * xs;
    const T* dyr = dy + r * dys;
    T* dxr = dx + r * n;
    int64_t i = paired_bf16_blocks<T>(nb, [&](auto p) {
      VF d[2], v[2];
      fetch_ahead(dyr + p);
      fetch_ahead(xr + p);
      load_bf16_pair(dyr + p, d[0], d[1]);
      load_bf16_pair(xr + p, v[0], v[1]);
      store_bf16_pair<Stream>(dxr + p, d[0] * dsilu(v[0]), d[1] * dsilu(v[1]));
    });
    if constexpr (kGatherable<T>) {
#if defined(__AVX512F__)
      // 32 gates a step in even and odd lanes, dy too (store_bf16_eo rounds the products).
      for (; gt && i + 2 * kBlock <= nb; i += 2 * kBlock) {
        fetch_ahead(dyr + i);
        fetch_ahead(xr + i);
        store_gathered_products_eo<Stream>(dxr + i, xr + i, dyr + i,
                                           [&](__m512i idx) { return gather_dsilu(idx, gt->dsilu); });
      }
#endif
      for (; gt && i < nb; i += kBlock) {
        fetch_ahead(dyr + i);
        fetch_ahead(xr + i);
        store_out<Stream>(dxr + i, load<A>(dyr + i) * gather_dsilu(gate_indices(xr + i), gt->dsilu));
      }
    }
    for (; i < nb; i += kBlock) {
      fetch_ahead(dyr + i);
      fetch_ahead(xr + i);
      store_out<Stream>(dxr + i, load<A>(dyr + i) * dsilu(load<A>(xr + i)));
    }
    for (int64_t i = nb; i < n; ++i) dxr[i] = from_acc<T>(to_acc<A>(dyr[i]) * dsilu_scalar(to_acc<A>(xr[i])));
  }
}

// Scalar math: s = round(g / (1 + exp(-g))); y = round(s * u)
template <bool Stream, class T>
void silu_and_mul_rows(const T* g, int64_t gs, const T* u, int64_t us, T* y, int64_t r0, int64_t r1,
                       int64_t n) {
  using A = Acc<T>;
  const SiluTables* gt = gathered_tables<T>();  // null: no gathers
  if constexpr (kTabled<T>) {
    if (!gt) {
      const SiluTables& t = silu_tables();
      alignas(64) T e[kChunk];
      for (int64_t r = r0; r < r1; ++r) {
        const T* gr = g + r * gs;
        const T* ur = u + r * us;
        T* yr = y + r * n;
        tabled_row(
            n, [&](int64_t c, int64_t m) { look_up_silu(gr + c, m, t.silu, e); },
            [&](int64_t c, auto j) {
              VF a[2], b[2];
              fetch_ahead(gr + c + j);
              fetch_ahead(ur + c + j);
              load_bf16_pair(e + j, a[0], a[1]);
              load_bf16_pair(ur + c + j, b[0], b[1]);
              store_bf16_pair<Stream>(yr + c + j, a[0] * b[0], a[1] * b[1]);
            },
            [&](int64_t c, auto j) {
              fetch_ahead(gr + c + j);
              fetch_ahead(ur + c + j);
              store_out<Stream>(yr + c + j, load<A>(e + j) * load<A>(ur + c + j));
            },
            [&](int64_t c, int64_t j) { yr[c + j] = from_acc<T>(to_acc<A>(e[j]) * to_acc<A>(ur[c + j])); });
      }
      return;
    }
  }
  const int64_t nb = n - n % kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const T* gr = g + r * gs;
    const T* ur = u + r * us;
    T* yr = y + r * n;
    int64_t i = paired_bf16_blocks<T>(nb, [&](auto p) {
      VF a[2], b[2];
      fetch_ahead(gr + p);
      fetch_ahead(ur + p);
      load_bf16_pair(gr + p, a[0], a[1]);
      load_bf16_pair(ur + p, b[0], b[1]);
      store_bf16_pair<Stream>(yr + p, round_block_arith<T>(silu_rounded_to<T>(a[0])) * b[0],
                              round_block_arith<T>(silu_rounded_to<T>(a[1])) * b[1]);
    });
    if constexpr (kGatherable<T>) {
#if defined(__AVX512F__)
      // 32 gates a step in even and odd lanes, up too, the products rounded by store_bf16_eo, then a block
      // of 16.
      for (; gt && i + 2 * kBlock <= nb; i += 2 * kBlock) {
        fetch_ahead(gr + i);
        fetch_ahead(ur + i);
        store_gathered_products_eo<Stream>(yr + i, gr + i, ur + i,
                                           [&](__m512i idx) { return gather_silu(idx, gt->silu); });
      }
#endif
      for (; gt && i < nb; i += kBlock) {
        fetch_ahead(gr + i);
        fetch_ahead(ur + i);
        store_out<Stream>(yr + i, gather_silu(gate_indices(gr + i), gt->silu) * load<A>(ur + i));
      }
    }
    for (; i < nb; i += kBlock) {
      fetch_ahead(gr + i);
      fetch_ahead(ur + i);
      auto a = load<A>(gr + i);
      store_out<Stream>(yr + i, round_block_arith<T>(silu_rounded_to<T>(a)) * load<A>(ur + i));
    }
    for (int64_t i = nb; i < n; ++i) {
      A a = to_acc<A>(gr[i]);
      yr[i] = from_acc<T>(round_to<T>(silu_rounded_to<T>(a)) * to_acc<A>(ur[i]));
    }
  }
}

// Scalar math: s = round(silu(g)); du = round(dy * s); dg = round(dsilu(g) * round(dy * u)). silu(g) is
// g * sigmoid(g) here, sharing the backward's one division: within a rounding of the forward's g / (1 +
// e^-g), with the same edge values (-inf * 0 is NaN, -1e30 * 0 is -0).
template <bool Stream, class T>
void silu_and_mul_bwd_rows(const T* dy, int64_t dys, const T* g, int64_t gs, const T* u, int64_t us, T* dg,
                           int64_t dgs, T* du, int64_t dus, int64_t r0, int64_t r1, int64_t n) {
  using A = Acc<T>;
  const int64_t nb = n - n % kBlock;
  // One block's math, for the paired and the single blocks alike.
  const auto grads = [](auto d, auto a, auto b, auto& u_grad, auto& g_grad) {
    const auto sg = sigmoid(a);
    u_grad = d * round_block_arith<T>(a * sg);
    g_grad = round_block_arith<T>(d * b) * (sg * (1 + a * (1 - sg)));
  };
  const SiluTables* gt = gathered_tables<T>();  // null: no gathers
  if constexpr (kTabled<T>) {
    if (!gt) {
      const SiluTables& t = silu_tables();
      alignas(64) GradEntry e[kChunk];
      for (int64_t r = r0; r < r1; ++r) {
        const T* dyr = dy + r * dys;
        const T* gr = g + r * gs;
        const T* ur = u + r * us;
        T* dgr = dg + r * dgs;
        T* dur = du + r * dus;
        tabled_row(
            n, [&](int64_t c, int64_t m) { look_up_grad(gr + c, m, t.grad, e); },
            [&](int64_t c, auto j) {
              VF d[2], b[2], s[2], f[2];
              fetch_ahead(dyr + c + j);
              fetch_ahead(gr + c + j);
              fetch_ahead(ur + c + j);
              load_bf16_pair(dyr + c + j, d[0], d[1]);
              load_bf16_pair(ur + c + j, b[0], b[1]);
              load_grad_pair(e + j, f, s);
              store_bf16_pair<Stream>(dur + c + j, d[0] * s[0], d[1] * s[1]);
              store_bf16_pair<Stream>(dgr + c + j, round_block_arith<T>(d[0] * b[0]) * f[0],
                                      round_block_arith<T>(d[1] * b[1]) * f[1]);
            },
            [&](int64_t c, auto j) {
              fetch_ahead(dyr + c + j);
              fetch_ahead(gr + c + j);
              fetch_ahead(ur + c + j);
              const VF d = load<A>(dyr + c + j);
              VF f, s;
              load_grad_block(e + j, f, s);
              store_out<Stream>(dur + c + j, d * s);
              store_out<Stream>(dgr + c + j, round_block_arith<T>(d * load<A>(ur + c + j)) * f);
            },
            [&](int64_t c, int64_t j) {
              const A d = to_acc<A>(dyr[c + j]);
              dur[c + j] = from_acc<T>(d * e[j].x_sigmoid);
              dgr[c + j] = from_acc<T>(round_to<T>(d * to_acc<A>(ur[c + j])) * e[j].dsilu);
            });
      }
      return;
    }
  }
  for (int64_t r = r0; r < r1; ++r) {
    const T* dyr = dy + r * dys;
    const T* gr = g + r * gs;
    const T* ur = u + r * us;
    T* dgr = dg + r * dgs;
    T* dur = du + r * dus;
    int64_t i = paired_bf16_blocks<T>(nb, [&](auto p) {
      VF d[2], a[2], b[2], u_grad[2], g_grad[2];
      fetch_ahead(dyr + p);
      fetch_ahead(gr + p);
      fetch_ahead(ur + p);
      load_bf16_pair(dyr + p, d[0], d[1]);
      load_bf16_pair(gr + p, a[0], a[1]);
      load_bf16_pair(ur + p, b[0], b[1]);
      for (int j = 0; j < 2; ++j) grads(d[j], a[j], b[j], u_grad[j], g_grad[j]);
      store_bf16_pair<Stream>(dur + p, u_grad[0], u_grad[1]);
      store_bf16_pair<Stream>(dgr + p, g_grad[0], g_grad[1]);
    });
    if constexpr (kGatherable<T>) {
#if defined(__AVX512F__)
      // 32 gates a step in even and odd lanes: du = dy * x_sigmoid; dg = round(dy * u) * dsilu, the rounded
      // products kept in their lanes (round_bf16_eo_kept), so dsilu is gathered by the same gate indices.
      for (; gt && i + 2 * kBlock <= nb; i += 2 * kBlock) {
        fetch_ahead(dyr + i);
        fetch_ahead(gr + i);
        fetch_ahead(ur + i);
        __m512i even, odd;
        gate_indices_eo(gr + i, even, odd);
        VF de, dox, ue, uo;
        load_bf16_eo(dyr + i, de, dox);
        load_bf16_eo(ur + i, ue, uo);
        store_bf16_eo<Stream>(dur + i, de * gather_grad(even, &gt->grad[0].x_sigmoid),
                              dox * gather_grad(odd, &gt->grad[0].x_sigmoid));
        VF pe = de * ue, po = dox * uo;
        round_bf16_eo_kept(pe, po);
        store_bf16_eo<Stream>(dgr + i, pe * gather_grad(even, &gt->grad[0].dsilu),
                              po * gather_grad(odd, &gt->grad[0].dsilu));
      }
#endif
      for (; gt && i < nb; i += kBlock) {
        fetch_ahead(dyr + i);
        fetch_ahead(gr + i);
        fetch_ahead(ur + i);
        const VF d = load<A>(dyr + i);
        const auto idx = gate_indices(gr + i);
        store_out<Stream>(dur + i, d * gather_grad(idx, &gt->grad[0].x_sigmoid));
        store_out<Stream>(dgr + i,
                          round_block_arith<T>(d * load<A>(ur + i)) * gather_grad(idx, &gt->grad[0].dsilu));
      }
    }
    for (; i < nb; i += kBlock) {
      fetch_ahead(dyr + i);
      fetch_ahead(gr + i);
      fetch_ahead(ur + i);
      Vec<A> u_grad, g_grad;
      grads(load<A>(dyr + i), load<A>(gr + i), load<A>(ur + i), u_grad, g_grad);
      store_out<Stream>(dur + i, u_grad);
      store_out<Stream>(dgr + i, g_grad);
    }
    for (int64_t i = nb; i < n; ++i) {
      A d = to_acc<A>(dyr[i]);
      A a = to_acc<A>(gr[i]);
      dur[i] = from_acc<T>(d * round_to<T>(a * sigmoid_scalar(a)));
      dgr[i] = from_acc<T>(round_to<T>(d * to_acc<A>(ur[i])) * dsilu_scalar(a));
    }
  }
}

// Runs rows<true> (streaming stores, then a fence) when asked and every output allows it, else rows<false>.
template <class Rows>
void with_stores(bool stream, bool outputs_allow, Rows&& rows) {
  if (stream && outputs_allow) {
    rows(std::true_type{});
    stream_fence();
  } else {
    rows(std::false_type{});
  }
}

}  // namespace

void silu_fwd(DType dtype, const void* x, int64_t x_stride, void* y, int64_t row_begin, int64_t row_end,
              int64_t n, bool stream) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    with_stores(stream, can_stream(static_cast<T*>(y), n), [&](auto s) {
      silu_rows<decltype(s)::value, T>(static_cast<const T*>(x), x_stride, static_cast<T*>(y), row_begin,
                                       row_end, n);
    });
  });
}

void silu_bwd(DType dtype, const void* dy, int64_t dy_stride, const void* x, int64_t x_stride, void* dx,
              int64_t row_begin, int64_t row_end, int64_t n, bool stream) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    with_stores(stream, can_stream(static_cast<T*>(dx), n), [&](auto s) {
      silu_bwd_rows<decltype(s)::value, T>(static_cast<const T*>(dy), dy_stride, static_cast<const T*>(x),
                                           x_stride, static_cast<T*>(dx), row_begin, row_end, n);
    });
  });
}

void silu_and_mul_fwd(DType dtype, const void* gate, int64_t gate_stride, const void* up, int64_t up_stride,
                      void* y, int64_t row_begin, int64_t row_end, int64_t n, bool stream) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    with_stores(stream, can_stream(static_cast<T*>(y), n), [&](auto s) {
      silu_and_mul_rows<decltype(s)::value, T>(static_cast<const T*>(gate), gate_stride,
                                               static_cast<const T*>(up), up_stride, static_cast<T*>(y),
                                               row_begin, row_end, n);
    });
  });
}

void silu_and_mul_bwd(DType dtype, const void* dy, int64_t dy_stride, const void* gate, int64_t gate_stride,
                      const void* up, int64_t up_stride, void* d_gate, int64_t d_gate_stride, void* d_up,
                      int64_t d_up_stride, int64_t row_begin, int64_t row_end, int64_t n, bool stream) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool allow =
        can_stream(static_cast<T*>(d_gate), d_gate_stride) && can_stream(static_cast<T*>(d_up), d_up_stride);
    with_stores(stream, allow, [&](auto s) {
      silu_and_mul_bwd_rows<decltype(s)::value, T>(
          static_cast<const T*>(dy), dy_stride, static_cast<const T*>(gate), gate_stride,
          static_cast<const T*>(up), up_stride, static_cast<T*>(d_gate), d_gate_stride, static_cast<T*>(d_up),
          d_up_stride, row_begin, row_end, n);
    });
  });
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
