"""kernmap.tune(model, batch): the measured kernel choice. Every eligible kernel of each bindable layer, timed
forward+backward in training mode on the model's live inputs (one sample step's kernel calls, captured as
`kernelize(verify=...)` captures them), each verified against the reference; the fastest verified one wins, and
the winners go to a mapping file in the existing format with the comparison beside it (docs/mapping.md,
"Verified and tuned mappings")."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import _cpu, _registry, _verify
from ._kernelize import _plan

COMPILED = " (torch.compile)"  # the suffix of the compiled reference's candidate name


@dataclass
class Candidate:
    """One kernel of a layer as tune measured it. ``median_ms``: one sample step's calls of the layer, forward and
    backward (None when not timed); ``error``/``tolerance``: the worst element over those calls (None when the
    kernel was not run); ``verdict``: ``winner``, or why it lost."""

    kernel: str
    median_ms: float | None = None
    error: float | None = None
    tolerance: float | None = None
    verdict: str = ""


@dataclass
class LayerResult:
    layer: str
    calls: int  # modules of the layer the sample step called
    shapes: list[str]  # the shape classes of their inputs (the first tensor argument's shape), with counts
    winner: str | None
    candidates: list[Candidate] = field(default_factory=list)


@dataclass
class TuneResult:
    """What tune measured: ``winners`` ({layer: kernel}), ``mapping`` (the mapping it wrote, as
    `register_mapping`/`use_mapping` take it), ``layers`` (every candidate's figures), ``machine``, and the
    ``path`` and ``table_path`` written (None without a path)."""

    device: str
    machine: dict
    layers: list[LayerResult]
    path: Path | None = None
    table_path: Path | None = None

    @property
    def winners(self) -> dict[str, str]:
        return {r.layer: r.winner for r in self.layers if r.winner}

    @property
    def mapping(self) -> dict:
        return {layer: {self.device: {"training": kernel}} for layer, kernel in self.winners.items()}

    def to_dict(self) -> dict:
        return {"kernmap_tune": 1, "device": self.device, "machine": self.machine, "mapping": self.mapping,
                "layers": [asdict(r) for r in self.layers]}

    def __str__(self) -> str:
        header = ("layer", "calls", "kernel", "median ms", "error / tolerance", "verdict")
        lines = []
        for r in self.layers:
            for c in r.candidates:
                lines.append((r.layer, str(r.calls), c.kernel, "-" if c.median_ms is None else f"{c.median_ms:.3f}",
                              "-" if c.error is None else f"{c.error:.2g} / {c.tolerance:.2g}", c.verdict))
        widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]

        def fmt(cells):
            return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

        summary = (f"kernmap.tune on {self.device} ({self.machine['cpu']}, {self.machine['threads']} threads): "
                   + ", ".join(f"{k} -> {v}" for k, v in self.winners.items()))
        return "\n".join([summary, fmt(header), "  ".join("-" * w for w in widths), *(fmt(x) for x in lines)])

    __repr__ = __str__


def machine(device: str) -> dict:
    """The machine a tune measured: host, CPU and its levels, threads, accelerator, library versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "host": platform.node(), "cpu": cpu, "arch": platform.machine(), "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "kernmap_cpu_level": _cpu.cpu_level(),  # the level kernmap's CPU kernels ran at, and ATen's own
        "aten_cpu_level": torch.backends.cpu.get_cpu_capability(),
        "kernmap_cpu_isa_env": os.environ.get("KERNMAP_CPU_ISA"),
        "accelerator": torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else None,
        "torch": torch.__version__, "transformers": version("transformers"), "kernmap": version("kernmap"),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _eligible(layer: str, device: str, dtype: torch.dtype, shapes: list[list[int]]) -> list[tuple[dict, str | None]]:
    """Every registered kernel of the layer with why it cannot run here (None when it can), as resolution would
    decide with it mapped alone: device, dtype, backward, its supports() check on the live shapes."""
    out = []
    for k in _registry.kernels():
        if k["layer"] != layer:
            continue
        if k["provider"] == "reference":
            out.append((k, None))
            continue
        with _registry.use_mapping({layer: {device: {"training": k["name"]}}}, inherit=False):
            d = _registry.resolve(layer, device, "training", dtype, shapes)
        out.append((k, None if not d.fallback and d.kernel == k["name"] else d.reason))
    return out


def _callable(descriptor: dict) -> Callable:
    if descriptor["op"]:
        namespace, name = descriptor["op"].split("::")
        return getattr(getattr(torch.ops, namespace), name)
    return _registry._python_kernels[descriptor["name"]]


def _step(fn: Callable, calls: list[_verify.Call]) -> Callable[[], None]:
    """One sample step's calls of a layer through `fn`, forward and backward (fixed upstream gradients)."""
    prepared = []
    for call in calls:
        args, leaves = _verify.prepare(call, training=True)
        prepared.append((args, [args[i] for i in leaves]))

    def run():
        for args, leaves in prepared:
            outs = [o for o in _verify.outputs_of(fn(*args)) if o.requires_grad]
            if outs and leaves:
                torch.autograd.backward(outs, _verify._upstream(outs))
            for leaf in leaves:
                leaf.grad = None

    return run


def _time(runs: list[Callable[[], None]], warmup: int, reps: int) -> list[float]:
    """Median milliseconds of each run, the runs interleaved: `python -m kernmap.bench`'s timing, memory uncounted."""
    from . import bench

    timings = bench.time_interleaved([bench.Impl(str(i), fn) for i, fn in enumerate(runs)], warmup, reps,
                                     memory=False)
    return [t.median_ms for t in timings]


def _verified(fn: Callable, calls: list[_verify.Call]) -> _verify.Check:
    worst = None
    for call in calls:
        c = _verify.check(fn, call, training=True)
        if not c.passed:
            return c
        if worst is None or c.error / c.tolerance > worst.error / worst.tolerance:
            worst = c
    return worst


def _tune_layer(layer: str, device: str, calls: list[_verify.Call], compile: bool, warmup: int,  # noqa: A002
                reps: int) -> LayerResult:
    counts: dict[str, int] = {}
    for call in calls:
        key = "x".join(map(str, call.shapes()[0])) + f" {_registry.dtype_name(call.dtype())}"
        counts[key] = counts.get(key, 0) + 1
    result = LayerResult(layer, len(calls), [f"{k} ({n})" for k, n in counts.items()], None)
    timed: list[tuple[Candidate, Callable]] = []
    for descriptor, why_not in _eligible(layer, device, calls[0].dtype(), calls[0].shapes()):
        candidate = Candidate(descriptor["name"])
        result.candidates.append(candidate)
        if why_not:
            candidate.verdict = f"not eligible: {why_not}"
            continue
        fns = [(candidate, _callable(descriptor))]
        if compile and descriptor["provider"] == "reference":
            compiled = Candidate(descriptor["name"] + COMPILED)
            result.candidates.append(compiled)
            if descriptor["compile_safe"]:
                fns.append((compiled, torch.compile(fns[0][1], dynamic=False)))
            else:
                compiled.verdict = "not eligible: the reference is not compile-safe"
        for c, fn in fns:
            check = _verified(fn, calls)
            if check.failure is None:
                c.error, c.tolerance = check.error, check.tolerance
            if not check.passed:
                c.verdict = f"failed {check.reason()}"
                continue
            timed.append((c, _step(fn, calls)))
    for (c, _), ms in zip(timed, _time([run for _, run in timed], warmup, reps)):
        c.median_ms = ms
    mappable = [c for c, _ in timed if not c.kernel.endswith(COMPILED)]
    if not mappable:
        return result
    best = min(mappable, key=lambda c: c.median_ms)
    result.winner = best.kernel
    for c, _ in timed:
        ratio = c.median_ms / best.median_ms
        if c is best:
            c.verdict = "winner"
        elif c.kernel.endswith(COMPILED) and ratio < 1:
            c.verdict = (f"faster ({ratio:.2f}x {best.kernel}'s {best.median_ms:.3f} ms) but not a registered "
                         f"kernel, and the mapping names only those")
        else:
            c.verdict = f"slower: {ratio:.2f}x {best.kernel}'s {best.median_ms:.3f} ms"
    return result


def _toml(result: TuneResult) -> str:
    m = result.machine
    lines = ["# kernmap tune: the fastest verified kernel of each layer, measured on this machine (docs/mapping.md,",
             "# 'Verified and tuned mappings'); every candidate's figures are in the side JSON.",
             f"# machine: {m['host']}, {m['cpu']} ({m['arch']}, {m['cores']} cores, {m['threads']} threads), "
             f"kernmap CPU level {m['kernmap_cpu_level']}, ATen CPU level {m['aten_cpu_level']}, "
             f"KERNMAP_CPU_ISA={m['kernmap_cpu_isa_env'] or '(unset)'}"
             + (f", {m['accelerator']}" if m["accelerator"] else ""),
             f"# versions: torch {m['torch']}, transformers {m['transformers']}, kernmap {m['kernmap']}; {m['date']}",
             "kernmap_mapping = 1", ""]
    for r in result.layers:
        if not r.winner:
            continue
        lines.append(f"# {r.layer}: {r.calls} calls, inputs {', '.join(r.shapes)}; forward+backward medians")
        for c in r.candidates:
            ms = "-" if c.median_ms is None else f"{c.median_ms:.3f} ms"
            err = "" if c.error is None else f", error {c.error:.2g} (tolerance {c.tolerance:.2g})"
            lines.append(f"#   {c.kernel}: {ms}{err}: {c.verdict}")
        lines += [f"[{r.layer}.{result.device}]", f'training = "{r.winner}"', ""]
    return "\n".join(lines)


def write(result: TuneResult, path: str | os.PathLike) -> None:
    """The mapping file at `path` (TOML, with the machine and the comparison as comments, or JSON) and the whole
    comparison in ``<stem>.tune.json`` beside it."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".toml":
        text = _toml(result)
    elif suffix == ".json":
        text = json.dumps({"kernmap_mapping": 1, **result.mapping}, indent=2)
    else:
        raise ValueError(f"kernmap.tune: path must end in .toml or .json (the mapping-file formats), got {path}")
    path.write_text(text + "\n")
    result.path, result.table_path = path, path.with_name(path.stem + ".tune.json")
    result.table_path.write_text(json.dumps(result.to_dict(), indent=1) + "\n")


def tune(model: nn.Module, batch: Mapping, path: str | os.PathLike | None = None, *,
         device: str | None = None, compile: bool = True, warmup: int = 3, reps: int = 10) -> TuneResult:  # noqa: A002
    """Times every eligible kernel of each layer `model` bears on the model's live inputs and picks the fastest
    verified one (docs/mapping.md, "Verified and tuned mappings").

    batch: the dict of model inputs a training step takes, labels included; the model runs it once (forward,
    no backward) to capture each bindable module's kernel arguments. Per layer, the candidates are every
    registered kernel that runs on the device, the dtype and the live shapes with a backward (built in, plugins,
    Python callables), the reference, and (``compile=True``) the reference under torch.compile when it is
    compile-safe. Each is verified as ``kernelize(verify=...)`` verifies, then the layer's calls of the sample
    step run through it, forward and backward, `warmup` times and `reps` timed times, candidates interleaved;
    the winner has the least median. With `path` (``.toml`` or ``.json``) the winners are written as a mapping
    file (``kernmap.load_mapping_file`` and ``--mapping`` read it as is) and the comparison as
    ``<stem>.tune.json`` beside it. The model's layers are left on their own forwards (kernelize it after, for
    instance ``with kernmap.use_mapping(result.mapping): kernmap.kernelize(model, mode="training")``);
    parameters and gradients are untouched. Returns the `TuneResult`."""
    if device is None:
        first = next(model.parameters(), None)
        device = first.device.type if first is not None else "cpu"
    if warmup < 0 or reps < 1:
        raise ValueError(f"kernmap.tune: warmup must be >= 0 and reps >= 1, got warmup={warmup}, reps={reps}")
    plans = [p for p in _plan(model, device, "training") if p.why_not is None]
    calls = _verify.capture(model, batch, [(p.path, p.module, p.binder) for p in plans], training=True)
    by_layer: dict[str, list[_verify.Call]] = {}
    for p in plans:
        if p.path in calls:
            by_layer.setdefault(p.binder.layer, []).append(calls[p.path])
    layers = [_tune_layer(layer, device, layer_calls, compile, warmup, reps) for layer, layer_calls in
              by_layer.items()]
    result = TuneResult(device, machine(device), layers)
    if path is not None:
        write(result, path)
    return result
