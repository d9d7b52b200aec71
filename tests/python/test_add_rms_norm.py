"""torch.ops.kernmap.add_rms_norm, the residual add fused with RMSNorm: the eager decoder layer's
`residual + hidden_states` followed by its RMSNorm (the sum bit for bit, the normed output RMSNorm's contract),
gradients of both outputs, gradcheck, opcheck, odd sizes, strided and empty inputs, bad input."""

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

ops = torch.ops.kernmap

TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}
DTYPES = list(TOL)


def layouts(rows, h, dtype):
    base = torch.randn(rows, h, dtype=torch.float64).to(dtype)
    wide = torch.randn(rows, h + 3, dtype=torch.float64).to(dtype)
    wide[:, 1 : h + 1] = base
    return {"contiguous": base, "sliced": wide[:, 1 : h + 1], "transposed": base.t().contiguous().t(),
            "3d": base.view(2, rows // 2, h)}


def run(fn, x, residual, weight, seed=1):
    x, residual, weight = (t.detach().clone().requires_grad_(True) for t in (x, residual, weight))
    normed, total = fn(x, residual, weight, 1e-6)
    g = torch.Generator().manual_seed(seed)
    gn = torch.randn(normed.shape, generator=g, dtype=torch.float64).to(normed.dtype)
    gs = torch.randn(total.shape, generator=g, dtype=torch.float64).to(total.dtype)
    torch.autograd.backward([normed, total], [gn, gs])
    return normed.detach(), total.detach(), x.grad, residual.grad, weight.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [1, 7, 769, 5125])
def test_matches_reference_and_is_the_add_then_rms_norm(dtype, h):
    for name, x in layouts(6, h, dtype).items():
        residual = torch.randn(x.shape, dtype=torch.float64).to(dtype)
        weight = (1 + 0.1 * torch.randn(h, dtype=torch.float64)).to(dtype)
        normed, total, dx, dr, dw = run(ops.add_rms_norm, x, residual, weight)
        want = run(ops.reference_add_rms_norm, x, residual, weight)
        eager_sum = residual + x
        assert torch.equal(total, eager_sum), name
        assert torch.equal(normed, ops.rms_norm(eager_sum, weight, 1e-6)), name
        torch.testing.assert_close(normed, want[0], **TOL[dtype])
        torch.testing.assert_close(dx, want[2], **TOL[dtype])
        assert torch.equal(dx, dr)
        torch.testing.assert_close(dr, want[3], **TOL[dtype])
        tol = {k: 4 * v for k, v in TOL[dtype].items()}  # dW: fp32 sums in kernmap, output dtype in the reference
        torch.testing.assert_close(dw, want[4], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_transformers_decoder_layer_add_and_norm(dtype):
    """`hidden_states = residual + hidden_states; residual = hidden_states; hidden_states = norm(hidden_states)`."""
    norm = Qwen2RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(96))
    norm = norm.to(dtype)
    attn_out, residual = torch.randn(3, 5, 96).to(dtype), torch.randn(3, 5, 96).to(dtype)
    h = residual + attn_out
    normed, total = ops.add_rms_norm(attn_out, residual, norm.weight.detach(), norm.variance_epsilon)
    assert torch.equal(total, h)
    torch.testing.assert_close(normed, norm(h).detach(), **TOL[dtype])


def test_fp32_weight_with_bf16_input_gives_fp32_normed_output():
    x, r, w = torch.randn(4, 33).bfloat16(), torch.randn(4, 33).bfloat16(), torch.rand(33) + 0.5
    normed, total = ops.add_rms_norm(x, r, w, 1e-6)
    assert normed.dtype == torch.float32 and total.dtype == torch.bfloat16
    assert torch.equal(normed, ops.rms_norm(r + x, w, 1e-6))


def test_gradcheck_float64():
    x, r = (torch.randn(3, 2, 7, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: ops.add_rms_norm(a, b, c, 1e-5), (x, r, w))
    xt = torch.randn(9, 4, dtype=torch.float64).t().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b, c: ops.add_rms_norm(a, b, c, 0.0),
                                    (xt, torch.randn(4, 9, dtype=torch.float64, requires_grad=True),
                                     torch.randn(9, dtype=torch.float64, requires_grad=True)))


def test_one_output_used():
    """An unused output's gradient arrives as zeros: the other's backward alone."""
    x, r, w = torch.randn(5, 16, requires_grad=True), torch.randn(5, 16, requires_grad=True), torch.randn(16)
    ops.add_rms_norm(x, r, w, 1e-6)[1].sum().backward()
    assert torch.equal(x.grad, torch.ones(5, 16)) and torch.equal(r.grad, torch.ones(5, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    x = torch.randn(4, 3, 16).to(dtype).requires_grad_(True)
    r = torch.randn(4, 3, 16).to(dtype).requires_grad_(True)
    w = torch.randn(16).to(dtype).requires_grad_(True)
    torch.library.opcheck(ops.add_rms_norm.default, (x, r, w, 1e-6))
    torch.library.opcheck(ops.add_rms_norm.default, (x.detach(), r.detach(), w.detach().float(), 1e-6))
    y, s, rstd = ops.add_rms_norm_forward(x.detach(), r.detach(), w.detach(), 1e-6)
    torch.library.opcheck(ops.add_rms_norm_forward.default, (x.detach(), r.detach(), w.detach(), 1e-6))
    torch.library.opcheck(ops.add_rms_norm_backward.default,
                          (torch.randn_like(y), torch.randn_like(s), s, w.detach(), rstd))


def test_torch_compile_runs_and_matches():
    def f(x, r, w):
        normed, total = ops.add_rms_norm(x, r, w, 1e-6)
        return normed.square().sum() + total.sum()

    args = [torch.randn(4, 32, requires_grad=True), torch.randn(4, 32, requires_grad=True),
            torch.randn(32, requires_grad=True)]
    eager = f(*args)
    eager_grads = torch.autograd.grad(eager, args)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(*args)
    for a, b in zip(torch.autograd.grad(compiled, args), eager_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_inputs(dtype):
    x = torch.empty(0, 16, dtype=dtype, requires_grad=True)
    w = torch.ones(16, dtype=dtype, requires_grad=True)
    normed, total = ops.add_rms_norm(x, torch.empty(0, 16, dtype=dtype), w, 1e-6)
    assert normed.shape == total.shape == (0, 16)
    (normed.sum() + total.sum()).backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


BAD_INPUTS = [
    (lambda: ops.add_rms_norm(torch.randn(4, 8), torch.randn(4, 7), torch.ones(8), 1e-6),
     "residual must have the shape of x [4, 8], got [4, 7]"),
    (lambda: ops.add_rms_norm(torch.randn(4, 8), torch.randn(4, 8).half(), torch.ones(8), 1e-6),
     "residual must have the dtype of x (Float), got Half"),
    (lambda: ops.add_rms_norm(torch.randn(4, 8), torch.randn(4, 8), torch.ones(7), 1e-6),
     "kernmap.add_rms_norm: weight must have shape [8]"),
    (lambda: ops.add_rms_norm(torch.randn(4, 8), torch.randn(4, 8), torch.ones(8), -1.0), "eps must be finite"),
    (lambda: ops.add_rms_norm(torch.randn(4, 8), torch.randn(4, 8, device="meta"), torch.ones(8), 1e-6),
     "residual must be on the device of x"),
    (lambda: ops.add_rms_norm(torch.ones(4, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32),
                              torch.ones(8), 1e-6), "x must be float32"),
]


@pytest.mark.parametrize("call,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_names_the_argument(call, message):
    escaped = message
    for c in "[]()":
        escaped = escaped.replace(c, "\\" + c)
    with pytest.raises(RuntimeError, match=escaped):
        call()
