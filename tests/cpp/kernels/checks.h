// The table's checks that are not "an op against its reference" (expect_matches_reference): bit-level
// properties of the raw kernels, bounds against float64 math, non-finite inputs, thread-count invariance, the
// ops' errors, and the harness's own proofs. Each runs one case of its row in table.cpp (add_rms_norm_inputs
// builds the inputs that a reference row shares with a check).
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

#include "tests/cpp/kernels/harness.h"

namespace kernmap::testing {

/// Sets an environment variable that the kernels or ops read at every call (KERNMAP_LCE_CHUNK_ROWS,
/// KERNMAP_PREFETCH_STREAMS, ...) for its lifetime, then restores the value it had (or unsets it).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    set(value);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  void set(const std::string& value) const { setenv(name_, value.c_str(), 1); }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

/// The attention's operand layouts the rotary rows run on (decoder_checks.cpp, rotary_inputs, says what each
/// is).
inline const std::vector<std::string> kRotaryLayouts = {
    "attention_views",     "contiguous", "bshd_unsqueeze2", "fused_qkv",
    "per_batch_positions", "sd_cos",     "strided_cos"};

// activation_checks.cpp: RMSNorm and the SiLU family.
/// Sizes n; layouts "aligned", "offset1" (outputs one element into a fresh block).
void streaming_stores_write_the_same_bits(const Case& c);
/// Sizes rows, n; bfloat16 and float16.
void low_precision_silu_matches_eager_bits(const Case& c);
void silu_handles_extreme_inputs(const Case& c);
void bf16_nan_has_torchs_bits(const Case& c);
/// 16-bit dtypes.
void rms_norm_backward_keeps_weight_nans(const Case& c);
/// Sizes H; 16-bit dtypes.
void rms_norm_backward_same_bits_for_either_weight_dtype(const Case& c);
/// Sizes n.
void bf16_silu_is_its_float_math_rounded(const Case& c);
void silu_gathers_give_the_same_bits(const Case& c);
void empty_inputs(const Case& c);

// grouped_checks.cpp: grouped_mm forward and backward.
/// Sizes K, N, groups; layouts "contiguous", "strided".
void grouped_mm_small_groups_within_float64_bound(const Case& c);
void grouped_mm_non_finite_stays_in_its_row_and_column(const Case& c);
void grouped_mm_same_bits_at_any_thread_count(const Case& c);
void gemm_nt_row_bits_independent_of_group_size(const Case& c);
void gemm_nt_reads_nothing_past_its_operands(const Case& c);
/// Sizes K, N, groups; layouts "b_EKN", "b_ENK_transposed".
void grouped_mm_backward_within_float64_bound_and_thread_count_free(const Case& c);

// gemm_bcast_checks.cpp: the outer-product kernel of the grouped backward. Sizes M, N, P; layouts "A" or "At"
// (A transposed), with "_B4k" (B's rows 4 KiB apart).
void gemm_bcast_within_float64_bound(const Case& c);
void gemm_bcast_independent_of_row_split_and_streaming(const Case& c);
void gemm_bcast_task_rows_bound_their_scratch(const Case& c);
void gemm_bcast_short_reductions_match_small_calls(const Case& c);
void gemm_bcast_independent_of_block_length(const Case& c);
void gemm_bcast_reads_nothing_past_its_operands(const Case& c);

// combine_checks.cpp: the MoE combine kernels and the Experts op.
/// Sizes H, k; layouts <unweighted|weighted|weighted_rounded>_<out_input|out_acc>.
void moe_combine_has_the_bits_of_the_scalar_math(const Case& c);
/// Sizes H, k.
void moe_combine_backward_matches_scalar_math_and_float64(const Case& c);
void experts_same_bits_at_any_thread_count(const Case& c);

// decoder_checks.cpp: the rotary embedding and the residual add fused with RMSNorm.
/// Sizes D; layouts kRotaryLayouts.
void rotary_has_the_eager_bits_and_float64_bound(const Case& c);
/// Sizes D; layouts with cos and sin broadcast over the heads and the positions walked after them: more
/// positions than one block of cos and sin holds (ops/rotary.cpp, block_positions).
void rotary_positions_in_blocks(const Case& c);
void rotary_gives_cos_and_sin_gradients(const Case& c);
/// Sizes D; layouts "aligned", "offset1" (outputs one element into a fresh block), "shared_cos" (cos and sin
/// shared by consecutive rows).
void rotary_streaming_stores_write_the_same_bits(const Case& c);
/// Sizes D; layouts kRotaryLayouts.
void rotary_non_finite_inputs(const Case& c);
void rotary_empty_inputs(const Case& c);
/// The inputs of the add_rms_norm rows (sizes rows, H; layouts kRowLayouts): x in the case's layout, the
/// residual in the next one (next_row_layout), the weight in `weight_dtype`.
std::vector<at::Tensor> add_rms_norm_inputs(const Case& c, at::ScalarType weight_dtype);
void add_rms_norm_has_the_bits_of_the_add_then_rms_norm(const Case& c);
/// Sizes rows, H.
void add_rms_norm_backward_is_rms_norm_backward_plus_the_residual_gradient(const Case& c);
void rms_norm_backward_rstd_nans(const Case& c);
void add_rms_norm_same_bits_at_any_thread_count(const Case& c);
/// Sizes H; layouts "aligned", "offset1".
void add_rms_norm_streaming_stores_write_the_same_bits(const Case& c);
void add_rms_norm_empty_inputs(const Case& c);
void decoder_ops_name_the_bad_argument(const Case& c);

// loss_checks.cpp: the fused LM-head product and cross-entropy.
/// Sizes N, H, V, chunk (rows per chunk), block (classes per block); layouts "no_bias", "bias".
void linear_cross_entropy_matches_reference(const Case& c);
/// Sizes V.
void cross_entropy_rows_match_float64_math(const Case& c);
/// Sizes rows, cols; layouts "2_bytes", "4_bytes"; no dtype (words of that size).
void transpose_moves_every_word(const Case& c);

// harness_checks.cpp: the ops' errors, the levels, and the harness's proofs.
void ops_name_the_bad_argument(const Case& c);
void the_level_is_active(const Case& c);
void the_public_level_functions_name_and_set_it(const Case& c);
void the_cache_reader_reads_sysfs(const Case& c);
void fresh_allocations_are_nan(const Case& c);
void an_unwritten_output_element_fails(const Case& c);

}  // namespace kernmap::testing
