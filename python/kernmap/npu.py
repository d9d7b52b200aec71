"""The NPU mapping: defaults for device ``npu`` that route RMSNorm, SiluAndMul and the MoE experts' grouped
products to torch_npu's fused ops (the seeds' hand-written patches, made a mapping). Active only when
``torch_npu`` imports; nothing here runs otherwise.

Argument conventions (torch_npu):

- ``npu_rms_norm(x, weight, epsilon=eps)`` returns ``(y, rstd)``; kernmap takes ``y``.
- ``npu_swiglu(x, dim=-1)`` computes ``silu(a) * b`` for ``a, b = x.chunk(2, dim)`` (gate first, kernmap's packed
  ``swiglu`` layout); ``SiluAndMul(gate, up)`` packs its two inputs for it.
- ``npu_grouped_matmul([a], [b], group_list=offs, split_item=2, group_type=0, group_list_type=0)`` returns a
  list of one ``[T, N]`` tensor: rows ``offs[e-1]:offs[e]`` of ``a`` times ``b[e]`` (``b``: ``[E, K, N]``;
  ``group_list_type=0``: cumulative ends, int64), the semantics of ``transformers.integrations.moe._grouped_mm``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from . import _registry

DEVICE = "npu"
_DTYPES = ("float16", "bfloat16", "float32")
_torch_npu: ModuleType | None = None
_registered = False


def _npu() -> ModuleType:
    if _torch_npu is None:
        raise RuntimeError("kernmap.npu: torch_npu is not active (kernmap.npu.activate() found no torch_npu)")
    return _torch_npu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _npu().npu_rms_norm(x, weight, epsilon=eps)[0]


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    return _npu().npu_swiglu(gate_up, dim=-1)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu(torch.cat((gate, up), dim=-1))


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _npu().npu_grouped_matmul([a], [b], group_list=offs.to(torch.int64), split_item=2, group_type=0,
                                     group_list_type=0)[0]


def experts(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up_proj: torch.Tensor,
            down_proj: torch.Tensor) -> torch.Tensor:
    """Token-sorted experts: two grouped products (``npu_grouped_matmul``) around ``npu_swiglu``; the weighted
    sum accumulates in the routing weights' precision as transformers' grouped_mm implementation does."""
    T, k = topk_ids.shape
    E = gate_up_proj.shape[0]
    ids = topk_ids.reshape(-1)
    order = torch.argsort(ids, stable=True)
    offs = torch.bincount(ids, minlength=E).cumsum(0)
    x = hidden[order // k]
    h = swiglu(grouped_mm(x, gate_up_proj.transpose(1, 2), offs))
    y = grouped_mm(h, down_proj.transpose(1, 2), offs) * topk_weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.empty_like(y).index_copy(0, order, y)
    return out.view(T, k, -1).sum(dim=1).to(hidden.dtype)


def _kernel(name: str, layer: str, fn, what: str) -> _registry.Kernel:
    return _registry.Kernel(name=f"npu/{name}", layer=layer, fn=fn, devices=(DEVICE,), dtypes=_DTYPES,
                            has_backward=True, compile_safe=False, deterministic=False, description=what)


KERNELS = {
    "RMSNorm": _kernel("rms_norm", "RMSNorm", rms_norm, "torch_npu.npu_rms_norm"),
    "SiluAndMul": _kernel("silu_and_mul", "SiluAndMul", silu_and_mul, "torch_npu.npu_swiglu on [gate, up]"),
    "GroupedMM": _kernel("grouped_mm", "GroupedMM", grouped_mm, "torch_npu.npu_grouped_matmul"),
    "Experts": _kernel("experts", "Experts", experts, "npu_grouped_matmul + npu_swiglu, token-sorted"),
}


def register(torch_npu: ModuleType) -> None:
    """Makes `torch_npu` (or a stand-in with the same functions) the provider of the ``npu/*`` kernels and
    registers them as the defaults for device ``npu`` (once per process; later calls only switch the module)."""
    global _torch_npu, _registered
    _torch_npu = torch_npu
    if not _registered:
        _registry.register_default_mapping({layer: {DEVICE: kernel} for layer, kernel in KERNELS.items()})
        _registered = True


def activate() -> bool:
    """Registers the NPU mapping when torch_npu imports; returns whether it did."""
    try:
        module = importlib.import_module("torch_npu")
    except ImportError:
        return False
    register(module)
    return True


activate()
