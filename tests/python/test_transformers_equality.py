"""kernmap's kernels equal transformers' own modules on the same inputs: Qwen2RMSNorm (forward and gradients,
including the fp32-weight-with-bf16-input quirk) and Qwen2MLP's activation product act_fn(gate) * up."""

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

from tolerances import tol

ops = torch.ops.kernmap


@pytest.mark.parametrize(
    "x_dtype,w_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
     (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize("hidden", [7, 896])
def test_rms_norm_equals_qwen2_rmsnorm(x_dtype, w_dtype, hidden):
    norm = Qwen2RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden))
    norm = norm.to(w_dtype)
    x = torch.randn(2, 5, hidden).to(x_dtype).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    w2 = norm.weight.detach().clone().requires_grad_(True)

    want = norm(x)
    got = ops.rms_norm(x2, w2, norm.variance_epsilon)
    assert got.dtype == want.dtype  # fp32 weight with bf16 x gives fp32, as in transformers
    # kernmap reproduces the eager casts, so only summation order differs; figures of x's dtype (the fp32
    # output of an fp32 weight is rounded to x's dtype first).
    torch.testing.assert_close(got, want, **tol(x_dtype))

    dy = torch.randn(want.shape).to(want.dtype)
    want.backward(dy)
    got.backward(dy)
    torch.testing.assert_close(x2.grad, x.grad, **tol(x_dtype))
    rows = x.numel() // hidden
    torch.testing.assert_close(w2.grad, norm.weight.grad, **tol(x_dtype, terms=rows))  # dW sums over the rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_equals_qwen2_mlp_activation_product(dtype):
    config = Qwen2Config(hidden_size=64, intermediate_size=200, hidden_act="silu")
    mlp = Qwen2MLP(config).to(dtype)
    x = torch.randn(3, 4, 64).to(dtype)
    with torch.no_grad():
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    g1, u1 = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    g2, u2 = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    want = mlp.act_fn(g1) * u1
    got = ops.silu_and_mul(g2, u2)
    torch.testing.assert_close(got, want, **tol(dtype))
    if dtype != torch.float32:
        # The eager roundings are reproduced: nearly every element is bit-identical.
        assert (got == want).float().mean() > 0.99
    dy = torch.randn(want.shape).to(dtype)
    want.backward(dy)
    got.backward(dy)
    torch.testing.assert_close(g2.grad, g1.grad, **tol(dtype))
    torch.testing.assert_close(u2.grad, u1.grad, **tol(dtype))
    # And the whole MLP, with kernmap's product in the middle.
    torch.testing.assert_close(mlp.down_proj(got.detach()), mlp(x), **tol(dtype))
