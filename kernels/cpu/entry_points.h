// The CPU kernel entry points, listed once: X(name, return type, (parameters)). kernels.h declares each in
// every instruction-set level's namespace, isa.h makes them the members of KernelTable, and table.cpp
// (compiled once per level like the kernels) fills one table per level from this list. Adding an entry point
// is adding its line here and defining it in its kernel file.
//
// Conventions: rows are [row_begin, row_end) of a 2-D view whose last dimension is contiguous; *_stride
// arguments are row strides in elements. `Acc` means double when the input dtype is float64 and float
// otherwise (weights and rstd are passed in that type). `stream` asks for streaming (non-temporal) stores of
// the large outputs, meant for outputs that cannot stay in the cache; the values written are the same either
// way (taken where the level and the outputs' alignment allow).
#pragma once

// clang-format off
#define KERNMAP_CPU_ENTRY_POINTS(X)                                                                              \
  /* RMSNorm forward: y[r] = round_y(w * float(round_x(x[r] * rstd[r]))), rstd[r] = 1/sqrt(mean(x[r]^2) + eps). \
     y is contiguous [rows, H]; w and rstd are Acc. */                                                          \
  X(rms_norm_fwd, void, (DType x_dtype, DType y_dtype, const void* x, int64_t x_stride, const void* w, void* y, \
                         void* rstd, int64_t row_begin, int64_t row_end, int64_t H, double eps, bool stream))    \
  /* RMSNorm backward: dx (contiguous, x_dtype) for the rows; dw_acc[H] (Acc) += sum over the rows of          \
     dy * round_x(x * rstd), accumulated in row order. */                                                       \
  X(rms_norm_bwd, void, (DType x_dtype, DType y_dtype, const void* dy, int64_t dy_stride, const void* x,        \
                         int64_t x_stride, const void* w, const void* rstd, void* dx, void* dw_acc,              \
                         int64_t row_begin, int64_t row_end, int64_t H, bool stream))                            \
  /* Residual add + RMSNorm forward: s = round_x(x[r] + res[r]) is written to sum (contiguous [rows, H],      \
     x_dtype), and y[r], rstd[r] are rms_norm_fwd's of s (the same bits as rms_norm_fwd on sum). */            \
  X(add_rms_norm_fwd, void, (DType x_dtype, DType y_dtype, const void* x, int64_t x_stride, const void* res,   \
                             int64_t res_stride, const void* w, void* y, void* sum, void* rstd,                \
                             int64_t row_begin, int64_t row_end, int64_t H, double eps, bool stream))          \
  /* Its backward, rms_norm_bwd on the saved sum s with the residual stream's gradient added: dx =             \
     round_x(round_x(rms_norm dx) + d_sum[r]), the gradient of both x and res; dw_acc as rms_norm_bwd. */      \
  X(add_rms_norm_bwd, void, (DType x_dtype, DType y_dtype, const void* dy, int64_t dy_stride,                   \
                             const void* d_sum, int64_t d_sum_stride, const void* s, int64_t s_stride,          \
                             const void* w, const void* rstd, void* dx, void* dw_acc, int64_t row_begin,        \
                             int64_t row_end, int64_t H, bool stream))                                          \
  /* Rotary embedding (transformers' rotate-half convention) over rows [row_begin, row_end) of the walk, with  \
     h = D / 2 and each product and the sum rounded to the dtype as eager rounds them. Forward:              \
     y[i] = x[i] cos[i] - x[i+h] sin[i], y[i+h] = x[i+h] cos[i+h] + x[i] sin[i+h] (x * cos +                 \
     rotate_half(x) * sin). backward: its transpose, x a gradient: y[i] = x[i] cos[i] + x[i+h] sin[i+h],     \
     y[i+h] = x[i+h] cos[i+h] - x[i] sin[i]. */                                                              \
  X(rotary, void, (DType dtype, bool backward, const RotaryRows& rows, int64_t row_begin, int64_t row_end,       \
                   bool stream))                                                                                 \
  /* SiLU: y = x * sigmoid(x), evaluated in Acc, rounded once. y contiguous [rows, n]. */                        \
  X(silu_fwd, void, (DType dtype, const void* x, int64_t x_stride, void* y, int64_t row_begin, int64_t row_end, \
                     int64_t n, bool stream))                                                                    \
  X(silu_bwd, void, (DType dtype, const void* dy, int64_t dy_stride, const void* x, int64_t x_stride, void* dx, \
                     int64_t row_begin, int64_t row_end, int64_t n, bool stream))                                \
  /* SiLU-and-mul: y = round(round(silu(gate)) * up), the eager module's two roundings. y contiguous          \
     [rows, n]. */                                                                                               \
  X(silu_and_mul_fwd, void, (DType dtype, const void* gate, int64_t gate_stride, const void* up,                \
                             int64_t up_stride, void* y, int64_t row_begin, int64_t row_end, int64_t n,          \
                             bool stream))                                                                       \
  /* Its backward: d_gate and d_up are written with their own row strides (so a packed [rows, 2n] gradient    \
     works). */                                                                                                  \
  X(silu_and_mul_bwd, void, (DType dtype, const void* dy, int64_t dy_stride, const void* gate,                  \
                             int64_t gate_stride, const void* up, int64_t up_stride, void* d_gate,               \
                             int64_t d_gate_stride, void* d_up, int64_t d_up_stride, int64_t row_begin,          \
                             int64_t row_end, int64_t n, bool stream))                                           \
  /* Small-M matrix product in "NT" form, the layout of nn.Linear-style weights: C[m, n] = sum_k A[m, k] *     \
     B[n, k] for m < M, n < N, with A and B rows K-contiguous (row strides lda, ldb) and C rows ldc apart; fp32 \
     accumulation (fp64 for fp64), one rounding to the element type. Reads each B row once per call from       \
     memory; meant for the small row groups of MoE experts, where packing B for a BLAS call costs as much as   \
     the product. */                                                                                             \
  X(gemm_nt, void, (DType dtype, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const void* B,    \
                    int64_t ldb, void* C, int64_t ldc))                                                          \
  /* The group size from which a BLAS product (packed operands) beats this level's gemm_nt for `dtype`: the    \
     grouped forward sends groups of fewer rows to gemm_nt, larger ones to BLAS. */                             \
  X(gemm_nt_blas_rows, int64_t, (DType dtype))                                                                   \
  /* Outer-product form for the grouped backward passes: C[m, n] = sum_p A(m, p) * B[p, n] for m < M, n < N,  \
     with A(m, p) at A[m * a_m + p * a_p] (any strides: grad @ W uses (lda, 1), grad^T @ x uses (1, lda)), B   \
     rows N-contiguous with row stride ldb, C rows N-contiguous with row stride ldc. fp32 accumulation (fp64   \
     for fp64), each element's products added in order of p, one rounding: the result does not depend on M's  \
     split over calls. Long reductions go in blocks of p with the partial sums in a per-thread fp32 scratch of \
     M x N elements, so callers keep M x N to a few hundred KiB. P = 0 writes zeros. */                         \
  X(gemm_bcast, void, (DType dtype, int64_t M, int64_t N, int64_t P, const void* A, int64_t a_m, int64_t a_p,  \
                       const void* B, int64_t ldb, void* C, int64_t ldc, bool stream))                           \
  /* The rows of C a streamed gemm_bcast call with A read across its rows (a weight gradient, x^T of `steps`   \
     rows) should take for `cols` columns: rows x cols within the partial sums' scratch (l2_block_bytes), or   \
     up to 512 where this level's kernel copies A and B once for all of them (a short reduction, or the row    \
     order of long ones) and A's copy stays within 8 MiB. Only a speed: no result depends on it. */            \
  X(gemm_bcast_task_rows, int64_t, (DType dtype, int64_t steps, int64_t cols))                                 \
  /* MoE combine, for tokens t in [t_begin, t_end): out[t] = round(sum over slot < k, in slot order, of        \
     term(rows[j]), j = pos[t * k + slot]), summed in Acc from +0: term(r) = r when weights is null, else      \
     r * weights[j], rounded to the element type first when round_product (transformers' `rows * weights` in   \
     the rows' dtype). rows contiguous [*, H]; weights Acc, one per row; out contiguous [*, H] of out_dtype,    \
     which is dtype or its Acc type (float32 for bfloat16 and float16). */                                      \
  X(moe_combine, void, (DType dtype, DType out_dtype, const void* rows, const int64_t* pos, int64_t k,          \
                        const void* weights, bool round_product, void* out, int64_t t_begin, int64_t t_end,      \
                        int64_t H))                                                                              \
  /* Its backward, for rows j in [row_begin, row_end) (token order[j] / k): d_rows[j] = round(grad[token] *    \
     weights[j]) and d_weights[j] = <grad[token], rows[j]> in Acc, summed in vector lanes (a fixed order per   \
     level and H, not element order). grad, rows and d_rows contiguous [*, H]; weights and d_weights Acc. */   \
  X(moe_combine_bwd, void, (DType dtype, const void* grad, const void* rows, const void* weights,               \
                            const int64_t* order, int64_t k, void* d_rows, void* d_weights, int64_t row_begin,   \
                            int64_t row_end, int64_t H))                                                   \
  /* Cross-entropy over rows [row_begin, row_end) of a chunk of logits z (rows ldz elements apart, V classes), \
     row r's label target[r] in [0, V): loss[r] (Acc) = logsumexp(z[r]) - z[r][target[r]], the log-sum-exp in \
     Acc from the row's maximum. With grad, z[r] is overwritten with round(softmax(z[r]) * scale), minus scale \
     at the label: the gradient of scale * loss[r]. A row with a NaN or an infinite maximum gives NaN loss and \
     gradient. */                                                                                               \
  X(cross_entropy_rows, void, (DType dtype, void* z, int64_t ldz, int64_t V, const int64_t* target,            \
                               double scale, void* loss, bool grad, int64_t row_begin, int64_t row_end))      \
  /* The same log-sum-exp by blocks of classes, for the loss alone: z holds classes [v0, v0 + cols) of rows   \
     [row_begin, row_end) (ldz apart); max[r] and sum[r] (Acc, -inf and 0 before the first block) become the \
     running maximum and sum of e^(z - max) over the blocks so far, and label_logit[r] (Acc) takes           \
     z[r][target[r] - v0] when the label is in the block. A NaN logit or an infinite maximum leaves max NaN  \
     or +inf; loss = -((label_logit - max) - log(sum)) where max is finite, else NaN (cross_entropy_rows'). */\
  X(cross_entropy_block, void, (DType dtype, const void* z, int64_t ldz, int64_t cols, int64_t v0,             \
                                const int64_t* target, void* max, void* sum, void* label_logit,                 \
                                int64_t row_begin, int64_t row_end))                                                 \
  /* Transpose of 2- or 4-byte elements (element_bytes; bits moved): dst[j * dst_ld + i] = src[i * src_ld + j] \
     for i < rows and the columns j in [col_begin, col_end) (the transpose's rows, so that threads split     \
     them). */                                                                                                \
  X(transpose, void, (int64_t element_bytes, const void* src, int64_t src_ld, void* dst, int64_t dst_ld,      \
                      int64_t rows, int64_t col_begin, int64_t col_end, bool stream))
// clang-format on
