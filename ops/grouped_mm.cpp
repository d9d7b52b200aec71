// The GroupedMM layer: kernmap::grouped_mm and its backward (checks, CPU, Meta shapes, autograd), the grouped
// products they share with the experts op (ops/grouped_mm.h), the reference and float64 kernels, and the
// layer record. The CPU products run as (group x tile) tasks on the intra-op pool, each task writing only its
// own outputs, so results do not depend on the thread count. The kernel follows b's layout and the group's
// size: b in nn.Linear layout (K-contiguous) goes to gemm_nt for groups under the level's gemm_nt_blas_rows,
// to BLAS from there; b with N-contiguous rows (the backward's grad @ W) and the weight gradients go to the
// outer-product kernel gemm_bcast (bf16 groups of kBf16BlasRows rows or more: BLAS); other layouts, and
// float64, are products per tile (BLAS; float64 by a loop, product below).
#include "ops/grouped_mm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <vector>

#include "kernels/cpu/cache.h"
#include "kernels/cpu/isa.h"
#include "kernmap/ops.h"
#include "ops/checks.h"
#include "ops/memory.h"

namespace kernmap::ops {
namespace {

constexpr const char* kOp = "grouped_mm";

// Tiles: small enough that small or uneven groups still give every thread work, large enough to amortize the
// per-tile setup. Columns are tiled in multiples of the kernels' 64-column register blocks.
constexpr int64_t kRowTile = 128;
constexpr int64_t kColTile = 128;

// Column tile of the forward's small-group tasks: each task packs its rows of a once and streams its columns
// of b once, so the tiles are as wide as keeps every thread busy: at least kTasksPerThread tasks per thread
// over all small groups, in multiples of kNtColStep (the kernels' column step).
constexpr int64_t kTasksPerThread = 8;
constexpr int64_t kNtColStep = 24;
int64_t nt_col_tile(int64_t N, int64_t groups, int64_t threads) {
  const int64_t wanted = kTasksPerThread * threads, g = std::max<int64_t>(1, groups);
  const int64_t per_group = std::max<int64_t>(1, (wanted + g - 1) / g);
  const int64_t tile = (N + per_group - 1) / per_group;
  return std::max<int64_t>(kNtColStep, (tile + kNtColStep - 1) / kNtColStep * kNtColStep);
}

struct Task {
  int64_t group, r0, r1, c0, c1;
  bool blas = false;  // the backward's kernel/BLAS choice for this task's group (backward_tiles)
};

std::vector<int64_t> group_starts(const at::Tensor& offs) {
  const at::Tensor o = offs.contiguous();
  const int32_t* p = o.const_data_ptr<int32_t>();
  std::vector<int64_t> starts(o.numel() + 1, 0);
  for (int64_t e = 0; e < o.numel(); ++e) starts[e + 1] = p[e];
  return starts;
}

// Tasks covering rows [starts[e], starts[e+1]) x columns [0, cols) of every group; rows are tiled unless a
// task must see all of its group's rows (a reduction over them).
std::vector<Task> tile(const std::vector<int64_t>& starts, int64_t cols, bool tile_rows) {
  std::vector<Task> tasks;
  for (size_t e = 0; e + 1 < starts.size(); ++e) {
    const int64_t s = starts[e], end = starts[e + 1];
    if (s == end) continue;
    const int64_t row_step = tile_rows ? kRowTile : end - s;
    for (int64_t r = s; r < end; r += row_step)
      for (int64_t c = 0; c < cols; c += kColTile)
        tasks.push_back(
            {static_cast<int64_t>(e), r, std::min(r + row_step, end), c, std::min(c + kColTile, cols)});
  }
  return tasks;
}

// Tasks for one BLAS call per group and column tile: all of a group's rows, columns in tiles of kBlasCols
// (fixed, so the calls and their results do not depend on the thread count; each call packs its small operand
// once).
constexpr int64_t kBlasCols = 512;
std::vector<Task> blas_tiles(const std::vector<int64_t>& starts, int64_t cols) {
  std::vector<Task> tasks;
  for (size_t e = 0; e + 1 < starts.size(); ++e) {
    if (starts[e + 1] == starts[e]) continue;
    for (int64_t c = 0; c < cols; c += kBlasCols)
      tasks.push_back({static_cast<int64_t>(e), starts[e], starts[e + 1], c, std::min(c + kBlasCols, cols)});
  }
  return tasks;
}

// The backward's outer products keep a task's partial sums (rows x columns, fp32) in scratch: as many
// elements as fill the level-2 rule's bytes (kernels/cpu/cache.h, l2_block_bytes), which stay in L2 next to
// the panel of the weight being streamed. Tasks only split output rows and columns: no sum changes with it.
int64_t scratch_elems() {
  return cpu::l2_block_bytes() / int64_t(sizeof(float));
}
// Columns of the outer-product kernels' register blocks.
constexpr int64_t kBcastCols = 64;

// Tasks of grad @ W (W [K, N] row-major): groups in row tiles of at most kRowTile rows (equal tiles, so a
// group of 130 rows is not a tile of 128 and one of 2 that reads W again for little work), each in column
// tiles of whole register blocks with rows x columns <= scratch_elems() (all of N for small groups).
std::vector<Task> bcast_tiles(const std::vector<int64_t>& starts, int64_t N) {
  std::vector<Task> tasks;
  for (size_t e = 0; e + 1 < starts.size(); ++e) {
    const int64_t s = starts[e], rows = starts[e + 1] - s;
    if (rows == 0) continue;
    const int64_t row_tiles = (rows + kRowTile - 1) / kRowTile;
    const int64_t row_step = (rows + row_tiles - 1) / row_tiles;
    const int64_t col_step = std::max(kBcastCols, scratch_elems() / row_step / kBcastCols * kBcastCols);
    for (int64_t r = s; r < s + rows; r += row_step)
      for (int64_t c = 0; c < N; c += col_step)
        tasks.push_back(
            {static_cast<int64_t>(e), r, std::min(r + row_step, s + rows), c, std::min(c + col_step, N)});
  }
  return tasks;
}

// Tasks of the weight gradients out[e] = x_e^T y_e ([M, N] per group): row tiles of each group's block over
// all N columns, as many rows as the active level's kernel asks for that reduction (gemm_bcast_task_rows: up
// to 512 where it copies x^T and y once for all of them, else rows x N within its partial sums' scratch);
// r0, r1 are rows of out[e] (docs/performance.md, "Grouped products: tasks and routing").
std::vector<Task> weight_grad_tiles(const std::vector<int64_t>& starts, int64_t M, int64_t N, cpu::DType dt) {
  const auto& k = cpu::kernel_table();
  std::vector<Task> tasks;
  for (size_t e = 0; e + 1 < starts.size(); ++e) {
    const int64_t row_step = std::max<int64_t>(1, k.gemm_bcast_task_rows(dt, starts[e + 1] - starts[e], N));
    for (int64_t r = 0; r < M; r += row_step)
      tasks.push_back({static_cast<int64_t>(e), r, std::min(r + row_step, M), 0, N});
  }
  return tasks;
}

// MKL's per-thread thread count (MKL_Set_Num_Threads_Local: the C entry; the lower-case names take a
// pointer), where torch's BLAS is MKL; null where it is not (no MKL in the LibTorch build).
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

// The BLAS calls of the calling thread made as on one intra-op thread, until destroyed: OpenMP's and MKL's
// thread counts for this thread set to 1, then restored. Inside the two-thread tasks torch's BLAS ran on one
// thread (a nested region) but still cut its work for two: oneDNN's bf16 products (and MKL's fp32 ones in the
// transposed-weight backward) summed in another order than on one thread, so grouped_mm's results changed
// with the thread count (bf16 grad_a of groups from 64 rows, K 130-2048; docs/performance.md, "Grouped
// products: tasks and routing", "BLAS calls as on one thread").
class SerialBlas {
 public:
  SerialBlas() : omp_(omp_get_max_threads()) {
    omp_set_num_threads(1);
    if (MKL_Set_Num_Threads_Local) mkl_ = MKL_Set_Num_Threads_Local(1);
  }
  ~SerialBlas() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(mkl_);
    omp_set_num_threads(omp_);
  }
  SerialBlas(const SerialBlas&) = delete;
  SerialBlas& operator=(const SerialBlas&) = delete;

 private:
  int omp_, mkl_ = 0;
};

// Runs the tasks on the intra-op threads: each thread takes the next task not yet taken, largest first by
// cost (default rows x columns) — uneven groups and the kernels' step-wise costs made any static split leave
// one thread waiting (docs/performance.md, "Grouped products: tasks and routing"). Each task writes only its
// own outputs, so who runs it does not change any result. One chunk per thread even when there are fewer
// tasks, so the tasks always run inside the parallel region, their BLAS calls as on one thread (SerialBlas):
// bit-identical results at any thread count.
void run_tasks(const std::vector<Task>& tasks, const std::function<void(const Task&)>& f,
               const std::function<int64_t(const Task&)>& cost = {}) {
  const int64_t n = static_cast<int64_t>(tasks.size());
  std::vector<int64_t> work(n);
  for (int64_t i = 0; i < n; ++i)
    work[i] = cost ? cost(tasks[i]) : (tasks[i].r1 - tasks[i].r0) * (tasks[i].c1 - tasks[i].c0);
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return work[x] > work[y]; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(1, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    // Dispatcher state is per thread: pool threads must also run the tile products below autograd.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const SerialBlas serial_blas;
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) f(tasks[order[i]]);
  });
}

void check_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  check_floating(kOp, "a", a);
  check_same_dtype(kOp, "a", a, "b", b);
  check_same_device(kOp, "a", a, "b", b);
  TORCH_CHECK(a.dim() == 2, "kernmap.grouped_mm: a must be 2-D [T, K], got ", a.sizes());
  TORCH_CHECK(b.dim() == 3 && b.size(1) == a.size(1),
              "kernmap.grouped_mm: b must be 3-D [E, K, N] with K = ", a.size(1), " (a's columns), got ",
              b.sizes());
  check_offs(kOp, offs, b.size(0), a.size(0), a);
}

at::Tensor grouped_mm_meta(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  check_grouped_mm(a, b, offs);
  return at::empty({a.size(0), b.size(2)}, a.options());
}

std::tuple<at::Tensor, at::Tensor> grouped_mm_backward_impl(const at::Tensor& grad, const at::Tensor& a,
                                                            const at::Tensor& b, const at::Tensor& offs,
                                                            std::array<bool, 2> output_mask) {
  check_grouped_mm(a, b, offs);
  check_same_dtype("grouped_mm_backward", "a", a, "grad_out", grad);
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == a.size(0) && grad.size(1) == b.size(2),
              "kernmap.grouped_mm_backward: grad_out must have shape [", a.size(0), ", ", b.size(2),
              "], got ", grad.sizes());
  // grad_a = grad @ b[e]^T: b^T is [E, N, K], itself a grouped operand.
  // A gradient output_mask does not ask for is left undefined.
  at::Tensor grad_a = output_mask[0] ? grouped_mm_cpu(grad, b.transpose(1, 2), offs) : at::Tensor();
  if (!output_mask[1]) return {grad_a, at::Tensor()};
  // grad_b[e] = a_e^T @ grad_e, produced in b's memory layout so the parameter's gradient needs no copy.
  const bool b_is_transposed = b.stride(1) == 1 && b.stride(2) != 1;
  at::Tensor grad_b = b_is_transposed ? grouped_weight_grad_cpu(grad, a, offs).transpose(1, 2)
                                      : grouped_weight_grad_cpu(a, grad, offs);
  return {grad_a, grad_b};
}

std::tuple<at::Tensor, at::Tensor> grouped_mm_backward_meta(const at::Tensor& grad, const at::Tensor& a,
                                                            const at::Tensor& b, const at::Tensor& offs,
                                                            std::array<bool, 2> output_mask) {
  check_grouped_mm(a, b, offs);
  return {output_mask[0] ? at::empty(a.sizes(), a.options()) : at::Tensor(),
          output_mask[1] ? at::empty_like(b) : at::Tensor()};
}

class GroupedMmFunction : public torch::autograd::Function<GroupedMmFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor& offs) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op =
        op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>("kernmap::grouped_mm");
    ctx->save_for_backward({a, b, offs});
    return op.call(a, b, offs);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static auto op = op_handle<std::tuple<at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, std::array<bool, 2>)>(
        "kernmap::grouped_mm_backward");
    const auto saved = ctx->get_saved_variables();
    auto [ga, gb] =
        op.call(grads[0], saved[0], saved[1], saved[2], {ctx->needs_input_grad(0), ctx->needs_input_grad(1)});
    return {ga, gb, at::Tensor()};
  }
};

at::Tensor grouped_mm_autograd(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  return GroupedMmFunction::apply(a, b, offs);
}

at::Tensor grouped_mm_checked(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  check_grouped_mm(a, b, offs);
  return grouped_mm_cpu(a, b, offs);
}

}  // namespace

void check_offs(const char* op, const at::Tensor& offs, int64_t E, int64_t T, const at::Tensor& a) {
  TORCH_CHECK(offs.scalar_type() == at::kInt, "kernmap.", op, ": offs must be int32, got ",
              offs.scalar_type());
  TORCH_CHECK(offs.dim() == 1 && offs.size(0) == E, "kernmap.", op, ": offs must have shape [", E,
              "] (one cumulative end per group), got ", offs.sizes());
  TORCH_CHECK(offs.device() == a.device(), "kernmap.", op, ": offs must be on the device of a (", a.device(),
              "), got ", offs.device());
  if (offs.is_meta() || !offs.is_cpu()) return;
  const at::Tensor o = offs.contiguous();
  const int32_t* p = o.const_data_ptr<int32_t>();
  int64_t previous = 0;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(p[e] >= previous, "kernmap.", op, ": offs must be non-decreasing and >= 0, got offs[", e,
                "] = ", p[e],
                e == 0 ? std::string("")
                       : " after offs[" + std::to_string(e - 1) + "] = " + std::to_string(previous));
    previous = p[e];
  }
  TORCH_CHECK(E == 0 ? T == 0 : previous == T, "kernmap.", op, ": offs[-1] must equal the row count T = ", T,
              ", got ", E == 0 ? std::string("no groups") : std::to_string(previous));
}

// The kernels read a row-major operand in place when its last dimension is contiguous; other layouts (and
// float64, which only the gradient checks use) go through one product per tile (product: BLAS, or a loop for
// float64).
bool kernel_dtype(const at::Tensor& t) {
  return t.scalar_type() != at::kDouble;
}

// Backward products of fp32 and bf16 in layouts the kernels do not read: one BLAS call per group and column
// tile of kBlasCols (fp16, without a fast CPU BLAS, and fp64: tiles of the forward's size).
bool backward_blas(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// Where the backward's operands suit the outer-product kernels (row-major grad, N-contiguous weight rows),
// they take every fp32 and fp16 group and the bf16 groups under kBf16BlasRows rows; larger bf16 groups go to
// BLAS, one call per group and kBlasCols columns: BLAS wins for bf16 from about 64 rows a group, the kernels
// everywhere else (docs/performance.md, "Grouped products: tasks and routing").
constexpr int64_t kBf16BlasRows = 64;
// Where torch's bf16 product is its scalar fallback (kernels/cpu/cache.h, bf16_gemm_native), every bf16 group
// stays on the kernels.
bool blas_group(at::ScalarType t, int64_t rows) {
  return t == at::kBFloat16 && rows >= kBf16BlasRows && cpu::bf16_gemm_native();
}

// dst = a @ b: one BLAS call, except for float64, whose products are a plain loop that adds the terms in
// a's column order. torch's BLAS on x86 is MKL, whose dgemm gave other bits on one thread than inside the
// two-thread tasks on an Intel AVX-512 CPU (xeon-amx-vm, the weight gradient's tiles of K70 N131 and K300
// N40; unless MKL_CBWR asked for strict reproducibility), and the tasks' results must not depend on the
// thread count; float64 is the gradient checks' dtype, where speed does not matter.
void product(at::Tensor dst, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != at::kDouble) {
    at::mm_out(dst, a, b);
    return;
  }
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  const int64_t as0 = a.stride(0), as1 = a.stride(1), bs0 = b.stride(0), bs1 = b.stride(1);
  const int64_t ds0 = dst.stride(0), ds1 = dst.stride(1);
  const double* pa = a.const_data_ptr<double>();
  const double* pb = b.const_data_ptr<double>();
  double* pd = dst.data_ptr<double>();
  for (int64_t i = 0; i < M; ++i) {
    double* row = pd + i * ds0;
    for (int64_t j = 0; j < N; ++j) row[j * ds1] = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double v = pa[i * as0 + k * as1];
      const double* bk = pb + k * bs0;
      for (int64_t j = 0; j < N; ++j) row[j * ds1] += v * bk[j * bs1];
    }
  }
}

// out[rows, cols of t] = a[rows of t] @ b[t.group][:, cols of t] (product).
void mm_task(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const Task& t) {
  product(out.slice(0, t.r0, t.r1).slice(1, t.c0, t.c1), a.slice(0, t.r0, t.r1),
          b.select(0, t.group).slice(1, t.c0, t.c1));
}

at::Tensor grouped_mm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  const int64_t N = b.size(2), K = a.size(1);
  at::Tensor out = empty_large({a.size(0), N}, a.options());
  const bool a_rows = a.stride(1) == 1 || K <= 1;
  const bool nt = kernel_dtype(a) && a_rows && b.stride(1) == 1;
  const auto& k = cpu::kernel_table();
  const auto dt = cpu_dtype(a.scalar_type());
  const int64_t es = a.element_size();
  const char* pa = static_cast<const char*>(a.const_data_ptr());
  const char* pb = static_cast<const char*>(b.const_data_ptr());
  char* po = static_cast<char*>(out.data_ptr());
  if (nt) {
    // b[e] is the transpose of an [N, K] matrix with K-contiguous rows (nn.Linear layout): gemm_nt for small
    // groups; from the level's gemm_nt_blas_rows on, BLAS's packed kernels amortize their packing and win
    // (docs/performance.md, "Grouped products: tasks and routing").
    // A group of blas_rows rows or more is one BLAS call over all its rows and columns (as the per-group loop
    // does: one packing of its rows of a, no edge tiles); smaller groups go to gemm_nt whole (all their rows)
    // in column tiles of nt_col_tile.
    // bf16 without a bf16 BLAS (kernels/cpu/cache.h, bf16_gemm_native): every group through gemm_nt.
    const int64_t blas_rows =
        a.scalar_type() == at::kBFloat16 && !cpu::bf16_gemm_native() ? INT64_MAX : k.gemm_nt_blas_rows(dt);
    std::vector<Task> nt_tasks;
    const std::vector<int64_t> starts = group_starts(offs);
    const int64_t E = static_cast<int64_t>(starts.size()) - 1;
    int64_t small = 0;
    for (int64_t e = 0; e < E; ++e)
      small += starts[e + 1] > starts[e] && starts[e + 1] - starts[e] < blas_rows;
    const int64_t col_tile = nt_col_tile(N, small, at::get_num_threads());
    for (int64_t e = 0; e < E; ++e) {
      const int64_t s = starts[e], end = starts[e + 1];
      if (s == end) continue;
      if (end - s >= blas_rows) {
        nt_tasks.push_back({e, s, end, 0, N});
        continue;
      }
      for (int64_t c = 0; c < N; c += col_tile) nt_tasks.push_back({e, s, end, c, std::min(c + col_tile, N)});
    }
    run_tasks(nt_tasks, [&](const Task& t) {
      if (t.r1 - t.r0 >= blas_rows) {
        mm_task(out, a, b, t);
        return;
      }
      k.gemm_nt(dt, t.r1 - t.r0, t.c1 - t.c0, K, pa + t.r0 * a.stride(0) * es, a.stride(0),
                pb + (t.group * b.stride(0) + t.c0 * b.stride(2)) * es, b.stride(2),
                po + (t.r0 * N + t.c0) * es, N);
    });
  } else if (kernel_dtype(a) && a_rows && b.stride(2) == 1) {
    // b[e] is [K, N] with N-contiguous rows (the backward's grad @ W): outer products, one task per row tile
    // x column tile that reads its panel of b[e] once while the kernel keeps the tile's partial sums in
    // scratch (large bf16 groups: BLAS, see blas_group).
    std::vector<Task> bw_tasks;
    const std::vector<int64_t> starts = group_starts(offs);
    for (const Task& t : bcast_tiles(starts, N))
      if (!blas_group(a.scalar_type(), starts[t.group + 1] - starts[t.group])) bw_tasks.push_back(t);
    for (Task t : blas_tiles(starts, N))
      if (blas_group(a.scalar_type(), t.r1 - t.r0)) {
        t.blas = true;
        bw_tasks.push_back(t);
      }
    run_tasks(bw_tasks, [&](const Task& t) {
      if (t.blas) {
        mm_task(out, a, b, t);
        return;
      }
      k.gemm_bcast(dt, t.r1 - t.r0, t.c1 - t.c0, K, pa + t.r0 * a.stride(0) * es, a.stride(0), 1,
                   pb + (t.group * b.stride(0) + t.c0) * es, b.stride(1), po + (t.r0 * N + t.c0) * es, N,
                   /*stream=*/false);
    });
  } else if (backward_blas(a)) {
    run_tasks(blas_tiles(group_starts(offs), N), [&](const Task& t) { mm_task(out, a, b, t); });
  } else {
    run_tasks(tile(group_starts(offs), N, /*tile_rows=*/true), [&](const Task& t) { mm_task(out, a, b, t); });
  }
  return out;
}

at::Tensor grouped_weight_grad_cpu(const at::Tensor& x, const at::Tensor& y, const at::Tensor& offs) {
  const int64_t E = offs.size(0), M = x.size(1), N = y.size(1);
  at::Tensor out = empty_large({E, M, N}, x.options());
  const std::vector<int64_t> starts = group_starts(offs);
  if (kernel_dtype(x) && (y.stride(1) == 1 || N <= 1)) {
    const auto& k = cpu::kernel_table();
    const auto dt = cpu_dtype(x.scalar_type());
    const int64_t es = x.element_size();
    const char* px = static_cast<const char*>(x.const_data_ptr());
    const char* py = static_cast<const char*>(y.const_data_ptr());
    char* po = static_cast<char*>(out.data_ptr());
    // Each task owns rows [r0, r1) of one group's [M, N] block (all columns: the output is written front to
    // back) and sums over all of the group's rows in order, so the result does not depend on the thread
    // count. An empty group's block is zeros (a reduction of no rows). Nothing reads the gradient soon and it
    // is as large as the weights: streaming stores. Large bf16 groups: one BLAS call per kBlasCols columns
    // (then r0, r1 are the group's rows), see blas_group.
    std::vector<Task> tasks;
    for (const Task& t : weight_grad_tiles(starts, M, N, dt))
      if (!blas_group(x.scalar_type(), starts[t.group + 1] - starts[t.group])) tasks.push_back(t);
    for (Task t : blas_tiles(starts, N))
      if (blas_group(x.scalar_type(), t.r1 - t.r0)) {
        t.blas = true;
        tasks.push_back(t);
      }
    run_tasks(
        tasks,
        [&](const Task& t) {
          if (t.blas) {
            at::Tensor dst = out.select(0, t.group).slice(1, t.c0, t.c1);
            at::mm_out(dst, x.slice(0, t.r0, t.r1).t(), y.slice(0, t.r0, t.r1).slice(1, t.c0, t.c1));
            return;
          }
          const int64_t s = starts[t.group], rows = starts[t.group + 1] - s;
          // out[e][i, n] = sum_r x[r, i] * y[r, n]: A(i, r) = x[r, i].
          k.gemm_bcast(dt, t.r1 - t.r0, N, rows, px + (s * x.stride(0) + t.r0 * x.stride(1)) * es,
                       x.stride(1), x.stride(0), py + s * y.stride(0) * es, y.stride(0),
                       po + (t.group * M + t.r0) * N * es, N,
                       /*stream=*/true);
        },
        // Writing the block costs about as much as 16 more rows of the reduction.
        [&](const Task& t) {
          const int64_t rows = starts[t.group + 1] - starts[t.group];
          return t.blas ? M * (t.c1 - t.c0) * (rows + 16) : (t.r1 - t.r0) * N * (rows + 16);
        });
    return out;
  }
  for (int64_t e = 0; e < E; ++e)
    if (starts[e] == starts[e + 1]) out.select(0, e).zero_();
  // Other layouts (fp32 and bf16: tiles of kBlasCols columns) and float64: one product per group x column
  // tile.
  run_tasks(backward_blas(x) ? blas_tiles(starts, N) : tile(starts, N, /*tile_rows=*/false),
            [&](const Task& t) {
              product(out.select(0, t.group).slice(1, t.c0, t.c1), x.slice(0, t.r0, t.r1).t(),
                      y.slice(0, t.r0, t.r1).slice(1, t.c0, t.c1));
            });
  return out;
}

TORCH_LIBRARY_IMPL(kernmap, CPU, m) {
  m.impl("grouped_mm", &grouped_mm_checked);
  m.impl("grouped_mm_backward", &grouped_mm_backward_impl);
}
TORCH_LIBRARY_IMPL(kernmap, Meta, m) {
  m.impl("grouped_mm", &grouped_mm_meta);
  m.impl("grouped_mm_backward", &grouped_mm_backward_meta);
}
TORCH_LIBRARY_IMPL(kernmap, Autograd, m) {
  m.impl("grouped_mm", &grouped_mm_autograd);
}

}  // namespace kernmap::ops

// ---- reference kernels: the transformers eager math in ATen ops (any device, autograd through ATen) ----

namespace kernmap::reference {

// transformers.integrations.moe's fallback: one matrix product per group.
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 3,
              "kernmap.reference_grouped_mm: a must be [T, K] and b [E, K, N], got ", a.sizes(), " and ",
              b.sizes());
  ops::check_offs("reference_grouped_mm", offs, b.size(0), a.size(0), a);
  const at::Tensor ends = offs.to(at::kCPU);
  // unbind, not select: its backward stacks the per-group gradients once, as transformers' fallback backward
  // fills one zeros_like(weight); select's would materialize a full-size gradient per group.
  const std::vector<at::Tensor> groups = b.unbind(0);
  std::vector<at::Tensor> pieces;
  int64_t start = 0;
  for (int64_t e = 0; e < b.size(0); ++e) {
    const int64_t end = ends[e].item<int64_t>();
    pieces.push_back(at::mm(a.slice(0, start, end), groups[e]));
    start = end;
  }
  return pieces.empty() ? at::empty({0, b.size(2)}, a.options()) : at::cat(pieces, 0);
}

}  // namespace kernmap::reference

namespace kernmap::float64 {

// Each group's product from float64, rounded once: the most accurate kernel of the layer (align's noise run,
// docs/training.md "The verdict").
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  return reference::grouped_mm(a.to(at::kDouble), b.to(at::kDouble), offs).to(a.scalar_type());
}

}  // namespace kernmap::float64

namespace kernmap::ops {

TORCH_LIBRARY_IMPL(kernmap, CompositeImplicitAutograd, m) {
  m.impl("reference_grouped_mm", &kernmap::reference::grouped_mm);
  m.impl("float64_grouped_mm", &kernmap::float64::grouped_mm);
}

// The layer record: every kernel of the layer and where it is the default (DESIGN §2), registered at
// load.
// The per-group loop reads offs on the host: data-dependent, so the reference is not compile-safe.
const LayerRegistrar kGroupedMMLayer(
    "GroupedMM",
    KernelDescriptor{.name = "reference/grouped_mm",
                     .devices = {"*"},
                     .dtypes = floating_dtypes(),
                     .has_backward = true,
                     .compile_safe = false,
                     .op = "kernmap::reference_grouped_mm",
                     .description = "one matrix product per group (transformers' fallback loop)"},
    {{KernelDescriptor{.name = "kernmap/grouped_mm",
                       .devices = {"cpu"},
                       .dtypes = floating_dtypes(),
                       .has_backward = true,
                       .compile_safe = true,
                       .op = "kernmap::grouped_mm",
                       .description = "grouped product over (group x tile) tasks on the intra-op pool",
                       .supports = needs_rank_at_least_1},
      /*default_on=*/{"cpu"}},
     {KernelDescriptor{.name = "float64/grouped_mm",
                       .devices = {"*"},
                       .dtypes = floating_dtypes(),
                       .has_backward = true,
                       .compile_safe = false,
                       .op = "kernmap::float64_grouped_mm",
                       .description = "one product per group from float64, rounded once (align's noise run)"},
      /*default_on=*/{}}});

}  // namespace kernmap::ops

namespace kernmap {
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  static auto op = ops::op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "kernmap::grouped_mm");
  return op.call(a, b, offs);
}
}  // namespace kernmap
