// The table of kernel test cases. A row is an op (or one property of an op), the shapes and layouts it runs
// on and its check; main.cpp runs every shape x layout x dtype of every row at every CPU level. Adding a
// kernel is adding its row: an expect_matches_reference call that builds the op's inputs for a case and names
// the kernel, its reference and how many terms each result sums (docs/development.md, "Tests").
#include <algorithm>

#include "kernmap/ops.h"
#include "tests/cpp/kernels/checks.h"

namespace kernmap::testing {
namespace {

const std::vector<int64_t> kOddSizes = {1, 7, 769, 5125};

std::vector<Shape> concat(std::vector<Shape> a, const std::vector<Shape>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// RMSNorm's shapes: 6 rows (one a backward call: the op splits the rows into kWeightGradBlocks blocks), and
// 70 rows, two or three a call, whose backward pipelines each row's second pass with the next row's first
// (kernels/cpu/rms_norm.cpp, bwd_rows_piped).
const std::vector<Shape> kNormShapes =
    concat(grid({{"rows", {6}}, {"H", kOddSizes}}), grid({{"rows", {70}}, {"H", {7, 769}}}));

// rms_norm with the weight in `weight_dtype` (Undefined: x's dtype).
void rms_norm_matches_reference(const Case& c, at::ScalarType weight_dtype) {
  const int64_t H = c["H"];
  expect_matches_reference(
      c, {.inputs = {laid_out(c.layout, c["rows"], H, c.dtype),
                     norm_weight(H, weight_dtype == at::ScalarType::Undefined ? c.dtype : weight_dtype)},
          .kernel = [](const auto& in) { return kernmap::rms_norm(in[0], in[1], 1e-6); },
          .reference = [](const auto& in) { return kernmap::reference::rms_norm(in[0], in[1], 1e-6); },
          .terms = {1, 1, c["rows"]}});  // dW sums over the rows
}

// add_rms_norm with the weight in `weight_dtype` (Undefined: x's dtype): the normed output and the sum, and
// the gradients of x, the residual and the weight.
void add_rms_norm_matches_reference(const Case& c, at::ScalarType weight_dtype) {
  const std::vector<at::Tensor> out = expect_matches_reference(
      c,
      {.inputs = add_rms_norm_inputs(c, weight_dtype == at::ScalarType::Undefined ? c.dtype : weight_dtype),
       .kernel = [](const auto& in) { return kernmap::add_rms_norm(in[0], in[1], in[2], 1e-6); },
       .reference =
           [](const auto& in) { return kernmap::reference::add_rms_norm(in[0], in[1], in[2], 1e-6); },
       .terms = {1, 1, 1, 1, c["rows"]}});  // dW sums over the rows
  // x and the residual get one gradient, the sum's.
  if (out.size() == 5) {
    EXPECT_TRUE(same_bits(out[3], out[2])) << "the residual's gradient against x's";
  }
}

// grouped_mm on 4 experts; b [E, K, N], or a transposed view of [E, N, K] (the Experts layer's weights).
std::vector<at::Tensor> grouped_mm_matches_reference(const Case& c) {
  const int64_t K = c["K"], N = c["N"], E = static_cast<int64_t>(c.groups().size());
  const at::Tensor offs = offsets(c.groups());
  const at::Tensor b =
      c.layout == "b_ENK_transposed" ? randn({E, N, K}, c.dtype).transpose(1, 2) : randn({E, K, N}, c.dtype);
  int64_t rows = 1;
  for (int64_t g : c.groups()) rows = std::max(rows, g);
  return expect_matches_reference(
      c, {.inputs = {randn({offs[-1].item<int64_t>(), K}, c.dtype), b, offs},
          .kernel = [](const auto& in) { return kernmap::grouped_mm(in[0], in[1], in[2]); },
          .reference = [](const auto& in) { return kernmap::reference::grouped_mm(in[0], in[1], in[2]); },
          .terms = {K, N, rows}});  // y over K, da over N, db over a group's rows
}

// Experts routing [T, k]: k distinct experts per token, at random, or ("one_expert_for_all") expert 3 in
// every token's first slot and k - 1 distinct others in the rest; weights a softmax over the slots.
std::pair<at::Tensor, at::Tensor> routing(const Case& c) {
  const int64_t T = c["T"], E = c["E"], k = c["k"];
  at::Tensor ids;
  if (c.layout == "one_expert_for_all") {
    const at::Tensor others =
        at::argsort(at::rand({T, E - 1}), /*dim=*/1, /*descending=*/false).narrow(1, 0, k - 1);
    ids = at::cat({at::full({T, 1}, 3, at::kLong), others + others.ge(3).to(at::kLong)}, 1).contiguous();
  } else {
    ids = at::argsort(at::rand({T, E}), /*dim=*/1, /*descending=*/false).narrow(1, 0, k).contiguous();
  }
  return {ids, at::rand({T, k}, at::kDouble).softmax(-1).to(c.dtype)};
}

// The experts op against its reference ("strided_weights": gate_up_proj a transposed view, down_proj a
// slice); an expert no token is routed to gets zero weight gradients.
void experts_match_reference(const Case& c) {
  const int64_t T = c["T"], E = c["E"], k = c["k"], H = c["H"], I = c["I"];
  const auto [ids, weights] = routing(c);
  const bool strided = c.layout == "strided_weights";
  const at::Tensor gate_up =
      strided ? randn({E, H, 2 * I}, c.dtype).transpose(1, 2) : randn({E, 2 * I, H}, c.dtype);
  const at::Tensor down = strided ? randn({E, H, 2 * I}, c.dtype).narrow(2, 0, I) : randn({E, H, I}, c.dtype);
  // The longest sum: gate/up over H, down over I, the weight gradients over the up to T * k rows of an
  // expert.
  const int64_t terms = std::max({H, 2 * I, T * k});
  const std::vector<at::Tensor> out = expect_matches_reference(
      c, {.inputs = {randn({T, H}, c.dtype), ids, weights, gate_up, down},
          .kernel = [](const auto& in) { return kernmap::experts(in[0], in[1], in[2], in[3], in[4]); },
          .reference =
              [](const auto& in) { return kernmap::reference::experts(in[0], in[1], in[2], in[3], in[4]); },
          .terms = {terms, terms, terms, terms, terms},
          .low_precision_against_float64 = true});
  if (out.size() != 5) return;  // y, then the gradients of hidden, topk_weights, gate_up_proj, down_proj
  for (int64_t e = 0; e < E; ++e) {
    if (ids.eq(e).any().item<bool>()) continue;
    EXPECT_EQ(out[3][e].abs().sum().item<double>(), 0.0) << "gate_up_proj of the unused expert " << e;
    EXPECT_EQ(out[4][e].abs().sum().item<double>(), 0.0) << "down_proj of the unused expert " << e;
  }
}

// The gemm_bcast cases: rows around the 4-row (AVX-512) and 6-row (below it) register blocks, columns around
// the 16-lane vector and 64-column block, reduction lengths around the bf16 pairs, and reductions long enough
// to be split into blocks (2048 columns: blocks of 24 to 128 steps, by the L2 size, the dtype and the level;
// 130 columns: blocks of 256 steps); then bf16 long reductions (more than 64 steps, A's pairs in its rows):
// interleaved 32-column panels and row blocks of up to 12 rows, rows around the blocks, columns around the
// 32-column tile, an odd step alone at the end of a reduction split into blocks of 256 steps (257) or not
// split (65); columns in two chunks of 576 and 524 with 128-step blocks, each block through both chunks
// (1100 x 301).
std::vector<Shape> gemm_bcast_shapes() {
  std::vector<Shape> out;
  auto add = [&](int64_t M, int64_t N, int64_t P, std::string layout) {
    out.push_back({.sizes = {{"M", M}, {"N", N}, {"P", P}}, .layouts = {std::move(layout)}});
  };
  for (int64_t M : {1, 2, 3, 4, 5, 15, 16, 17, 63, 64, 200}) add(M, 130, 17, "A");
  for (int64_t N : {1, 15, 16, 17, 63, 64, 65, 130, 200}) add(17, N, 63, "A");
  for (int64_t P : {0, 1, 2, 15, 16, 17, 63, 64, 200}) add(5, 200, P, "A");
  for (int64_t P : {0, 1, 2, 15, 16, 17, 63, 64, 200}) add(17, 130, P, "At");
  for (int64_t M : {31, 32, 33, 63}) add(M, 130, 17, "At_B4k");
  add(40, 200, 64, "A_B4k");
  add(50, 200, 301, "A_B4k");  // a blocked reduction's panels copied (8 or more row blocks, below AVX-512)
  for (int64_t M : {1, 11, 12, 13, 24, 25, 37})
    for (int64_t N : {1, 17, 32, 33, 130})
      for (int64_t P : {65, 257}) add(M, N, P, "A");
  add(13, 1100, 301, "A");
  add(6, 2048, 301, "A");
  add(9, 130, 777, "A");
  add(9, 130, 777, "At");
  return out;
}

// Short reductions over many row blocks: rows around 8 row blocks, reduction lengths around the pairs and up
// to the one-pass limit (256 steps at 128 columns) and past it (blocked); B's rows 4 KiB apart at 32 rows.
std::vector<Shape> short_reduction_shapes() {
  std::vector<Shape> out;
  for (int64_t M : {29, 32, 35, 64})
    for (int64_t P : {1, 2, 3, 16, 17, 64, 255, 256, 257})
      for (int64_t N : {64, 131}) {
        Shape s{.sizes = {{"M", M}, {"N", N}, {"P", P}}};
        s.layouts =
            M == 32 ? std::vector<std::string>{"A_B4k", "At_B4k"} : std::vector<std::string>{"A", "At"};
        out.push_back(std::move(s));
      }
  return out;
}

// float64 takes one pass through gemm_bcast: long reductions add nothing there, only time.
bool fp64_past(const Case& c, int64_t P) {
  return c.dtype == at::kDouble && c["P"] > P;
}

// Group sizes around the small-group kernel's 8-row groups, 16-row (AVX2) and 32-row (AVX-512) passes and
// dot-product rows.
const std::vector<int64_t> kSmallGroups = {0,  1,  2,  3,  4,  5,  7,  8,  9,  10, 11, 12, 13, 15, 16, 17, 18,
                                           19, 20, 23, 24, 25, 31, 32, 33, 34, 35, 40, 41, 47, 48, 57, 63, 0};

std::vector<Shape> with_groups(std::vector<Shape> shapes, const std::vector<int64_t>& groups) {
  for (Shape& s : shapes) s.groups = groups;
  return shapes;
}

}  // namespace

const std::vector<Row>& kernel_table() {
  static const std::vector<Row> rows = {
      // ---- RMSNorm, the SiLU family: the op against its reference, forward and backward ----
      {.op = "rms_norm",
       .shapes = kNormShapes,
       .layouts = kRowLayouts,
       .check = [](const Case& c) { rms_norm_matches_reference(c, at::ScalarType::Undefined); }},
      // An fp32 weight with 16-bit x: the output is fp32 (the transformers quirk), rounded to x's dtype
      // first.
      {.op = "rms_norm_fp32_weight",
       .shapes = grid({{"rows", {6}}, {"H", kOddSizes}}),
       .layouts = kRowLayouts,
       .check = [](const Case& c) { rms_norm_matches_reference(c, at::kFloat); },
       .dtypes = {at::kBFloat16, at::kHalf}},
      {.op = "silu_and_mul",
       .shapes = grid({{"rows", {4, 6}}, {"I", kOddSizes}}),
       .layouts = kRowLayouts,
       .check =
           [](const Case& c) {
             const at::Tensor gate = laid_out(c.layout, c["rows"], c["I"], c.dtype);
             expect_matches_reference(
                 c, {.inputs = {gate, randn(gate.sizes(), c.dtype)},
                     .kernel = [](const auto& in) { return kernmap::silu_and_mul(in[0], in[1]); },
                     .reference =
                         [](const auto& in) { return kernmap::reference::silu_and_mul(in[0], in[1]); }});
           }},
      {.op = "swiglu",
       .shapes = grid({{"I", kOddSizes}}),
       .layouts = {"2x3x2I"},
       .check =
           [](const Case& c) {
             expect_matches_reference(
                 c, {.inputs = {randn({2, 3, 2 * c["I"]}, c.dtype)},
                     .kernel = [](const auto& in) { return kernmap::swiglu(in[0]); },
                     .reference = [](const auto& in) { return kernmap::reference::swiglu(in[0]); }});
           }},
      {.op = "silu",
       .shapes = grid({{"I", kOddSizes}}),
       .layouts = {"2x3x2I"},
       .check =
           [](const Case& c) {
             expect_matches_reference(
                 c, {.inputs = {randn({2, 3, 2 * c["I"]}, c.dtype)},
                     .kernel = [](const auto& in) { return kernmap::silu(in[0]); },
                     .reference = [](const auto& in) { return kernmap::reference::silu(in[0]); }});
           }},
      // ---- the SiLU family and RMSNorm: properties ----
      {.op = "streaming_stores",
       .shapes = grid({{"n", {64, 80, 37}}}),
       .layouts = {"aligned", "offset1"},
       .check = streaming_stores_write_the_same_bits},
      {.op = "silu_eager_roundings",
       .shapes = grid({{"rows", {16}}, {"n", {1031}}}),
       .layouts = {""},
       .check = low_precision_silu_matches_eager_bits,
       .dtypes = {at::kBFloat16, at::kHalf}},  // only the 16-bit dtypes round
      {.op = "silu_extreme_inputs",
       .shapes = {Shape{}},
       .layouts = {""},
       .check = silu_handles_extreme_inputs},
      {.op = "bf16_nan_bits",
       .shapes = {Shape{}},
       .layouts = {""},
       .check = bf16_nan_has_torchs_bits,
       .dtypes = {at::kBFloat16},
       // vcvtneps2bf16 keeps a NaN's sign and payload (vec.h)
       .skip = [](const Case& c) { return c.level >= kernmap::cpu::Level::kAvx512Bf16; }},
      {.op = "rms_norm_backward_weight_nans",
       .shapes = {Shape{}},
       .layouts = {""},
       .check = rms_norm_backward_keeps_weight_nans,
       .dtypes = {at::kBFloat16, at::kHalf}},
      {.op = "rms_norm_backward_either_weight_dtype",
       .shapes = grid({{"H", {8, 24, 40, 72, 100, 3608}}}),
       .layouts = {""},
       .check = rms_norm_backward_same_bits_for_either_weight_dtype,
       .dtypes = {at::kBFloat16, at::kHalf}},
      {.op = "bf16_silu_every_gate",
       .shapes = grid({{"n", {256, 1031}}}),
       .layouts = {""},
       .check = bf16_silu_is_its_float_math_rounded,
       .dtypes = kNoDtype},
      {.op = "silu_gathers_same_bits",
       .shapes = grid({{"n", {16, 1031, 4096}}}),
       .layouts = {"contiguous", "strided"},
       .check = silu_gathers_give_the_same_bits,
       .dtypes = kNoDtype},
      {.op = "empty_inputs", .shapes = {Shape{}}, .layouts = {""}, .check = empty_inputs},
      // ---- the residual add fused with RMSNorm: against its reference, then properties ----
      {.op = "add_rms_norm",
       .shapes = kNormShapes,
       .layouts = kRowLayouts,
       .check = [](const Case& c) { add_rms_norm_matches_reference(c, at::ScalarType::Undefined); }},
      {.op = "add_rms_norm_fp32_weight",
       .shapes = grid({{"rows", {6}}, {"H", kOddSizes}}),
       .layouts = kRowLayouts,
       .check = [](const Case& c) { add_rms_norm_matches_reference(c, at::kFloat); },
       .dtypes = {at::kBFloat16, at::kHalf}},
      {.op = "add_rms_norm_eager_bits",
       // 128 rows of 7: a multiply-add fused in one kernel and not the other changes about one row in ten.
       // H 24 and 40: the plain forward's paired bf16 blocks at avx2 (normalize_row) followed by a single
       // block, against the fused forward's single blocks.
       .shapes = concat(grid({{"rows", {6}}, {"H", {1, 7, 24, 40, 769, 5125}}}),
                        {{.sizes = {{"rows", 128}, {"H", 7}}}}),
       .layouts = kRowLayouts,
       .check = add_rms_norm_has_the_bits_of_the_add_then_rms_norm},
      {.op = "add_rms_norm_backward_bits",
       // 96 rows: three a weight-gradient block, so the pipelined loop's second pass runs (one row a block
       // runs the row's passes one after the other); H 1000: 32-element steps, two single blocks, a tail.
       .shapes = {{.sizes = {{"rows", 11}, {"H", 259}}}, {.sizes = {{"rows", 96}, {"H", 1000}}}},
       .layouts = {""},
       .check = add_rms_norm_backward_is_rms_norm_backward_plus_the_residual_gradient},
      {.op = "rms_norm_backward_rstd_nans",
       .shapes = {Shape{}},
       .layouts = {""},
       .check = rms_norm_backward_rstd_nans},
      {.op = "add_rms_norm_thread_count",
       .shapes = {{.sizes = {{"rows", 300}, {"H", 777}}}},
       .layouts = {""},
       .check = add_rms_norm_same_bits_at_any_thread_count},
      {.op = "add_rms_norm_streaming_stores",
       .shapes = grid({{"H", {64, 80, 37}}}),
       .layouts = {"aligned", "offset1"},
       .check = add_rms_norm_streaming_stores_write_the_same_bits},
      {.op = "add_rms_norm_empty_inputs",
       .shapes = {Shape{}},
       .layouts = {""},
       .check = add_rms_norm_empty_inputs},
      // ---- the rotary embedding: bit for bit against the eager math, within a float64 bound ----
      {.op = "rotary",
       .shapes = grid({{"D", {2, 6, 64, 128, 130, 514}}}),
       .layouts = kRotaryLayouts,
       .check = rotary_has_the_eager_bits_and_float64_bound},
      {.op = "rotary_positions_in_blocks",
       .shapes = grid({{"D", {64}}}),
       .layouts = {"contiguous", "per_batch_positions", "sd_cos"},
       .check = rotary_positions_in_blocks},
      {.op = "rotary_cos_sin_gradients",
       .shapes = grid({{"D", {6}}}),
       .layouts = {"attention_views"},
       .check = rotary_gives_cos_and_sin_gradients},
      {.op = "rotary_streaming_stores",
       .shapes = grid({{"D", {64, 130, 514}}}),
       .layouts = {"aligned", "offset1", "shared_cos"},
       .check = rotary_streaming_stores_write_the_same_bits},
      {.op = "rotary_non_finite",
       .shapes = grid({{"D", {64, 130}}}),
       .layouts = {"attention_views", "contiguous"},
       .check = rotary_non_finite_inputs},
      {.op = "rotary_empty_inputs", .shapes = {Shape{}}, .layouts = {""}, .check = rotary_empty_inputs},
      // ---- grouped_mm: against its reference (uneven groups, empty ones, edge blocks in every dimension;
      // the
      // second shape spans several 64-column blocks and 128-column tiles and odd group sizes) ----
      {.op = "grouped_mm",
       .shapes = {{.sizes = {{"K", 77}, {"N", 70}}, .groups = {5, 0, 18, 17}},
                  {.sizes = {{"K", 131}, {"N", 200}}, .groups = {0, 33, 0, 37}},
                  // Groups on both sides of the forward's gemm_nt / BLAS routing at every level (64, 128,
                  // 256).
                  {.sizes = {{"K", 70}, {"N", 45}}, .groups = {63, 64, 127, 128, 255, 256, 0, 130}}},
       .layouts = {"b_EKN", "b_ENK_transposed"},
       .check =
           [](const Case& c) {
             const std::vector<at::Tensor> out = grouped_mm_matches_reference(c);
             for (size_t e = 0; e < c.groups().size() && out.size() == 3; ++e) {
               if (c.groups()[e] == 0) {
                 EXPECT_EQ(out[2][e].abs().sum().item<double>(), 0.0) << "empty group " << e;
               }
             }
           }},
      {.op = "grouped_mm_small_groups",
       .shapes = with_groups(grid({{"K", {1, 77, 259}}, {"N", {1, 53, 70}}}), kSmallGroups),
       .layouts = {"contiguous", "strided"},
       .check = grouped_mm_small_groups_within_float64_bound,
       .skip = [](const Case& c) { return c["K"] == 1 && c["N"] == 70; }},  // nothing K = 1, N = 53 misses
      {.op = "grouped_mm_non_finite",
       .shapes = {{.sizes = {{"T", 40}}, .groups = {17, 0, 23}},
                  {.sizes = {{"T", 37}}, .groups = {19, 0, 18}},
                  {.sizes = {{"T", 13}}, .groups = {10, 0, 3}}},
       .layouts = {""},
       .check = grouped_mm_non_finite_stays_in_its_row_and_column},
      {.op = "grouped_mm_thread_count",
       .shapes = {{.sizes = {{"K", 301}, {"N", 250}}, .groups = {9, 0, 17, 33, 1, 40, 22}},
                  // Groups past 64 rows: gemm_nt (several passes) below the level's BLAS routing, BLAS above.
                  {.sizes = {{"K", 131}, {"N", 250}}, .groups = {200, 70, 0, 300}},
                  // bf16 groups through torch's BLAS (oneDNN) with a long reduction: inside the two-thread
                  // tasks it summed in another order than on one thread until its calls were made serial.
                  {.sizes = {{"K", 2048}, {"N", 64}}, .groups = {70, 0, 200}}},
       .layouts = {""},
       .check = grouped_mm_same_bits_at_any_thread_count},
      // The quads form: a row's bits whatever the group's size (fp32, bf16; K odd and past a line).
      {.op = "gemm_nt_row_bits",
       .shapes = grid({{"K", {77, 301}}, {"N", {53}}}),
       .layouts = {""},
       .check = gemm_nt_row_bits_independent_of_group_size,
       .dtypes = {at::kFloat, at::kBFloat16}},
      {.op = "gemm_nt_edge_reads",
       .shapes = grid({{"M", {1, 3, 5, 17, 33}}, {"N", {1, 7, 16, 17, 48, 50}}, {"K", {1, 15, 33, 50, 70}}}),
       .layouts = {""},
       .check = gemm_nt_reads_nothing_past_its_operands},
      // Group sizes around every block and the bf16 BLAS threshold (64 rows), an empty group, and one long
      // enough for the fp32 weight gradient's reduction blocks in the row order below 2 MiB of L2 (1100).
      {.op = "grouped_mm_backward",
       .shapes = {{.sizes = {{"K", 70}, {"N", 131}}, .groups = {0, 1, 2, 15, 16, 17, 63, 64, 200, 1100}},
                  // A reduction long enough that the weight gradient's tasks take fewer than 512 rows (their
                  // packed copy of x^T within 8 MiB: 174 rows at 12000 fp32 steps).
                  {.sizes = {{"K", 300}, {"N", 40}}, .groups = {0, 12000, 7}},
                  // grad_a of bf16 groups through BLAS where its blocking depends on the thread count it is
                  // told (oneDNN, N 1024; fp32 through MKL in the b_EKN layout): SerialBlas.
                  {.sizes = {{"K", 130}, {"N", 1024}}, .groups = {100, 64, 3, 300}}},
       .layouts = {"b_EKN", "b_ENK_transposed"},
       .check = grouped_mm_backward_within_float64_bound_and_thread_count_free},
      {.op = "gemm_bcast",
       .shapes = gemm_bcast_shapes(),
       .layouts = {},
       .check = gemm_bcast_within_float64_bound,
       .skip = [](const Case& c) { return fp64_past(c, 300); }},
      {.op = "gemm_bcast_row_split",
       .shapes = {{.sizes = {{"M", 23}, {"N", 200}, {"P", 77}}, .layouts = {"A"}},
                  {.sizes = {{"M", 23}, {"N", 2048}, {"P", 150}}, .layouts = {"At"}},
                  {.sizes = {{"M", 13}, {"N", 130}, {"P", 777}}, .layouts = {"A"}},
                  // bf16 long reductions with A's pairs in its rows at the dot-product levels: two column
                  // chunks a reduction block, streamed and not.
                  {.sizes = {{"M", 23}, {"N", 1100}, {"P", 301}}, .layouts = {"A"}},
                  {.sizes = {{"M", 41}, {"N", 130}, {"P", 16}}, .layouts = {"At_B4k"}},
                  // Streamed short reductions of 8 or more row blocks (the rows of the third call): the row
                  // order, its two-line register blocks below AVX-512 (a last panel of half their width at N
                  // 208, a leftover vector at 200, one and two leftover rows).
                  {.sizes = {{"M", 56}, {"N", 208}, {"P", 16}}, .layouts = {"At"}},
                  {.sizes = {{"M", 58}, {"N", 192}, {"P", 31}}, .layouts = {"At_B4k"}},
                  {.sizes = {{"M", 57}, {"N", 200}, {"P", 9}}, .layouts = {"A"}},
                  // Rows past the first streamed one and two register blocks later at avx2: a row of one
                  // register block and a half panel, and of two (fewer blocks than the delay).
                  {.sizes = {{"M", 57}, {"N", 48}, {"P", 16}}, .layouts = {"At_B4k"}},
                  {.sizes = {{"M", 56}, {"N", 64}, {"P", 5}}, .layouts = {"A"}},
                  // Streamed reductions longer than short_reduction_bytes at every L2 size up to 2 MiB: the
                  // row order column range by column range (a last range ending in a half panel, a leftover
                  // vector and columns, leftover rows), and in reduction blocks, their sums parked, where 128
                  // columns of all the steps do not fit (1100 steps below 2 MiB of L2, 2100 at 2 MiB too).
                  {.sizes = {{"M", 56}, {"N", 1050}, {"P", 300}}, .layouts = {"At"}},
                  {.sizes = {{"M", 50}, {"N", 1000}, {"P", 300}}, .layouts = {"At_B4k"}},
                  {.sizes = {{"M", 50}, {"N", 130}, {"P", 1100}}, .layouts = {"A"}},
                  {.sizes = {{"M", 50}, {"N", 1050}, {"P", 2100}}, .layouts = {"At"}}},
       .layouts = {},
       .check = gemm_bcast_independent_of_row_split_and_streaming,
       .skip = [](const Case& c) { return fp64_past(c, 300); }},
      // Reductions long enough for several blocks at every cap: fp32 rows 8 KiB apart (grad @ W of gate_up,
      // 4 KiB for bf16), a row block and leftover rows, and 128-column panels of a long reduction.
      {.op = "gemm_bcast_block_lengths",
       .shapes = {{.sizes = {{"M", 6}, {"N", 2048}, {"P", 301}}, .layouts = {"A_B4k"}},
                  {.sizes = {{"M", 17}, {"N", 200}, {"P", 150}}, .layouts = {"A"}},
                  {.sizes = {{"M", 9}, {"N", 130}, {"P", 777}}, .layouts = {"A"}}},
       .layouts = {},
       .check = gemm_bcast_independent_of_block_length,
       .skip = [](const Case& c) { return c.dtype == at::kDouble; }},
      {.op = "gemm_bcast_task_rows",
       .shapes = {Shape{}},
       .layouts = {""},
       .check = gemm_bcast_task_rows_bound_their_scratch},
      // M, N and P around the tiles' 16 rows and columns and 32 steps, the vectors' 16 and the pairs' 2.
      {.op = "gemm_bcast_edge_reads",
       .shapes = grid({{"M", {1, 7, 17, 33}}, {"N", {5, 17, 130}}, {"P", {1, 3, 33, 70}}}),
       .layouts = {"A", "At"},
       .check = gemm_bcast_reads_nothing_past_its_operands},
      {.op = "gemm_bcast_short_reductions",
       .shapes = short_reduction_shapes(),
       .layouts = {},
       .check = gemm_bcast_short_reductions_match_small_calls,
       .skip = [](const Case& c) { return fp64_past(c, 64); }},
      // ---- the MoE combine and Experts ----
      // One expert, uneven routing, 64 experts with most unused, a token count that is not a multiple of k.
      {.op = "experts",
       .shapes = {{.sizes = {{"E", 1}, {"k", 1}, {"T", 6}, {"H", 16}, {"I", 8}}},
                  {.sizes = {{"E", 5}, {"k", 2}, {"T", 8}, {"H", 9}, {"I", 6}}},
                  {.sizes = {{"E", 6}, {"k", 2}, {"T", 11}, {"H", 10}, {"I", 7}}},
                  {.sizes = {{"E", 7}, {"k", 2}, {"T", 9}, {"H", 13}, {"I", 11}}},
                  {.sizes = {{"E", 64}, {"k", 8}, {"T", 20}, {"H", 24}, {"I", 10}}}},
       .layouts = {"random_routing", "one_expert_for_all", "strided_weights"},
       .check = experts_match_reference,
       .skip = [](const Case& c) { return c.layout == "one_expert_for_all" && c["E"] < 4; }},  // no expert 3
      {.op = "moe_combine",
       .shapes = grid({{"H", {1, 15, 16, 17, 33, 2048 + 3}}, {"k", {1, 2, 8}}}),
       .layouts = {"unweighted_out_input", "weighted_out_input", "weighted_rounded_out_input",
                   "unweighted_out_acc", "weighted_out_acc", "weighted_rounded_out_acc"},
       .check = moe_combine_has_the_bits_of_the_scalar_math,
       // the accumulation type of float32 and float64 is their own: out_acc is out_input
       .skip = [](const Case& c) { return c.layout.ends_with("out_acc") && acc_of(c.dtype) == c.dtype; }},
      {.op = "moe_combine_backward",
       .shapes = grid({{"H", {1, 15, 16, 17, 33, 2048 + 3}}, {"k", {1, 2, 8}}}),
       .layouts = {""},
       .check = moe_combine_backward_matches_scalar_math_and_float64},
      {.op = "experts_thread_count",
       .shapes = {{.sizes = {{"T", 37}, {"H", 67}, {"E", 5}, {"I", 24}, {"k", 3}}}},
       .layouts = {""},
       .check = experts_same_bits_at_any_thread_count},
      // ---- the fused LM-head product and cross-entropy ----
      // One element; several chunks of rows (16 and 5 rows a chunk); a vocabulary under one vector (7); the
      // 16-bit products by blocks of classes (block: KERNMAP_LCE_VOCAB_BLOCK, 0 the default), several blocks
      // with the last partial, and a chunk of 100 rows and blocks of 72 classes, whose transposes take whole
      // bands and tiles and partial ones.
      {.op = "linear_cross_entropy",
       .shapes = {{.sizes = {{"N", 1}, {"H", 1}, {"V", 1}, {"chunk", 256}, {"block", 0}}},
                  {.sizes = {{"N", 37}, {"H", 19}, {"V", 101}, {"chunk", 256}, {"block", 64}}},
                  {.sizes = {{"N", 203}, {"H", 33}, {"V", 517}, {"chunk", 16}, {"block", 40}}},
                  {.sizes = {{"N", 64}, {"H", 8}, {"V", 7}, {"chunk", 5}, {"block", 3}}},
                  {.sizes = {{"N", 150}, {"H", 24}, {"V", 300}, {"chunk", 100}, {"block", 72}}}},
       .layouts = {"no_bias", "bias"},
       .check = linear_cross_entropy_matches_reference},
      // Its row kernel over 203 logits: no block width divides it.
      {.op = "cross_entropy_rows",
       .shapes = grid({{"V", {203}}}),
       .layouts = {""},
       .check = cross_entropy_rows_match_float64_math},
      // Its transposes: bands (32 rows of 2-byte words, 16 of 4-byte) and tiles (8 and 4 columns) whole and
      // partial, one row or column.
      {.op = "transpose",
       .shapes = grid({{"rows", {1, 15, 16, 17, 31, 32, 33, 100}}, {"cols", {1, 3, 4, 5, 7, 8, 9, 70}}}),
       .layouts = {"2_bytes", "4_bytes"},
       .check = transpose_moves_every_word,
       .dtypes = kNoDtype},
      // ---- the ops' errors, the levels, the harness ----
      {.op = "op_errors",
       .shapes = {Shape{}},
       .layouts = {""},
       .check = ops_name_the_bad_argument,
       .dtypes = kNoDtype},
      {.op = "decoder_op_errors",
       .shapes = {Shape{}},
       .layouts = {""},
       .check = decoder_ops_name_the_bad_argument,
       .dtypes = kNoDtype},
      {.op = "levels",
       .shapes = {Shape{}},
       .layouts = {""},
       .check = the_level_is_active,
       .dtypes = kNoDtype},
      {.op = "cpu_level_api",
       .shapes = {Shape{}},
       .layouts = {""},
       .check = the_public_level_functions_name_and_set_it,
       .dtypes = kNoDtype},
      {.op = "cpu_caches",
       .shapes = {Shape{}},
       .layouts = {""},
       .check = the_cache_reader_reads_sysfs,
       .dtypes = kNoDtype},
      {.op = "poison",
       .shapes = {Shape{}},
       .layouts = {"fresh_allocations"},
       .check = fresh_allocations_are_nan},
      {.op = "poison",
       .shapes = {Shape{}},
       .layouts = {"unwritten_element_fails"},
       .check = an_unwritten_output_element_fails},
  };
  return rows;
}

}  // namespace kernmap::testing
