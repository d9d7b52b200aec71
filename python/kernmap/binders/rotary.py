"""rotary_pos_emb: attention modules whose class transformers marks ``@use_kernelized_func(apply_rotary_pos_emb)``,
the function being marked ``@use_kernel_forward_from_hub("rotary_pos_emb")`` (Qwen2/3, Llama, Mistral, Qwen2-MoE,
Qwen3-MoE, Mixtral, ...). The attention's forward calls the function as a global of its modeling module, so the
binding is per module instance: the module's forward becomes a copy of its class's forward whose globals map the
function's name to the kernel. Other modules, other models and the modeling module itself are untouched."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable

import torch
from torch import nn

from .._markers import kernelized_functions
from .base import Binder, bind_forward, foreign_forward

LAYER = "rotary_pos_emb"
PARAMETERS = ["q", "k", "cos", "sin", "unsqueeze_dim"]


def rotary_function(cls: type) -> str | None:
    """The global name of the rotary_pos_emb function `cls` carries, or None."""
    return next((fn for fn, layer, _ in kernelized_functions(cls) if layer == LAYER), None)


def class_forward(module: nn.Module):
    return inspect.getattr_static(type(module), "forward", None)


class RotaryBinder(Binder):
    layer = LAYER

    def recognises(self, module: nn.Module) -> bool:
        return rotary_function(type(module)) is not None

    def unsupported(self, module: nn.Module) -> str | None:
        cls, name = type(module).__name__, rotary_function(type(module))
        forward = class_forward(module)
        if not isinstance(forward, types.FunctionType):
            return f"{cls}.forward is not a plain function (wrapped or a descriptor)"
        if name not in forward.__code__.co_names:
            return f"{cls}.forward does not call {name}"
        fn = forward.__globals__.get(name)
        if fn is None:
            return f"{name} is not a global of {cls}.forward's module"
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = None
        if params != PARAMETERS:
            return f"{name} takes {params}, not transformers' ({', '.join(PARAMETERS)})"
        if foreign_forward(module):
            return f"{cls}'s forward is replaced on the instance (hooks or another library)"
        head_dim = getattr(module, "head_dim", None)
        if isinstance(head_dim, int) and head_dim % 2:
            return f"odd head_dim {head_dim} (needs even)"
        return None

    def dtype(self, module: nn.Module) -> torch.dtype | None:
        return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)

    def bind(self, module: nn.Module, kernel: Callable) -> None:
        name = rotary_function(type(module))
        forward = class_forward(module)

        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            return kernel(q, k, cos, sin, unsqueeze_dim)

        scope = dict(forward.__globals__)
        scope[name] = apply_rotary_pos_emb
        bound = types.FunctionType(forward.__code__, scope, forward.__name__, forward.__defaults__,
                                   forward.__closure__)
        bound.__kwdefaults__ = forward.__kwdefaults__
        bound.__qualname__ = forward.__qualname__
        bind_forward(module, bound)
