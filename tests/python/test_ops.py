"""torch.ops.kernmap RMSNorm, SiLU, SiLU-and-mul and SwiGLU against the reference math, gradcheck, opcheck,
odd sizes, strided and empty inputs, and bad input."""

import pytest
import torch
from conftest import poison

ops = torch.ops.kernmap

TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}
DTYPES = list(TOL)
SIZES = [1, 7, 769, 5125]


def layouts(shape, dtype):
    """The same values as: contiguous, 3-D view, a slice of a wider tensor, a transposed copy viewed back."""
    rows, h = shape
    base = torch.randn(rows, h, dtype=torch.float64).to(dtype)
    wide = torch.randn(rows, h + 3, dtype=torch.float64).to(dtype)
    wide[:, 1 : h + 1] = base
    out = {"contiguous": base, "sliced": wide[:, 1 : h + 1], "transposed": base.t().contiguous().t()}
    if rows % 2 == 0:
        out["3d"] = base.view(2, rows // 2, h)
    return out


def assert_close(got, want, dtype, scale=1.0):
    tol = {k: v * scale for k, v in TOL[dtype].items()}
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **tol)


def run_both(kernel, reference, inputs, grad_seed=1):
    """Forward and backward of kernel and reference on clones of inputs; returns outputs and input grads."""
    results = []
    for fn in (kernel, reference):
        xs = [t.detach().clone().requires_grad_(True) for t in inputs]
        poison()
        y = fn(*xs)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=torch.float64)
        y.backward(g.to(y.dtype))
        results.append((y.detach(), [x.grad for x in xs]))
    return results


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", SIZES)
def test_rms_norm_matches_reference(dtype, h):
    for name, x in layouts((6, h), dtype).items():
        w = (1 + 0.1 * torch.randn(h, dtype=torch.float64)).to(dtype)
        (y, (dx, dw)), (yr, (dxr, dwr)) = run_both(
            lambda a, b: ops.rms_norm(a, b, 1e-6), lambda a, b: ops.reference_rms_norm(a, b, 1e-6), [x, w]
        )
        assert_close(y, yr, dtype)
        assert_close(dx, dxr, dtype)
        # dW sums over rows: the reference sums in the output dtype, kernmap in fp32.
        assert_close(dw, dwr, dtype, scale=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_fp32_weight_with_half_input_gives_fp32(dtype):
    x = torch.randn(5, 33).to(dtype)
    w = torch.rand(33) + 0.5
    y = ops.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ops.reference_rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_silu_and_mul_swiglu_silu_match_reference(dtype, n):
    for name, g in layouts((4, n), dtype).items():
        u = torch.randn(g.shape, dtype=torch.float64).to(dtype)
        (y, (dg, du)), (yr, (dgr, dur)) = run_both(ops.silu_and_mul, ops.reference_silu_and_mul, [g, u])
        assert_close(y, yr, dtype)
        assert_close(dg, dgr, dtype)
        assert_close(du, dur, dtype)
    gu = torch.randn(2, 3, 2 * n, dtype=torch.float64).to(dtype)
    (y, (d,)), (yr, (dr,)) = run_both(ops.swiglu, ops.reference_swiglu, [gu])
    assert_close(y, yr, dtype)
    assert_close(d, dr, dtype)
    (y, (d,)), (yr, (dr,)) = run_both(ops.silu, ops.reference_silu, [gu])
    assert_close(y, yr, dtype)
    assert_close(d, dr, dtype)


def test_silu_and_mul_of_chunked_views_is_swiglu():
    gu = torch.randn(8, 2 * 96)
    gate, up = gu.chunk(2, -1)  # non-contiguous halves of one tensor
    torch.testing.assert_close(ops.silu_and_mul(gate, up), ops.swiglu(gu), rtol=0, atol=0)


def test_gradcheck_float64():
    x = torch.randn(3, 2, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: ops.rms_norm(a, b, 1e-5), (x, w))
    xt = torch.randn(9, 4, dtype=torch.float64).t().requires_grad_(True)  # non-contiguous
    assert torch.autograd.gradcheck(lambda a, b: ops.rms_norm(a, b, 0.0), (xt, torch.randn(9, dtype=torch.float64, requires_grad=True)))
    g = torch.randn(5, 19, dtype=torch.float64, requires_grad=True)
    u = torch.randn(5, 19, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ops.silu_and_mul, (g, u))
    assert torch.autograd.gradcheck(ops.silu, (g,))
    assert torch.autograd.gradcheck(ops.swiglu, (torch.randn(2, 3, 10, dtype=torch.float64, requires_grad=True),))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    x = torch.randn(4, 3, 16).to(dtype).requires_grad_(True)
    w = torch.randn(16).to(dtype).requires_grad_(True)
    g = torch.randn(4, 24).to(dtype).requires_grad_(True)
    u = torch.randn(4, 24).to(dtype).requires_grad_(True)
    cases = [
        (ops.rms_norm.default, (x, w, 1e-6)),
        (ops.rms_norm.default, (x.detach(), w.detach().float(), 1e-6)),
        (ops.silu.default, (g,)),
        (ops.silu_and_mul.default, (g, u)),
        (ops.swiglu.default, (g,)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
    y, rstd = ops.rms_norm_forward(x.detach(), w.detach(), 1e-6)
    torch.library.opcheck(ops.rms_norm_backward.default, (torch.randn_like(y), x.detach(), w.detach(), rstd))
    torch.library.opcheck(ops.silu_and_mul_backward.default, (torch.randn_like(g), g.detach(), u.detach()))


def test_torch_compile_runs_and_matches():
    def f(x, w, g, u):
        return ops.rms_norm(x, w, 1e-6).sum() + ops.silu_and_mul(g, u).sum()

    args = [torch.randn(4, 32, requires_grad=True), torch.randn(32, requires_grad=True),
            torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)]
    eager = f(*args)
    eager_grads = torch.autograd.grad(eager, args)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(*args)
    compiled_grads = torch.autograd.grad(compiled, args)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_inputs(dtype):
    x = torch.empty(0, 16, dtype=dtype, requires_grad=True)
    w = torch.ones(16, dtype=dtype, requires_grad=True)
    y = ops.rms_norm(x, w, 1e-6)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    assert ops.silu_and_mul(x, x).shape == (0, 16)
    assert ops.swiglu(x).shape == (0, 8)
    assert ops.silu(torch.empty(0, dtype=dtype)).shape == (0,)


def test_expanded_grad_from_sum():
    """y.sum().backward() hands the backward a stride-0 gradient."""
    x = torch.randn(3, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    ops.rms_norm(x, w, 1e-6).sum().backward()
    xr, wr = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    ops.reference_rms_norm(xr, wr, 1e-6).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


def test_results_do_not_depend_on_thread_count():
    x = torch.randn(300, 777)
    w = torch.randn(777)
    dy = torch.randn(300, 777)
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            y, rstd = ops.rms_norm_forward(x, w, 1e-6)
            outs.append((y, *ops.rms_norm_backward(dy, x, w, rstd)))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


BAD_INPUTS = [
    (lambda: ops.rms_norm(torch.randn(4, 8), torch.ones(7), 1e-6), "weight must have shape [8]"),
    (lambda: ops.rms_norm(torch.randn(4, 8), torch.ones(2, 4), 1e-6), "weight must have shape [8]"),
    (lambda: ops.rms_norm(torch.ones(4, 8, dtype=torch.long), torch.ones(8), 1e-6), "x must be float32"),
    (lambda: ops.rms_norm(torch.ones(4, 8), torch.ones(8, dtype=torch.int32), 1e-6), "weight must be float32"),
    (lambda: ops.rms_norm(torch.ones(4, 8), torch.ones(8), -1.0), "eps must be finite and >= 0"),
    (lambda: ops.rms_norm(torch.ones(4, 8), torch.ones(8, device="meta"), 1e-6), "weight must be on the device of x"),
    (lambda: ops.rms_norm(torch.tensor(1.0), torch.ones(1), 1e-6), "x must have at least 1 dimension"),
    (lambda: ops.silu_and_mul(torch.randn(4, 8), torch.randn(4, 9)), "up must have the shape of gate"),
    (lambda: ops.silu_and_mul(torch.randn(4, 8), torch.randn(4, 8).half()), "up must have the dtype of gate"),
    (lambda: ops.silu_and_mul(torch.ones(4, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32)), "gate must be float32"),
    (lambda: ops.swiglu(torch.randn(4, 7)), "even last dimension"),
    (lambda: ops.silu(torch.ones(3, dtype=torch.int64)), "x must be float32"),
    (lambda: ops.reference_silu_and_mul(torch.randn(4, 8), torch.randn(8)), "up must have the shape of gate"),
]


@pytest.mark.parametrize("call,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call()
