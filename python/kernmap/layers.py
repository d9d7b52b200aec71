"""kernmap's layers for the Hugging Face `kernels` library, loaded through its ``LocalLayerRepository`` (no
network):

    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
    import kernmap.layers

    kernmap.layers.mark_transformers_layers(model)   # needed while transformers' layer markers are no-ops (kernels < 0.18.2)
    with use_kernel_mapping({"RMSNorm": {"cpu": kernmap.layers.repository("RMSNorm")}}):
        kernelize(model, mode=Mode.TRAINING, device="cpu")

Each layer is stateless, as `kernels` requires: its forward reads the replaced module's own attributes (weight,
epsilon) and calls a kernmap op.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ._markers import layer_name

__all__ = ["RMSNorm", "SiLU", "SiluAndMul", "mark_transformers_layers", "repository", "repository_path"]


class RMSNorm(nn.Module):
    """kernmap/rms_norm for modules with ``weight`` and ``variance_epsilon`` (or ``eps``)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
        return torch.ops.kernmap.rms_norm(hidden_states, self.weight, eps)


class SiLU(nn.Module):
    """kernmap/silu."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 -- transformers' parameter name
        return torch.ops.kernmap.silu(input)


class SiluAndMul(nn.Module):
    """kernmap/silu_and_mul on the packed ``[..., 2I]`` input (gate first), as `kernels` activation layers take it."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kernmap.swiglu(x)


def repository_path() -> Path:
    """The folder `kernels.LocalLayerRepository` loads kernmap's layers from."""
    return Path(__file__).resolve().parent / "kernels_repository"


def repository(layer: str):
    """``kernels.LocalLayerRepository`` for one of kernmap's layers ("RMSNorm", "SiLU", "SiluAndMul")."""
    from kernels import LocalLayerRepository

    return LocalLayerRepository(repo_path=repository_path(), layer_name=layer)


def mark_transformers_layers(model: nn.Module) -> list[type]:
    """Makes `kernels.kernelize` see the layers transformers marked with ``@use_kernel_forward_from_hub``.

    transformers applies those markers only when it accepts the installed `kernels` version (transformers 5.23
    wants >= 0.18.2; PyPI's newest is 0.17.2), otherwise its decorator is a no-op. This applies `kernels`' own
    ``replace_kernel_forward_from_hub`` to each marked class of `model` that lacks the marker; returns them."""
    from kernels import replace_kernel_forward_from_hub

    marked = []
    for cls in {type(m) for m in model.modules()}:
        name = layer_name(cls)
        if name and getattr(cls, "kernel_layer_name", None) is None:
            replace_kernel_forward_from_hub(cls, name)
            marked.append(cls)
    return marked
