"""The float64 kernels align's noise run binds (docs/training.md, "The verdict"): every layer has one; it is the
reference's math from float64, rounded where the reference rounds. So in float64 it is the reference, in a reduced
dtype it returns the reference's dtypes and agrees with the reference to its last rounding, it is at least as
accurate as the reference against exact arithmetic, its gradients are the reference's (gradcheck in float64), and
it rounds where the reference rounds (a loss from bf16 inputs is the one from bf16-rounded logits)."""

import pytest
import torch

import kernmap

from tolerances import tol

ops = torch.ops.kernmap
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def offsets(counts):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def routing(T, E, k, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g, dtype=torch.float64).softmax(-1)
    return ids, weights


def labels(N, V, seed=5):
    y = torch.randint(V, (N,), generator=torch.Generator().manual_seed(seed))
    y[::4] = -100  # ignored rows
    return y


# (layer, op name without prefix, inputs(dtype) -> args, float input positions, terms a result sums)
CASES = {
    "RMSNorm": ("rms_norm", lambda dt: (randn(3, 5, 67, dtype=dt), 1 + randn(67, dtype=dt, seed=1) / 4, 1e-6),
                (0, 1), 67),
    "RMSNorm fp32 weight": ("rms_norm", lambda dt: (randn(4, 33, dtype=dt), 1 + randn(33, seed=1) / 4, 1e-5),
                            (0, 1), 33),
    "FusedAddRMSNorm": ("add_rms_norm", lambda dt: (randn(3, 5, 67, dtype=dt), randn(3, 5, 67, dtype=dt, seed=2),
                                                    1 + randn(67, dtype=dt, seed=1) / 4, 1e-6), (0, 1, 2), 67),
    "SiLU": ("silu", lambda dt: (4 * randn(7, 129, dtype=dt),), (0,), 1),
    "SiluAndMul": ("silu_and_mul", lambda dt: (4 * randn(7, 129, dtype=dt), randn(7, 129, dtype=dt, seed=1)),
                   (0, 1), 1),
    "GroupedMM": ("grouped_mm", lambda dt: (randn(11, 13, dtype=dt), randn(3, 13, 9, dtype=dt, seed=1),
                                            offsets([4, 0, 7])), (0, 1), 13),
    "Experts": ("experts", lambda dt: (randn(9, 16, dtype=dt), routing(9, 6, 2)[0], routing(9, 6, 2)[1].to(dt),
                                       randn(6, 2 * 12, 16, dtype=dt, seed=1) / 4,
                                       randn(6, 16, 12, dtype=dt, seed=2) / 4), (0, 2, 3, 4), 16),
    "rotary_pos_emb": ("apply_rotary", lambda dt: (randn(2, 4, 5, 16, dtype=dt), randn(2, 2, 5, 16, dtype=dt, seed=1),
                                                   randn(2, 5, 16, dtype=dt, seed=2), randn(2, 5, 16, dtype=dt, seed=3),
                                                   1), (0, 1), 1),
    "ForCausalLMLoss": ("linear_cross_entropy", lambda dt: (randn(12, 24, dtype=dt), randn(37, 24, dtype=dt, seed=1),
                                                            labels(12, 37)), (0, 1), 24),
    "ForCausalLMLoss bias, num_items_in_batch": (
        "linear_cross_entropy", lambda dt: (randn(12, 24, dtype=dt), randn(37, 24, dtype=dt, seed=1), labels(12, 37),
                                            randn(37, dtype=dt, seed=2), -100, torch.tensor(20)), (0, 1, 3), 24),
}


def outputs(result):
    return list(result) if isinstance(result, (tuple, list)) else [result]


def call(kind, name, args):
    return outputs(getattr(ops, f"{kind}_{name}")(*args))


def as_float64(args):
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def test_every_layer_has_a_float64_kernel_that_runs_where_its_reference_runs():
    kernels = kernmap.kernels()
    for layer in {k["layer"] for k in kernels if k["provider"] == "reference"}:
        ref = next(k for k in kernels if k["layer"] == layer and k["provider"] == "reference")
        mine = [k for k in kernels if k["layer"] == layer and k["provider"] == "float64"]
        assert len(mine) == 1, f"{layer}: {len(mine)} float64 kernels (align's noise floor needs one)"
        assert mine[0]["devices"] == ref["devices"] and mine[0]["dtypes"] == ref["dtypes"], layer
        assert mine[0]["has_backward"], layer
    assert {c.split()[0] for c in CASES} == {k["layer"] for k in kernels if k["provider"] == "reference"}


@pytest.mark.parametrize("case", list(CASES))
def test_in_float64_it_is_the_reference(case):
    name, inputs, _, _ = CASES[case]
    args = inputs(torch.float64)
    for got, want in zip(call("float64", name, args), call("reference", name, args), strict=True):
        assert got.dtype == want.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_in_a_reduced_dtype_it_agrees_with_the_reference_and_is_at_least_as_accurate(case, dtype):
    name, inputs, _, terms = CASES[case]
    args = inputs(dtype)
    exact = call("float64", name, as_float64(args))  # no rounding anywhere: the exact math, to fp64
    for got, want, truth in zip(call("float64", name, args), call("reference", name, args), exact, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
        torch.testing.assert_close(got, want, **tol(dtype, terms))
        # Closer to exact arithmetic, or as close up to a unit in the output's last place: where both round the
        # same intermediate (bf16 logits), the reference's fp32 sums may happen to err towards the exact value.
        last_place = (truth.abs() * torch.finfo(got.dtype).eps).norm()
        assert (got.double() - truth).norm() <= (want.double() - truth).norm() + last_place


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_are_the_references(case):
    name, inputs, floats, _ = CASES[case]

    def grads(kind, args):
        args = list(args)
        leaves = [args[i].detach().requires_grad_(True) for i in floats]
        for i, leaf in zip(floats, leaves):
            args[i] = leaf
        outs = call(kind, name, args)
        torch.autograd.backward(outs, [randn(*o.shape, dtype=o.dtype, seed=9) for o in outs])
        return [leaf.grad for leaf in leaves]

    args = inputs(torch.float64)
    for got, want in zip(grads("float64", args), grads("reference", args), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    args = inputs(torch.float32)
    for got, want in zip(grads("float64", args), grads("reference", args), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tol(torch.float32, CASES[case][3]))


@pytest.mark.parametrize("case", list(CASES))
def test_gradcheck(case):
    name, inputs, floats, _ = CASES[case]
    args = list(as_float64(inputs(torch.float64)))

    def f(*leaves):
        full = list(args)
        for i, leaf in zip(floats, leaves):
            full[i] = leaf
        return tuple(call("float64", name, full))

    leaves = tuple(args[i].detach().requires_grad_(True) for i in floats)
    assert torch.autograd.gradcheck(f, leaves, fast_mode=True)


def test_the_loss_rounds_the_logits_to_the_input_dtype_as_the_reference_does():
    hidden, weight = randn(64, 32, dtype=torch.bfloat16), randn(211, 32, dtype=torch.bfloat16, seed=1)
    y = labels(64, 211)
    got = ops.float64_linear_cross_entropy(hidden, weight, y)
    want = ops.reference_linear_cross_entropy(hidden, weight, y)
    unrounded = ops.float64_linear_cross_entropy(hidden.double(), weight.double(), y)
    assert got.dtype == want.dtype == torch.float32
    # Within fp32 accumulation of the reference, and far from the loss of unrounded logits.
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want))
    assert abs(float(unrounded) - float(want)) > 10 * abs(float(got) - float(want))


def test_the_fused_add_rounds_the_sum_to_the_input_dtype():
    x, residual, weight = randn(5, 40, dtype=torch.bfloat16), randn(5, 40, dtype=torch.bfloat16, seed=1), randn(40)
    normed, total = ops.float64_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, ops.float64_rms_norm(residual + x, weight, 1e-6))


@pytest.mark.parametrize("case", ["FusedAddRMSNorm", "rotary_pos_emb", "ForCausalLMLoss"])
def test_errors_name_the_op_and_the_arguments(case):
    if case == "FusedAddRMSNorm":
        message = r"float64_add_rms_norm: residual must have the shape of x \[2, 4\], got \[2, 5\]"
        with pytest.raises(RuntimeError, match=message):
            ops.float64_add_rms_norm(torch.randn(2, 4), torch.randn(2, 5), torch.randn(4), 1e-6)
    elif case == "ForCausalLMLoss":
        with pytest.raises(RuntimeError, match=r"float64_linear_cross_entropy: weight must be \[V, H\]"):
            ops.float64_linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 6), torch.zeros(3, dtype=torch.long))
    else:
        with pytest.raises(RuntimeError, match="size of tensor"):
            ops.float64_apply_rotary(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 3, 6),
                                     torch.randn(1, 3, 6))
