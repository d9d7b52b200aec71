"""kernmap.kernelize on every causal-LM family of the installed transformers that builds from a tiny config
(tiny_families.py), each against its unkernelized copy: kernelize never raises, one forward/backward gives the same
loss and the same gradients (relative to the largest gradient: some are exactly zero in exact arithmetic, so a
relative figure per element would mean nothing there), and every module that looks like a kernmap layer has a
row in the Report, bound or a fallback with its reason. One forward/backward of a tiny model per family keeps the
whole file to about 20 s; a family that cannot be built or run as it stands is skipped with transformers' reason
(`pytest -rs` lists them)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kernmap
import tiny_families
from kernmap._markers import kernelized_functions, layer_name
from tolerances import tol

FP32 = tol(torch.float32)
IDS = torch.randint(0, tiny_families.VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


def look_alikes(model: nn.Module) -> dict[str, str]:
    """Module path -> layer, for each module that, read independently of kernmap's binders, bears a layer: a
    transformers layer marker, a gated MLP (gate_proj, up_proj, down_proj and an act_fn), a transformers experts
    module (``@use_experts_implementation``: ``has_gate`` and 3-D expert weights), or a class that calls a marked
    function (``@use_kernelized_func``)."""
    layers = {k["layer"] for k in kernmap.kernels()}
    out = {}
    for path, module in model.named_modules():
        if (marked := layer_name(type(module))) in layers:
            out[path] = marked
        elif all(isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")) \
                and hasattr(module, "act_fn"):
            out[path] = "SiluAndMul"
        elif hasattr(module, "has_gate") and isinstance(getattr(module, "down_proj", None), torch.Tensor):
            out[path] = "Experts"
        elif any(layer in layers for _, layer, _ in kernelized_functions(type(module))):
            out[path] = next(layer for _, layer, _ in kernelized_functions(type(module)) if layer in layers)
    return out


def loss_and_grads(model: nn.Module):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=IDS).logits.float()
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), IDS[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def prepared(model_type: str, class_name: str):
    """The family's tiny model, a copy of it made before either ran, and the model's loss and gradients; or
    pytest.skip with the reason the family cannot be made or run."""
    try:
        family = tiny_families.build(model_type, class_name)
        model = tiny_families.make(family)
        twin = copy.deepcopy(model)
        loss, grads = loss_and_grads(model)
    except Exception as e:  # noqa: BLE001 -- what transformers raises for a family that cannot be built here
        pytest.skip(f"{model_type} does not build or run from a tiny config: {type(e).__name__}: {e}"[:400])
    return model, twin, loss, grads


@pytest.mark.families
@pytest.mark.parametrize("model_type, class_name", sorted(tiny_families.model_classes().items()))
def test_kernelize_trains_equal_and_reports_every_look_alike(model_type, class_name):
    model, kernelized, loss, grads = prepared(model_type, class_name)
    report = kernmap.kernelize(kernelized, mode="training", device="cpu")

    rows = {r.path: r for r in report.rows}
    for path, layer in look_alikes(model).items():
        assert path in rows, f"{path} ({type(model.get_submodule(path)).__name__}, {layer}) has no row:\n{report}"
        assert rows[path].fallback or rows[path].layer == layer, str(report)
        assert rows[path].reason, str(report)

    k_loss, k_grads = loss_and_grads(kernelized)
    torch.testing.assert_close(k_loss, loss, **FP32)
    largest = max((g.abs().max().item() for g in grads.values() if g is not None), default=0.0)
    for name, g in grads.items():
        assert (g is None) == (k_grads[name] is None), name
        if g is not None:
            diff = (k_grads[name] - g).abs().max().item()
            assert diff <= FP32["rtol"] * largest + FP32["atol"] * 1e-3, f"{name}: |diff| {diff}, largest {largest}"


def test_experts_without_the_gated_layout_fall_back_with_the_reason_whichever_way_kernmap_is_chosen():
    """NemotronH's experts are up_proj and down_proj (no gate): transformers' experts module, not kernmap's layout.
    kernelize reports them as fallbacks, and choosing the "kernmap" implementation directly runs transformers'
    own loop for them (it read gate_up_proj and raised AttributeError)."""
    model, kernelized, loss, grads = prepared("nemotron_h", "NemotronHForCausalLM")
    report = kernmap.kernelize(kernelized, mode="training", device="cpu")
    experts = report.by_layer()["Experts"]
    assert experts and all(r.fallback and r.module == "NemotronHExperts" for r in experts), str(report)
    assert {r.reason for r in experts} == {"experts without a gate projection are not supported"}

    direct = copy.deepcopy(model)
    direct.set_experts_implementation("kernmap")
    k_loss, _ = loss_and_grads(direct)
    torch.testing.assert_close(k_loss, loss, rtol=0, atol=0)
