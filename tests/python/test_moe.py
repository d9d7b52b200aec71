"""torch.ops.kernmap.grouped_mm and torch.ops.kernmap.experts against the reference loops, transformers' own
grouped_mm and eager experts (Qwen2-MoE, Qwen3-MoE expert modules with the same weights), gradcheck, opcheck,
edge cases and bad input."""

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen3MoeConfig
from transformers.integrations import moe as hf_moe
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from tolerances import tol

ops = torch.ops.kernmap


def offsets(counts):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def grads_of(fn, inputs, grad_out=None):
    xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    y = fn(*xs)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(y.dtype)
    y.backward(g)
    return y.detach(), [x.grad for x in xs]


def assert_close(a, b, dtype, terms=1):
    """a and b within the table's figures for a result of `dtype` inputs that sums `terms` terms."""
    torch.testing.assert_close(a, b, **tol(dtype, terms))


def experts_terms(T, k, H, I):
    """The longest sum in an experts layer: the gate/up product over H, the down product over I, the combine
    over k slots, the weight gradients over the up to T * k rows routed to one expert."""
    return max(H, 2 * I, T * k)


GROUPINGS = {
    "E1": [5],
    "E7_uneven_with_empty": [3, 0, 1, 9, 0, 0, 4],
    "E64": [1] * 40 + [0] * 20 + [2] * 4,
    "all_on_one": [0, 0, 12, 0],
    "T0": [0, 0, 0],
    "T1": [0, 1],
    "BLAS_sized": [70, 0, 131],  # groups of 64+ rows take one BLAS call each in the forward
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("b_layout", ["EKN", "transposed_ENK"])
@pytest.mark.parametrize("K,N", [(13, 21), (16, 24)])
def test_grouped_mm_matches_reference_and_transformers(dtype, grouping, b_layout, K, N):
    counts = GROUPINGS[grouping]
    T, E = sum(counts), len(counts)
    a = torch.randn(T, K).to(dtype)
    b = torch.randn(E, K, N).to(dtype) if b_layout == "EKN" else torch.randn(E, N, K).to(dtype).transpose(1, 2)
    offs = offsets(counts)
    (y, (da, db, _)), (yr, (dar, dbr, _)) = (grads_of(f, [a, b, offs]) for f in (ops.grouped_mm, ops.reference_grouped_mm))
    assert_close(y, yr, dtype, terms=K)
    assert_close(da, dar, dtype, terms=N)
    assert_close(db, dbr, dtype, terms=max(counts))  # over a group's rows
    assert db.stride() == b.stride()  # the gradient comes in the weight's own layout
    assert_close(y, torch.ops.transformers.grouped_mm_fallback(a, b, offs), dtype, terms=K)
    if T > 0 and dtype != torch.float16 and K % 8 == 0 and N % 8 == 0:  # torch._grouped_mm needs 16-byte strides
        assert_close(y, torch._grouped_mm(a, b, offs=offs), dtype, terms=K)


@pytest.mark.parametrize("route", ["native", "fp32"])
def test_grouped_mm_bf16_large_groups_in_either_route(monkeypatch, route):
    """bf16 groups of 64+ rows go to torch's bf16 product where it is native, to the kernels where torch's is
    its scalar fallback (kernels/cpu/cache.h bf16_gemm_native; KERNMAP_BF16_GEMM forces either): forward and
    backward match the reference either way, in both weight layouts."""
    monkeypatch.setenv("KERNMAP_BF16_GEMM", route)
    counts = GROUPINGS["BLAS_sized"]
    T, E, K, N = sum(counts), len(counts), 40, 24
    a = torch.randn(T, K).to(torch.bfloat16)
    offs = offsets(counts)
    for b in (torch.randn(E, K, N).to(torch.bfloat16), torch.randn(E, N, K).to(torch.bfloat16).transpose(1, 2)):
        (y, (da, db, _)), (yr, (dar, dbr, _)) = (grads_of(f, [a, b, offs]) for f in (ops.grouped_mm, ops.reference_grouped_mm))
        assert_close(y, yr, torch.bfloat16, terms=K)
        assert_close(da, dar, torch.bfloat16, terms=N)
        assert_close(db, dbr, torch.bfloat16, terms=max(counts))


def test_grouped_mm_zero_row_groups_get_zero_weight_grad():
    a = torch.randn(4, 6)
    b = torch.randn(3, 6, 5, requires_grad=True)
    ops.grouped_mm(a, b, offsets([4, 0, 0])).sum().backward()
    assert torch.equal(b.grad[1:], torch.zeros(2, 6, 5))
    assert b.grad[0].abs().sum() > 0


def test_grouped_mm_gradcheck_float64():
    a = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 5, 4, dtype=torch.float64).transpose(1, 2).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, w: ops.grouped_mm(x, w, offsets([2, 0, 7])), (a, b))


def test_grouped_mm_opcheck():
    a = torch.randn(10, 8, requires_grad=True)
    b = torch.randn(3, 8, 6, requires_grad=True)
    torch.library.opcheck(ops.grouped_mm.default, (a, b, offsets([4, 0, 6])))


BAD_OFFS = [
    (offsets([3, 2]).flip(0), "offs must be non-decreasing"),
    (offsets([2, 2, 1]), r"offs must have shape \[2\]"),
    (offsets([2, 2]), r"offs\[-1\] must equal the row count T = 5, got 4"),
    (offsets([2, 3]).long(), "offs must be int32, got Long"),
    (torch.tensor([2, 5], dtype=torch.int32, device="meta"), "offs must be on the device of a"),
]


@pytest.mark.parametrize("offs,message", BAD_OFFS, ids=[m for _, m in BAD_OFFS])
def test_grouped_mm_bad_offs(offs, message):
    with pytest.raises(RuntimeError, match=message):
        ops.grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 3), offs)


def test_grouped_mm_bad_shapes():
    with pytest.raises(RuntimeError, match=r"b must be 3-D \[E, K, N\] with K = 4"):
        ops.grouped_mm(torch.randn(5, 4), torch.randn(2, 3, 3), offsets([2, 3]))
    with pytest.raises(RuntimeError, match="a must be 2-D"):
        ops.grouped_mm(torch.randn(5), torch.randn(2, 4, 3), offsets([2, 3]))
    with pytest.raises(RuntimeError, match="b must have the dtype of a"):
        ops.grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 3).double(), offsets([2, 3]))


# ---- experts ------------------------------------------------------------------------------------------


def make_experts(cls, config_cls, E, H, I, dtype):
    config = config_cls(hidden_size=H, moe_intermediate_size=I, num_experts=E, hidden_act="silu")
    config._experts_implementation = "eager"
    module = cls(config)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn_like(module.gate_up_proj) * 0.2)
        module.down_proj.copy_(torch.randn_like(module.down_proj) * 0.2)
    return module.to(dtype)


def at_thread_counts(fn, counts=(1, 2, 2)):
    """fn() run at each intra-op thread count in turn (the setting restored after)."""
    before = torch.get_num_threads()
    try:
        results = []
        for threads in counts:
            torch.set_num_threads(threads)
            results.append(fn())
        return results
    finally:
        torch.set_num_threads(before)


def routing(T, E, k, seed=0, skew=None):
    g = torch.Generator().manual_seed(seed)
    if skew is not None:
        ids = torch.full((T, k), skew, dtype=torch.long)
        ids[:, 1:] = torch.stack([torch.randperm(E - 1, generator=g)[: k - 1] for _ in range(T)]) if k > 1 else ids[:, 1:]
        ids[:, 1:] += (ids[:, 1:] >= skew).long()
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.empty(0, k, dtype=torch.long)
    weights = torch.rand(T, k, generator=g).softmax(-1)
    return ids, weights


CASES = [  # (E, k, T, H, I)
    (1, 1, 6, 16, 8),
    (7, 2, 9, 13, 11),
    (64, 8, 20, 24, 16),
    (64, 8, 20, 24, 10),
    (7, 2, 1, 13, 11),
    (7, 2, 0, 13, 11),
]


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,k,T,H,I", CASES)
def test_experts_equal_transformers_eager(family, dtype, E, k, T, H, I):
    cls, config_cls = (Qwen2MoeExperts, Qwen2MoeConfig) if family == "qwen2_moe" else (Qwen3MoeExperts, Qwen3MoeConfig)
    module = make_experts(cls, config_cls, E, H, I, dtype)
    hidden = torch.randn(T, H).to(dtype)
    ids, weights = routing(T, E, k)
    weights = weights.to(dtype)

    if T == 0:  # transformers' loop hits no expert and returns a constant: check shapes and zero grads only
        h, gu = hidden.clone().requires_grad_(True), module.gate_up_proj.detach().clone().requires_grad_(True)
        got = ops.experts(h, ids, weights, gu, module.down_proj.detach())
        assert got.shape == (0, H)
        got.sum().backward()
        assert h.grad.shape == (0, H) and torch.equal(gu.grad, torch.zeros_like(gu))
        return
    h1 = hidden.clone().requires_grad_(True)
    w1 = weights.clone().requires_grad_(True)
    want = module(h1, ids, w1)
    dy = torch.randn(want.shape).to(dtype)
    want.backward(dy)

    h2, w2 = hidden.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    gu, dn = module.gate_up_proj.detach().clone().requires_grad_(True), module.down_proj.detach().clone().requires_grad_(True)
    got = ops.experts(h2, ids, w2, gu, dn)
    got.backward(dy)

    terms = experts_terms(T, k, H, I)
    assert_close(got, want.detach(), dtype, terms)
    assert_close(h2.grad, h1.grad, dtype, terms)
    assert_close(w2.grad, w1.grad, dtype, terms)
    assert_close(gu.grad, module.gate_up_proj.grad, dtype, terms)
    assert_close(dn.grad, module.down_proj.grad, dtype, terms)
    # And transformers' own grouped_mm implementation, forward (torch._grouped_mm needs 16-byte strides).
    if H % 8 == 0 and I % 8 == 0:
        module.config._experts_implementation = "grouped_mm"
        with torch.no_grad():
            assert_close(got.detach(), module(hidden, ids, weights), dtype, terms)


def test_experts_all_tokens_on_one_expert_and_unused_experts():
    E, k, T, H, I = 6, 2, 11, 10, 7
    hidden = torch.randn(T, H)
    ids, weights = routing(T, E, k, skew=3)
    gu, dn = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    (y, grads), (yr, grads_r) = (grads_of(f, [hidden, ids, weights, gu, dn]) for f in (ops.experts, ops.reference_experts))
    terms = experts_terms(T, k, H, I)
    assert_close(y, yr, torch.float32, terms)
    for g, gr in zip(grads, grads_r):
        if g is not None:
            assert_close(g, gr, torch.float32, terms)
    unused = [e for e in range(E) if not (ids == e).any()]
    assert unused and all(torch.equal(grads[3][e], torch.zeros(2 * I, H)) for e in unused)


def test_experts_non_contiguous_weights():
    E, k, T, H, I = 5, 2, 8, 9, 6
    hidden = torch.randn(T, H)
    ids, weights = routing(T, E, k)
    gu = torch.randn(E, H, 2 * I).transpose(1, 2)  # [E, 2I, H] view of a transposed buffer
    dn = torch.randn(E, H, 2 * I)[:, :, :I]       # sliced
    (y, grads), (yr, grads_r) = (grads_of(f, [hidden, ids, weights, gu, dn]) for f in (ops.experts, ops.reference_experts))
    terms = experts_terms(T, k, H, I)
    assert_close(y, yr, torch.float32, terms)
    for g, gr in zip(grads, grads_r):
        if g is not None:
            assert_close(g, gr, torch.float32, terms)


def test_experts_gradcheck_float64():
    E, k, T, H, I = 4, 2, 5, 3, 2
    ids, weights = routing(T, E, k)
    args = (torch.randn(T, H, dtype=torch.float64, requires_grad=True), ids,
            weights.double().requires_grad_(True), torch.randn(E, 2 * I, H, dtype=torch.float64, requires_grad=True),
            torch.randn(E, H, I, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(lambda h, w, gu, dn: ops.experts(h, ids, w, gu, dn),
                                    (args[0], args[2], args[3], args[4]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_deterministic_across_runs_and_threads(dtype):
    E, k, T, H, I = 16, 4, 64, 72, 40  # H = 72: 64-column blocks and a tail in the bf16 outer-product kernel
    hidden = torch.randn(T, H).to(dtype)
    ids, weights = routing(T, E, k)
    weights = weights.to(dtype)
    gu, dn = torch.randn(E, 2 * I, H).to(dtype), torch.randn(E, H, I).to(dtype)
    results = at_thread_counts(lambda: grads_of(ops.experts, [hidden, ids, weights, gu, dn]))
    (y0, g0) = results[0]
    for y, g in results[1:]:
        assert torch.equal(y, y0)
        for a, b in zip(g, g0):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("dtype,weights_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float64),
                                                   (torch.float32, torch.bfloat16)])
def test_experts_routing_weights_of_another_dtype(dtype, weights_dtype):
    # The weighted combine and its backward follow the eager product's type promotion (bf16 rows times fp32
    # weights are not rounded to bf16 before the sum; fp64 weights keep the ATen composition).
    E, k, T, H, I = 6, 2, 10, 70, 12
    hidden = torch.randn(T, H).to(dtype)
    ids, weights = routing(T, E, k)
    weights = weights.to(weights_dtype)
    gu, dn = torch.randn(E, 2 * I, H).to(dtype) * 0.3, torch.randn(E, H, I).to(dtype) * 0.3
    (y, grads), (yr, grads_r) = (grads_of(f, [hidden, ids, weights, gu, dn]) for f in (ops.experts, ops.reference_experts))
    assert y.dtype == yr.dtype
    terms = experts_terms(T, k, H, I)
    assert_close(y, yr, dtype, terms)
    for g, gr in zip(grads, grads_r):
        if g is not None:
            assert g.dtype == gr.dtype
            assert_close(g.float(), gr.float(), dtype if g.dtype != torch.float64 else torch.float32, terms)


def test_experts_opcheck():
    E, k, T, H, I = 4, 2, 6, 8, 5
    ids, weights = routing(T, E, k)
    args = (torch.randn(T, H, requires_grad=True), ids, weights.requires_grad_(True),
            torch.randn(E, 2 * I, H, requires_grad=True), torch.randn(E, H, I, requires_grad=True))
    torch.library.opcheck(ops.experts.default, args)


def test_experts_bad_input():
    E, k, T, H, I = 4, 2, 6, 8, 5
    ids, weights = routing(T, E, k)
    hidden, gu, dn = torch.randn(T, H), torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    with pytest.raises(RuntimeError, match=r"down_proj must be \[E, H, I\] = \[4, 8, 5\]"):
        ops.experts(hidden, ids, weights, gu, torch.randn(E, H, I + 1))
    with pytest.raises(RuntimeError, match="topk_weights must have the shape of topk_ids"):
        ops.experts(hidden, ids, weights[:, :1], gu, dn)
    with pytest.raises(RuntimeError, match="topk_ids must be int64 or int32"):
        ops.experts(hidden, ids.float(), weights, gu, dn)
    with pytest.raises(RuntimeError, match="gate_up_proj must have the dtype of hidden"):
        ops.experts(hidden, ids, weights, gu.double(), dn)


def sentinel_routing(T, E, k):
    """routing() with transformers' expert-parallel sentinel id E in some slots: token 1 has only sentinels,
    tokens 0 and 3 one each. The sentinel slots' weights are NaN, and token 1's hidden row inf: eager reads
    neither."""
    ids, weights = routing(T, E, k)
    for t, slot in [(0, 0), (1, 0), (1, 1), (3, k - 1)]:
        ids[t, slot] = E
        weights[t, slot] = float("nan")
    return ids, weights


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["experts", "reference_experts"])
def test_experts_skip_the_sentinel_id_like_transformers_eager(family, dtype, op):
    # transformers' eager experts one-hot the ids over E + 1 classes and skip class E: a token routed to an
    # expert of another rank contributes nothing, and its weight gets a zero gradient.
    E, k, T, H, I = 7, 2, 9, 16, 8
    cls, config_cls = (Qwen2MoeExperts, Qwen2MoeConfig) if family == "qwen2_moe" else (Qwen3MoeExperts, Qwen3MoeConfig)
    module = make_experts(cls, config_cls, E, H, I, dtype)
    hidden = torch.randn(T, H).to(dtype)
    hidden[1] = float("inf")
    ids, weights = sentinel_routing(T, E, k)
    weights = weights.to(dtype)
    h1, w1 = hidden.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    want = module(h1, ids, w1)
    dy = torch.randn(want.shape).to(dtype)
    want.backward(dy)
    assert torch.isfinite(want).all() and torch.equal(want[1], torch.zeros(H, dtype=dtype))

    h2, w2 = hidden.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    gu, dn = (module.gate_up_proj.detach().clone().requires_grad_(True),
              module.down_proj.detach().clone().requires_grad_(True))
    got = getattr(ops, op)(h2, ids, w2, gu, dn)
    got.backward(dy)
    scale = 1.0 if dtype == torch.float32 else 2.0
    assert_close(got, want.detach(), dtype, scale)
    assert_close(h2.grad, h1.grad, dtype, scale)
    assert_close(w2.grad, w1.grad, dtype, scale)
    assert_close(gu.grad, module.gate_up_proj.grad, dtype, scale)
    assert_close(dn.grad, module.down_proj.grad, dtype, scale)
    sentinel = ids == E
    assert torch.equal(w2.grad[sentinel], torch.zeros(int(sentinel.sum()), dtype=dtype))


def test_experts_sentinel_everywhere_and_opcheck():
    E, k, T, H, I = 4, 2, 6, 8, 5
    module = make_experts(Qwen2MoeExperts, Qwen2MoeConfig, E, H, I, torch.float32)
    hidden, gu, dn = torch.randn(T, H), module.gate_up_proj.detach(), module.down_proj.detach()
    ids, weights = torch.full((T, k), E), torch.rand(T, k)
    assert torch.equal(module(hidden, ids, weights), torch.zeros(T, H))  # eager: no expert hit at all
    y, grads = grads_of(ops.experts, [hidden, ids, weights, gu, dn])
    assert torch.equal(y, torch.zeros(T, H)) and torch.equal(ops.reference_experts(hidden, ids, weights, gu, dn), y)
    for g in grads:
        assert g is None or torch.equal(g, torch.zeros_like(g))
    ids, weights = sentinel_routing(T, E, k)
    args = (torch.randn(T, H, requires_grad=True), ids, weights.nan_to_num(0.5).requires_grad_(True),
            torch.randn(E, 2 * I, H, requires_grad=True), torch.randn(E, H, I, requires_grad=True))
    torch.library.opcheck(ops.experts.default, args)


@pytest.mark.parametrize("bad", [-1, 5, 2**40])
@pytest.mark.parametrize("op", ["experts", "reference_experts"])
def test_experts_ids_outside_0_to_E_are_errors_like_transformers(bad, op):
    E, k, T, H, I = 4, 2, 6, 8, 5
    module = make_experts(Qwen2MoeExperts, Qwen2MoeConfig, E, H, I, torch.float32)
    hidden = torch.randn(T, H)
    ids, weights = routing(T, E, k)
    ids[2, 1] = bad
    with pytest.raises(RuntimeError):  # one_hot: "Class values must be non-negative" / "smaller than num_classes"
        module(hidden, ids, weights)
    for id_dtype in (torch.int64, torch.int32):
        if id_dtype == torch.int32 and bad >= 2**31:
            continue
        with pytest.raises(RuntimeError, match=rf"topk_ids\[2, 1\] = {bad} is outside \[0, 4\]"):
            getattr(ops, op)(hidden, ids.to(id_dtype), weights, module.gate_up_proj.detach(),
                             module.down_proj.detach())


def test_experts_backward_bad_saved_tensors():
    # experts_backward is a public op: an order that is not a permutation would make the combine kernels read
    # outside the rows.
    E, k, T, H, I = 4, 2, 6, 8, 5
    ids, weights = routing(T, E, k)
    hidden, gu, dn = torch.randn(T, H), torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    out, order, offs, h1, h2 = ops.experts_forward(hidden, ids, weights, gu, dn)
    grad = torch.randn(T, H)
    ops.experts_backward(grad, hidden, weights, gu, dn, order, offs, h1, h2)  # the real ones work
    for bad, message in [(order.clone().fill_(0), r"order must be a permutation of \[0, 12\), got 0 at position 1"),
                         (order + T * k, r"order must be a permutation of \[0, 12\), got 1[2-9]"),
                         (order.int(), "order must be a contiguous 1-D int64 tensor")]:
        with pytest.raises(RuntimeError, match=message):
            ops.experts_backward(grad, hidden, weights, gu, dn, bad, offs, h1, h2)
    with pytest.raises(RuntimeError, match=r"grad must have the shape of hidden \[6, 8\], got \[6, 7\]"):
        ops.experts_backward(grad[:, :7], hidden, weights, gu, dn, order, offs, h1, h2)
    with pytest.raises(RuntimeError, match=r"h2 must be \[T \* k, H\] = \[12, 8\]"):
        ops.experts_backward(grad, hidden, weights, gu, dn, order[:-1], offs, h1, h2[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[300], [0, 300, 5]])
def test_grouped_mm_backward_bit_identical_across_threads(dtype, counts):
    # One large group: the BLAS calls of the backward must run single-threaded inside kernmap's parallel region
    # (a BLAS call left to thread itself may sum in another order); N = 700 spans two column tiles.
    K, N = 384, 700
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    T = int(offs[-1])
    a = torch.randn(T, K).to(dtype)
    b = torch.randn(len(counts), N, K).to(dtype).transpose(1, 2)
    grad = torch.randn(T, N).to(dtype)
    results = at_thread_counts(lambda: torch.ops.kernmap.grouped_mm_backward(grad, a, b, offs))
    for ga, gb in results[1:]:
        assert torch.equal(ga, results[0][0])
        assert torch.equal(gb, results[0][1])
    expected_gb = torch.zeros(len(counts), K, N, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        expected_gb[e] = a[start:end].double().t() @ grad[start:end].double()
        start = end
    torch.testing.assert_close(results[0][1].double(), expected_gb, **tol(dtype, terms=max(counts)))


def page_aligned(t):
    """A copy of t whose data starts on a 4 KiB boundary (as the large-block cache's buffers do)."""
    buf = torch.empty(t.numel() + 1024, dtype=t.dtype)
    skip = (-buf.data_ptr() % 4096) // t.element_size()
    out = buf[skip:skip + t.numel()].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 4096 == 0
    return out


@pytest.mark.parametrize("counts,N", [([150, 0, 200], 304), ([30, 33], 2048), ([5, 300, 60, 1], 771),
                                      ([16, 7, 0, 20], 768)])
def test_grouped_mm_weight_grad_short_and_long_reductions(counts, N):
    # fp32 weight gradients: groups whose rows of grad fit short_reduction_bytes run in one pass over a
    # contiguous copy (row blocks outer), also where they are longer than the kernel's reduction block (150
    # and 200 rows of 304 columns), by register blocks of two cache lines a row below AVX-512 unless the rows
    # are a multiple of 4 KiB apart (N = 2048); longer ones block the reduction; N = 771 has tail columns and
    # is not streamed. Every path sums each element in order of rows: the same bits at every thread count, and the
    # float64 product within fp32's tolerance, with grad 4 KiB-aligned as well as not.
    K = 100
    offs = offsets(counts)
    T = int(offs[-1])
    a = torch.randn(T, K)
    b = torch.randn(len(counts), K, N)
    grad = torch.randn(T, N)
    expected = torch.zeros(len(counts), K, N, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        expected[e] = a[start:end].double().t() @ grad[start:end].double()
        start = end
    for g in (grad, page_aligned(grad)):
        results = at_thread_counts(lambda: torch.ops.kernmap.grouped_mm_backward(g, a, b, offs, [False, True])[1])
        for r in results[1:]:
            assert torch.equal(r, results[0])
        torch.testing.assert_close(results[0].double(), expected, **tol(torch.float32, terms=max(counts)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b_layout", ["EKN", "transposed_ENK"])
def test_grouped_mm_backward_computes_only_the_gradients_asked_for(dtype, b_layout):
    # output_mask (autograd passes needs_input_grad): a gradient not asked for is None, not computed; the others
    # have the bits of the full backward.
    counts = [3, 0, 17, 5]
    K, N = 40, 72
    offs = offsets(counts)
    T, E = sum(counts), len(counts)
    a = torch.randn(T, K).to(dtype)
    b = torch.randn(E, K, N).to(dtype) if b_layout == "EKN" else torch.randn(E, N, K).to(dtype).transpose(1, 2)
    grad = torch.randn(T, N).to(dtype)
    ga, gb = ops.grouped_mm_backward(grad, a, b, offs)
    only_a = ops.grouped_mm_backward(grad, a, b, offs, [True, False])
    only_b = ops.grouped_mm_backward(grad, a, b, offs, [False, True])
    assert only_a[1] is None and torch.equal(only_a[0], ga)
    assert only_b[0] is None and torch.equal(only_b[1], gb)
    assert ops.grouped_mm_backward(grad, a, b, offs, [False, False]) == (None, None)
    # Through autograd: frozen weights get no gradient, the input's is unchanged.
    x = a.clone().requires_grad_(True)
    ops.grouped_mm(x, b, offs).backward(grad)
    assert torch.equal(x.grad, ga)
    w = b.detach().clone().requires_grad_(True)
    ops.grouped_mm(a, w, offs).backward(grad)
    assert torch.equal(w.grad, gb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trainable", [(True, True, False, False), (True, False, False, False),
                                       (False, False, True, False), (False, True, False, True),
                                       (True, True, True, True)],
                         ids=["frozen_experts", "hidden_only", "gate_up_only", "weights_and_down", "all"])
def test_experts_backward_computes_only_the_gradients_asked_for(dtype, trainable):
    # LoRA-style fine-tuning freezes the expert weights: their gradients (and the weight-gradient products
    # behind them) are skipped, and the gradients still asked for keep the bits of the full backward.
    E, k, T, H, I = 8, 2, 24, 72, 40
    ids, weights = routing(T, E, k)
    tensors = [torch.randn(T, H).to(dtype), weights.to(dtype), torch.randn(E, 2 * I, H).to(dtype) * 0.3,
               torch.randn(E, H, I).to(dtype) * 0.3]
    g = torch.randn(T, H).to(dtype)

    def run(flags):
        xs = [t.clone().requires_grad_(f) for t, f in zip(tensors, flags)]
        ops.experts(xs[0], ids, xs[1], xs[2], xs[3]).backward(g)
        return [x.grad for x in xs]

    full = run((True,) * 4)
    for got, want, asked in zip(run(trainable), full, trainable):
        if asked:
            assert torch.equal(got, want)
        else:
            assert got is None
    out, order, offs, h1, h2 = ops.experts_forward(tensors[0], ids, tensors[1], tensors[2], tensors[3])
    grads = ops.experts_backward(g, tensors[0], tensors[1], tensors[2], tensors[3], order, offs, h1, h2,
                                 list(trainable))
    for got, want, asked in zip(grads, full, trainable):
        assert (got is None) != asked
        if asked:
            assert torch.equal(got, want)


def test_backward_output_mask_opcheck():
    # The frozen-weight paths through autograd (needs_input_grad false) and the masked backward ops themselves.
    E, k, T, H, I = 4, 2, 6, 8, 5
    ids, weights = routing(T, E, k)
    frozen = (torch.randn(T, H, requires_grad=True), ids, weights.requires_grad_(True), torch.randn(E, 2 * I, H),
              torch.randn(E, H, I))
    torch.library.opcheck(ops.experts.default, frozen)
    a, b, offs = torch.randn(10, 8), torch.randn(3, 8, 6), offsets([4, 0, 6])
    torch.library.opcheck(ops.grouped_mm.default, (a.requires_grad_(True), b, offs))
    torch.library.opcheck(ops.grouped_mm_backward.default, (torch.randn(10, 6), a.detach(), b, offs, [True, False]))
