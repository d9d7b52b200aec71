"""kernmap.kernelize(verify=batch): a kernel is bound only if its outputs and gradients on the model's live inputs
are within its layer's tolerance of the reference's; a kernel off in its forward, and one off only in its
backward, fall back with the measured error in the Report; every default kernel binds on the seven families; the
model's parameters, gradients, RNG state and train/eval flags are left as they were."""

import json
import math
from pathlib import Path

import pytest
import torch

import kernmap
from kernmap import _verify
from hf_models import FAMILIES, batch, expected_layers, make_model

ROOT = Path(__file__).resolve().parents[2]
OFF = 1e-3  # relative: 100 times fp32's rtol, well inside bf16's


def sample(seed=1):
    ids = batch(seed)
    return {"input_ids": ids, "labels": ids}


class _ScaleGrad(torch.autograd.Function):
    """The identity forward, a backward off by OFF relative."""

    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * (1 + OFF)


def _rms_forward_off(x, weight, eps):
    """Off by OFF relative in its output only: the gradients are the reference's."""
    y = torch.ops.kernmap.reference_rms_norm(x, weight, eps)
    return y + (y * OFF).detach()


def _rms_backward_off(x, weight, eps):
    return _ScaleGrad.apply(torch.ops.kernmap.reference_rms_norm(x, weight, eps))


def _silu_and_mul_raises(gate, up):
    raise RuntimeError("no such shape")


FORWARD_OFF = kernmap.register_kernel(kernmap.Kernel(name="test_verify/rms_norm_forward_off", layer="RMSNorm",
                                                     fn=_rms_forward_off, has_backward=True))
BACKWARD_OFF = kernmap.register_kernel(kernmap.Kernel(name="test_verify/rms_norm_backward_off", layer="RMSNorm",
                                                      fn=_rms_backward_off, has_backward=True))
RAISES = kernmap.register_kernel(kernmap.Kernel(name="test_verify/silu_and_mul_raises", layer="SiluAndMul",
                                                fn=_silu_and_mul_raises, has_backward=True))


def test_the_tolerance_table_is_the_kernels_documented_one():
    package = _verify.TABLE
    tests = json.loads((ROOT / "tests" / "tolerances.json").read_text())
    for dtype, figures in package["elementwise"].items():
        assert figures == {k: tests["elementwise"][dtype][k] for k in ("rtol", "atol")}, dtype
    assert set(package["elementwise"]) == set(tests["elementwise"]) - {"comment"}
    assert package["sum"]["atol_exponent"] == tests["sum"]["atol_exponent"]


@pytest.mark.parametrize("kernel, what", [(FORWARD_OFF, "output"), (BACKWARD_OFF, "grad_")])
def test_a_kernel_off_by_a_small_relative_error_falls_back_with_its_error(kernel, what):
    model = make_model("qwen2")
    with kernmap.use_mapping({"RMSNorm": {"cpu": kernel}}):
        unverified = kernmap.kernelize(model, mode="training")
        report = kernmap.kernelize(model, mode="training", verify=sample())
    assert all(r.kernel == kernel.name and not r.fallback for r in unverified.by_layer()["RMSNorm"])
    rows = report.by_layer()["RMSNorm"]
    assert len(rows) == expected_layers("qwen2")["RMSNorm"]
    for row in rows:
        assert row.fallback and row.kernel == "reference/rms_norm", row
        assert row.reason.startswith(f"verify: {what}"), row.reason
        assert row.error > row.tolerance > 0, row
        assert f"max error {row.error:.3g} > tolerance {row.tolerance:.3g}" in row.reason
    for name, module in model.named_modules():  # the refused kernel is not bound; the rest are
        if type(module).__name__ == "Qwen2RMSNorm":
            assert "forward" not in module.__dict__, name
    assert all(not r.fallback for r in report.rows if r.layer != "RMSNorm")
    assert "error / tolerance" in str(report)


def test_a_kernel_off_in_forward_is_within_tolerance_in_bfloat16():
    """The same relative error is below bf16's rounding: verify holds each dtype to its own figures."""
    model = make_model("qwen2", dtype=torch.bfloat16)
    with kernmap.use_mapping({"RMSNorm": {"cpu": FORWARD_OFF}}):
        report = kernmap.kernelize(model, mode="training", verify=sample())
    assert all(not r.fallback and r.error <= r.tolerance for r in report.by_layer()["RMSNorm"])


def test_a_kernel_that_raises_on_the_live_inputs_falls_back_with_the_error():
    model = make_model("llama")
    with kernmap.use_mapping({"SiluAndMul": {"cpu": RAISES}}):
        report = kernmap.kernelize(model, mode="training", verify=sample())
    for row in report.by_layer()["SiluAndMul"]:
        assert row.fallback and row.error is None
        assert row.reason == "verify: the kernel raised RuntimeError: no such shape"
    with kernmap.use_mapping({"SiluAndMul": {"cpu": RAISES}}):
        with pytest.raises(kernmap.KernelizeError, match="verify: the kernel raised"):
            kernmap.kernelize(make_model("llama"), mode="training", verify=sample(), use_fallback=False)


@pytest.mark.parametrize("family, dtype", [(f, torch.float32) for f in FAMILIES]
                         + [("qwen2", torch.bfloat16), ("qwen3_moe", torch.bfloat16)])
def test_every_default_kernel_binds_on_every_family(family, dtype):
    model = make_model(family, dtype=dtype)
    plain = kernmap.kernelize(make_model(family, dtype=dtype), mode="training")
    report = kernmap.kernelize(model, mode="training", verify=sample())
    assert [(r.path, r.kernel) for r in report.rows] == [(r.path, r.kernel) for r in plain.rows]
    assert not report.fallbacks, str(report)
    counts = {}
    for row in report.rows:
        counts[row.layer] = counts.get(row.layer, 0) + 1
        if row.error is None:  # SiLU modules whose MLP (or experts) the fused kernel replaced: never called
            assert row.layer == "SiLU" and row.reason.endswith("verify: not called by the sample batch"), row
        else:
            assert 0 <= row.error <= row.tolerance, row
    assert counts == expected_layers(family)


def test_the_model_is_left_as_it_was():
    model = make_model("qwen3_moe")
    model.eval()
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, float(i))
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    kernmap.kernelize(model, mode="training", verify=sample())
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any(m.training for m in model.modules())
    for p, want, grad in zip(model.parameters(), params, grads):
        assert torch.equal(p, want) and torch.equal(p.grad, grad)


def test_a_verified_model_computes_what_the_plain_kernelized_one_does():
    verified, plain = make_model("qwen2_moe"), make_model("qwen2_moe")
    kernmap.kernelize(verified, mode="training", verify=sample())
    kernmap.kernelize(plain, mode="training")
    data = sample(seed=3)
    for m in (verified, plain):
        m.train()
        m(**data).loss.backward()
    for (name, a), b in zip(verified.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_inference_mode_verifies_the_forward_only():
    report = kernmap.kernelize(make_model("mistral"), mode="inference", verify={"input_ids": batch()})
    for row in report.rows:
        assert row.error is None or row.error <= row.tolerance, row


def test_a_batch_that_is_not_a_dict_is_refused():
    with pytest.raises(TypeError, match="batch must be a dict of model inputs.*got Tensor"):
        kernmap.kernelize(make_model("qwen2"), mode="training", verify=batch())


def test_compare_holds_non_finite_values_to_equality():
    rtol, atol = 1e-5, 1e-5
    inf, nan = math.inf, math.nan
    assert _verify.compare(torch.tensor([inf, nan, 1.0]), torch.tensor([inf, nan, 1.0]), rtol, atol)[0] == 0
    assert _verify.compare(torch.tensor([nan, 1.0]), torch.tensor([0.0, 1.0]), rtol, atol)[0] == inf
    assert _verify.compare(torch.tensor([inf]), torch.tensor([-inf]), rtol, atol)[0] == inf
    error, allowed = _verify.compare(torch.tensor([1.0, 100.002]), torch.tensor([1.0, 100.0]), rtol, atol)
    assert error == pytest.approx(0.002, rel=1e-3) and allowed == pytest.approx(atol + rtol * 100)
    assert _verify.compare(torch.empty(0), torch.empty(0), rtol, atol) == (0.0, atol)
