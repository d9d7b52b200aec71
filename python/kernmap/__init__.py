"""kernmap: fused, device-specific kernels for transformer layers, mapped without touching model code.

Importing this package loads the kernmap C++ library, which registers the ops under ``torch.ops.kernmap``
(``rms_norm``, ``silu``, ``silu_and_mul``, ``swiglu`` and their ``reference_*`` counterparts).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["library_path", "ops"]


def library_path() -> Path:
    """Where libkernmap.so is: $KERNMAP_LIBRARY, else the package folder, else the repository's build."""
    env = os.environ.get("KERNMAP_LIBRARY")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
    candidates += [here / "libkernmap.so", here.parents[1] / "build" / "release" / "libkernmap.so"]
    for c in candidates:
        if c.is_file():
            return c
    raise ImportError(
        "kernmap: libkernmap.so not found (looked in: " + ", ".join(str(c) for c in candidates) + "); run scripts/setup"
    )


torch.ops.load_library(str(library_path()))
ops = torch.ops.kernmap
