"""Experts: transformers' MoE experts modules (``@use_experts_implementation``, 3-D expert weights), bound through
transformers' experts-implementation hook: the bound modules' model runs the ``"kernmap"`` implementation
(kernmap/experts.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .. import experts as _experts
from .base import Binder


class ExpertsBinder(Binder):
    layer = "Experts"

    def recognises(self, module: nn.Module) -> bool:
        return _experts.is_experts_module(module)

    def unsupported(self, module: nn.Module) -> str | None:
        return _experts.unsupported_layout(module)

    def dtype(self, module: nn.Module) -> torch.dtype | None:
        return module.down_proj.dtype

    def bind(self, module: nn.Module, kernel: Callable) -> None:
        _experts.bind(module, kernel)

    def restore(self, module: nn.Module) -> None:
        _experts.bind(module, None)

    def finish(self, model: nn.Module, bound: list[nn.Module]) -> None:
        if bound:
            _experts.use_kernmap_implementation(model)
