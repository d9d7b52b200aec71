"""The kernel mapping, from Python: a thin layer over the C++ registry (one source of truth). Python callables
become kernels with a descriptor registered in C++ (empty ``op``); this module keeps name -> callable."""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from . import _library
from ._library import KernmapError

MODES = ("inference", "training", "inference+compile", "training+compile", "fallback")
ALL_DTYPES = ("float32", "bfloat16", "float16", "float64")

_python_kernels: dict[str, Callable] = {}
_supports_callbacks: dict[str, object] = {}  # keeps ctypes callbacks alive: C++ holds their addresses forever
_lock = threading.Lock()


@dataclass(frozen=True)
class Kernel:
    """A Python callable registered as a kernel of a layer.

    The callable takes the layer's op arguments (``RMSNorm``: ``(x, weight, eps)``, ``SiLU``: ``(x)``,
    ``SiluAndMul``: ``(gate, up)``, ``GroupedMM``: ``(a, b, offs)``, ``Experts``: ``(hidden, topk_ids,
    topk_weights, gate_up_proj, down_proj)``) and returns the output tensor. ``supports(inputs)`` (optional) gets
    ``{"dtype": str, "shapes": [[...]]}`` and returns None when it takes the inputs, else the reason."""

    name: str
    layer: str
    fn: Callable
    devices: tuple[str, ...] = ("*",)
    dtypes: tuple[str, ...] = ALL_DTYPES
    has_backward: bool = False
    compile_safe: bool = False
    deterministic: bool = True
    description: str = ""
    supports: Callable[[dict], str | None] | None = None

    def descriptor(self) -> dict:
        return {
            "name": self.name,
            "layer": self.layer,
            "devices": list(self.devices),
            "dtypes": list(self.dtypes),
            "has_backward": self.has_backward,
            "compile_safe": self.compile_safe,
            "deterministic": self.deterministic,
            "op": "",
            "description": self.description or f"Python callable {getattr(self.fn, '__qualname__', self.fn)!r}",
        }


def _supports_trampoline(check: Callable[[dict], str | None]):
    def callback(_user, inputs_json, reason, capacity):
        try:
            why = check(json.loads(inputs_json))
        except Exception as e:  # noqa: BLE001 -- nothing may unwind into C++
            why = f"supports() raised {type(e).__name__}: {e}"
        if why is None:
            return 1
        data = str(why).encode()[: capacity - 1] + b"\0"
        ctypes.memmove(reason, data, len(data))
        return 0

    return _library.SUPPORTS_FN(callback)


def register_kernel(kernel: Kernel) -> Kernel:
    """Registers a Python kernel with the C++ registry (visible to C++ resolution and `kernmap kernels`).
    Registering the same Kernel object again is a no-op; another kernel under a taken name is an error."""
    with _lock:
        if _python_kernels.get(kernel.name) is kernel.fn:
            return kernel
        callback = _supports_trampoline(kernel.supports) if kernel.supports else _library.SUPPORTS_FN()
        _library.call("kernmap_register_kernel", json.dumps(kernel.descriptor()).encode(), callback, None)
        _python_kernels[kernel.name] = kernel.fn
        if kernel.supports:
            _supports_callbacks[kernel.name] = callback
    return kernel


def _mode_key(mode) -> str:
    if isinstance(mode, str):
        return mode
    # The `kernels` library's Mode flags: INFERENCE, TRAINING, TORCH_COMPILE, FALLBACK.
    names = {f.name for f in type(mode) if f in mode} if hasattr(type(mode), "__iter__") else set()
    if "FALLBACK" in names:
        return "fallback"
    base = "training" if "TRAINING" in names else "inference"
    return base + ("+compile" if "TORCH_COMPILE" in names else "")


def _kernel_name(value) -> str:
    if isinstance(value, Kernel):
        return register_kernel(value).name
    if isinstance(value, str):
        return value
    raise TypeError(f"kernmap: a mapping value must be a kernel name or a kernmap.Kernel, got {value!r}")


def _normalize(mapping: Mapping) -> dict:
    """{layer: {device: kernel | {mode: kernel}}} -> {layer: {device: {mode: name}}}. A bare kernel for a device
    is its fallback entry (any mode it qualifies for), as in the `kernels` library."""
    out: dict = {}
    for layer, devices in mapping.items():
        if not isinstance(devices, Mapping):
            raise TypeError(f"kernmap: layer {layer!r} must map to {{device: kernel}}, got {devices!r}")
        out[layer] = {}
        for device, entry in devices.items():
            device = device.type if isinstance(device, torch.device) else str(device)
            if isinstance(entry, Mapping):
                out[layer][device] = {_mode_key(m): _kernel_name(k) for m, k in entry.items()}
            else:
                out[layer][device] = {"fallback": _kernel_name(entry)}
    return out


MappingFile = str | os.PathLike


def load_mapping_file(path: MappingFile) -> dict:
    """Reads a mapping file (``.json`` or ``.toml``, docs/mapping.md), validates it against the registry as it
    stands, and returns ``{layer: {device: {mode: kernel}}}``. The C++ parser does the work (one parser for C++,
    Python and the CLI); a bad file raises KernmapError whose message starts with the location
    (``FILE:LINE:COL: problem``, or ``FILE: /Layer/device/mode: problem`` for JSON entries)."""
    (text,) = _library.call("kernmap_load_mapping_file", os.fsencode(path), outputs=1)
    return json.loads(text)


def _is_path(value) -> bool:
    return isinstance(value, (str, os.PathLike))


def register_mapping(mapping: Mapping | MappingFile) -> None:
    """Adds user registrations: ``{"RMSNorm": {"cpu": "kernmap/rms_norm"}}`` or with modes
    ``{"RMSNorm": {"npu": {"training": kernel, "inference": kernel}}}``, or the path of a mapping file (see
    `load_mapping_file`). Values are kernel names or `Kernel` objects (registered on first use). A (layer, device)
    entry replaces the previous one."""
    if _is_path(mapping):
        _library.call("kernmap_register_mapping_file", os.fsencode(mapping))
        return
    _library.call("kernmap_register_mapping", json.dumps(_normalize(mapping)).encode())


def register_default_mapping(mapping: Mapping) -> None:
    """Adds built-in defaults (the lowest level): for device packages such as the NPU mapping."""
    _library.call("kernmap_register_default_mapping", json.dumps(_normalize(mapping)).encode())


def clear_user_mappings() -> None:
    """Removes every user registration (defaults and scopes stay)."""
    _library.call("kernmap_clear_user_mappings")


class _Scope:
    """One ``use_mapping`` block: its mapping as the C API's JSON, validated when the block is entered."""

    def __init__(self, mapping_json: bytes, inherit: bool):
        self.mapping_json, self.inherit = mapping_json, inherit
        self.token: contextvars.Token | None = None


# The scopes of this context, outermost first. A ContextVar, as the `kernels` library keeps its mapping: each
# thread and each asyncio task sees the scopes entered in it (a task also those of the context it was created
# in), never those of another.
_scopes: contextvars.ContextVar[tuple[_Scope, ...]] = contextvars.ContextVar("kernmap_scopes", default=())


@contextlib.contextmanager
def _scopes_on_this_thread() -> Iterator[None]:
    """This context's scopes, pushed on the calling thread's C++ scope stack for the length of one C API call
    that resolves (C++ keeps scopes per thread; nothing else can run on this thread in between)."""
    handles = []
    try:
        for scope in _scopes.get():
            handle = ctypes.c_uint64()
            _library.call("kernmap_push_scope", scope.mapping_json, int(scope.inherit), ctypes.byref(handle))
            handles.append(handle)
        yield
    finally:
        for handle in reversed(handles):
            _library.call("kernmap_pop_scope", handle)


class use_mapping:  # noqa: N801 -- a context manager used like a function, as contextlib's are
    """Scoped override, highest level: ``with kernmap.use_mapping({...}): kernelize(...)``, or
    ``with kernmap.use_mapping("kernmap.toml"): ...`` for a mapping file. With ``inherit=False`` user
    registrations and defaults are hidden inside the block.

    The scope belongs to the current context (a `contextvars.ContextVar`): other threads and other asyncio tasks
    do not see it; a task created inside the block does (it copies the context). It must be left in the context
    that entered it: leaving it from another thread or task raises `KernmapError` and leaves it active where it
    was entered. Scopes may end out of nesting order."""

    def __init__(self, mapping: Mapping | MappingFile, inherit: bool = True):
        self._mapping, self._inherit = mapping, inherit
        self._scope: _Scope | None = None

    def __enter__(self) -> None:
        if self._scope is not None:
            raise KernmapError("kernmap.use_mapping: this scope is entered already (a use_mapping object is "
                               "entered once; make a new one per block)")
        mapping = load_mapping_file(self._mapping) if _is_path(self._mapping) else self._mapping
        scope = _Scope(json.dumps(_normalize(mapping)).encode(), self._inherit)
        # Validated now, as register_mapping would, so that a typo fails where the block starts.
        handle = ctypes.c_uint64()
        _library.call("kernmap_push_scope", scope.mapping_json, int(scope.inherit), ctypes.byref(handle))
        _library.call("kernmap_pop_scope", handle)
        scope.token = _scopes.set((*_scopes.get(), scope))
        self._scope = scope

    def __exit__(self, *exc) -> None:
        scope = self._scope
        if scope is None:
            raise KernmapError("kernmap.use_mapping: this scope was never entered")
        current = _scopes.get()
        try:
            # Only to check that this is the context that entered the scope: the value is set below.
            _scopes.reset(scope.token)
        except ValueError:
            raise KernmapError(
                "kernmap.use_mapping: this scope was entered in another context (another thread or asyncio "
                "task) and must be left there; it stays active in the context that entered it") from None
        _scopes.set(tuple(s for s in current if s is not scope))  # out of nesting order too
        self._scope = None


@dataclass(frozen=True)
class Decision:
    """What resolution chose: the kernel (the layer's reference when `fallback`), where the choice came from
    and why."""

    layer: str
    device: str
    mode: str
    kernel: str
    op: str
    fallback: bool
    source: str
    reason: str

    def callable(self) -> Callable:
        """The function that runs the kernel: its torch op, or the registered Python callable."""
        if self.op:
            namespace, name = self.op.split("::")
            return getattr(getattr(torch.ops, namespace), name)
        return _python_kernels[self.kernel]


def resolve(layer: str, device: str, mode: str, dtype: torch.dtype | str | None = None,
            shapes: list[list[int]] | None = None) -> Decision:
    """Resolves a layer on a device in a mode ("inference", "training", "inference+compile", "training+compile"),
    optionally for a dtype and input shapes, exactly as C++ ``kernmap::resolve`` does."""
    request = {"layer": layer, "device": device, "mode": mode}
    if dtype is not None:
        request["dtype"] = dtype_name(dtype)
    if shapes is not None:
        request["shapes"] = [list(s) for s in shapes]
    with _scopes_on_this_thread():
        (text,) = _library.call("kernmap_resolve", json.dumps(request).encode(), outputs=1)
    d = json.loads(text)
    if not d["op"] and d["kernel"] not in _python_kernels:
        # A kernel registered without an op by another party (a C++ caller): nothing Python can call.
        d.update(kernel=_reference_name(layer), op=_reference_op(layer), fallback=True, source="reference",
                 reason=f"{d['kernel']} has no torch op and no Python callable in this process")
    return Decision(**d)


def kernels() -> list[dict]:
    """Every registered kernel's descriptor, sorted by name."""
    (text,) = _library.call("kernmap_list_kernels", outputs=1)
    return json.loads(text)


def effective_mapping() -> dict:
    """The mapping resolution sees in this context (thread, asyncio task), all levels merged."""
    with _scopes_on_this_thread():
        (text,) = _library.call("kernmap_effective_mapping", outputs=1)
    return json.loads(text)


def dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _reference(layer: str) -> dict:
    for k in kernels():
        if k["layer"] == layer and k["provider"] == "reference":
            return k
    raise KeyError(layer)


def _reference_name(layer: str) -> str:
    return _reference(layer)["name"]


def _reference_op(layer: str) -> str:
    return _reference(layer)["op"]


__all__ = ["Kernel", "Decision", "register_kernel", "register_mapping", "register_default_mapping",
           "clear_user_mappings", "use_mapping", "load_mapping_file", "resolve", "kernels", "effective_mapping", "MODES"]
