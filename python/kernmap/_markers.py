"""transformers' layer markers: ``@use_kernel_forward_from_hub("RMSNorm")`` sets ``kernel_layer_name`` on the
class, but only when a `kernels` version transformers accepts is installed (transformers 5.23 wants kernels
>= 0.18.2; PyPI's newest is 0.17.2). Otherwise the decorator is a no-op, so the marker is read where transformers
wrote it: the decorator line above the class in its module's source.

Functions are marked the same way (``@use_kernel_forward_from_hub("rotary_pos_emb")`` above ``def
apply_rotary_pos_emb``), and the classes that call one carry ``@use_kernelized_func(apply_rotary_pos_emb)``; both
are read from the source too."""

from __future__ import annotations

import functools
import inspect
import re
import sys

_DECORATOR = re.compile(r"@use_kernel_forward_from_hub\(\s*[\"'](\w+)[\"']\s*\)\s*\n(?:@.*\n)*(class|def)\s+(\w+)\b")
_USES = re.compile(r"@use_kernelized_func\(([\w\s,\[\]]*)\)\s*\n(?:@.*\n)*class\s+(\w+)\b")


@functools.cache
def _source(module_name: str) -> str:
    module = sys.modules.get(module_name)
    try:
        return inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return ""


@functools.cache
def _source_markers(module_name: str) -> dict[str, str]:
    """Class and function names of the module marked with a layer name, to that name."""
    return {name: layer for layer, _, name in _DECORATOR.findall(_source(module_name))}


@functools.cache
def _source_uses(module_name: str) -> dict[str, tuple[str, ...]]:
    """Class names of the module marked ``@use_kernelized_func(f, ...)``, to the function names."""
    return {cls: tuple(re.findall(r"\w+", names)) for names, cls in _USES.findall(_source(module_name))}


def layer_name(cls: type) -> str | None:
    """The kernel layer name transformers marked `cls` (or a base class) with, or None."""
    marked = getattr(cls, "kernel_layer_name", None)
    if marked:
        return marked
    for klass in cls.__mro__:
        if klass.__module__.startswith("transformers."):
            name = _source_markers(klass.__module__).get(klass.__name__)
            if name:
                return name
    return None


def kernelized_functions(cls: type) -> list[tuple[str, str, str]]:
    """The functions transformers attached to `cls` (or a base class) with ``@use_kernelized_func``, as
    (function name, layer name, module name) for those marked with a layer name in the same module."""
    out = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("transformers."):
            continue
        for fn in _source_uses(klass.__module__).get(klass.__name__, ()):
            layer = _source_markers(klass.__module__).get(fn)
            if layer and (fn, layer, klass.__module__) not in out:
                out.append((fn, layer, klass.__module__))
    return out
