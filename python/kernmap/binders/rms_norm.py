"""RMSNorm: modules transformers marks ``@use_kernel_forward_from_hub("RMSNorm")`` with a weight and an epsilon."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .._markers import layer_name
from .base import Binder, bind_forward


def epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (float, int)) and not isinstance(value, bool):
            return float(value)
    return None


class RMSNormBinder(Binder):
    layer = "RMSNorm"

    def recognises(self, module: nn.Module) -> bool:
        return layer_name(type(module)) == "RMSNorm"

    def unsupported(self, module: nn.Module) -> str | None:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            return f"{type(module).__name__} has no 1-D weight (an RMSNorm without scale or with another layout)"
        if epsilon(module) is None:
            return f"{type(module).__name__} has no variance_epsilon/eps attribute"
        return None

    def bind(self, module: nn.Module, kernel: Callable) -> None:
        module._kernmap_eps = epsilon(module)

        def forward(self, hidden_states):
            return kernel(hidden_states, self.weight, self._kernmap_eps)

        bind_forward(module, forward)
