"""Interoperability with the Hugging Face `kernels` package (the pinned PyPI version): kernmap's layers load
through `kernels.LocalLayerRepository` from the folder kernmap ships, and `kernels.kernelize` binds them into a
transformers model, with the network off (HF_HUB_OFFLINE=1)."""

import copy

import pytest
import torch

kernels = pytest.importorskip("kernels")

import kernmap.layers  # noqa: E402
from hf_models import batch, make_model  # noqa: E402


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_local_layer_repository_loads_kernmap_layers():
    for name in ("RMSNorm", "SiLU", "SiluAndMul"):
        layer = kernmap.layers.repository(name).load()
        assert layer.__name__ == name and layer.has_backward and layer.can_torch_compile
        assert layer.forward is getattr(kernmap.layers, name).forward


@pytest.mark.parametrize("mode", ["TRAINING", "INFERENCE"])
def test_kernels_kernelize_binds_kernmap_layers_into_a_transformers_model(mode):
    model = make_model("llama")
    kernelized = copy.deepcopy(model)
    kernmap.layers.mark_transformers_layers(kernelized)
    mapping = {"RMSNorm": {"cpu": kernmap.layers.repository("RMSNorm")},
               "SiLU": {"cpu": kernmap.layers.repository("SiLU")}}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(kernelized, mode=getattr(kernels.Mode, mode), device="cpu")
    norms = [m for m in kernelized.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 5
    assert all(m.forward.__func__ is kernmap.layers.RMSNorm.forward for m in norms)
    assert kernelized.model.layers[0].mlp.act_fn.forward.__func__ is kernmap.layers.SiLU.forward

    ids = batch()
    got, want = kernelized(ids, labels=ids), model(ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    got.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(model.named_parameters(), kernelized.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_silu_and_mul_layer_is_the_packed_form():
    x = torch.randn(3, 10, requires_grad=True)
    layer = kernmap.layers.repository("SiluAndMul").load()()
    torch.testing.assert_close(layer(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])
