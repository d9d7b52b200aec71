"""kernmap.kernelize on real transformers models (tiny random configs, no downloads), against the original model
with the same weights: every eligible layer is replaced, logits, loss and every gradient match (fp32 tight, bf16
within documented tolerances), 20 AdamW steps run in lockstep, and torch.compile of the kernelized model runs and
matches."""

import copy

import pytest
import torch

import kernmap
from hf_models import FAMILIES, MOE_FAMILIES, batch, expected_layers, make_model
from tolerances import TRAINING_STEPS, loss_tol, model_gradient_bound, tol

# fp32: only summation order differs (fused RMSNorm rows, grouped experts); bf16: kernmap reproduces the eager
# roundings, so logits and loss come out equal here. tests/tolerances.json says where each figure comes from.
FP32 = tol(torch.float32)


def kernelized_copy(model, **kwargs):
    k = copy.deepcopy(model)
    report = kernmap.kernelize(k, **kwargs)
    return k, report


def assert_every_layer_replaced(report, family):
    assert report.fallbacks == [], str(report)
    counts = {layer: len(rows) for layer, rows in report.by_layer().items()}
    assert counts == expected_layers(family), str(report)
    assert all(r.kernel.startswith("kernmap/") for r in report.rows)


def loss_and_grads(model, ids, run=None):
    """Forward (through `run`, e.g. a compiled wrapper, when given) and backward; the gradients of `model`. The
    logits come from a call without labels: with labels a kernelized model's training forward fuses the loss
    and returns no logits (ForCausalLMLoss)."""
    model.zero_grad(set_to_none=True)
    call = model if run is None else run
    logits = call(ids).logits.detach()
    out = call(ids, labels=ids)
    out.loss.backward()
    return logits, out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp32_logits_loss_and_every_gradient_match(family):
    model = make_model(family)
    kernelized, report = kernelized_copy(model, mode="training")
    assert_every_layer_replaced(report, family)
    if family in MOE_FAMILIES:
        assert kernelized.config._experts_implementation == "kernmap"
    ids = batch()
    logits, loss, grads = loss_and_grads(model, ids)
    k_logits, k_loss, k_grads = loss_and_grads(kernelized, ids)
    torch.testing.assert_close(k_logits, logits, **FP32)
    torch.testing.assert_close(k_loss, loss, **loss_tol(torch.float32))
    assert grads.keys() == k_grads.keys()
    for name in grads:
        assert k_grads[name] is not None, name
        torch.testing.assert_close(k_grads[name], grads[name], **FP32, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_logits_loss_and_every_gradient_match(family):
    model = make_model(family, torch.bfloat16)
    kernelized, report = kernelized_copy(model, mode="training")
    assert_every_layer_replaced(report, family)
    ids = batch()
    logits, loss, grads = loss_and_grads(model, ids)
    k_logits, k_loss, k_grads = loss_and_grads(kernelized, ids)
    torch.testing.assert_close(k_logits, logits, **tol(torch.bfloat16))
    torch.testing.assert_close(k_loss, loss, **loss_tol(torch.bfloat16))
    for name, g in grads.items():
        bound = model_gradient_bound(torch.bfloat16, g.float().abs().max().item()) + 1e-6
        diff = (k_grads[name].float() - g.float()).abs().max().item()
        assert diff <= bound, f"{name}: max |diff| {diff} > {bound}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_twenty_adamw_steps_in_lockstep(family):
    model = make_model(family)
    kernelized, _ = kernelized_copy(model, mode="training")
    lr = 1e-3
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.01) for m in (model, kernelized)]
    for step in range(20):
        ids = batch(seed=100 + step)
        losses = []
        for m, opt in zip((model, kernelized), opts):
            opt.zero_grad(set_to_none=True)
            loss = m(ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=TRAINING_STEPS["loss_rtol"], abs=TRAINING_STEPS["loss_atol"]), \
            f"step {step}: {losses}"
    # AdamW normalizes each element's update: where a gradient is ~0, an ulp-level difference in it (kernmap's
    # SiLU/exp vs torch's) moves that element by up to lr per step; the parameters are held to a fraction of one.
    bound = TRAINING_STEPS["param_fraction_of_lr"] * lr
    for (name, p), q in zip(model.named_parameters(), kernelized.parameters()):
        torch.testing.assert_close(q, p, rtol=bound, atol=bound, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_torch_compile_training_runs_and_matches(family):
    """aot_eager traces the kernelized model with fake tensors (every kernmap op's Meta implementation and
    autograd formula) and runs forward and backward from the captured graphs."""
    model = make_model(family)
    kernelized, report = kernelized_copy(model, mode="training", compile=True)
    assert report.mode == "training+compile" and report.fallbacks == []
    compiled = torch.compile(kernelized, backend="aot_eager")
    ids = batch()
    logits, loss, grads = loss_and_grads(model, ids)
    c_logits, c_loss, c_grads = loss_and_grads(kernelized, ids, run=compiled)
    torch.testing.assert_close(c_logits, logits, **FP32)
    torch.testing.assert_close(c_loss, loss, **loss_tol(torch.float32))
    for name in grads:
        torch.testing.assert_close(c_grads[name], grads[name], **FP32, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_torch_compile_inductor_inference_matches(family):
    """Inductor code generation, on one dense and one MoE family (each compile takes ~10 s on 2 cores)."""
    model = make_model(family).eval()
    kernelized, _ = kernelized_copy(model, mode="inference", compile=True)
    compiled = torch.compile(kernelized)
    ids = batch()
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, **FP32)


def test_kernelize_twice_rebinds_and_fallback_restores_original_forward(monkeypatch):
    model = make_model("qwen2")
    norm = model.model.norm
    original = norm.forward
    kernmap.kernelize(model, mode="training")
    assert norm.forward.__func__ is not original.__func__
    kernmap.kernelize(model, mode="training")
    monkeypatch.setenv("KERNMAP_DISABLE", "all")
    report = kernmap.kernelize(model, mode="training")
    assert len(report.fallbacks) == len(report)
    assert norm.forward.__func__ is original.__func__
    assert "forward" not in norm.__dict__


def _mlp_pair(dtype, bias=False):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    model = LlamaMLP(LlamaConfig(hidden_size=48, intermediate_size=80, num_attention_heads=4, num_key_value_heads=4, mlp_bias=bias)).to(dtype)
    kernelized, report = kernelized_copy(model, mode="training", device="cpu")
    assert [(r.layer, r.kernel) for r in report.rows if r.path == ""] == [("SiluAndMul", "kernmap/silu_and_mul")]
    return model, kernelized


class _RecordFunctions(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _forward_backward(module, x, dy, record=None):
    x = x.detach().clone().requires_grad_(True)
    with record or _RecordFunctions():
        y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, [p.grad for p in module.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("leading", [(), (7,), (2, 5)])
def test_gated_mlp_matches_eager_in_both_product_orientations(dtype, bias, leading):
    """Bias-free plain nn.Linear projections on CPU take the weights-first products (W x^T); with biases the
    module's own linears run. Either way: output, input gradient and every weight gradient match eager (bf16
    exactly: same fp32 sums, same roundings), and every result keeps its usual contiguous layout."""
    model, kernelized = _mlp_pair(dtype, bias)
    x = torch.randn(*leading, 48).to(dtype)
    dy = torch.randn(*leading, 48).to(dtype)
    y, dx, grads = _forward_backward(model, x, dy)
    record = _RecordFunctions()
    k_y, k_dx, k_grads = _forward_backward(kernelized, x, dy, record)
    assert (record.names.count("mm"), record.names.count("linear")) == ((0, 3) if bias else (3, 0)), record.names
    tol = FP32 if dtype is torch.float32 else dict(rtol=0, atol=0)
    assert k_y.shape == y.shape and k_y.is_contiguous()
    torch.testing.assert_close(k_y, y, **tol)
    torch.testing.assert_close(k_dx, dx, **tol)
    for g, k_g in zip(grads, k_grads):
        assert k_g.is_contiguous() and k_g.stride() == g.stride()
        torch.testing.assert_close(k_g, g, **tol)


def test_gated_mlp_keeps_hooks_and_linear_subclasses_of_its_projections():
    """A hooked or subclassed projection (adapters, quantized linears) is called as a module, never bypassed."""
    model, kernelized = _mlp_pair(torch.float32)
    calls = []
    kernelized.up_proj.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    x = torch.randn(3, 48)
    torch.testing.assert_close(kernelized(x), model(x), **FP32)
    assert calls == [torch.Size([3, 80])]

    class ScaledLinear(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    scaled = ScaledLinear(80, 48, bias=False)
    scaled.weight = kernelized.down_proj.weight
    kernelized.down_proj = scaled
    torch.testing.assert_close(kernelized(x), 2 * model(x), **FP32)
