"""kernmap: fused, device-specific kernels for transformer layers, mapped without touching model code.

Importing this package loads the kernmap C++ library, which registers the ops under ``torch.ops.kernmap``
(``rms_norm``, ``silu``, ``silu_and_mul``, ``swiglu``, ``grouped_mm``, ``experts`` and their ``reference_*``
counterparts), exposes the C++ registry (one mapping for C++ and Python), registers ``"kernmap"`` as a
transformers experts implementation (when transformers' MoE integration imports: kernmap imports no transformers),
activates the NPU mapping when ``torch_npu`` imports, and loads the plugin
packages of the kernel repositories in ``KERNMAP_PATH`` (a refused package is a warning, never an import error;
``kernmap.plugin_report()`` says what happened).

    import kernmap
    report = kernmap.kernelize(model, mode="training")
    print(report)
"""

from __future__ import annotations

import torch

from ._library import KernmapError, library_path
from ._cpu import cpu_level, set_cpu_level, supported_cpu_levels
from ._registry import (
    Decision,
    Kernel,
    clear_user_mappings,
    effective_mapping,
    kernels,
    load_mapping_file,
    register_default_mapping,
    register_kernel,
    register_mapping,
    resolve,
    use_mapping,
)
from . import experts  # noqa: E402 -- registers the "kernmap" experts implementation when transformers' MoE imports
from ._kernelize import KernelizeError, Report, Row, kernelize
from ._tune import TuneResult, tune
from . import npu  # noqa: E402 -- the NPU defaults, active only when torch_npu imports
from ._plugins import PluginError, load_plugins, plugin_report, write_lock
from ._plugins import load_from_env_at_import as _load_from_env_at_import

ops = torch.ops.kernmap


def cached_memory_bytes() -> int:
    """Bytes of freed large CPU buffers (>= 16 MiB: expert layers' weight gradients and intermediates) that
    kernmap keeps for reuse on the next step, as a GPU caching allocator does (docs/ops.md, "Memory")."""
    return int(torch.ops.kernmap.cached_memory_bytes())


def release_cached_memory() -> int:
    """Returns kernmap's cached large CPU buffers to the system (buffers in use are untouched); returns the bytes
    released."""
    return int(torch.ops.kernmap.release_cached_memory())


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Backs a large CPU tensor's memory (>= 16 MiB; expert weights) with 2 MiB pages now, contents unchanged,
    so the grouped expert products stream through it without a TLB miss every few cache lines. One-time cost:
    a copy of the memory. Returns whether it was done (False when the system refuses, the tensor is not a large
    CPU tensor, or KERNMAP_HUGE_PAGES=0). ``kernmap.kernelize`` does it for the experts it maps on CPU."""
    return bool(torch.ops.kernmap.advise_huge_pages(tensor.detach()))

def count_cpu_memory() -> None:
    """Starts counting the CPU memory of tensors (idempotent, for the life of the process): c10's CPU allocator is
    wrapped by one that counts and forwards, and kernmap's large blocks are counted too. Memory that libraries
    allocate outside c10 (BLAS and oneDNN scratch) is not. `python -m kernmap ablate` reads each step's peak."""
    torch.ops.kernmap.count_cpu_memory()


def cpu_memory() -> dict[str, int]:
    """``{"in_use": bytes, "peak": bytes}``: CPU memory in tensors now, and the most at once since the last
    `reset_cpu_memory_peak` (c10's allocations count from the first `count_cpu_memory`)."""
    in_use, peak = torch.ops.kernmap.cpu_memory()
    return {"in_use": int(in_use), "peak": int(peak)}


def reset_cpu_memory_peak() -> None:
    """Sets the peak of `cpu_memory` to what is in use now."""
    torch.ops.kernmap.reset_cpu_memory_peak()


__all__ = [
    "Decision", "Kernel", "KernelizeError", "KernmapError", "PluginError", "Report", "Row", "advise_huge_pages",
    "cached_memory_bytes",
    "clear_user_mappings", "count_cpu_memory", "cpu_level", "cpu_memory",
    "effective_mapping", "kernelize", "kernels", "library_path", "load_mapping_file", "load_plugins", "ops",
    "plugin_report", "register_default_mapping", "register_kernel", "register_mapping", "release_cached_memory",
    "reset_cpu_memory_peak",
    "resolve", "set_cpu_level", "supported_cpu_levels", "tune", "TuneResult", "use_mapping",
    "write_lock",
]

_load_from_env_at_import()
