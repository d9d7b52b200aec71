"""rotary_pos_emb: attention modules whose class transformers marks ``@use_kernelized_func(apply_rotary_pos_emb)``,
the function being marked ``@use_kernel_forward_from_hub("rotary_pos_emb")`` (Qwen2/3, Llama, Mistral, Qwen2-MoE,
Qwen3-MoE, Mixtral, ...). The attention's forward calls the function as a global of its modeling module, so the
binding is per module instance: the module's forward becomes a copy of its class's forward whose globals map the
function's name to the kernel. Other modules, other models and the modeling module itself are untouched."""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable

import torch
from torch import nn

from .._markers import kernelized_functions
from .base import Binder, bind_forward, foreign_forward

LAYER = "rotary_pos_emb"
PARAMETERS = ["q", "k", "cos", "sin", "unsqueeze_dim"]


def _code(fn) -> tuple:
    """What a function computes, as far as its code says: bytecode, names and constants (not docstrings or line
    numbers), so that transformers' copies of one function compare equal across modeling modules."""
    c = fn.__code__
    return c.co_code, c.co_names, c.co_varnames, tuple(x for x in c.co_consts if not isinstance(x, str))


@functools.cache
def _forms() -> dict[tuple, bool]:
    """The codes of transformers' apply_rotary_pos_emb whose math is the kernel's, to whether that form casts each
    result back to its input's dtype: Llama's (the one most models copy) and Olmo's (the cast added)."""
    from transformers.models.llama import modeling_llama
    from transformers.models.olmo2 import modeling_olmo2

    return {_code(modeling_llama.apply_rotary_pos_emb): False, _code(modeling_olmo2.apply_rotary_pos_emb): True}


@functools.cache
def _rotate_half() -> tuple:
    from transformers.models.llama import modeling_llama

    return _code(modeling_llama.rotate_half)


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
        # The marker names the layer, not the math: gpt-oss rotates with half-width cos/sin, NanoChat's rotate_half
        # has the other sign. Only code that is transformers' rotate-half form computes the kernel's contract.
        if not isinstance(fn, types.FunctionType) or _code(fn) not in _forms():
            return (f"{fn.__module__}.{name} is not transformers' rotate-half apply_rotary_pos_emb (the code of "
                    "modeling_llama's, which kernmap's kernel computes)")
        rotate = fn.__globals__.get("rotate_half")
        if not isinstance(rotate, types.FunctionType) or _code(rotate) != _rotate_half():
            return f"{fn.__module__}.rotate_half is not transformers' (modeling_llama's): another rotation"
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
        casts = _forms()[_code(forward.__globals__[name])]

        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            q_embed, k_embed = kernel(q, k, cos, sin, unsqueeze_dim)
            return (q_embed.to(q.dtype), k_embed.to(k.dtype)) if casts else (q_embed, k_embed)

        scope = dict(forward.__globals__)
        scope[name] = apply_rotary_pos_emb
        bound = types.FunctionType(forward.__code__, scope, forward.__name__, forward.__defaults__,
                                   forward.__closure__)
        bound.__kwdefaults__ = forward.__kwdefaults__
        bound.__qualname__ = forward.__qualname__
        bind_forward(module, bound)
