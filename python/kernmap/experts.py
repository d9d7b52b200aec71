"""kernmap as a transformers experts implementation: ``"kernmap"`` is registered in transformers'
``ExpertsInterface`` when this package is imported, so ``from_pretrained(..., experts_implementation="kernmap")``
and ``model.set_experts_implementation("kernmap")`` work on every model whose experts class uses
``@use_experts_implementation`` (Qwen2-MoE, Qwen3-MoE, Mixtral, ...).

The kernel is the one the registry resolves for layer ``Experts``: bound per module by `kernmap.kernelize`, or
resolved at the first call of each mode when only the implementation was chosen. A module whose layout kernmap
does not take (biases, transposed or interleaved weights, a non-SiLU gate, expert parallelism) runs the
implementation it had before, or transformers' eager loop."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import _registry
from ._markers import layer_name

IMPLEMENTATION = "kernmap"

try:
    from transformers.integrations import moe as _hf_moe
except ImportError:  # transformers is optional for the ops and the registry
    _hf_moe = None


def is_experts_module(module: nn.Module) -> bool:
    """A transformers experts module decorated with ``@use_experts_implementation`` (3-D expert weights)."""
    return (hasattr(module, "has_gate") and hasattr(module, "config")
            and isinstance(getattr(module, "down_proj", None), torch.Tensor)
            and getattr(module, "down_proj").dim() == 3)


def unsupported_layout(module: nn.Module) -> str | None:
    """None when kernmap's experts kernel computes this module's math; else why not."""
    if not module.has_gate or not isinstance(getattr(module, "gate_up_proj", None), torch.Tensor):
        return "experts without a gate projection are not supported"
    for flag, what in (("has_bias", "expert biases"), ("is_transposed", "transposed expert weights"),
                       ("has_post_expert_norm", "a post-expert norm"), ("_is_expert_parallel", "expert parallelism")):
        if getattr(module, flag, False):
            return f"{what} not supported by kernmap experts"
    if not getattr(module, "is_concatenated", True):
        return "interleaved gate/up weights not supported by kernmap experts"
    if _hf_moe is not None and getattr(type(module), "_apply_gate", None) is not _hf_moe._default_apply_gate:
        return f"{type(module).__name__} has its own gate function"
    act = getattr(module, "act_fn", None)
    if not (isinstance(act, nn.SiLU) or (isinstance(act, nn.Module) and layer_name(type(act)) == "SiLU")):
        return f"activation {type(act).__name__} is not SiLU"
    return None


def advise_weights(module: nn.Module) -> None:
    """Once per module: its CPU expert weights on 2 MiB pages (kernmap.advise_huge_pages; docs/ops.md#memory)."""
    if module.__dict__.get("_kernmap_weights_advised"):
        return
    module._kernmap_weights_advised = True
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(module, name, None)
        if isinstance(weight, torch.Tensor) and weight.device.type == "cpu":
            torch.ops.kernmap.advise_huge_pages(weight.detach())


def bind(module: nn.Module, kernel: Callable | None) -> None:
    """Binds the module's kernel (None: run the previous implementation) and remembers that implementation."""
    current = module.config._experts_implementation
    if current != IMPLEMENTATION:
        module._kernmap_previous_implementation = current
    module._kernmap_experts = kernel
    if kernel is not None:
        advise_weights(module)


def use_kernmap_implementation(model: nn.Module) -> None:
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(IMPLEMENTATION)
    for module in model.modules():
        if is_experts_module(module) and module.config._experts_implementation != IMPLEMENTATION:
            module.config._experts_implementation = IMPLEMENTATION


def _previous(module: nn.Module) -> Callable:
    name = getattr(module, "_kernmap_previous_implementation", "eager")
    eager = type(module).forward.__wrapped__
    if name in (None, "eager", IMPLEMENTATION) or _hf_moe is None:
        return eager
    return _hf_moe.ALL_EXPERTS_FUNCTIONS.get(name, eager)


@torch.compiler.disable
def _resolve_at_call(module: nn.Module, hidden_states: torch.Tensor) -> Callable | None:
    # Only down_proj is read before the layout check: every experts module has it, not every one a gate_up_proj
    # (NemotronH's experts are up_proj and down_proj).
    training = torch.is_grad_enabled() and (module.down_proj.requires_grad or hidden_states.requires_grad)
    mode = ("training" if training else "inference") + ("+compile" if torch.compiler.is_compiling() else "")
    cache = module.__dict__.setdefault("_kernmap_call_cache", {})
    key = (mode, hidden_states.device.type, module.down_proj.dtype)
    if key not in cache:
        if unsupported_layout(module) is not None:
            cache[key] = None
        else:
            d = _registry.resolve("Experts", key[1], mode, key[2])
            cache[key] = None if d.fallback else d.callable()
            if cache[key] is not None:
                advise_weights(module)
    return cache[key]


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"kernmap"`` experts implementation (signature of transformers' experts forward functions)."""
    if "_kernmap_experts" in self.__dict__:
        kernel = self._kernmap_experts
    else:
        kernel = _resolve_at_call(self, hidden_states)
    if kernel is None:
        return _previous(self)(self, hidden_states, top_k_index, top_k_weights)
    out = kernel(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)
    return out.to(hidden_states.dtype)


if _hf_moe is not None:
    _hf_moe.ExpertsInterface.register(IMPLEMENTATION, experts_forward)
