// RMSNorm forward and backward, compiled once per instruction-set level (KERNMAP_CPU_LEVEL names the level).
// Each pass reads a row from memory once; the second read of a row hits the cache (a row of H = 8192 fp32 is
// 32 KiB).
#include "kernels/cpu/vec.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {
namespace {

// Scalar math:
//   h = float(x); r = 1 / sqrt(sum(h^2) / H + eps); n = round_X(h * r); y = round_Y(w * n)
template <bool Stream, class X, class Y>
void fwd_rows(const X* x, int64_t xs, const Acc<X>* w, Y* y, Acc<X>* rstd, int64_t r0, int64_t r1, int64_t H,
              double eps) {
  using A = Acc<X>;
  using V = Vec<A>;
  const int64_t Hb = H - H % kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const X* xr = x + r * xs;
    Y* yr = y + r * H;
    V acc{};
    for (int64_t i = 0; i < Hb; i += kBlock) {
      V h = load<A>(xr + i);
      acc += h * h;
    }
    A ss = lane_sum(acc);
    for (int64_t i = Hb; i < H; ++i) {
      A v = to_acc<A>(xr[i]);
      ss += v * v;
    }
    const A rs = A(1) / std::sqrt(ss / static_cast<A>(H) + static_cast<A>(eps));
    rstd[r] = rs;
    for (int64_t i = 0; i < Hb; i += kBlock) {
      V n = round_block<X>(load<A>(xr + i) * rs);
      store_out<Stream>(yr + i, load<A>(w + i) * n);
    }
    for (int64_t i = Hb; i < H; ++i) yr[i] = from_acc<Y>(w[i] * round_to<X>(to_acc<A>(xr[i]) * rs));
  }
}

// Scalar math (g is the gradient reaching round_X(h * r), rounded to X as the eager autograd does):
//   g = round_X(dy * w); dx = round_X(r * g - r^3 * h * sum(g * h) / H); dw += dy * round_X(h * r)
template <bool Stream, class X, class Y>
void bwd_rows(const Y* dy, int64_t dys, const X* x, int64_t xs, const Acc<X>* w, const Acc<X>* rstd, X* dx,
              Acc<X>* dw, int64_t r0, int64_t r1, int64_t H) {
  using A = Acc<X>;
  using V = Vec<A>;
  const int64_t Hb = H - H % kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const Y* dyr = dy + r * dys;
    const X* xr = x + r * xs;
    X* dxr = dx + r * H;
    const A rs = rstd[r];
    V acc{};
    for (int64_t i = 0; i < Hb; i += kBlock) {
      V g = round_block<X>(load<A>(dyr + i) * load<A>(w + i));
      acc += g * load<A>(xr + i);
    }
    A dot = lane_sum(acc);
    for (int64_t i = Hb; i < H; ++i) dot += round_to<X>(to_acc<A>(dyr[i]) * w[i]) * to_acc<A>(xr[i]);
    const A c = rs * rs * rs * dot / static_cast<A>(H);
    for (int64_t i = 0; i < Hb; i += kBlock) {
      V h = load<A>(xr + i);
      V d = load<A>(dyr + i);
      V g = round_block<X>(d * load<A>(w + i));
      store_out<Stream>(dxr + i, rs * g - c * h);
      store(dw + i, load<A>(dw + i) + d * round_block<X>(h * rs));
    }
    for (int64_t i = Hb; i < H; ++i) {
      A h = to_acc<A>(xr[i]);
      A d = to_acc<A>(dyr[i]);
      dxr[i] = from_acc<X>(rs * round_to<X>(d * w[i]) - c * h);
      dw[i] += d * round_to<X>(h * rs);
    }
  }
}

// Calls f with values of the (x, y) element types; y is x's dtype, float32 or float64 (the promoted dtype of
// x and the weight), which the op checks before calling.
template <class F>
void dispatch_xy(DType xt, DType yt, F&& f) {
  dispatch_dtype(xt, [&](auto x_tag) {
    using X = decltype(x_tag);
    if (yt == DType::kFloat32) return f(X{}, float{});
    if (yt == DType::kFloat64) return f(X{}, double{});
    return f(X{}, X{});
  });
}

}  // namespace

void rms_norm_fwd(DType x_dtype, DType y_dtype, const void* x, int64_t x_stride, const void* w, void* y,
                  void* rstd, int64_t row_begin, int64_t row_end, int64_t H, double eps, bool stream) {
  dispatch_xy(x_dtype, y_dtype, [&](auto x_tag, auto y_tag) {
    using X = decltype(x_tag);
    using Y = decltype(y_tag);
    auto run = [&](auto rows) {
      rows(static_cast<const X*>(x), x_stride, static_cast<const Acc<X>*>(w), static_cast<Y*>(y),
           static_cast<Acc<X>*>(rstd), row_begin, row_end, H, eps);
    };
    if (stream && can_stream(static_cast<Y*>(y), H)) {
      run(fwd_rows<true, X, Y>);
      stream_fence();
    } else {
      run(fwd_rows<false, X, Y>);
    }
  });
}

void rms_norm_bwd(DType x_dtype, DType y_dtype, const void* dy, int64_t dy_stride, const void* x,
                  int64_t x_stride, const void* w, const void* rstd, void* dx, void* dw_acc,
                  int64_t row_begin, int64_t row_end, int64_t H, bool stream) {
  dispatch_xy(x_dtype, y_dtype, [&](auto x_tag, auto y_tag) {
    using X = decltype(x_tag);
    using Y = decltype(y_tag);
    auto run = [&](auto rows) {
      rows(static_cast<const Y*>(dy), dy_stride, static_cast<const X*>(x), x_stride,
           static_cast<const Acc<X>*>(w), static_cast<const Acc<X>*>(rstd), static_cast<X*>(dx),
           static_cast<Acc<X>*>(dw_acc), row_begin, row_end, H);
    };
    if (stream && can_stream(static_cast<X*>(dx), H)) {
      run(bwd_rows<true, X, Y>);
      stream_fence();
    } else {
      run(bwd_rows<false, X, Y>);
    }
  });
}

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
