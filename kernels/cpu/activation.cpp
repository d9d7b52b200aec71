// SiLU and SiLU-and-mul forward and backward, compiled once per instruction-set level. One pass over the data
// each way; the eager module's intermediate roundings are reproduced so low-precision results match it.
#include "kernels/cpu/vec.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {
namespace {

template <class T>
using AccOf = typename Traits<T>::Acc;

// y = round(x * sigmoid(x))
template <class T>
void silu_rows(const T* x, int64_t xs, T* y, int64_t r0, int64_t r1, int64_t n) {
  using Acc = AccOf<T>;
  const int64_t nb = n - n % kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * xs;
    T* yr = y + r * n;
    Acc v[kBlock];
    for (int64_t i = 0; i < nb; i += kBlock) {
      load_block(xr + i, v);
      for (int j = 0; j < kBlock; ++j) v[j] = v[j] * sigmoid(v[j]);
      store_block(yr + i, v);
    }
    for (int64_t i = nb; i < n; ++i) {
      Acc a = static_cast<Acc>(to_float(xr[i]));
      yr[i] = Traits<T>::store(a * sigmoid(a));
    }
  }
}

// dsilu(x) = sigmoid(x) * (1 + x * (1 - sigmoid(x)));  dx = round(dy * dsilu(x))
template <class Acc>
inline Acc silu_grad(Acc x, Acc dy) {
  Acc s = sigmoid(x);
  return dy * s * (Acc(1) + x * (Acc(1) - s));
}

template <class T>
void silu_bwd_rows(const T* dy, int64_t dys, const T* x, int64_t xs, T* dx, int64_t r0, int64_t r1, int64_t n) {
  using Acc = AccOf<T>;
  const int64_t nb = n - n % kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * xs;
    const T* dyr = dy + r * dys;
    T* dxr = dx + r * n;
    Acc v[kBlock], d[kBlock];
    for (int64_t i = 0; i < nb; i += kBlock) {
      load_block(xr + i, v);
      load_block(dyr + i, d);
      for (int j = 0; j < kBlock; ++j) v[j] = silu_grad(v[j], d[j]);
      store_block(dxr + i, v);
    }
    for (int64_t i = nb; i < n; ++i)
      dxr[i] = Traits<T>::store(silu_grad(static_cast<Acc>(to_float(xr[i])), static_cast<Acc>(to_float(dyr[i]))));
  }
}

// s = round(silu(g)); y = round(s * u)
template <class T>
void silu_and_mul_rows(const T* g, int64_t gs, const T* u, int64_t us, T* y, int64_t r0, int64_t r1, int64_t n) {
  using Acc = AccOf<T>;
  const int64_t nb = n - n % kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const T* gr = g + r * gs;
    const T* ur = u + r * us;
    T* yr = y + r * n;
    Acc a[kBlock], b[kBlock];
    for (int64_t i = 0; i < nb; i += kBlock) {
      load_block(gr + i, a);
      load_block(ur + i, b);
      for (int j = 0; j < kBlock; ++j) a[j] = a[j] * sigmoid(a[j]);
      round_block<T>(a);
      for (int j = 0; j < kBlock; ++j) a[j] *= b[j];
      store_block(yr + i, a);
    }
    for (int64_t i = nb; i < n; ++i) {
      Acc ga = static_cast<Acc>(to_float(gr[i]));
      Acc s = Traits<T>::round(ga * sigmoid(ga));
      yr[i] = Traits<T>::store(s * static_cast<Acc>(to_float(ur[i])));
    }
  }
}

// s = round(silu(g)); du = round(dy * s); dg = round(dsilu(g) * round(dy * u))
template <class T>
void silu_and_mul_bwd_rows(const T* dy, int64_t dys, const T* g, int64_t gs, const T* u, int64_t us, T* dg,
                           int64_t dgs, T* du, int64_t dus, int64_t r0, int64_t r1, int64_t n) {
  using Acc = AccOf<T>;
  const int64_t nb = n - n % kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const T* dyr = dy + r * dys;
    const T* gr = g + r * gs;
    const T* ur = u + r * us;
    T* dgr = dg + r * dgs;
    T* dur = du + r * dus;
    Acc d[kBlock], a[kBlock], b[kBlock], s[kBlock], gu[kBlock];
    for (int64_t i = 0; i < nb; i += kBlock) {
      load_block(dyr + i, d);
      load_block(gr + i, a);
      load_block(ur + i, b);
      for (int j = 0; j < kBlock; ++j) {
        Acc sg = sigmoid(a[j]);
        s[j] = a[j] * sg;
        gu[j] = d[j] * b[j];
        b[j] = sg * (Acc(1) + a[j] * (Acc(1) - sg));  // dsilu(g)
      }
      round_block<T>(s);
      round_block<T>(gu);
      for (int j = 0; j < kBlock; ++j) {
        s[j] *= d[j];
        gu[j] *= b[j];
      }
      store_block(dur + i, s);
      store_block(dgr + i, gu);
    }
    for (int64_t i = nb; i < n; ++i) {
      Acc di = static_cast<Acc>(to_float(dyr[i]));
      Acc gi = static_cast<Acc>(to_float(gr[i]));
      Acc ui = static_cast<Acc>(to_float(ur[i]));
      Acc si = Traits<T>::round(gi * sigmoid(gi));
      dur[i] = Traits<T>::store(di * si);
      dgr[i] = Traits<T>::store(silu_grad(gi, Traits<T>::round(di * ui)));
    }
  }
}

template <class F>
void dispatch(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat64:
      return f(double{});
    case DType::kBFloat16:
      return f(BFloat16{});
    case DType::kFloat16:
      return f(Float16{});
  }
}

}  // namespace

void silu_fwd(DType dtype, const void* x, int64_t x_stride, void* y, int64_t row_begin, int64_t row_end,
              int64_t n) {
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_rows<T>(static_cast<const T*>(x), x_stride, static_cast<T*>(y), row_begin, row_end, n);
  });
}

void silu_bwd(DType dtype, const void* dy, int64_t dy_stride, const void* x, int64_t x_stride, void* dx,
              int64_t row_begin, int64_t row_end, int64_t n) {
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_bwd_rows<T>(static_cast<const T*>(dy), dy_stride, static_cast<const T*>(x), x_stride, static_cast<T*>(dx),
                     row_begin, row_end, n);
  });
}

void silu_and_mul_fwd(DType dtype, const void* gate, int64_t gate_stride, const void* up, int64_t up_stride,
                      void* y, int64_t row_begin, int64_t row_end, int64_t n) {
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_rows<T>(static_cast<const T*>(gate), gate_stride, static_cast<const T*>(up), up_stride,
                         static_cast<T*>(y), row_begin, row_end, n);
  });
}

void silu_and_mul_bwd(DType dtype, const void* dy, int64_t dy_stride, const void* gate, int64_t gate_stride,
                      const void* up, int64_t up_stride, void* d_gate, int64_t d_gate_stride, void* d_up,
                      int64_t d_up_stride, int64_t row_begin, int64_t row_end, int64_t n) {
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_bwd_rows<T>(static_cast<const T*>(dy), dy_stride, static_cast<const T*>(gate), gate_stride,
                             static_cast<const T*>(up), up_stride, static_cast<T*>(d_gate), d_gate_stride,
                             static_cast<T*>(d_up), d_up_stride, row_begin, row_end, n);
  });
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
