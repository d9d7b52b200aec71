"""kernelize(model): find the layer-bearing modules of a transformers model (the binders of kernmap/binders/, one
per layer), resolve each through the C++ registry and bind its forward to the chosen kernel. No weights are
copied; a module whose decision is a fallback keeps (or gets back) its original forward, which is the reference
math."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from . import _registry, _verify
from .binders import BINDERS, Binder


@dataclass(frozen=True)
class Row:
    """One kernelized module: where it is, the layer it bears, the kernel chosen and why; with
    ``kernelize(verify=...)``, the measured error of the resolved kernel against the reference at its worst
    element and the tolerance there (None when not verified)."""

    path: str
    module: str  # class name
    layer: str
    kernel: str
    fallback: bool
    reason: str
    error: float | None = None
    tolerance: float | None = None


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
        verified = any(r.error is not None for r in self.rows)
        header = ("module", "class", "layer", "kernel", *(("error / tolerance",) if verified else ()), "reason")
        lines = [(r.path or "<model>", r.module, r.layer, r.kernel + (" (fallback)" if r.fallback else ""),
                  *((f"{r.error:.2g} / {r.tolerance:.2g}" if r.error is not None else "-",) if verified else ()),
                  r.reason) for r in self.rows]
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


# ---- planning: which binder owns each module, and what the registry resolves for it ------------------------


@dataclass
class _Plan:
    path: str
    module: nn.Module
    binder: Binder
    decision: _registry.Decision | None
    why_not: str | None  # the module cannot take the kernel (a fallback, whatever the mapping says)


def _guarded(what: str, module: nn.Module, fn: Callable):
    """Runs a binder's question about a module; a binder must never make kernelize raise on a model that runs,
    so an exception becomes the reason the module keeps its forward."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 -- any failure to inspect a module is a fallback, with its reason
        return None, f"kernmap could not {what} {type(module).__name__}: {type(e).__name__}: {e}"


def _owner(module: nn.Module) -> tuple[Binder | None, str | None]:
    for binder in BINDERS:
        hit, error = _guarded(f"inspect ({binder.layer})", module, lambda: binder.recognises(module))
        if hit or error:
            return binder, error
    return None, None


def _plan(model: nn.Module, device: str, mode: str) -> list[_Plan]:
    default_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    plans: list[_Plan] = []
    for path, module in model.named_modules():
        binder, why_not = _owner(module)
        if binder is None:
            continue
        if why_not is None:
            why_not, error = _guarded("check", module, lambda: binder.unsupported(module))
            why_not = why_not or error
        dtype, error = (None, None) if why_not else _guarded("read the dtype of", module, lambda: binder.dtype(module))
        why_not = why_not or error
        decision = _registry.resolve(binder.layer, device, mode, dtype or default_dtype)
        plans.append(_Plan(path, module, binder, decision, why_not))
    return plans


def _mode_string(mode, compile: bool) -> str:  # noqa: A002 -- the public parameter's name
    text = _registry._mode_key(mode) if not isinstance(mode, str) else mode
    if text not in ("inference", "training", "inference+compile", "training+compile"):
        raise ValueError(f"kernmap.kernelize: mode must be 'inference' or 'training' (optionally '+compile'), "
                         f"got {mode!r}")
    if compile and not text.endswith("+compile"):
        text += "+compile"
    return text


def _verified(model: nn.Module, batch: Mapping, plans: list[_Plan], rows: list[Row], training: bool) -> list[Row]:
    """The rows after checking each resolved kernel on the module's live inputs (docs/mapping.md, "Verified and
    tuned mappings"): a kernel off by more than the tolerance becomes a fallback with the measured error."""
    chosen = [(p.path, p.module, p.binder) for p, row in zip(plans, rows) if not row.fallback]
    calls = _verify.capture(model, batch, chosen, training)
    out = []
    for p, row in zip(plans, rows):
        call = None if row.fallback else calls.get(p.path)
        if row.fallback:
            out.append(row)
        elif call is None:
            out.append(replace(row, reason=f"{row.reason}; verify: not called by the sample batch"))
        else:
            layer = p.binder.layer
            result = _verify.check(p.decision.callable(), call, training)
            error = result.error if math.isfinite(result.error) else None
            if result.passed:
                out.append(replace(row, error=result.error, tolerance=result.tolerance))
            else:
                out.append(replace(row, kernel=_registry._reference_name(layer), fallback=True,
                                   reason=result.reason(), error=error if result.failure is None else None,
                                   tolerance=result.tolerance if result.failure is None else None))
    return out


def kernelize(model: nn.Module, *, mode, device: str | torch.device | None = None, use_fallback: bool = True,
              compile: bool = False, verify: Mapping | None = None) -> Report:  # noqa: A002 -- as `kernels`'s
    """Binds every layer-bearing module of `model` to the kernel the mapping resolves for (`device`, `mode`).

    Layers: modules marked by transformers with ``kernel_layer_name`` (``RMSNorm``, ``SiLU``), gated SiLU MLPs
    (``down(silu_and_mul(gate(x), up(x)))``, layer ``SiluAndMul``), MoE experts modules (layer ``Experts``,
    through transformers' experts-implementation hook: the model's implementation becomes ``"kernmap"``),
    attentions' rotary embedding (``rotary_pos_emb``) and the causal-LM model's loss (``ForCausalLMLoss``: in
    training with labels the loss is fused with lm_head and ``outputs.logits`` is None; docs/python.md).

    mode: ``"inference"`` or ``"training"``; ``compile=True`` (or a ``"+compile"`` mode) accepts only
    compile-safe kernels. device: a torch device type; by default the model's. With ``use_fallback=False`` any
    layer without a usable kernel raises `KernelizeError` (carrying the report) and the model is left unchanged.
    Calling kernelize again re-resolves every layer.

    verify: a sample batch (the dict of model inputs a training step takes, labels included). The model runs it
    once (forward; no backward, no optimizer step; parameters, gradients and the RNG state are left as they
    were), recording each resolved module's kernel arguments; then each module's kernel and its layer's
    reference kernel run on them, forward and, in training, backward under a fixed random upstream gradient, and
    a kernel whose outputs or gradients differ from the reference's by more than the layer's tolerance falls
    back: its row says ``verify: <output|grad_x> max error X > tolerance Y``. Rows carry the measured error.
    Returns the `Report`."""
    mode_text = _mode_string(mode, compile)
    if device is None:
        first = next(model.parameters(), None)
        device = first.device.type if first is not None else "cpu"
    device = device.type if isinstance(device, torch.device) else str(device).split(":")[0]

    plans = _plan(model, device, mode_text)
    rows = []
    for p in plans:
        fallback = p.decision.fallback or p.why_not is not None
        kernel = _registry._reference_name(p.binder.layer) if p.why_not else p.decision.kernel
        reason = p.why_not or p.decision.reason
        if not fallback:
            change, error = _guarded("describe", p.module, lambda: p.binder.change(p.module))
            reason = "; ".join(filter(None, (reason, change, error)))
        rows.append(Row(p.path, type(p.module).__name__, p.binder.layer, kernel, fallback, reason))
    if verify is not None:
        rows = _verified(model, verify, plans, rows, training=mode_text.startswith("training"))
    report = Report(device, mode_text, rows)
    if not use_fallback and report.fallbacks:
        raise KernelizeError(report)

    bound: dict[Binder, list[nn.Module]] = {binder: [] for binder in BINDERS}
    for p, row in zip(plans, rows):
        p.binder.restore(p.module)
        if not row.fallback:
            p.binder.bind(p.module, p.decision.callable())
            bound[p.binder].append(p.module)
    for binder, modules in bound.items():
        binder.finish(model, modules)
    return report
