"""Loads libkernmap.so once: torch.ops.load_library registers the ``torch.ops.kernmap`` ops, and ctypes opens the
same file for the C API (include/kernmap/c_api.h). dlopen returns the handle it already holds, so both see one
registry: a mapping registered from Python is the one C++ resolution reads, and the reverse."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

C_API_VERSION = 1


def library_path() -> Path:
    """Where libkernmap.so is: $KERNMAP_LIBRARY, else the package folder (installed), else the repository's build."""
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


SUPPORTS_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t)


def _declare(lib: ctypes.CDLL) -> None:
    out = ctypes.POINTER(ctypes.c_void_p)  # void*: we free it ourselves after copying
    sigs = {
        "kernmap_c_api_version": ([], ctypes.c_int),
        "kernmap_free": ([ctypes.c_void_p], None),
        "kernmap_register_kernel": ([ctypes.c_char_p, SUPPORTS_FN, ctypes.c_void_p, out], ctypes.c_int),
        "kernmap_register_mapping": ([ctypes.c_char_p, out], ctypes.c_int),
        "kernmap_register_default_mapping": ([ctypes.c_char_p, out], ctypes.c_int),
        "kernmap_clear_user_mappings": ([out], ctypes.c_int),
        "kernmap_load_mapping_file": ([ctypes.c_char_p, out, out], ctypes.c_int),
        "kernmap_register_mapping_file": ([ctypes.c_char_p, out], ctypes.c_int),
        "kernmap_push_scope": ([ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), out], ctypes.c_int),
        "kernmap_pop_scope": ([ctypes.c_uint64, out], ctypes.c_int),
        "kernmap_resolve": ([ctypes.c_char_p, out, out], ctypes.c_int),
        "kernmap_list_kernels": ([out, out], ctypes.c_int),
        "kernmap_effective_mapping": ([out, out], ctypes.c_int),
        "kernmap_cpu_levels": ([out, out], ctypes.c_int),
        "kernmap_set_cpu_level": ([ctypes.c_char_p, out], ctypes.c_int),
        "kernmap_load_plugins": ([ctypes.c_char_p, out, out], ctypes.c_int),
        "kernmap_plugin_report": ([out, out], ctypes.c_int),
        "kernmap_write_lock": ([ctypes.c_char_p, out, out], ctypes.c_int),
    }
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


def _load() -> ctypes.CDLL:
    path = str(library_path())
    torch.ops.load_library(path)
    lib = ctypes.CDLL(path)
    _declare(lib)
    version = lib.kernmap_c_api_version()
    if version != C_API_VERSION:
        raise ImportError(f"kernmap: {path} implements C API version {version}, this package needs {C_API_VERSION}")
    return lib


LIB = _load()


def take_string(ptr: ctypes.c_void_p) -> str | None:
    """Copies and frees a string returned by the library."""
    if not ptr.value:
        return None
    try:
        return ctypes.string_at(ptr.value).decode()
    finally:
        LIB.kernmap_free(ptr)


class KernmapError(ValueError):
    """An error reported by the kernmap C++ registry (bad mapping, unknown layer or kernel, ...)."""


def call(name: str, *args, outputs: int = 0):
    """Calls a C API function whose trailing parameters are `outputs` char** results and one char** error; returns
    the result strings. Raises KernmapError with the library's message on failure."""
    results = [ctypes.c_void_p() for _ in range(outputs)]
    error = ctypes.c_void_p()
    status = getattr(LIB, name)(*args, *[ctypes.byref(r) for r in results], ctypes.byref(error))
    if status != 0:
        for r in results:
            take_string(r)
        raise KernmapError(take_string(error) or f"{name} failed with status {status}")
    return [take_string(r) for r in results]
