"""Plugins from local kernel repositories (docs/plugins.md), through the C++ loader: the same packages, checks and
report as `kernmap kernels`. Nothing is downloaded; only folders the user names (KERNMAP_PATH or ``paths``) are
searched."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable

import torch

from . import _library


class PluginError(_library.KernmapError):
    """Raised by ``load_plugins(strict=True)`` when a package was refused; ``.report`` is the load report."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


def _process_toolkits() -> dict[str, str]:
    # The CUDA toolkit of this torch, when it can run here; other toolkits come from KERNMAP_TOOLKITS.
    if torch.version.cuda and torch.cuda.is_available():
        return {"cuda": torch.version.cuda}
    return {}


def load_plugins(paths: str | os.PathLike | Iterable[str | os.PathLike] | None = None, *,
                 strict: bool = False) -> dict:
    """Loads the plugin packages of the given kernel repositories (default: those of KERNMAP_PATH) and returns the
    load report: ``{"process": {...}, "repositories": [...], "packages": [{"name", "version", "state", "reason",
    "variant", "kernels", ...}]}``. A refused package is reported, not raised, unless ``strict`` is true
    (PluginError). Loading a package again is a no-op."""
    if paths is None:
        options = {"use_env_path": True}
    else:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        options = {"paths": [os.fspath(p) for p in paths]}
    options["toolkits"] = _process_toolkits()
    options["strict"] = False  # strictness is applied here, so that the report comes back either way
    (text,) = _library.call("kernmap_load_plugins", json.dumps(options).encode(), outputs=1)
    report = json.loads(text)
    refused = [p for p in report["packages"] if p["state"] == "refused"]
    if strict and refused:
        lines = [f"{len(refused)} plugin package(s) refused:"]
        lines += [f"  {p['repository']}/{p['folder']}: {p['reason']}" for p in refused]
        raise PluginError("\n".join(lines), report)
    return report


def plugin_report() -> dict:
    """Every plugin load attempt of this process so far, in the form ``load_plugins`` returns."""
    (text,) = _library.call("kernmap_plugin_report", outputs=1)
    return json.loads(text)


def write_lock(directory: str | os.PathLike) -> str:
    """Writes DIRECTORY/kernmap.lock pinning every package of that repository (as ``kernmap lock``) and returns its
    text. Raises KernmapError, writing nothing, when a library is missing or does not match its manifest."""
    (text,) = _library.call("kernmap_write_lock", os.fspath(directory).encode(), outputs=1)
    return text


def load_from_env_at_import() -> None:
    """KERNMAP_PATH's packages, loaded when kernmap is imported: problems become warnings, never import errors."""
    if not os.environ.get("KERNMAP_PATH"):
        return
    try:
        report = load_plugins()
    except Exception as e:  # noqa: BLE001 -- an import must not fail because of a plugin
        warnings.warn(f"kernmap: loading plugins from KERNMAP_PATH failed: {e}", RuntimeWarning, stacklevel=3)
        return
    for p in report["packages"]:
        if p["state"] == "refused":
            warnings.warn(f"kernmap: plugin package {p['repository']}/{p['folder']} refused: {p['reason']}",
                          RuntimeWarning, stacklevel=3)
    for r in report["repositories"]:
        if r["error"]:
            warnings.warn(f"kernmap: kernel repository {r['path']}: {r['error']}", RuntimeWarning, stacklevel=3)


