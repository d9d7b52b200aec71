"""transformers' layer markers: ``@use_kernel_forward_from_hub("RMSNorm")`` sets ``kernel_layer_name`` on the
class, but only when a `kernels` version transformers accepts is installed (transformers 5.23 wants kernels
>= 0.18.2; PyPI's newest is 0.17.2). Otherwise the decorator is a no-op, so the marker is read where transformers
wrote it: the decorator line above the class in its module's source."""

from __future__ import annotations

import functools
import inspect
import re
import sys

_DECORATOR = re.compile(r"@use_kernel_forward_from_hub\(\s*[\"'](\w+)[\"']\s*\)\s*\n(?:@.*\n)*class\s+(\w+)\b")


@functools.cache
def _source_markers(module_name: str) -> dict[str, str]:
    module = sys.modules.get(module_name)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return {}
    return {cls: layer for layer, cls in _DECORATOR.findall(source)}


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
