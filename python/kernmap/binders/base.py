"""The binder interface, and the forward swap the module-level binders share."""

from __future__ import annotations

import enum
import functools
import types
from collections.abc import Callable

import torch
from torch import nn

_ORIGINAL = "_kernmap_original_forward"


class _Forward(enum.Enum):
    # An enum member, so that deep copies (and pickles) of a bound module still compare identical to it.
    NOT_ON_INSTANCE = "the module's forward was its class's"


_NO_INSTANCE_FORWARD = _Forward.NOT_ON_INSTANCE


class Binder:
    """How kernelize finds one layer in a model and binds a module of it to a kernel.

    ``kernel`` below is the callable of the resolved kernel (a torch op or a registered Python kernel) taking the
    layer's op arguments."""

    layer: str  # the registry's layer name

    def recognises(self, module: nn.Module) -> bool:
        """Whether `module` bears this layer (by marker or by shape), bindable or not."""
        raise NotImplementedError

    def unsupported(self, module: nn.Module) -> str | None:
        """Why this module cannot run the layer's kernel (it keeps its forward; the report says why), or None."""
        return None

    def dtype(self, module: nn.Module) -> torch.dtype | None:
        """The dtype resolution is told about (the module's weights'), or None when it has none."""
        return next((p.dtype for p in module.parameters(recurse=False) if p.is_floating_point()), None)

    def bind(self, module: nn.Module, kernel: Callable) -> None:
        raise NotImplementedError

    def restore(self, module: nn.Module) -> None:
        """Back to the module's own forward (a no-op when it was never bound)."""
        restore_forward(module)

    def finish(self, model: nn.Module, bound: list[nn.Module]) -> None:
        """A model-level step after every module of this layer was bound or restored (default: none)."""

    def change(self, module: nn.Module) -> str | None:
        """What a bound module does differently from its own forward, beyond computing the same values (the
        report's reason says it), or None."""
        return None


def bind_forward(module: nn.Module, forward: Callable) -> None:
    """Makes `forward` (a function of (self, *args)) the module's forward, remembering the original once."""
    if _ORIGINAL not in module.__dict__:
        module.__dict__[_ORIGINAL] = module.__dict__.get("forward", _NO_INSTANCE_FORWARD)
    module.forward = types.MethodType(forward, module)


def original_forward(module: nn.Module) -> Callable:
    """The forward kernmap's binding replaced, bound to `module` (looked up on the module itself, so that a
    deep copy of a bound module calls its own)."""
    original = module.__dict__.get(_ORIGINAL, _NO_INSTANCE_FORWARD)
    if original is _NO_INSTANCE_FORWARD:
        # A partial, not types.MethodType: torch.compile traces it (fullgraph=True refuses a MethodType call).
        return functools.partial(type(module).forward, module)
    return original


def foreign_forward(module: nn.Module) -> bool:
    """Whether the module's instance has a forward of its own that kernmap did not bind (a hook wrapper of
    another library): what it would run with kernmap's binding restored is not its class's forward."""
    original = module.__dict__.get(_ORIGINAL, module.__dict__.get("forward", _NO_INSTANCE_FORWARD))
    return original is not _NO_INSTANCE_FORWARD


def restore_forward(module: nn.Module) -> None:
    original = module.__dict__.pop(_ORIGINAL, None)
    if original is None:
        return
    if original is _NO_INSTANCE_FORWARD:
        module.__dict__.pop("forward", None)
    else:
        module.forward = original
