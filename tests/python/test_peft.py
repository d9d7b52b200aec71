"""kernelize and peft LoRA: the gated MLP whose projections are LoRA layers is fused (its modules called), the
MoE experts wrapped by peft are bound, and kernelizing before or after get_peft_model binds the same layers and
gives the gradients of the unkernelized LoRA model."""

import copy
import re

import pytest
import torch
from peft import LoraConfig, get_peft_model

import kernmap

from hf_models import batch, make_model

CONFIG = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)


def lora(model):
    torch.manual_seed(7)  # every copy gets the same adapters (init_lora_weights=False: B is not zero)
    return get_peft_model(model, LoraConfig(**CONFIG))


def rows(report):
    """(path, layer, kernel, fallback) with peft's wrappers taken out of the path."""
    def path(p):
        return re.sub(r"\.base_layer\b", "", re.sub(r"^base_model\.model\.?", "", p))
    return sorted((path(r.path), r.layer, r.kernel, r.fallback) for r in report.rows)


def lora_grads(model):
    model.zero_grad(set_to_none=True)
    ids = batch(shape=(2, 11))
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["qwen2", "qwen2_moe", "qwen3_moe"])
def test_kernelize_before_and_after_get_peft_model(family):
    base = make_model(family)
    after = lora(copy.deepcopy(base))
    report_after = kernmap.kernelize(after, mode="training")
    before = copy.deepcopy(base)
    report_before = kernmap.kernelize(before, mode="training")
    before = lora(before)
    plain = lora(copy.deepcopy(base))

    assert rows(report_after) == rows(report_before)
    assert not report_after.fallbacks, str(report_after)
    mlps = [r for r in report_after.rows if r.layer == "SiluAndMul"]
    if family != "qwen3_moe":  # qwen3_moe has no dense or shared-expert MLP
        assert mlps and all(r.kernel == "kernmap/silu_and_mul" for r in mlps)
        gate = after.get_submodule(mlps[0].path).gate_proj
        assert type(gate).__module__.startswith("peft"), type(gate)  # the projection is a LoRA layer
    if family != "qwen2":
        assert any(r.layer == "Experts" and r.kernel == "kernmap/experts" for r in report_after.rows)

    want = lora_grads(plain)
    for model in (after, before):
        got = lora_grads(model)
        assert got.keys() == want.keys()
        for name, g in want.items():
            assert g.abs().sum() > 0, name  # every adapter trains, the MLP's included
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_a_lora_gated_mlp_with_another_activation_falls_back_with_the_reason():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = lora(Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                              hidden_act="gelu")))
    report = kernmap.kernelize(model, mode="training")
    (mlp,) = [r for r in report.rows if r.layer == "SiluAndMul"]
    assert mlp.fallback and mlp.reason == "act_fn GELUActivation is not SiLU"
