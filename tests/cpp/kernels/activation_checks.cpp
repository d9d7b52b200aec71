// RMSNorm and SiLU-family checks beyond the reference comparison: the raw kernels' streaming stores, the
// eager roundings in 16-bit dtypes, extreme and non-finite inputs, empty inputs.
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/isa.h"
#include "kernmap/ops.h"
#include "ops/checks.h"
#include "tests/cpp/kernels/checks.h"

namespace kernmap::testing {

// Streaming stores (asked for by the ops when outputs exceed the last-level cache) write the same bits as
// normal stores: on aligned rows (where they are taken), on rows a stride away that breaks the alignment, on
// a misaligned start and on widths with scalar tails (where the kernels fall back to normal stores).
void streaming_stores_write_the_same_bits(const Case& c) {
  const auto& k = kernmap::cpu::kernel_table();
  const auto dt = kernmap::ops::cpu_dtype(c.dtype);
  const at::ScalarType acc = acc_of(c.dtype);
  const int64_t n = c["n"], offset = c.layout == "offset1" ? 1 : 0, rows = 5;
  const at::Tensor x = randn({rows, n}, c.dtype), u = randn({rows, n}, c.dtype),
                   dy = randn({rows, n}, c.dtype);
  const at::Tensor w = norm_weight(n, acc);
  // Output buffers [rows, cols] starting `offset` elements into a fresh (poisoned, 64-byte aligned) block.
  auto out = [&](int64_t cols) {
    return at::empty({rows * cols + offset}, at::TensorOptions(c.dtype)).narrow(0, offset, rows * cols);
  };
  std::vector<at::Tensor> results[2];
  for (bool stream : {false, true}) {
    at::Tensor y = out(n), rstd = at::empty({rows}, at::TensorOptions(acc));
    k.rms_norm_fwd(dt, dt, x.const_data_ptr(), n, w.const_data_ptr(), y.data_ptr(), rstd.data_ptr(), 0, rows,
                   n, 1e-6, stream);
    at::Tensor dx = out(n), dw = at::zeros({n}, at::TensorOptions(acc));
    k.rms_norm_bwd(dt, dt, dy.const_data_ptr(), n, x.const_data_ptr(), n, w.const_data_ptr(),
                   rstd.const_data_ptr(), dx.data_ptr(), dw.data_ptr(), 0, rows, n, stream);
    at::Tensor s = out(n), ds = out(n), sm = out(n);
    k.silu_fwd(dt, x.const_data_ptr(), n, s.data_ptr(), 0, rows, n, stream);
    k.silu_bwd(dt, dy.const_data_ptr(), n, x.const_data_ptr(), n, ds.data_ptr(), 0, rows, n, stream);
    k.silu_and_mul_fwd(dt, x.const_data_ptr(), n, u.const_data_ptr(), n, sm.data_ptr(), 0, rows, n, stream);
    // Backward into a packed [rows, 2n] gradient, as swiglu_backward writes it.
    at::Tensor packed = out(2 * n);
    const int64_t half = n * packed.element_size();
    k.silu_and_mul_bwd(dt, dy.const_data_ptr(), n, x.const_data_ptr(), n, u.const_data_ptr(), n,
                       packed.data_ptr(), 2 * n, static_cast<char*>(packed.data_ptr()) + half, 2 * n, 0, rows,
                       n, stream);
    results[stream] = {y, rstd, dx, dw, s, ds, sm, packed};
  }
  for (size_t i = 0; i < results[0].size(); ++i) {
    SCOPED_TRACE("output " + std::to_string(i));
    EXPECT_TRUE(same_bits(results[1][i], results[0][i]));
    // And every element is the kernels' (a skipped block would still hold the poison).
    EXPECT_FALSE(results[1][i].isnan().any().item<bool>());
  }
}

namespace {

// The kernels emulate the eager module's roundings; at::silu in the same dtype evaluates with another exp and
// division, so a few results may land on the other side of a rounding boundary, but no further.
::testing::AssertionResult nearly_bit_exact(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor gb = got.contiguous().view(at::kShort).to(at::kInt);
  const at::Tensor wb = want.contiguous().view(at::kShort).to(at::kInt);
  const at::Tensor same = got.eq(want) | gb.eq(wb);
  const double identical = same.to(at::kDouble).mean().item<double>();
  const int64_t max_ulps = at::where(same, at::zeros_like(gb), (gb - wb).abs()).max().item<int64_t>();
  if (identical >= 0.99 && max_ulps <= 1) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "identical " << identical << ", max ulps apart " << max_ulps;
}

}  // namespace

void low_precision_silu_matches_eager_bits(const Case& c) {
  const at::Tensor g = (3 * at::randn({c["rows"], c["n"]}, at::kDouble)).to(c.dtype);
  const at::Tensor u = randn({c["rows"], c["n"]}, c.dtype);
  EXPECT_TRUE(nearly_bit_exact(kernmap::silu_and_mul(g, u), at::silu(g) * u));
  EXPECT_TRUE(nearly_bit_exact(kernmap::silu(g), at::silu(g)));
}

namespace {

// bf16 results that equal want_float rounded to bf16 by torch, NaN where it is NaN (a failure names the first
// gate whose result differs).
::testing::AssertionResult rounded_from(const at::Tensor& got, const at::Tensor& want_float,
                                        const at::Tensor& gate, const char* what) {
  const at::Tensor want = want_float.to(at::kBFloat16);
  const at::Tensor nan = want.isnan();
  if (!got.isnan().equal(nan)) return ::testing::AssertionFailure() << what << ": NaN elsewhere than eager";
  const at::Tensor gb = got.view(at::kShort).masked_select(~nan),
                   wb = want.view(at::kShort).masked_select(~nan);
  const int64_t differ = gb.ne(wb).sum().item<int64_t>();
  if (differ == 0) return ::testing::AssertionSuccess();
  const int64_t i = gb.ne(wb).nonzero()[0].item<int64_t>();
  return ::testing::AssertionFailure() << what << ": " << differ << " results differ, the first at gate "
                                       << at::masked_select(gate.to(at::kDouble), ~nan)[i].item<double>();
}

}  // namespace

namespace {

// Sets how the AVX-512 levels' bf16 SiLU rows get their gates' values for the scope, then back to the
// default.
struct SiluGathersScope {
  explicit SiluGathersScope(kernmap::cpu::SiluGathers how) { kernmap::cpu::set_silu_gathers(how); }
  ~SiluGathersScope() { kernmap::cpu::set_silu_gathers(kernmap::cpu::SiluGathers::kAuto); }
  SiluGathersScope(const SiluGathersScope&) = delete;
  SiluGathersScope& operator=(const SiluGathersScope&) = delete;
};

void bf16_silu_every_gate_once(const Case& c);

}  // namespace

// A bfloat16 gate has 65536 values, and every one of them (NaNs and infinities included) gives the bf16 SiLU
// family the results of its float32 math rounded, as eager rounds: y = round(silu(g)), round(round(silu(g)) *
// u), dx = round(dy * silu'(x)), du = round(dy * round(g * sigmoid(g))), dg = round(round(dy * u) *
// silu'(g)), with silu, silu' and g * sigmoid(g) from the same kernels in float32 (a gradient of 1 and an up
// of 1 isolate them). Below AVX-512 the bf16 rows read these from tables built at first use, at avx512
// silu_and_mul's rows (silu_tables.h); a table built with another formula, or a row reading the wrong entry,
// fails here. At the AVX-512 levels the bf16 forwards compute SiLU with a shorter exp than float32's
// (vec.h, one_plus_exp_neg_bf16) whose bf16 roundings are the same: this check is what holds it to that. At
// the bf16 levels the rounding instruction flushes subnormal results to zero (vec.h; the scalar tails round
// them as torch does), so there the wanted results are flushed too, and only the forwards are checked: the
// backwards' multiply-adds are fused as GCC decides for each instantiation (vec.h, madd; silu_eager_roundings
// checks them against eager). Rows of 256 (whole chunks) and of 1031 (a chunk's remainder of 7: looked-up
// tails, scalar tails).
void bf16_silu_is_its_float_math_rounded(const Case& c) {
  for (const auto how : {kernmap::cpu::SiluGathers::kAlways, kernmap::cpu::SiluGathers::kNever}) {
    SCOPED_TRACE(how == kernmap::cpu::SiluGathers::kAlways ? "gathers" : "no gathers");
    const SiluGathersScope scope(how);
    bf16_silu_every_gate_once(c);
  }
}

namespace {

void bf16_silu_every_gate_once(const Case& c) {
  const auto& k = kernmap::cpu::kernel_table();
  const auto bf = kernmap::ops::cpu_dtype(at::kBFloat16), f32 = kernmap::ops::cpu_dtype(at::kFloat);
  const int64_t n = c["n"], rows = (65536 + n - 1) / n;
  // Every bf16 bit pattern once (the last row wraps around to the first values).
  const at::Tensor g =
      at::arange(rows * n, at::kInt).remainder(65536).to(at::kShort).view(at::kBFloat16).view({rows, n});
  const at::Tensor u = randn({rows, n}, at::kBFloat16), dy = randn({rows, n}, at::kBFloat16);
  const at::Tensor g32 = g.to(at::kFloat), ones = at::ones({rows, n});
  auto empty = [&](at::ScalarType t) { return at::empty({rows, n}, at::TensorOptions(t)); };

  at::Tensor silu32 = empty(at::kFloat), dsilu32 = empty(at::kFloat), dg32 = empty(at::kFloat),
             xsig32 = empty(at::kFloat);
  k.silu_fwd(f32, g32.const_data_ptr(), n, silu32.data_ptr(), 0, rows, n, false);
  k.silu_bwd(f32, ones.const_data_ptr(), n, g32.const_data_ptr(), n, dsilu32.data_ptr(), 0, rows, n, false);
  k.silu_and_mul_bwd(f32, ones.const_data_ptr(), n, g32.const_data_ptr(), n, ones.const_data_ptr(), n,
                     dg32.data_ptr(), n, xsig32.data_ptr(), n, 0, rows, n, false);
  ASSERT_TRUE(dg32.equal(dsilu32) ||
              (dg32.isnan().equal(dsilu32.isnan()) && dg32.nan_to_num().equal(dsilu32.nan_to_num())));

  at::Tensor y = empty(at::kBFloat16), ym = empty(at::kBFloat16), dx = empty(at::kBFloat16),
             dg = empty(at::kBFloat16), du = empty(at::kBFloat16);
  k.silu_fwd(bf, g.const_data_ptr(), n, y.data_ptr(), 0, rows, n, false);
  k.silu_and_mul_fwd(bf, g.const_data_ptr(), n, u.const_data_ptr(), n, ym.data_ptr(), 0, rows, n, false);
  k.silu_bwd(bf, dy.const_data_ptr(), n, g.const_data_ptr(), n, dx.data_ptr(), 0, rows, n, false);
  k.silu_and_mul_bwd(bf, dy.const_data_ptr(), n, g.const_data_ptr(), n, u.const_data_ptr(), n, dg.data_ptr(),
                     n, du.data_ptr(), n, 0, rows, n, false);
  const at::Tensor dy32 = dy.to(at::kFloat), u32 = u.to(at::kFloat);
  const bool flushes = c.level >= kernmap::cpu::Level::kAvx512Bf16;
  // A float result below FLT_MIN in magnitude as the level's rounding stores it: a signed zero where it
  // flushes, which is in the rows' blocks of 16; a row's scalar tail rounds as torch does.
  const at::Tensor in_blocks = at::arange(n).lt(n - n % 16).expand({rows, n});
  auto stored = [&](const at::Tensor& t) {
    return flushes ? at::where(in_blocks & t.abs().lt(std::numeric_limits<float>::min()), t * 0, t) : t;
  };
  auto rounded = [&](const at::Tensor& t) { return stored(t).to(at::kBFloat16).to(at::kFloat); };
  EXPECT_TRUE(rounded_from(y, stored(silu32), g, "silu"));
  EXPECT_TRUE(rounded_from(ym, stored(rounded(silu32) * u32), g, "silu_and_mul"));
  if (flushes) return;
  EXPECT_TRUE(rounded_from(dx, dy32 * dsilu32, g, "silu backward"));
  EXPECT_TRUE(rounded_from(du, dy32 * rounded(xsig32), g, "silu_and_mul backward, up's gradient"));
  EXPECT_TRUE(rounded_from(dg, rounded(dy32 * u32) * dsilu32, g, "silu_and_mul backward, gate's gradient"));
}

}  // namespace

// The AVX-512 levels' bf16 SiLU rows have the same bits whether they gather their gates' values from the
// tables or compute them (kernmap::cpu::SiluGathers, silu_tables.h), and below AVX-512 the setting changes
// nothing: the four kernels on every bf16 gate (NaNs and infinities included) with random up and gradient
// rows, in rows of n (16: whole blocks; 1031: 64 blocks and a scalar tail; 4096: streamed when asked), the
// inputs' rows contiguous or `ld` apart, plain and streaming stores. This also holds the backwards at the
// bf16 levels, which bf16_silu_every_gate does not compare with float32's math.
void silu_gathers_give_the_same_bits(const Case& c) {
  const auto& k = kernmap::cpu::kernel_table();
  const auto bf = kernmap::ops::cpu_dtype(at::kBFloat16);
  const int64_t n = c["n"], rows = (65536 + n - 1) / n, ld = c.layout == "strided" ? n + 24 : n;
  auto input = [&](const at::Tensor& values) {
    at::Tensor buf = randn({rows, ld}, at::kBFloat16);
    buf.narrow(1, 0, n).copy_(values);
    return buf;
  };
  const at::Tensor g = input(
      at::arange(rows * n, at::kInt).remainder(65536).to(at::kShort).view(at::kBFloat16).view({rows, n}));
  const at::Tensor u = input(randn({rows, n}, at::kBFloat16)), dy = input(randn({rows, n}, at::kBFloat16));
  auto run = [&](kernmap::cpu::SiluGathers how, bool stream) {
    const SiluGathersScope scope(how);
    auto out = [&] { return at::empty({rows, n}, at::TensorOptions(at::kBFloat16)); };
    at::Tensor y = out(), ym = out(), dx = out(), dg = out(), du = out();
    k.silu_fwd(bf, g.const_data_ptr(), ld, y.data_ptr(), 0, rows, n, stream);
    k.silu_and_mul_fwd(bf, g.const_data_ptr(), ld, u.const_data_ptr(), ld, ym.data_ptr(), 0, rows, n, stream);
    k.silu_bwd(bf, dy.const_data_ptr(), ld, g.const_data_ptr(), ld, dx.data_ptr(), 0, rows, n, stream);
    k.silu_and_mul_bwd(bf, dy.const_data_ptr(), ld, g.const_data_ptr(), ld, u.const_data_ptr(), ld,
                       dg.data_ptr(), n, du.data_ptr(), n, 0, rows, n, stream);
    return std::vector<at::Tensor>{y, ym, dx, dg, du};
  };
  const char* names[] = {"silu", "silu_and_mul", "silu backward", "silu_and_mul backward, gate's gradient",
                         "silu_and_mul backward, up's gradient"};
  for (bool stream : {false, true}) {
    const auto gathered = run(kernmap::cpu::SiluGathers::kAlways, stream);
    const auto computed = run(kernmap::cpu::SiluGathers::kNever, stream);
    for (size_t i = 0; i < gathered.size(); ++i) {
      SCOPED_TRACE(std::string(names[i]) + (stream ? ", streamed" : ""));
      EXPECT_TRUE(same_bits(gathered[i], computed[i]));
    }
  }
}

// A NaN result in bfloat16 has the bits torch's vectorized conversion writes, 0xffff (vec.h,
// bf16_round_high), in full blocks and in the scalar tail (where torch's scalar conversion writes 0x7fc0),
// from a NaN of either sign: silu, silu_and_mul and rms_norm (whose row of a NaN is all NaN). The table skips
// the avx512bf16 and amx levels, whose vcvtneps2bf16 keeps the NaN's sign and payload.
void bf16_nan_has_torchs_bits(const Case& c) {
  const int64_t n = 37;  // two blocks of 16 and a tail of 5 at avx512; four and a tail of 5 at avx2
  const double nan = std::numeric_limits<double>::quiet_NaN();
  at::Tensor x = at::randn({3, n}, at::kDouble);
  x[0][5] = nan;
  x[0][33] = -nan;
  x[1][0] = -nan;
  x[2][36] = nan;
  x = x.to(c.dtype);
  const at::Tensor u = randn({3, n}, c.dtype);
  const at::Tensor w = norm_weight(n, c.dtype);
  auto expect_torchs_nans = [](const at::Tensor& got, const at::Tensor& want, const char* what) {
    const at::Tensor nans = want.isnan();
    ASSERT_TRUE(nans.any().item<bool>()) << what;
    EXPECT_TRUE(got.isnan().equal(nans)) << what << ": NaN where eager has NaN, nowhere else";
    const at::Tensor got_bits = got.contiguous().view(at::kShort).masked_select(nans);
    EXPECT_TRUE(got_bits.eq(-1).all().item<bool>()) << what << ": every NaN is 0xffff";
  };
  expect_torchs_nans(kernmap::silu(x), at::silu(x), "silu");
  expect_torchs_nans(kernmap::silu_and_mul(x, u), at::silu(x) * u, "silu_and_mul");
  expect_torchs_nans(kernmap::rms_norm(x, w, 1e-6), kernmap::reference::rms_norm(x, w, 1e-6), "rms_norm");
  // The fused add's backward: a NaN of the residual's gradient stays in its element (dx = round(dx) + d_sum),
  // next to finite ones, in even and odd elements of the 32-element steps and in the single block after them
  // (H 80); a NaN in x makes its row's rstd NaN and the row's dx NaN by arithmetic (a NaN whose low bits a
  // rounding without the NaN select would carry into); 96 rows, three a weight-gradient block, so that the
  // pipelined loop's second pass runs.
  const int64_t rows = 96, H = 80;
  at::Tensor gs = at::randn({rows, H}, at::kDouble);
  gs[4][3] = nan;
  gs[7][10] = -nan;
  gs[50][33] = nan;
  gs[50][34] = -nan;
  gs[95][69] = nan;
  gs = gs.to(c.dtype);
  at::Tensor xs = randn({rows, H}, c.dtype);
  xs[30][5] = nan;
  const at::Tensor rs = randn({rows, H}, c.dtype), gy = randn({rows, H}, c.dtype);
  const at::Tensor wh = norm_weight(H, c.dtype);
  at::Tensor xg = xs.clone().requires_grad_(true);
  auto [y, sum] = kernmap::add_rms_norm(xg, rs, wh, 1e-6);
  torch::autograd::backward({y, sum}, {gy, gs});
  at::Tensor want = gs.to(at::kFloat);
  want[30] = nan;
  expect_torchs_nans(xg.grad(), want, "add_rms_norm's dx");
}

// rms_norm's backward under an fp32 weight holding NaNs whose low 16 bits are set (0x7fffffff, 0xffffffff):
// g = dy * w rounded to x's dtype must stay NaN, so every dx of the row is NaN (the row's dot product carries
// it), while the weight's gradient, which the weight does not enter, stays finite. A rounding without the NaN
// select (round_block_arith, right for products of x-typed values) would carry out of such a mantissa and
// make g a zero.
void rms_norm_backward_keeps_weight_nans(const Case& c) {
  const int64_t n = 37;
  const at::Tensor x = randn({3, n}, c.dtype).requires_grad_(true);
  at::Tensor w0 = at::randn({n}, at::kFloat);
  w0.view(at::kInt)[5] = 0x7fffffff;
  w0.view(at::kInt)[20] = static_cast<int32_t>(0xffffffffu);
  const at::Tensor w = w0.requires_grad_(true);
  const at::Tensor y = kernmap::rms_norm(x, w, 1e-6);
  ASSERT_EQ(y.scalar_type(), at::kFloat);
  torch::autograd::backward({y}, {at::ones_like(y)});
  EXPECT_TRUE(x.grad().isnan().all().item<bool>()) << "dx: NaN in every element";
  EXPECT_TRUE(w.grad().isfinite().all().item<bool>()) << "dw = sum(dy * normed x) holds no weight";
}

// rms_norm's backward has one math whatever the weight's dtype: with a bf16 weight (the first pass in the
// pairs' lane order below AVX-512, accumulate_pairs) and with the same values as an fp32 weight and an fp32
// grad_y (single blocks), dx has the same bits and dw the same before its conversion to the weight's dtype —
// so the pairs' sums run in the single blocks' order. Rows enough that each call of the kernel takes several
// (dw accumulated across them in the pairs' lane order), widths with and without blocks after the last group.
void rms_norm_backward_same_bits_for_either_weight_dtype(const Case& c) {
  static auto fwd = kernmap::ops::op_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, double)>("kernmap::rms_norm_forward");
  static auto bwd = kernmap::ops::op_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "kernmap::rms_norm_backward");
  const int64_t rows = 70, H = c["H"];
  const at::Tensor x = randn({rows, H}, c.dtype), w = norm_weight(H, c.dtype), gy = randn({rows, H}, c.dtype);
  auto [y, rstd] = fwd.call(x, w, 1e-6);
  auto [dx, dw] = bwd.call(gy, x, w, rstd);
  auto [dx32, dw32] = bwd.call(gy.to(at::kFloat), x, w.to(at::kFloat), rstd);
  EXPECT_TRUE(same_bits(dx, dx32)) << "dx";
  EXPECT_TRUE(same_bits(dw, dw32.to(c.dtype))) << "dw";
}

namespace {

// The smallest normal and the largest finite value of a floating dtype.
std::pair<double, double> normal_range(at::ScalarType t) {
  std::pair<double, double> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t, "normal_range", [&] {
    out = {static_cast<double>(std::numeric_limits<scalar_t>::min()),
           static_cast<double>(std::numeric_limits<scalar_t>::max())};
  });
  return out;
}

// Eager's value, element by element: NaN where eager gives NaN, the same infinity, a zero of the same sign
// where eager gives a signed zero, and otherwise within rtol of eager's value (plus the dtype's smallest
// normal number: the avx512bf16 level flushes bfloat16 subnormal results to zero, see vec.h).
::testing::AssertionResult eager_values(const at::Tensor& got, const at::Tensor& want, const at::Tensor& x,
                                        double rtol) {
  const at::Tensor g = got.to(at::kDouble).contiguous().view(-1),
                   w = want.to(at::kDouble).contiguous().view(-1);
  const at::Tensor xs = x.to(at::kDouble).contiguous().view(-1);
  const double tiny = normal_range(want.scalar_type()).first;
  std::ostringstream wrong;
  for (int64_t i = 0; i < w.numel(); ++i) {
    const double a = g[i].item<double>(), b = w[i].item<double>();
    const bool same = std::isnan(b)   ? std::isnan(a)
                      : std::isinf(b) ? a == b
                      : b == 0        ? a == 0 && std::signbit(a) == std::signbit(b)
                                      : std::abs(a - b) <= rtol * std::abs(b) + tiny;
    if (!same) wrong << "\n  x = " << xs[i].item<double>() << ": got " << a << ", eager " << b;
  }
  if (!wrong.str().empty()) return ::testing::AssertionFailure() << wrong.str();
  return ::testing::AssertionSuccess();
}

}  // namespace

// SiLU's non-finite and huge inputs, where the kernels' exp and reciprocal leave their usual range: eager
// computes x / (1 + exp(-x)), so silu(-inf) is NaN, silu(-1e30) is -0 and silu'(+inf) is NaN. Each value sits
// in several lane positions of full blocks and of the scalar tail; forward and backward of silu, silu_and_mul
// and swiglu.
void silu_handles_extreme_inputs(const Case& c) {
  const double inf = std::numeric_limits<double>::infinity();
  const auto [smallest, max] = normal_range(c.dtype);
  const double denormal = smallest / 8;
  const std::vector<double> special = {-inf, inf,   std::nan(""), -1e30, 1e30, -1e4,     1e4,       -88.7,
                                       88.7, -89,   89,           -0.0,  0.0,  denormal, -denormal, max,
                                       -max, -87.5, 17.0,         -17.0, 104,  -104};
  std::vector<double> values;
  for (int shift = 0; shift < 3; ++shift)
    for (size_t i = 0; i < special.size(); ++i) values.push_back(special[(i + shift * 7) % special.size()]);
  const int64_t n = static_cast<int64_t>(values.size());
  const at::Tensor x0 = at::tensor(values, at::kDouble).to(c.dtype).view({1, n});
  const at::Tensor u0 = (at::rand({1, n}, at::kDouble) + 0.5).to(c.dtype);
  const at::Tensor dy = (at::rand({1, n}, at::kDouble) - 0.5).to(c.dtype);
  const double rtol = tolerance(c.dtype).rtol;
  auto grad_of = [&](auto&& fn, std::vector<at::Tensor> inputs) {
    for (at::Tensor& t : inputs) t = t.clone().requires_grad_(true);
    const at::Tensor y = fn(inputs);
    torch::autograd::backward({y}, {dy});
    std::vector<at::Tensor> out = {y.detach()};
    for (const at::Tensor& t : inputs) out.push_back(t.grad());
    return out;
  };
  const auto silu = grad_of([](const auto& in) { return kernmap::silu(in[0]); }, {x0});
  const auto eager_silu = grad_of([](const auto& in) { return at::silu(in[0]); }, {x0});
  EXPECT_TRUE(eager_values(silu[0], eager_silu[0], x0, rtol)) << "silu forward";
  EXPECT_TRUE(eager_values(silu[1], eager_silu[1], x0, rtol)) << "silu backward";

  const auto mul = grad_of([](const auto& in) { return kernmap::silu_and_mul(in[0], in[1]); }, {x0, u0});
  const auto eager_mul = grad_of([](const auto& in) { return at::silu(in[0]) * in[1]; }, {x0, u0});
  for (size_t i = 0; i < mul.size(); ++i)
    EXPECT_TRUE(eager_values(mul[i], eager_mul[i], x0, rtol)) << "silu_and_mul output " << i;

  const at::Tensor packed = at::cat({x0, u0}, -1);
  const auto sw = grad_of([](const auto& in) { return kernmap::swiglu(in[0]); }, {packed});
  const auto eager_sw = grad_of([](const auto& in) { return kernmap::reference::swiglu(in[0]); }, {packed});
  EXPECT_TRUE(eager_values(sw[0], eager_sw[0], x0, rtol)) << "swiglu forward";
  EXPECT_TRUE(eager_values(sw[1], eager_sw[1], at::cat({x0, x0}, -1), rtol)) << "swiglu backward";
}

void empty_inputs(const Case& c) {
  const at::Tensor x = at::empty({0, 16}, c.dtype);
  const at::Tensor w = at::ones({16}, c.dtype).requires_grad_(true);
  const at::Tensor xg = x.clone().requires_grad_(true);
  const at::Tensor y = kernmap::rms_norm(xg, w, 1e-6);
  EXPECT_EQ(y.sizes(), x.sizes());
  torch::autograd::backward({y}, {at::empty_like(y)});
  EXPECT_EQ(w.grad().sizes(), w.sizes());
  EXPECT_EQ(w.grad().abs().sum().item<double>(), 0.0);
  EXPECT_EQ(kernmap::silu_and_mul(x, x).sizes(), x.sizes());
  EXPECT_EQ(kernmap::swiglu(x).sizes(), (at::IntArrayRef{0, 8}));
  EXPECT_EQ(kernmap::silu(at::empty({0}, c.dtype)).sizes(), (at::IntArrayRef{0}));
}

}  // namespace kernmap::testing
