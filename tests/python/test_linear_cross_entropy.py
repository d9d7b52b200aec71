"""torch.ops.kernmap.linear_cross_entropy against transformers' ForCausalLMLoss of lm_head(hidden) on the same
tensors: loss and gradients for hidden, weight and bias in fp32, bf16 and fp16, odd sizes, several chunks of
rows, rows at ignore_index, every row ignored, num_items_in_batch, strided and empty inputs, gradcheck, opcheck,
torch.compile, and bad input. The reference kernel is checked against transformers the same way."""

import pytest
import torch
import torch.nn.functional as F
from tolerances import linear_cross_entropy_tol
from transformers.loss.loss_utils import ForCausalLMLoss

ops = torch.ops.kernmap


def make(n, h, v, dtype, bias=False, ignore=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * (2 / h**0.5)).to(dtype)
    b = (torch.randn(v, generator=g, dtype=torch.float64) * 0.5).to(dtype) if bias else None
    labels = torch.randint(v, (n,), generator=g)
    labels[list(ignore)] = -100
    return hidden, weight, b, labels


def transformers_loss(hidden, weight, bias, labels, **kwargs):
    """ForCausalLMLoss of lm_head(hidden), labels passed as already shifted."""
    logits = F.linear(hidden, weight, bias)
    return ForCausalLMLoss(logits, None, weight.shape[0], shift_labels=labels, **kwargs)


def loss_and_grads(fn, hidden, weight, bias, labels, grad_scale=1.0, **kwargs):
    xs = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (hidden, weight, bias)]
    loss = fn(xs[0], xs[1], xs[2], labels, **kwargs)
    (loss * grad_scale).backward()
    return loss.detach(), [x.grad if x is not None else None for x in xs]


def kernmap_loss(hidden, weight, bias, labels, **kwargs):
    return ops.linear_cross_entropy(hidden, weight, labels, bias, **kwargs)


def reference_loss(hidden, weight, bias, labels, **kwargs):
    return ops.reference_linear_cross_entropy(hidden, weight, labels, bias, **kwargs)


def rel_err(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def check_against_transformers(fn, dtype, hidden, weight, bias, labels, **kwargs):
    tol = linear_cross_entropy_tol(dtype)
    want, want_grads = loss_and_grads(transformers_loss, hidden, weight, bias, labels, **kwargs)
    got, got_grads = loss_and_grads(fn, hidden, weight, bias, labels, **kwargs)
    assert got.dtype == torch.float32 and got.shape == ()
    assert abs(got.item() - want.item()) <= tol["loss"] * abs(want.item()), (got, want)
    for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads):
        if w is None:
            assert g is None
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert rel_err(g, w) <= tol["weight_grad" if name == "weight" else "grad"], (name, rel_err(g, w))


@pytest.fixture
def chunk_rows(monkeypatch):
    """Sets the rows per chunk (KERNMAP_LCE_CHUNK_ROWS), so that small inputs take several chunks."""

    def set_rows(rows):
        monkeypatch.setenv("KERNMAP_LCE_CHUNK_ROWS", str(rows))

    return set_rows


SHAPES = [(1, 1, 1), (37, 19, 101), (64, 96, 1000), (300, 64, 4099)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,h,v", SHAPES)
@pytest.mark.parametrize("fn", [kernmap_loss, reference_loss], ids=["kernmap", "reference"])
def test_matches_transformers(fn, n, h, v, dtype):
    hidden, weight, _, labels = make(n, h, v, dtype, ignore=range(0, n, 3) if n > 1 else ())
    check_against_transformers(fn, dtype, hidden, weight, None, labels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 16, 50])
def test_several_chunks_match_transformers(chunk_rows, rows, dtype):
    """N not a multiple of the chunk, ignored rows inside and across chunks, bias."""
    chunk_rows(rows)
    hidden, weight, bias, labels = make(203, 33, 517, dtype, bias=True, ignore=[*range(10, 70), 150, 151, 202])
    check_against_transformers(kernmap_loss, dtype, hidden, weight, bias, labels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_items", [torch.tensor(77), torch.tensor(77.0), torch.tensor([77])])
def test_num_items_in_batch(chunk_rows, dtype, num_items):
    """The Trainer's gradient accumulation: the sum over counted rows / num_items_in_batch."""
    chunk_rows(40)
    hidden, weight, bias, labels = make(120, 24, 300, dtype, bias=True, ignore=range(50, 90))
    for fn in (kernmap_loss, reference_loss):
        check_against_transformers(fn, dtype, hidden, weight, bias, labels, num_items_in_batch=num_items.reshape(()))
    got = kernmap_loss(hidden, weight, bias, labels, num_items_in_batch=num_items)  # one element, any shape
    want = transformers_loss(hidden, weight, bias, labels, num_items_in_batch=num_items.reshape(()))
    assert got.shape == () and abs(got.item() - want.item()) <= linear_cross_entropy_tol(dtype)["loss"] * abs(want.item())


@pytest.mark.parametrize("fn", [kernmap_loss, reference_loss], ids=["kernmap", "reference"])
def test_every_row_ignored_is_nan_as_in_transformers(fn):
    hidden, weight, bias, labels = make(9, 8, 20, torch.float32, bias=True, ignore=range(9))
    want, want_grads = loss_and_grads(transformers_loss, hidden, weight, bias, labels)
    got, got_grads = loss_and_grads(fn, hidden, weight, bias, labels)
    assert want.isnan() and got.isnan()
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(w, torch.zeros_like(w)) and torch.equal(g, w)
    # With num_items_in_batch the sum of nothing is 0.
    got = fn(hidden, weight, bias, labels, num_items_in_batch=torch.tensor(4))
    assert got.item() == 0 == transformers_loss(hidden, weight, bias, labels, num_items_in_batch=torch.tensor(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_rows(dtype):
    hidden = torch.empty(0, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(10, 16, dtype=dtype, requires_grad=True)
    loss = ops.linear_cross_entropy(hidden, weight, torch.empty(0, dtype=torch.long))
    want = transformers_loss(hidden, weight, None, torch.empty(0, dtype=torch.long))
    assert loss.isnan() and want.isnan()
    loss.backward()
    assert hidden.grad.shape == (0, 16) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_ignore_index_other_than_default(chunk_rows):
    chunk_rows(7)
    hidden, weight, _, labels = make(30, 12, 40, torch.float32)
    labels[::4] = 0  # class 0 is ignored, as transformers' ignore_index=0 does
    check_against_transformers(kernmap_loss, torch.float32, hidden, weight, None, labels, ignore_index=0)
    labels[1] = -100  # no longer the ignore value: an error
    with pytest.raises(RuntimeError, match=r"labels\[1\] = -100 is neither a class index in \[0, 40\)"):
        ops.linear_cross_entropy(hidden, weight, labels, ignore_index=0)


def test_strided_hidden_and_weight(chunk_rows):
    """Rows a wider tensor's slice apart, every other row of [B, S, H], a column-major hidden, a transposed
    weight: the same loss and gradients as contiguous copies."""
    chunk_rows(13)
    hidden, weight, bias, labels = make(60, 20, 97, torch.float32, bias=True, ignore=[3, 4, 40])
    wide = torch.randn(60, 27)
    wide[:, 5:25] = hidden
    every_other = torch.randn(2, 60, 20)
    every_other[:, ::2] = hidden.view(2, 30, 20)
    views = {"sliced": wide[:, 5:25], "every other row": every_other[:, ::2].flatten(0, 1),
             "column-major": hidden.t().contiguous().t()}
    want, want_grads = loss_and_grads(kernmap_loss, hidden, weight, bias, labels)
    for name, view in views.items():
        assert not view.is_contiguous()
        got, got_grads = loss_and_grads(kernmap_loss, view, weight, bias, labels)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=name)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=name)
    got, got_grads = loss_and_grads(kernmap_loss, hidden, weight.t().contiguous().t(), bias, labels)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_grads[1], want_grads[1], rtol=1e-5, atol=1e-7)


def test_gradients_only_for_inputs_that_need_them():
    hidden, weight, bias, labels = make(20, 8, 30, torch.float32, bias=True)
    full = loss_and_grads(kernmap_loss, hidden, weight, bias, labels)[1]
    for needs in [(True, False, False), (False, True, False), (False, False, True), (True, True, False)]:
        xs = [t.detach().clone().requires_grad_(r) for t, r in zip((hidden, weight, bias), needs)]
        ops.linear_cross_entropy(xs[0], xs[1], labels, xs[2]).backward()
        for x, r, f in zip(xs, needs, full):
            assert (x.grad is not None) == r
            if r:
                torch.testing.assert_close(x.grad, f, rtol=1e-6, atol=1e-8)
    with torch.no_grad():  # no gradient computed: the loss alone, equal to the one with gradients
        xs = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
        loss = ops.linear_cross_entropy(xs[0], xs[1], labels, xs[2])
    assert not loss.requires_grad
    assert loss.item() == loss_and_grads(kernmap_loss, hidden, weight, bias, labels)[0].item()


def test_incoming_gradient_scales_the_gradients():
    hidden, weight, bias, labels = make(20, 8, 30, torch.float32, bias=True)
    want = loss_and_grads(reference_loss, hidden, weight, bias, labels, grad_scale=-2.5)[1]
    got = loss_and_grads(kernmap_loss, hidden, weight, bias, labels, grad_scale=-2.5)[1]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_tied_weight_gradient_accumulates_both_uses():
    """An input embedding tied to the head: its gradient is the embedding's plus the loss's."""
    hidden, weight, _, labels = make(12, 8, 30, torch.float32)
    ids = torch.randint(30, (12,))
    grads = []
    for fn in (ops.linear_cross_entropy, ops.reference_linear_cross_entropy):
        w = weight.detach().clone().requires_grad_(True)
        h = F.embedding(ids, w) * 0.5 + hidden
        fn(h, w, labels).backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    w = weight.detach().clone().requires_grad_(True)
    ops.linear_cross_entropy(hidden, w, labels).backward()
    assert not torch.allclose(grads[0], w.grad)  # the embedding's share is there


def test_second_backward_through_a_retained_graph_is_an_error():
    """The backward scales the gradients it saved in place: a second pass is refused by autograd's check."""
    hidden, weight, _, labels = make(10, 8, 30, torch.float32)
    hidden.requires_grad_(True)
    loss = ops.linear_cross_entropy(hidden, weight, labels) * 3
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_logits_give_nan_as_in_transformers(monkeypatch, dtype):
    """16-bit: the products by blocks of classes (8 a block), whose transposes carry NaN and Inf as bits."""
    monkeypatch.setenv("KERNMAP_LCE_VOCAB_BLOCK", "8")
    hidden, weight, _, labels = make(6, 8, 30, dtype)
    hidden[2, 3] = float("nan")
    weight[5] = float("inf")
    got, got_grads = loss_and_grads(kernmap_loss, hidden, weight, None, labels)
    want, want_grads = loss_and_grads(transformers_loss, hidden, weight, None, labels)
    assert got.isnan() and want.isnan()
    assert torch.equal(got_grads[0].isnan(), want_grads[0].isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_minus_infinity_logits_contribute_nothing(monkeypatch, dtype):
    monkeypatch.setenv("KERNMAP_LCE_VOCAB_BLOCK", "8")
    hidden, weight, bias, labels = make(6, 8, 30, dtype, bias=True)
    bias[7] = -float("inf")
    labels[labels == 7] = 8
    check_against_transformers(kernmap_loss, dtype, hidden, weight, bias, labels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_results_do_not_depend_on_thread_count(chunk_rows, monkeypatch, dtype):
    """Several chunks; the 16-bit products by blocks of classes (KERNMAP_LCE_VOCAB_BLOCK), the last partial,
    their transposes split between the threads."""
    chunk_rows(32)
    monkeypatch.setenv("KERNMAP_LCE_VOCAB_BLOCK", "64")
    hidden, weight, bias, labels = make(150, 40, 333, dtype, bias=True, ignore=range(20, 40))
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            loss, grads = loss_and_grads(kernmap_loss, hidden, weight, bias, labels)
            outs.append([loss, *grads])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_gradcheck_float64(chunk_rows):
    chunk_rows(3)
    h = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([1, -100, 6, 0, 3, -100, 2, 6])
    assert torch.autograd.gradcheck(lambda a, c, d: ops.linear_cross_entropy(a, c, y, d), (h, w, b))
    assert torch.autograd.gradcheck(lambda a, c: ops.linear_cross_entropy(a, c, y, num_items_in_batch=torch.tensor(5)),
                                    (h, w))
    ht = torch.randn(5, 8, dtype=torch.float64).t().requires_grad_(True)  # column-major
    assert torch.autograd.gradcheck(lambda a, c: ops.linear_cross_entropy(a, c, y), (ht, w))
    loss = ops.linear_cross_entropy(h, w, y, b)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ops.reference_linear_cross_entropy(h, w, y, b), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    hidden, weight, bias, labels = make(12, 16, 40, dtype, bias=True, ignore=[2, 5])
    req = [t.requires_grad_(True) for t in (hidden, weight, bias)]
    cases = [(req[0], req[1], labels), (req[0], req[1], labels, req[2]),
             (req[0], req[1], labels, req[2], -100, torch.tensor(7)), (hidden.detach(), req[1], labels)]
    for args in cases:
        torch.library.opcheck(ops.linear_cross_entropy.default, args)
        torch.library.opcheck(ops.reference_linear_cross_entropy.default, args)
    torch.library.opcheck(ops.linear_cross_entropy_forward.default,
                          (hidden.detach(), weight.detach(), labels, bias.detach(), -100, None, [True, True, True]))
    torch.library.opcheck(ops.linear_cross_entropy_forward.default,
                          (hidden.detach(), weight.detach(), labels, None, -100, torch.tensor(3), [False, True, False]))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_matches_eager(backend):
    hidden, weight, bias, labels = make(24, 16, 50, torch.float32, bias=True, ignore=[0, 1])

    def f(h, w, b):
        return ops.linear_cross_entropy(torch.tanh(h), w, labels, b) * 2

    eager = loss_and_grads(lambda h, w, b, y: f(h, w, b), hidden, weight, bias, labels)
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    got = loss_and_grads(lambda h, w, b, y: compiled(h, w, b), hidden, weight, bias, labels)
    torch.testing.assert_close(got[0], eager[0])
    for g, w in zip(got[1], eager[1]):
        torch.testing.assert_close(g, w)


H8 = torch.randn(4, 8)
W8 = torch.randn(10, 8)
Y4 = torch.tensor([1, 2, -100, 9])
BAD_INPUTS = [
    (lambda: ops.linear_cross_entropy(H8, W8, torch.tensor([1, 2, 10, 3])),
     "labels[2] = 10 is neither a class index in [0, 10) (weight's rows) nor ignore_index (-100)"),
    (lambda: ops.linear_cross_entropy(H8, W8, torch.tensor([1, -1, 0, 3])), "labels[1] = -1 is neither a class index"),
    (lambda: ops.linear_cross_entropy(H8, torch.randn(10, 7), Y4),
     "weight must be [V, H] with V >= 1 and H = 8 (hidden's last dimension), got [10, 7]"),
    (lambda: ops.linear_cross_entropy(H8, torch.randn(0, 8), torch.full((4,), -100)), "weight must be [V, H] with V >= 1"),
    (lambda: ops.linear_cross_entropy(H8, W8.double(), Y4), "weight must have the dtype of hidden (Float), got Double"),
    (lambda: ops.linear_cross_entropy(H8.long(), W8.long(), Y4), "hidden must be float32, bfloat16, float16 or float64"),
    (lambda: ops.linear_cross_entropy(H8, W8, Y4.int()), "labels must be int64, got Int"),
    (lambda: ops.linear_cross_entropy(H8, W8, Y4[:3]), "labels must be [4] (one per row of hidden), got shape [3]"),
    (lambda: ops.linear_cross_entropy(H8, W8, Y4.view(2, 2)), "labels must be [4] (one per row of hidden)"),
    (lambda: ops.linear_cross_entropy(H8.view(2, 2, 8), W8, Y4), "hidden must be [N, H], got shape [2, 2, 8]"),
    (lambda: ops.linear_cross_entropy(H8, W8, Y4, torch.randn(9)), "bias must be [10] (weight's rows), got shape [9]"),
    (lambda: ops.linear_cross_entropy(H8, W8, Y4, torch.randn(10).half()), "bias must have the dtype of hidden"),
    (lambda: ops.linear_cross_entropy(H8, W8.to("meta"), Y4), "weight must be on the device of hidden (cpu), got meta"),
    (lambda: ops.linear_cross_entropy(H8, W8, Y4.to("meta")), "labels must be on the device of hidden (cpu), got meta"),
    (lambda: ops.linear_cross_entropy(H8, W8, Y4, num_items_in_batch=torch.tensor([2, 3])),
     "num_items_in_batch must be a number (a tensor of one element), got shape [2]"),
    (lambda: ops.linear_cross_entropy(H8, W8, Y4, num_items_in_batch=torch.tensor(True)),
     "num_items_in_batch must be a real number, got Bool"),
    (lambda: ops.reference_linear_cross_entropy(H8, torch.randn(10, 7), Y4), "weight must be [V, H] with V >= 1"),
]


@pytest.mark.parametrize("call,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(RuntimeError) as err:
        call()
    assert message in str(err.value)


@pytest.mark.parametrize("route", ["native", "fp32"])
def test_bf16_products_in_either_route_match_transformers(chunk_rows, monkeypatch, route):
    """bf16 through torch's bf16 product (native) or in fp32 (where torch's bf16 product is its scalar
    fallback, kernels/cpu/cache.h bf16_gemm_native; KERNMAP_BF16_GEMM forces either): several chunks, gathered
    rows, bias; the two routes agree with transformers and with each other within bf16's rounding."""
    chunk_rows(16)
    hidden, weight, bias, labels = make(90, 40, 333, torch.bfloat16, bias=True, ignore=[*range(5, 30), 70])
    monkeypatch.setenv("KERNMAP_BF16_GEMM", route)
    check_against_transformers(kernmap_loss, torch.bfloat16, hidden, weight, bias, labels)
    loss, grads = loss_and_grads(kernmap_loss, hidden, weight, bias, labels)
    monkeypatch.setenv("KERNMAP_BF16_GEMM", "fp32" if route == "native" else "native")
    other, other_grads = loss_and_grads(kernmap_loss, hidden, weight, bias, labels)
    assert abs(loss.item() - other.item()) <= 1e-2 * abs(other.item())
    for g, o in zip(grads, other_grads):
        assert rel_err(g, o) <= 2e-2


@pytest.mark.parametrize("route", ["native", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_loss_without_gradients_by_blocks_of_classes(chunk_rows, monkeypatch, dtype, route):
    """Without gradients the logits go by blocks of classes (KERNMAP_LCE_VOCAB_BLOCK) against passes of rows
    (KERNMAP_LCE_CHUNK_ROWS): several passes and blocks, the last of each partial, gathered rows, bias, either
    bf16 route; the loss of transformers and of the route with gradients, within the dtype's loss tolerance."""
    chunk_rows(16)
    monkeypatch.setenv("KERNMAP_LCE_VOCAB_BLOCK", "64")
    monkeypatch.setenv("KERNMAP_BF16_GEMM", route)
    hidden, weight, bias, labels = make(90, 40, 333, dtype, bias=True, ignore=[*range(5, 30), 70])
    tol = linear_cross_entropy_tol(dtype)["loss"]
    with torch.no_grad():
        got = kernmap_loss(hidden, weight, bias, labels)
        want = transformers_loss(hidden, weight, bias, labels)
    with_grads = loss_and_grads(kernmap_loss, hidden, weight, bias, labels)[0]
    assert got.dtype == torch.float32 and got.shape == ()
    assert abs(got.item() - want.item()) <= tol * abs(want.item()), (got, want)
    assert abs(got.item() - with_grads.item()) <= tol * abs(want.item()), (got, with_grads)


def test_loss_without_gradients_of_non_finite_rows(monkeypatch):
    """By blocks of classes a NaN logit, an infinite one or a row of -inf logits makes the loss NaN, as
    transformers' does; a -inf logit elsewhere counts as probability 0."""
    monkeypatch.setenv("KERNMAP_LCE_VOCAB_BLOCK", "8")
    hidden, _, _, labels = make(4, 3, 30, torch.float32)
    labels[:] = torch.tensor([0, 29, 15, 3])
    bias = torch.zeros(30)
    weight = torch.zeros(30, 3)
    for poison in (float("nan"), float("inf")):
        b = bias.clone()
        b[20] = poison
        with torch.no_grad():
            assert kernmap_loss(hidden, weight, b, labels).isnan()
            assert transformers_loss(hidden, weight, b, labels).isnan()
    b = bias.clone()
    b[[1, 17]] = float("-inf")
    with torch.no_grad():
        got, want = kernmap_loss(hidden, weight, b, labels), transformers_loss(hidden, weight, b, labels)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    b[:] = float("-inf")
    with torch.no_grad():
        assert kernmap_loss(hidden, weight, b, labels).isnan()


def test_bad_bf16_gemm_setting_is_an_error(monkeypatch):
    hidden, weight, _, labels = make(4, 8, 16, torch.bfloat16)
    monkeypatch.setenv("KERNMAP_BF16_GEMM", "fast")
    with pytest.raises(RuntimeError, match="KERNMAP_BF16_GEMM must be 'native' or 'fp32', got 'fast'"):
        ops.linear_cross_entropy(hidden, weight, labels)
