"""torch.ops.kernmap.apply_rotary against transformers' apply_rotary_pos_emb (bit for bit, forward and backward,
in every dtype, and the same output layout), the float64 math, gradcheck and opcheck, the layouts attention
classes pass, empty and bad inputs, torch.compile; kernelize's per-instance binding of each family's attention."""

import copy
import importlib

import pytest
import torch

import kernmap
from hf_models import FAMILIES, make_model

ops = torch.ops.kernmap
MODELING = {f: importlib.import_module(f"transformers.models.{f}.modeling_{f}") for f in FAMILIES}
eager_rotary = MODELING["qwen2"].apply_rotary_pos_emb
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def cases(D, dtype):
    """(name, q, k, cos, sin, unsqueeze_dim) in the layouts apply_rotary_pos_emb is called with."""
    B, S, H, KV = 2, 5, 4, 2
    cos, sin = randn(1, S, D, dtype=dtype), randn(1, S, D, dtype=dtype)
    qkv = randn(B, S, (H + 2 * KV) * D, dtype=dtype)
    return [
        ("attention views", randn(B, S, H, D, dtype=dtype).transpose(1, 2),
         randn(B, S, KV, D, dtype=dtype).transpose(1, 2), cos, sin, 1),
        ("contiguous", randn(B, H, S, D, dtype=dtype), randn(B, KV, S, D, dtype=dtype), cos, sin, 1),
        ("BSHD unsqueeze_dim=2", randn(B, S, H, D, dtype=dtype), randn(B, S, KV, D, dtype=dtype), cos, sin, 2),
        ("fused qkv slices", qkv[..., : H * D].view(B, S, H, D).transpose(1, 2),
         qkv[..., H * D:(H + KV) * D].view(B, S, KV, D).transpose(1, 2), cos, sin, 1),
        ("per-batch positions", randn(B, H, S, D, dtype=dtype), randn(B, KV, S, D, dtype=dtype),
         randn(B, S, D, dtype=dtype), randn(B, S, D, dtype=dtype), 1),
        ("[S, D] cos, unsqueeze_dim=0", randn(B, H, S, D, dtype=dtype), randn(B, KV, S, D, dtype=dtype), cos[0],
         sin[0], 0),
        ("[S, D] cos, BSHD", randn(B, S, H, D, dtype=dtype), randn(B, S, KV, D, dtype=dtype), cos[0], sin[0], 1),
        ("negative unsqueeze_dim", randn(B, H, S, D, dtype=dtype), randn(B, KV, S, D, dtype=dtype), cos, sin, -3),
    ]


def forward_backward(fn, q, k, cos, sin, dim, seed=1):
    q, k = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
    qe, ke = fn(q, k, cos, sin, dim)
    g = torch.Generator().manual_seed(seed)
    gq = torch.randn(qe.shape, generator=g, dtype=torch.float64).to(qe.dtype)
    gk = torch.randn(ke.shape, generator=g, dtype=torch.float64).to(ke.dtype)
    torch.autograd.backward([qe, ke], [gq, gk])
    return qe.detach(), ke.detach(), q.grad, k.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [2, 6, 64, 128, 130])
def test_equals_transformers_apply_rotary_pos_emb_bit_for_bit(dtype, D):
    """Each product and the sum rounded as eager rounds them: forward bits, output layout and gradients equal."""
    for name, q, k, cos, sin, dim in cases(D, dtype):
        got = forward_backward(ops.apply_rotary, q, k, cos, sin, dim)
        want = forward_backward(eager_rotary, q, k, cos, sin, dim)
        for a, b, what in zip(got, want, ("q_embed", "k_embed", "q.grad", "k.grad")):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, what)
            assert torch.equal(a, b), f"{name}: {what} differs in {(a != b).sum()} elements"
        for a, b in zip(got, want):  # outputs and gradients in eager's layouts
            assert a.stride() == b.stride(), name
        # And against the float64 math.
        q64, k64 = eager_rotary(q.double(), k.double(), cos.double(), sin.double(), dim)
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
        torch.testing.assert_close(got[0].double(), q64, rtol=tol, atol=tol)
        torch.testing.assert_close(got[1].double(), k64, rtol=tol, atol=tol)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_calls_the_same_math(family):
    """The seven families' apply_rotary_pos_emb (each modeling file has its own copy) against the op."""
    _, q, k, cos, sin, dim = cases(8, torch.bfloat16)[0]
    want = MODELING[family].apply_rotary_pos_emb(q, k, cos, sin, dim)
    for a, b in zip(ops.apply_rotary(q, k, cos, sin, dim), want):
        assert torch.equal(a, b)


def test_mixed_dtypes_promote_as_eager():
    """bf16 q and k with fp32 cos and sin (autocast's projections): fp32 outputs equal to eager's, gradients back
    in bf16 within one rounding."""
    _, q, k, cos, sin, dim = cases(16, torch.bfloat16)[0]
    cos, sin = cos.float() + 0.01, sin.float() - 0.01
    got = forward_backward(ops.apply_rotary, q, k, cos, sin, dim)
    want = forward_backward(eager_rotary, q, k, cos, sin, dim)
    assert got[0].dtype == torch.float32 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[2], want[2], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[3], want[3], rtol=1e-2, atol=1e-2)


def test_cos_and_sin_that_require_grad_get_the_eager_gradients():
    _, q, k, cos, sin, dim = cases(6, torch.float32)[0]
    grads = []
    for fn in (ops.apply_rotary, eager_rotary):
        args = [t.detach().clone().requires_grad_(True) for t in (q, k, cos, sin)]
        qe, ke = fn(*args, dim)
        (qe.square().sum() + ke.sum()).backward()
        grads.append([a.grad for a in args])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gradcheck_float64():
    for _, q, k, cos, sin, dim in cases(6, torch.float64)[:4]:
        q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        assert torch.autograd.gradcheck(lambda a, b: ops.apply_rotary(a, b, cos, sin, dim), (q, k))
    _, q, k, cos, sin, dim = cases(4, torch.float64)[0]
    args = [t.detach().requires_grad_(True) for t in (q, k, cos, sin)]
    assert torch.autograd.gradcheck(lambda *a: ops.apply_rotary(*a, dim), args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    for _, q, k, cos, sin, dim in cases(8, dtype)[:4]:
        torch.library.opcheck(ops.apply_rotary.default, (q.requires_grad_(True), k.requires_grad_(True), cos, sin, dim))
        torch.library.opcheck(ops.apply_rotary.default, (q.detach(), k.detach(), cos, sin, dim))
        torch.library.opcheck(ops.apply_rotary_backward.default,
                              (torch.randn_like(q.detach()), torch.randn_like(k.detach()), cos, sin, dim))


def test_empty_inputs():
    cos, sin = torch.randn(1, 0, 8), torch.randn(1, 0, 8)
    q = torch.empty(2, 3, 0, 8, requires_grad=True)
    k = torch.empty(2, 1, 0, 8, requires_grad=True)
    qe, ke = ops.apply_rotary(q, k, cos, sin)
    assert qe.shape == q.shape and ke.shape == k.shape
    (qe.sum() + ke.sum()).backward()
    assert q.grad.shape == q.shape


def test_results_do_not_depend_on_thread_count():
    _, q, k, cos, sin, dim = cases(128, torch.float32)[0]
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(ops.apply_rotary(q, k, cos, sin, dim))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("layout", [c[0] for c in cases(8, torch.float32)])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile(backend, layout):
    """Under inductor the real outputs must have the fake (Meta) tensors' strides, which inductor asserts, for
    every layout callers hand the op."""
    _, q, k, cos, sin, dim = next(c for c in cases(8, torch.float32) if c[0] == layout)

    def f(q, k, cos, sin):
        qe, ke = ops.apply_rotary(q, k, cos, sin, dim)
        return qe.square().sum() + ke.sum()

    torch._dynamo.reset()
    args = [q.detach().requires_grad_(True), k.detach().requires_grad_(True), cos, sin]
    eager = f(*args)
    eager_grads = torch.autograd.grad(eager, args[:2])
    compiled = torch.compile(f, backend=backend, fullgraph=True)(*args)
    compiled_grads = torch.autograd.grad(compiled, args[:2])
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b)


BAD_INPUTS = [
    (lambda: ops.apply_rotary(torch.randn(1, 2, 3, 7), torch.randn(1, 1, 3, 7), torch.randn(1, 3, 7),
                              torch.randn(1, 3, 7)), "q's last dimension (head_dim) must be even, got 7"),
    (lambda: ops.apply_rotary(torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 4, 8),
                              torch.randn(1, 4, 8)),
     "cos.unsqueeze(unsqueeze_dim) of shape [1, 1, 4, 8] must broadcast to q's shape [1, 2, 3, 8]"),
    (lambda: ops.apply_rotary(torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 3, 8),
                              torch.randn(1, 3, 6)), "sin must have the shape of cos [1, 3, 8], got [1, 3, 6]"),
    (lambda: ops.apply_rotary(torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 3, 8),
                              torch.randn(1, 3, 8), 4), "unsqueeze_dim must be in [-4, 3] for cos of 3 dimensions, got 4"),
    (lambda: ops.apply_rotary(torch.ones(1, 2, 3, 8, dtype=torch.long), torch.randn(1, 1, 3, 8), torch.randn(1, 3, 8),
                              torch.randn(1, 3, 8)), "q must be float32"),
    (lambda: ops.apply_rotary(torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8, device="meta"), torch.randn(1, 3, 8),
                              torch.randn(1, 3, 8)), "k must be on the device of cos"),
]


@pytest.mark.parametrize("call,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        call()


# ---- kernelize: each family's attention, bound per instance --------------------------------------------------


class _RecordOps(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def attention_inputs(model, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 7, model.config.hidden_size, generator=g).to(dtype)
    position_ids = torch.arange(7).unsqueeze(0)
    cos, sin = model.model.rotary_emb(hidden, position_ids)
    return hidden, (cos, sin)


def run_attention(attn, hidden, position_embeddings, grad):
    hidden = hidden.detach().clone().requires_grad_(True)
    record = _RecordOps()
    with record:
        out, _ = attn(hidden, position_embeddings=position_embeddings, attention_mask=None)
    out.backward(grad)
    return out.detach(), hidden.grad, {n: p.grad for n, p in attn.named_parameters()}, record.names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_attention_equals_eager_with_the_kernel_bound(family, dtype):
    """With only rotary_pos_emb bound (Qwen3's q/k norms keep their eager forward) the attention's output and
    every gradient are the eager attention's bit for bit; with q/k norms bound too, within RMSNorm's tolerance."""
    model = make_model(family, dtype)
    attn = model.model.layers[0].self_attn
    hidden, pe = attention_inputs(model, dtype)
    grad = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    want = run_attention(attn, hidden, pe, grad)
    assert "kernmap.apply_rotary" not in " ".join(want[3])

    only_rotary = copy.deepcopy(attn)
    with kernmap.use_mapping({"RMSNorm": {"cpu": "reference/rms_norm"}}, inherit=True):
        report = kernmap.kernelize(only_rotary, mode="training", device="cpu")
    assert [(r.path, r.layer, r.kernel) for r in report.rows if r.layer == "rotary_pos_emb"] == [
        ("", "rotary_pos_emb", "kernmap/apply_rotary")]
    got = run_attention(only_rotary, hidden, pe, grad)
    assert any("apply_rotary" in n for n in got[3]), got[3]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name, g in want[2].items():
        assert torch.equal(got[2][name], g), name

    every = copy.deepcopy(attn)
    kernmap.kernelize(every, mode="training", device="cpu")
    got = run_attention(every, hidden, pe, grad)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)


def test_kernelizing_one_model_leaves_another_and_the_modeling_module_alone():
    module = MODELING["qwen2"]
    original = module.apply_rotary_pos_emb
    first, second = make_model("qwen2"), make_model("qwen2")
    report = kernmap.kernelize(first, mode="training")
    assert len(report.by_layer()["rotary_pos_emb"]) == 2
    assert module.apply_rotary_pos_emb is original
    for model, bound in ((first, True), (second, False)):
        record = _RecordOps()
        with record:
            model(torch.randint(0, 64, (1, 5)))
        assert any("apply_rotary" in n for n in record.names) == bound
    # Restoring gives the class's forward back.
    kernmap.kernelize(first, mode="training", compile=False, device="cuda")
    assert "forward" not in first.model.layers[0].self_attn.__dict__


def test_an_attention_that_does_not_call_the_function_gets_a_fallback_row():
    model = make_model("llama")
    attn = model.model.layers[0].self_attn
    cls = type(attn)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        return hidden_states, None

    sub = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    attn.__class__ = sub
    report = kernmap.kernelize(model, mode="training")
    rows = [r for r in report.rows if r.layer == "rotary_pos_emb"]
    assert rows[0].fallback and "does not call apply_rotary_pos_emb" in rows[0].reason
    assert not rows[1].fallback
