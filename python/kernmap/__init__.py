"""kernmap: fused, device-specific kernels for transformer layers, mapped without touching model code.

Importing this package loads the kernmap C++ library, which registers the ops under ``torch.ops.kernmap``
(``rms_norm``, ``silu``, ``silu_and_mul``, ``swiglu``, ``grouped_mm``, ``experts`` and their ``reference_*``
counterparts), exposes the C++ registry (one mapping for C++ and Python), registers ``"kernmap"`` as a
transformers experts implementation, and activates the NPU mapping when ``torch_npu`` imports.

    import kernmap
    report = kernmap.kernelize(model, mode="training")
    print(report)
"""

from __future__ import annotations

import torch

from ._library import KernmapError, library_path
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
from . import experts  # noqa: E402 -- registers the "kernmap" experts implementation with transformers
from ._kernelize import KernelizeError, Report, Row, kernelize
from . import npu  # noqa: E402 -- the NPU defaults, active only when torch_npu imports

ops = torch.ops.kernmap

__all__ = [
    "Decision", "Kernel", "KernelizeError", "KernmapError", "Report", "Row", "clear_user_mappings",
    "effective_mapping", "kernelize", "kernels", "library_path", "load_mapping_file", "ops", "register_default_mapping",
    "register_kernel", "register_mapping", "resolve", "use_mapping",
]
