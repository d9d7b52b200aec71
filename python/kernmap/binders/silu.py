"""SiLU: activation modules transformers marks ``@use_kernel_forward_from_hub("SiLU")``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .._markers import layer_name
from .base import Binder, bind_forward


class SiLUBinder(Binder):
    layer = "SiLU"

    def recognises(self, module: nn.Module) -> bool:
        return layer_name(type(module)) == "SiLU"

    def bind(self, module: nn.Module, kernel: Callable) -> None:
        def forward(self, input):  # noqa: A002 -- transformers' parameter name
            return kernel(input)

        bind_forward(module, forward)
