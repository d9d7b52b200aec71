"""The instruction-set level of kernmap's CPU kernels (docs/ops.md, "CPU kernels"): each kernel is compiled once
per level ("baseline", "avx2", "avx512", "avx512bf16", "amx"); the process runs one level at a time, the best this CPU runs
unless KERNMAP_CPU_ISA caps it when the library loads. Tests and benchmarks compare levels in one process with
`set_cpu_level`."""

from __future__ import annotations

import json

from . import _library


def _levels() -> dict:
    (text,) = _library.call("kernmap_cpu_levels", outputs=1)
    return json.loads(text)


def cpu_level() -> str:
    """The level kernmap's CPU kernels run at now."""
    return _levels()["level"]


def supported_cpu_levels() -> list[str]:
    """The levels compiled into kernmap that this CPU runs, lowest first ("baseline" is always one)."""
    return _levels()["supported"]


def set_cpu_level(level: str) -> None:
    """Makes `level` the level of the whole process, every thread, from the next kernel call on. Raises
    KernmapError naming the level and the supported ones when this CPU cannot run it."""
    if not isinstance(level, str):
        raise TypeError(f"set_cpu_level: level must be a str, got {type(level).__name__}")
    _library.call("kernmap_set_cpu_level", level.encode())
