"""Checking a kernel on the model it is about to change (`kernmap.kernelize(verify=batch)`, `kernmap.tune`): one
forward of a sample batch with every selected module bound to a recorder that keeps its kernel's arguments (and
computes with the layer's reference kernel), then the kernel and the reference on those arguments, forward and
backward under one fixed random upstream gradient, compared element by element against the layer's tolerance
(verify_tolerances.json; docs/mapping.md, "Verified and tuned mappings")."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import _registry

TABLE = json.loads((Path(__file__).resolve().parent / "verify_tolerances.json").read_text())
SEED = 0  # of the upstream gradients

# The kernel's arguments per layer, to name a gradient in a reason ("grad_weight"); the ops' own signatures.
ARGUMENTS = {
    "RMSNorm": ("x", "weight", "eps"),
    "SiLU": ("x",),
    "SiluAndMul": ("gate", "up"),
    "Experts": ("hidden", "topk_ids", "topk_weights", "gate_up_proj", "down_proj"),
    "rotary_pos_emb": ("q", "k", "cos", "sin", "unsqueeze_dim"),
    "ForCausalLMLoss": ("hidden", "weight", "labels", "bias", "ignore_index", "num_items_in_batch"),
}


def _terms(call: Call) -> int:
    """The longest sum any result of the layer computes (the tolerance's "sum" rule widens atol by it)."""
    layer, args = call.layer, call.args
    if layer == "RMSNorm":  # rsqrt of a mean over H; dW over the rows
        x = args[0]
        return max(x.shape[-1], x.numel() // max(x.shape[-1], 1)) if x.dim() else 1
    if layer == "Experts":  # down over I, gate_up's gradient over H, the weights' gradients over the tokens
        hidden, _, _, gate_up, _ = args[:5]
        return max(hidden.shape[-1], gate_up.shape[-2], hidden.shape[0])
    if layer == "ForCausalLMLoss":  # logits over H, hidden's gradient over V, weight's over the rows, the mean
        hidden, weight = args[:2]
        return max(hidden.shape[-1], weight.shape[0], hidden.shape[0])
    if layer == "rotary_pos_emb" and any(call.needs_grad[2:4]):
        return max(args[0].numel() // max(args[2].numel(), 1), 1)  # cos/sin's gradients sum over the heads
    return 1  # elementwise


def tolerance(dtype: torch.dtype, terms: int) -> tuple[float, float]:
    """(rtol, atol) for results computed from inputs of `dtype` that sum `terms` terms."""
    figures = TABLE["elementwise"][_registry.dtype_name(dtype)]
    return figures["rtol"], figures["atol"] * max(terms, 1) ** TABLE["sum"]["atol_exponent"]


@dataclass
class Call:
    """One captured kernel call: its arguments (detached) and which of them the step differentiated."""

    layer: str
    args: tuple
    needs_grad: tuple[bool, ...]
    # The reference's run of the capture step, (args, leaves, outputs, the outputs' versions), until `reference`
    # turns it into `reference_results` (its outputs and gradients, computed once per call).
    pending: tuple | None = field(default=None, repr=False)
    reference_results: dict | None = field(default=None, repr=False)

    def shapes(self) -> list[list[int]]:
        return [list(a.shape) for a in self.args if isinstance(a, torch.Tensor)]

    def dtype(self) -> torch.dtype:
        return next(a.dtype for a in self.args if isinstance(a, torch.Tensor) and a.is_floating_point())


def reference_callable(layer: str) -> Callable:
    namespace, name = _registry._reference_op(layer).split("::")
    return getattr(getattr(torch.ops, namespace), name)


def _recorder(calls: dict, path: str, layer: str, compute: Callable, training: bool) -> Callable:
    def record(*args):
        if path in calls:  # the module's first call is the one checked; later calls (if any) only compute
            return compute(*args)
        # Detached views, not copies (a weight is not copied): nothing writes the step's tensors once they are
        # made, and the kernel and the reference read the same values in any case.
        call = Call(layer, tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                    tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args))
        # The reference runs on the call's own leaves, so that its outputs of this step are the check's reference
        # outputs and its backward is the check's (no second reference forward). The model computes on from
        # them; its own graph is never differentiated.
        leaf_args, leaves = prepare(call, training)
        with torch.set_grad_enabled(training):
            result = compute(*leaf_args)
        outs = outputs_of(result)
        call.pending = (leaf_args, leaves, outs, [o._version for o in outs])
        calls[path] = call
        return result

    return record


def capture(model: nn.Module, batch: Mapping, modules: list, training: bool) -> dict[str, Call]:
    """Runs ``model(**batch)`` once (gradients on in training, no backward) with each of `modules` ((path, module,
    binder) triples) bound to a recorder computing with its layer's reference kernel; returns the first call of
    each module by path. The modules are restored afterwards (their own forwards); the RNG state, the modules'
    train/eval flags and every parameter and gradient are as before."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"kernmap: verify/tune batch must be a dict of model inputs (labels included), got "
                        f"{type(batch).__name__}")
    calls: dict[str, Call] = {}
    by_binder: dict = {}
    flags = {m: m.training for m in model.modules()}
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        for path, module, binder in modules:
            binder.bind(module, _recorder(calls, path, binder.layer, reference_callable(binder.layer), training))
            by_binder.setdefault(binder, []).append(module)
        for binder, bound in by_binder.items():
            binder.finish(model, bound)
        if training:
            model.train()
        with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(training):
            model(**batch)
    finally:
        for path, module, binder in modules:
            binder.restore(module)
        for m, flag in flags.items():
            m.training = flag
    return calls


@dataclass
class Check:
    """A kernel against the reference on one call: the worst element of every output and gradient."""

    error: float  # |got - want| at the worst element (relative to its tolerance)
    tolerance: float  # atol + rtol * |want| there
    what: str  # "output", "grad_x", ... (the worst one)
    failure: str | None = None  # the kernel or the reference raised, or a shape differs

    @property
    def passed(self) -> bool:
        return self.failure is None and self.error <= self.tolerance

    def reason(self) -> str:
        if self.failure:
            return f"verify: {self.failure}"
        return f"verify: {self.what} max error {self.error:.3g} > tolerance {self.tolerance:.3g}"


def _upstream(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fixed random upstream gradient of each output (the same for kernel and reference: it depends only on
    the output's shape and position)."""
    out = []
    for i, o in enumerate(outputs):
        g = torch.randn(o.shape, generator=torch.Generator().manual_seed(SEED + i), dtype=torch.float32)
        out.append(g.to(device=o.device, dtype=o.dtype))
    return out


def prepare(call: Call, training: bool) -> tuple[list, list[int]]:
    """The call's arguments as fresh autograd leaves (requiring grad where the step differentiated them; the
    storage is shared, kernels do not write their inputs) and the positions of those leaves."""
    args, leaves = [], []
    for i, (a, grad) in enumerate(zip(call.args, call.needs_grad)):
        if isinstance(a, torch.Tensor):
            a = a.detach().requires_grad_(grad and training)
            if grad and training:
                leaves.append(i)
        args.append(a)
    return args, leaves


def outputs_of(result) -> list[torch.Tensor]:
    return [o for o in (result if isinstance(result, (tuple, list)) else (result,)) if isinstance(o, torch.Tensor)]


def _results(call: Call, args: list, leaves: list[int], outs: list[torch.Tensor],
             training: bool) -> dict[str, torch.Tensor]:
    names = ["output"] if len(outs) == 1 else [f"output[{i}]" for i in range(len(outs))]
    results = {n: o.detach() for n, o in zip(names, outs)}
    differentiable = [o for o in outs if o.requires_grad]
    if training and leaves and differentiable:
        grads = torch.autograd.grad(differentiable, [args[i] for i in leaves], _upstream(differentiable),
                                    allow_unused=True)
        arg_names = ARGUMENTS.get(call.layer, ())
        for i, g in zip(leaves, grads):
            name = f"grad_{arg_names[i]}" if i < len(arg_names) else f"grad_arg{i}"
            results[name] = g if g is not None else torch.zeros_like(args[i])
    return results


def run(fn: Callable, call: Call, training: bool) -> dict[str, torch.Tensor]:
    """The kernel's outputs and (in training) its gradients with respect to the differentiated arguments."""
    args, leaves = prepare(call, training)
    with torch.set_grad_enabled(training):
        outs = outputs_of(fn(*args))
    return _results(call, args, leaves, outs, training)


def reference(call: Call, training: bool) -> dict[str, torch.Tensor]:
    """The reference kernel's outputs and gradients on the call: from its run in the capture step (its backward
    now), or run again where the model wrote its outputs in place since."""
    if call.reference_results is None:
        args, leaves, outs, versions = call.pending
        call.pending = None
        if [o._version for o in outs] != versions:
            call.reference_results = run(reference_callable(call.layer), call, training)
        else:
            call.reference_results = _results(call, args, leaves, outs, training)
    return call.reference_results


def compare(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> tuple[float, float]:
    """(|got - want|, atol + rtol * |want|) at the element where the first is largest relative to the second;
    equal non-finite values agree, any other non-finite difference is an infinite error. Computed in float32
    (float64 for float64 results): the difference of two values is then exact to a unit in its last place, far
    inside any tolerance, and a [vocab, hidden] gradient is not copied to float64 twice."""
    if got.numel() == 0:
        return 0.0, atol
    dtype = torch.float64 if torch.float64 in (got.dtype, want.dtype) else torch.float32
    g, w = got.detach().reshape(-1).to(dtype), want.detach().reshape(-1).to(dtype)
    ratio = (g - w).abs_().div_(w.abs().mul_(rtol).add_(atol))
    if not math.isfinite(float(ratio.max())):  # max propagates NaN: some value is not finite
        same = (g == w) | (g.isnan() & w.isnan())
        ratio = ratio.nan_to_num_(nan=math.inf, posinf=math.inf).masked_fill_(same, 0.0)
    worst = int(torch.argmax(ratio))
    gw, ww = float(g[worst]), float(w[worst])
    if gw == ww or (math.isnan(gw) and math.isnan(ww)):
        return 0.0, atol + rtol * abs(ww) if math.isfinite(ww) else atol
    diff = abs(gw - ww)
    return (diff if math.isfinite(diff) else math.inf), atol + rtol * (abs(ww) if math.isfinite(ww) else 0.0)


def check(kernel: Callable, call: Call, training: bool) -> Check:
    """The kernel against the layer's reference on one captured call (docs/mapping.md, "Verified and tuned
    mappings")."""
    try:
        want = reference(call, training)
    except Exception as e:  # noqa: BLE001 -- the reason the layer keeps its own forward
        return Check(math.inf, 0.0, "output", f"the reference kernel raised {type(e).__name__}: {e}")
    try:
        got = run(kernel, call, training)
    except Exception as e:  # noqa: BLE001 -- a kernel that cannot run the live inputs falls back, with why
        return Check(math.inf, 0.0, "output", f"the kernel raised {type(e).__name__}: {e}")
    rtol, atol = tolerance(call.dtype(), _terms(call))
    worst = Check(0.0, atol, "output")
    for name, w in want.items():
        g = got.get(name)
        if g is None or g.shape != w.shape:
            shape = "missing" if g is None else list(g.shape)
            return Check(math.inf, 0.0, name, f"{name} has shape {shape}, the reference's {list(w.shape)}")
        error, allowed = compare(g, w, rtol, atol)
        if error / allowed > worst.error / worst.tolerance:
            worst = Check(error, allowed, name)
    return worst
