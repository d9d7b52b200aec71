// RMSNorm forward and backward, compiled once per instruction-set level (KERNMAP_CPU_LEVEL names the level).
// Each row is read from memory once per pass; the second read of a row hits the cache (a row of H = 8192 fp32
// is 32 KiB).
#include <cmath>

#include "kernels/cpu/vec.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {
namespace {

// Scalar math:
//   h = float(x); r = 1 / sqrt(sum(h^2) / H + eps); n = round_X(h * r); y = round_Y(w * n)
template <class X, class Y>
void fwd_rows(const X* x, int64_t xs, const typename Traits<X>::Acc* w, Y* y, typename Traits<X>::Acc* rstd,
              int64_t r0, int64_t r1, int64_t H, double eps) {
  using Acc = typename Traits<X>::Acc;
  const int64_t Hb = H - H % kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const X* xr = x + r * xs;
    Y* yr = y + r * H;
    Acc acc[kBlock] = {};
    Acc h[kBlock];
    for (int64_t i = 0; i < Hb; i += kBlock) {
      load_block(xr + i, h);
      for (int j = 0; j < kBlock; ++j) acc[j] += h[j] * h[j];
    }
    Acc ss = 0;
    for (int64_t i = Hb; i < H; ++i) {
      Acc v = static_cast<Acc>(to_float(xr[i]));
      ss += v * v;
    }
    for (int j = 0; j < kBlock; ++j) ss += acc[j];
    const Acc rs = Acc(1) / std::sqrt(ss / static_cast<Acc>(H) + static_cast<Acc>(eps));
    rstd[r] = rs;
    Acc o[kBlock];
    for (int64_t i = 0; i < Hb; i += kBlock) {
      load_block(xr + i, h);
      for (int j = 0; j < kBlock; ++j) h[j] *= rs;
      round_block<X>(h);
      for (int j = 0; j < kBlock; ++j) o[j] = w[i + j] * h[j];
      store_block(yr + i, o);
    }
    for (int64_t i = Hb; i < H; ++i) {
      Acc n = Traits<X>::round(static_cast<Acc>(to_float(xr[i])) * rs);
      yr[i] = Traits<Y>::store(w[i] * n);
    }
  }
}

// Scalar math (g is the gradient reaching round_X(h * r), rounded to X as the eager autograd does):
//   g = round_X(dy * w); dx = round_X(r * g - r^3 * h * sum(g * h) / H); dw += dy * round_X(h * r)
template <class X, class Y>
void bwd_rows(const Y* dy, int64_t dys, const X* x, int64_t xs, const typename Traits<X>::Acc* w,
              const typename Traits<X>::Acc* rstd, X* dx, typename Traits<X>::Acc* dw, int64_t r0, int64_t r1,
              int64_t H) {
  using Acc = typename Traits<X>::Acc;
  const int64_t Hb = H - H % kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const Y* dyr = dy + r * dys;
    const X* xr = x + r * xs;
    X* dxr = dx + r * H;
    const Acc rs = rstd[r];
    Acc h[kBlock], g[kBlock], acc[kBlock] = {};
    for (int64_t i = 0; i < Hb; i += kBlock) {
      load_block(xr + i, h);
      load_block(dyr + i, g);
      for (int j = 0; j < kBlock; ++j) g[j] *= w[i + j];
      round_block<X>(g);
      for (int j = 0; j < kBlock; ++j) acc[j] += g[j] * h[j];
    }
    Acc dot = 0;
    for (int64_t i = Hb; i < H; ++i)
      dot += Traits<X>::round(static_cast<Acc>(to_float(dyr[i])) * w[i]) * static_cast<Acc>(to_float(xr[i]));
    for (int j = 0; j < kBlock; ++j) dot += acc[j];
    const Acc c = rs * rs * rs * dot / static_cast<Acc>(H);
    Acc d[kBlock], n[kBlock], o[kBlock];
    for (int64_t i = 0; i < Hb; i += kBlock) {
      load_block(xr + i, h);
      load_block(dyr + i, d);
      for (int j = 0; j < kBlock; ++j) g[j] = d[j] * w[i + j];
      round_block<X>(g);
      for (int j = 0; j < kBlock; ++j) {
        o[j] = rs * g[j] - c * h[j];
        n[j] = h[j] * rs;
      }
      store_block(dxr + i, o);
      round_block<X>(n);
      for (int j = 0; j < kBlock; ++j) dw[i + j] += d[j] * n[j];
    }
    for (int64_t i = Hb; i < H; ++i) {
      Acc hi = static_cast<Acc>(to_float(xr[i]));
      Acc di = static_cast<Acc>(to_float(dyr[i]));
      Acc gi = Traits<X>::round(di * w[i]);
      dxr[i] = Traits<X>::store(rs * gi - c * hi);
      dw[i] += di * Traits<X>::round(hi * rs);
    }
  }
}

// Calls f with values of the (x, y) element types; y is x's dtype, float32 or float64 (the promoted dtype of
// x and the weight), which the op checks before calling.
template <class F>
void dispatch_xy(DType xt, DType yt, F&& f) {
  auto with_x = [&](auto x_tag) {
    using X = decltype(x_tag);
    if (yt == DType::kFloat32) return f(X{}, float{});
    if (yt == DType::kFloat64) return f(X{}, double{});
    return f(X{}, X{});
  };
  switch (xt) {
    case DType::kFloat32:
      return with_x(float{});
    case DType::kFloat64:
      return with_x(double{});
    case DType::kBFloat16:
      return with_x(BFloat16{});
    case DType::kFloat16:
      return with_x(Float16{});
  }
}

}  // namespace

void rms_norm_fwd(DType x_dtype, DType y_dtype, const void* x, int64_t x_stride, const void* w, void* y,
                  void* rstd, int64_t row_begin, int64_t row_end, int64_t H, double eps) {
  dispatch_xy(x_dtype, y_dtype, [&](auto x_tag, auto y_tag) {
    using X = decltype(x_tag);
    using Y = decltype(y_tag);
    using Acc = typename Traits<X>::Acc;
    fwd_rows<X, Y>(static_cast<const X*>(x), x_stride, static_cast<const Acc*>(w), static_cast<Y*>(y),
                   static_cast<Acc*>(rstd), row_begin, row_end, H, eps);
  });
}

void rms_norm_bwd(DType x_dtype, DType y_dtype, const void* dy, int64_t dy_stride, const void* x,
                  int64_t x_stride, const void* w, const void* rstd, void* dx, void* dw_acc, int64_t row_begin,
                  int64_t row_end, int64_t H) {
  dispatch_xy(x_dtype, y_dtype, [&](auto x_tag, auto y_tag) {
    using X = decltype(x_tag);
    using Y = decltype(y_tag);
    using Acc = typename Traits<X>::Acc;
    bwd_rows<X, Y>(static_cast<const Y*>(dy), dy_stride, static_cast<const X*>(x), x_stride,
                   static_cast<const Acc*>(w), static_cast<const Acc*>(rstd), static_cast<X*>(dx),
                   static_cast<Acc*>(dw_acc), row_begin, row_end, H);
  });
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
