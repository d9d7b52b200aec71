"""kernelize(model): find the layer-bearing modules of a transformers model, resolve each through the C++
registry and bind its forward to the chosen kernel. No weights are copied; a module whose decision is a fallback
keeps (or gets back) its original forward, which is the reference math."""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from . import _registry
from . import experts as _experts
from ._markers import layer_name

# Layers kernelize binds by transformers' `kernel_layer_name` marker, with the forward that calls the kernel.
_MARKED_LAYERS = ("RMSNorm", "SiLU")
_ORIGINAL = "_kernmap_original_forward"


@dataclass(frozen=True)
class Row:
    """One kernelized module: where it is, the layer it bears, the kernel chosen and why."""

    path: str
    module: str  # class name
    layer: str
    kernel: str
    fallback: bool
    reason: str


class Report:
    """What kernelize did, one row per layer-bearing module; ``print(report)`` shows a table."""

    def __init__(self, device: str, mode: str, rows: list[Row]):
        self.device, self.mode, self.rows = device, mode, rows

    @property
    def replaced(self) -> list[Row]:
        return [r for r in self.rows if not r.fallback]

    @property
    def fallbacks(self) -> list[Row]:
        return [r for r in self.rows if r.fallback]

    def by_layer(self) -> dict[str, list[Row]]:
        out: dict[str, list[Row]] = {}
        for r in self.rows:
            out.setdefault(r.layer, []).append(r)
        return out

    def to_dict(self) -> dict:
        return {"device": self.device, "mode": self.mode, "rows": [asdict(r) for r in self.rows]}

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        header = ("module", "class", "layer", "kernel", "reason")
        lines = [(r.path or "<model>", r.module, r.layer, r.kernel + (" (fallback)" if r.fallback else ""), r.reason)
                 for r in self.rows]
        widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]

        def fmt(cells):
            return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

        summary = (f"kernmap.kernelize on {self.device} ({self.mode}): {len(self.replaced)} of {len(self.rows)} "
                   f"layers replaced, {len(self.fallbacks)} fallbacks")
        rule = "  ".join("-" * w for w in widths)
        return "\n".join([summary, fmt(header), rule, *(fmt(line) for line in lines)])

    __repr__ = __str__


class KernelizeError(RuntimeError):
    """Raised by kernelize(use_fallback=False) when a layer has no usable kernel; `.report` says which and why."""

    def __init__(self, report: Report):
        bad = "; ".join(f"{r.path} ({r.layer}): {r.reason}" for r in report.fallbacks)
        super().__init__(f"kernmap.kernelize: no kernel for {len(report.fallbacks)} layer(s): {bad}\n{report}")
        self.report = report


# ---- how each layer binds ------------------------------------------------------------------------------------


def _rms_norm_forward(kernel: Callable):
    def forward(self, hidden_states):
        return kernel(hidden_states, self.weight, self._kernmap_eps)

    return forward


def _silu_forward(kernel: Callable):
    def forward(self, input):  # noqa: A002 -- transformers' parameter name
        return kernel(input)

    return forward


def _plain_linear(proj: nn.Module) -> bool:
    """An nn.Linear itself (not a subclass such as a quantized or adapter layer), without bias or hooks: its
    forward is exactly ``x @ weight.T``, so the product may be computed in another orientation."""
    return (type(proj) is nn.Linear and proj.bias is None and not proj._forward_hooks
            and not proj._forward_pre_hooks)


def _weights_first(module: nn.Module, x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dim() >= 1 and x.dtype == module.gate_proj.weight.dtype
            and all(_plain_linear(getattr(module, n)) for n in ("gate_proj", "up_proj", "down_proj")))


def _gated_mlp_forward(kernel: Callable):
    def forward(self, x):
        if _weights_first(self, x):
            # The same products with the weight as the left operand: gate^T = W_gate x^T is [I, tokens], and
            # silu_and_mul is elementwise, so it runs on the transposed pair as it is. On CPU the BLAS (oneDNN)
            # computes W x^T faster than x W^T when tokens are few (measured: python -m kernmap.bench, GatedMLP;
            # docs/python.md), and autograd's matrix-product backward keeps every weight gradient in the
            # weight's own layout. Each element's sum runs over the same K values in fp32.
            x2 = x.reshape(-1, x.shape[-1]).t()
            h = kernel(torch.mm(self.gate_proj.weight, x2), torch.mm(self.up_proj.weight, x2))
            y = torch.mm(self.down_proj.weight, h).t().contiguous()
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return self.down_proj(kernel(self.gate_proj(x), self.up_proj(x)))

    return forward


def _is_silu(act: nn.Module | Callable | None) -> bool:
    if isinstance(act, nn.SiLU) or (isinstance(act, nn.Module) and layer_name(type(act)) == "SiLU"):
        return True
    return act is torch.nn.functional.silu


def _rms_norm_eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (float, int)):
            return float(value)
    return None


def _is_gated_mlp(module: nn.Module) -> bool:
    """Qwen2MLP, Qwen3MLP, LlamaMLP, MistralMLP, Qwen2MoeMLP and the like: down(act(gate(x)) * up(x)) with SiLU."""
    return (all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
            and _is_silu(getattr(module, "act_fn", None)))


@dataclass
class _Plan:
    path: str
    module: nn.Module
    layer: str
    decision: _registry.Decision | None
    bind: Callable | None  # kernel -> forward; None for experts (bound through transformers' hook)
    reason_override: str | None = None


def _dtype_of(module: nn.Module, default: torch.dtype) -> torch.dtype:
    for p in module.parameters(recurse=False):
        if p.is_floating_point():
            return p.dtype
    return default


def _plan(model: nn.Module, device: str, mode: str) -> list[_Plan]:
    default_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    plans: list[_Plan] = []
    for path, module in model.named_modules():
        marker = layer_name(type(module))
        dtype = _dtype_of(module, default_dtype)
        if marker == "RMSNorm" and _rms_norm_eps(module) is not None and isinstance(getattr(module, "weight", None),
                                                                                     torch.Tensor):
            plans.append(_Plan(path, module, "RMSNorm", _registry.resolve("RMSNorm", device, mode, dtype),
                               _rms_norm_forward))
        elif marker == "SiLU":
            plans.append(_Plan(path, module, "SiLU", _registry.resolve("SiLU", device, mode, dtype), _silu_forward))
        elif _is_gated_mlp(module):
            dtype = module.gate_proj.weight.dtype
            plans.append(_Plan(path, module, "SiluAndMul", _registry.resolve("SiluAndMul", device, mode, dtype),
                               _gated_mlp_forward))
        elif _experts.is_experts_module(module):
            why_not = _experts.unsupported_layout(module)
            decision = _registry.resolve("Experts", device, mode, module.gate_up_proj.dtype)
            plans.append(_Plan(path, module, "Experts", decision, None, why_not))
    return plans


def _restore(module: nn.Module) -> None:
    original = module.__dict__.pop(_ORIGINAL, None)
    if original is not None:
        if original is _NO_INSTANCE_FORWARD:
            module.__dict__.pop("forward", None)
        else:
            module.forward = original


_NO_INSTANCE_FORWARD = object()


def _bind(module: nn.Module, forward: Callable) -> None:
    if _ORIGINAL not in module.__dict__:
        module.__dict__[_ORIGINAL] = module.__dict__.get("forward", _NO_INSTANCE_FORWARD)
    module.forward = types.MethodType(forward, module)


def _mode_string(mode, compile: bool) -> str:  # noqa: A002 -- the public parameter's name
    text = _registry._mode_key(mode) if not isinstance(mode, str) else mode
    if text not in ("inference", "training", "inference+compile", "training+compile"):
        raise ValueError(f"kernmap.kernelize: mode must be 'inference' or 'training' (optionally '+compile'), "
                         f"got {mode!r}")
    if compile and not text.endswith("+compile"):
        text += "+compile"
    return text


def kernelize(model: nn.Module, *, mode, device: str | torch.device | None = None, use_fallback: bool = True,
              compile: bool = False) -> Report:  # noqa: A002 -- `compile` mirrors the `kernels` library
    """Binds every layer-bearing module of `model` to the kernel the mapping resolves for (`device`, `mode`).

    Layers: modules marked by transformers with ``kernel_layer_name`` (``RMSNorm``, ``SiLU``), gated SiLU MLPs
    (``down(silu_and_mul(gate(x), up(x)))``, layer ``SiluAndMul``), and MoE experts modules (layer ``Experts``,
    through transformers' experts-implementation hook: the model's implementation becomes ``"kernmap"``).

    mode: ``"inference"`` or ``"training"``; ``compile=True`` (or a ``"+compile"`` mode) accepts only
    compile-safe kernels. device: a torch device type; by default the model's. With ``use_fallback=False`` any
    layer without a usable kernel raises `KernelizeError` (carrying the report) and the model is left unchanged.
    Calling kernelize again re-resolves every layer. Returns the `Report`."""
    mode_text = _mode_string(mode, compile)
    if device is None:
        first = next(model.parameters(), None)
        device = first.device.type if first is not None else "cpu"
    device = device.type if isinstance(device, torch.device) else str(device).split(":")[0]

    plans = _plan(model, device, mode_text)
    rows = []
    for p in plans:
        fallback = p.decision.fallback or p.reason_override is not None
        kernel = _registry._reference_name(p.layer) if p.reason_override else p.decision.kernel
        rows.append(Row(p.path, type(p.module).__name__, p.layer, kernel, fallback,
                        p.reason_override or p.decision.reason))
    report = Report(device, mode_text, rows)
    if not use_fallback and report.fallbacks:
        raise KernelizeError(report)

    for p, row in zip(plans, rows):
        if p.layer == "Experts":
            _experts.bind(p.module, None if row.fallback else p.decision)
            continue
        _restore(p.module)
        if row.fallback:
            continue
        if p.layer == "RMSNorm":
            p.module._kernmap_eps = _rms_norm_eps(p.module)
        _bind(p.module, p.bind(p.decision.callable()))
    if any(p.layer == "Experts" and not row.fallback for p, row in zip(plans, rows)):
        _experts.use_kernmap_implementation(model)
    return report
