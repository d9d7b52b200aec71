"""SiluAndMul: gated MLPs ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with a SiLU act_fn (Qwen2MLP,
Qwen3MLP, LlamaMLP, MistralMLP, the MoE families' shared experts, ...). The projections may be any modules that
compute them — plain nn.Linear, peft LoRA layers, quantized linears — and are called as modules; plain bias-free
nn.Linear projections on CPU take the weights-first products instead."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .._markers import layer_name
from .base import Binder, bind_forward

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def is_silu(act) -> bool:
    if isinstance(act, nn.SiLU) or (isinstance(act, nn.Module) and layer_name(type(act)) == "SiLU"):
        return True
    return act is torch.nn.functional.silu


def plain_linear(proj: nn.Module) -> bool:
    """An nn.Linear itself (not a subclass such as a quantized or adapter layer), without bias or hooks: its
    forward is exactly ``x @ weight.T``, so the product may be computed in another orientation."""
    return (type(proj) is nn.Linear and proj.bias is None and not proj._forward_hooks
            and not proj._forward_pre_hooks)


def weights_first(module: nn.Module, x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dim() >= 1 and all(plain_linear(getattr(module, n)) for n in PROJECTIONS)
            and x.dtype == module.gate_proj.weight.dtype)


def projection_weight(proj: nn.Module) -> torch.Tensor | None:
    """The weight a projection module computes with: its own, or its wrapped base layer's (peft)."""
    for candidate in (proj, getattr(proj, "base_layer", None)):
        weight = getattr(candidate, "weight", None)
        if isinstance(weight, torch.Tensor):
            return weight
    return None


class GatedMLPBinder(Binder):
    layer = "SiluAndMul"

    def recognises(self, module: nn.Module) -> bool:
        return (all(isinstance(getattr(module, n, None), nn.Module) for n in PROJECTIONS)
                and hasattr(module, "act_fn"))

    def unsupported(self, module: nn.Module) -> str | None:
        act = getattr(module, "act_fn")
        if not is_silu(act):
            return f"act_fn {type(act).__name__} is not SiLU"
        if projection_weight(module.gate_proj) is None:
            return f"gate_proj {type(module.gate_proj).__name__} has no weight to read the dtype from"
        return None

    def dtype(self, module: nn.Module) -> torch.dtype | None:
        weight = projection_weight(module.gate_proj)
        return weight.dtype if weight is not None else None

    def bind(self, module: nn.Module, kernel: Callable) -> None:
        def forward(self, x):
            if weights_first(self, x):
                # The same products with the weight as the left operand: gate^T = W_gate x^T is [I, tokens], and
                # silu_and_mul is elementwise, so it runs on the transposed pair as it is. On CPU the BLAS
                # (oneDNN) computes W x^T faster than x W^T when tokens are few (measured: python -m
                # kernmap.bench, GatedMLP; docs/python.md), and autograd's matrix-product backward keeps every
                # weight gradient in the weight's own layout. Each element's sum runs over the same K values.
                x2 = x.reshape(-1, x.shape[-1]).t()
                h = kernel(torch.mm(self.gate_proj.weight, x2), torch.mm(self.up_proj.weight, x2))
                y = torch.mm(self.down_proj.weight, h).t().contiguous()
                return y.reshape(*x.shape[:-1], y.shape[-1])
            return self.down_proj(kernel(self.gate_proj(x), self.up_proj(x)))

        bind_forward(module, forward)
