"""torch.ops.kernmap RMSNorm, SiLU, SiLU-and-mul and SwiGLU through torch: gradcheck, opcheck, torch.compile,
views and stride-0 gradients, thread counts, and bad input. The kernels' values against the reference math
(every level, dtype, odd size, layout, empty inputs) are the C++ kernel suite's (tests/cpp/kernels/table.cpp)."""

import pytest
import torch

import kernmap

ops = torch.ops.kernmap


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


def test_the_cpu_level_is_read_and_set_from_python():
    levels = kernmap.supported_cpu_levels()
    assert levels[0] == "baseline" and kernmap.cpu_level() in levels
    before = kernmap.cpu_level()
    x, w = torch.randn(5, 37), torch.randn(37)
    want = torch.ops.kernmap.rms_norm(x, w, 1e-6)
    try:
        for level in levels:
            kernmap.set_cpu_level(level)
            assert kernmap.cpu_level() == level
            torch.testing.assert_close(torch.ops.kernmap.rms_norm(x, w, 1e-6), want)
        for bad in ("sse9", "AVX2", ""):
            with pytest.raises(kernmap.KernmapError, match=f"set_cpu_level: unknown level '{bad}' "
                                                           r"\(this CPU runs: baseline"):
                kernmap.set_cpu_level(bad)
        with pytest.raises(TypeError, match="level must be a str, got int"):
            kernmap.set_cpu_level(2)
    finally:
        kernmap.set_cpu_level(before)
    assert kernmap.cpu_level() == before
