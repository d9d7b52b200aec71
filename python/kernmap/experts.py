"""kernmap as a transformers experts implementation: ``"kernmap"`` is registered in transformers'
``ExpertsInterface`` when this package is imported (or, if transformers' MoE integration is not imported yet,
the moment it is: importing kernmap does not import transformers), so ``from_pretrained(..., experts_implementation="kernmap")``
and ``model.set_experts_implementation("kernmap")`` work on every model whose experts class uses
``@use_experts_implementation`` (Qwen2-MoE, Qwen3-MoE, Mixtral, ...).

The kernel is the one the registry resolves for layer ``Experts``: bound per module by `kernmap.kernelize`, or
resolved at the first call of each mode when only the implementation was chosen. A module whose layout kernmap
does not take (biases, transposed or interleaved weights, a non-SiLU gate, expert parallelism) runs the
implementation it had before, or transformers' eager loop."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable

import torch
from torch import nn

from . import _registry
from ._markers import layer_name

IMPLEMENTATION = "kernmap"

# transformers' MoE integration, once imported (by a model's modeling file, or by transformers itself): kernmap's
# import does not import it (seconds of transformers' import for every process that never builds a model); a
# post-import hook registers the implementation the moment it is (`_register_when_imported`, at the end).
_MOE_MODULE = "transformers.integrations.moe"
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
        kernel = _resolve_at_call_eagerly(self, hidden_states)
    if kernel is None:
        return _previous(self)(self, hidden_states, top_k_index, top_k_weights)
    out = kernel(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)
    return out.to(hidden_states.dtype)


# _resolve_at_call outside torch.compile's graph (torch.compiler.disable imports torch._dynamo: seconds, paid
# when transformers' MoE integration imports, which imports it anyway, not at kernmap's import).
_resolve_at_call_eagerly = None


def _register(moe) -> None:
    global _hf_moe, _resolve_at_call_eagerly
    _resolve_at_call_eagerly = torch.compiler.disable(_resolve_at_call)
    _hf_moe = moe
    moe.ExpertsInterface.register(IMPLEMENTATION, experts_forward)


class _RegisteringLoader(importlib.abc.Loader):
    """transformers.integrations.moe's own loader, registering the implementation once the module has run."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _unhook()
        _register(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the real loader's
        return getattr(self._loader, name)


class _RegisterWhenImported(importlib.abc.MetaPathFinder):
    """First on sys.meta_path until transformers.integrations.moe imports: finds it with the other finders and
    wraps its loader."""

    def find_spec(self, name, path, target=None):
        if name != _MOE_MODULE:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


_HOOK = _RegisterWhenImported()


def _unhook() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def _register_when_imported() -> None:
    if _MOE_MODULE in sys.modules:
        _register(sys.modules[_MOE_MODULE])
    else:
        sys.meta_path.insert(0, _HOOK)


_register_when_imported()
