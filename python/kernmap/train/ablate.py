"""``python -m kernmap ablate``: step time of the original model (as transformers runs it: for MoE models its
default experts implementation, grouped_mm in transformers 5.23), of more originals with other experts
implementations (--experts-baseline), of each kernel alone and of all of them, with --compile torch.compile of
the original and of all. Each row trains its own copy on the same batches; rows are interleaved (step s of every
row before step s+1 of any, in an order that rotates each step) so that machine drift hits all rows alike;
--one-at-a-time trains them one after another instead, one copy in memory at a time, for a model of which a copy
per row does not fit. Per
row: the median step time after warm-up, the spread, the speedup over the original, CPU time, and the peak
memory of a step (kernmap's count of CPU memory in tensors, reset before each step: per row, whatever the other
rows hold) and, with --one-at-a-time, the process's peak resident memory while the row ran."""

from __future__ import annotations

import gc
import statistics
import sys
from dataclasses import dataclass, field

import torch

import kernmap

from . import distributed, options
from .errors import UsageError
from .models import Setup, layers_of
from .output import fixed, json_document, pct, progress_bar, render
from .session import Session, open_session
from .trainer import Trainer


@dataclass
class Row:
    name: str
    setup: Setup
    experts: str | None  # the experts implementation the row runs (None: no experts)
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    peak_bytes: float = 0.0
    peak_rss_bytes: float | None = None  # --one-at-a-time: the process's peak resident memory during the row
    final_loss: float = 0.0

    def stats(self) -> dict:
        s = sorted(self.seconds)
        return {"median_s": percentile(s, 0.5), "p25_s": percentile(s, 0.25), "p75_s": percentile(s, 0.75),
                "min_s": s[0] if s else float("nan"), "median_cpu_s": statistics.median(self.cpu_seconds)
                if self.cpu_seconds else float("nan")}


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the nearest ranks (the C++ command's percentile)."""
    if not values:
        return float("nan")
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def reset_peak_rss() -> bool:
    """Resets the process's resident-memory high-water mark (Linux: 5 to /proc/self/clear_refs); False where
    it cannot."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> float | None:
    """The process's resident-memory high-water mark in bytes (VmHWM), None where it is not readable."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def plan_rows(session: Session) -> list[Row]:
    args, models = session.args, session.models
    default = models.default_experts
    rows = [Row("original", Setup(), default)]
    if default is not None:
        for name in args.experts_baseline:
            if name != default:
                rows.append(Row(f"original (experts {name})", Setup(experts=name), name))
    present = [layer for layer in layers_of(models.base, session.parallel.device) if layer in session.layers]
    for layer in present:
        rows.append(Row(f"+{layer}", Setup(frozenset({layer})), "kernmap" if layer == "Experts" else default))
    every = frozenset(present)
    all_experts = "kernmap" if "Experts" in every else default
    rows.append(Row("all", Setup(every), all_experts))
    if args.compile:
        rows += [Row("original+compile", Setup(compile=True), default),
                 Row("all+compile", Setup(every, compile=True), all_experts)]
    return rows


def ablate(session: Session) -> list[Row]:
    args = session.args
    kernmap.count_cpu_memory()
    rows = plan_rows(session)
    total = args.warmup + args.steps
    progress = progress_bar("ablate", session.parallel.main and not args.json)

    def trainer(row: Row) -> Trainer:
        return Trainer(session.models.make(row.setup)[0], session.data, session.options, session.parallel,
                       session.models.pad_id)

    def step(row: Row, trainer: Trainer, s: int) -> None:
        kernmap.reset_cpu_memory_peak()
        before = kernmap.cpu_memory()["in_use"]
        log = trainer.step()
        row.final_loss = log.loss
        if s >= args.warmup:  # warm-up steps also hold one-time allocations (AdamW's state, caches)
            row.peak_bytes = max(row.peak_bytes, kernmap.cpu_memory()["peak"] - before)
            row.seconds.append(log.seconds)
            row.cpu_seconds.append(log.cpu_seconds)

    if args.one_at_a_time:
        session.models.release()  # each row loads its own copy: one model in memory, not two
        for k, row in enumerate(rows):
            gc.collect()  # the previous row's model and optimizer state go before this row's load
            resettable = reset_peak_rss()
            t = trainer(row)
            for s in range(total):
                step(row, t, s)
                if progress:
                    progress(k * total + s + 1, len(rows) * total)
            row.peak_rss_bytes = peak_rss() if resettable else None
            del t
        return rows
    trainers = [trainer(r) for r in rows]
    for s in range(total):
        for k in range(len(rows)):
            r = (s + k) % len(rows)  # rotate the order so no row is always first
            step(rows[r], trainers[r], s)
        if progress:
            progress(s + 1, total)
    return rows


def to_json(session: Session, rows: list[Row]) -> dict:
    base = rows[0].stats()
    out = []
    for r in rows:
        st = r.stats()
        out.append({"name": r.name, "experts": r.experts, **st,
                    "speedup_pct": (base["median_s"] / st["median_s"] - 1) * 100,
                    "cpu_speedup_pct": (base["median_cpu_s"] / st["median_cpu_s"] - 1) * 100,
                    "peak_bytes": r.peak_bytes, "peak_rss_bytes": r.peak_rss_bytes, "final_loss": r.final_loss,
                    "seconds": r.seconds})
    return {"model": session.source.name, "parallel": {"kind": session.parallel.kind, "world": session.parallel.world},
            "optim": session.options.optim,
            "interleaved": not session.args.one_at_a_time,
            "experts_implementation": session.models.default_experts, "rows": out}


def print_human(session: Session, rows: list[Row]) -> None:
    args = session.args
    default = session.models.default_experts
    order = "rows one at a time (not interleaved)" if args.one_at_a_time else "rows interleaved"
    session.say(f"ablate {session.describe()}; {args.steps} measured steps per row after {args.warmup} warm-up, "
                f"{order}\n")
    if default is not None:
        session.say(f"original: the model as transformers runs it, experts {default} (transformers' default); "
                    f"rows without the Experts kernel run their experts as the original does\n")
    session.say("\n")
    data = to_json(session, rows)["rows"]
    header = ["kernels", "median ms/step", "spread (p25-p75) ms", "min ms", "speedup %", "cpu ms/step",
              "cpu speedup %", "peak MiB", "final loss"]
    rss = args.one_at_a_time  # one row in the process at a time: its peak resident memory is its own
    if rss:
        header.insert(-1, "peak RSS MiB")
    table = []
    for i, r in enumerate(data):
        name = r["name"] + (f" (experts {default})" if i == 0 and default is not None else "")
        line = [name, fixed(r["median_s"] * 1e3, 1), f"{fixed(r['p25_s'] * 1e3, 1)}-{fixed(r['p75_s'] * 1e3, 1)}",
                fixed(r["min_s"] * 1e3, 1), pct(r["speedup_pct"]), fixed(r["median_cpu_s"] * 1e3, 1),
                pct(r["cpu_speedup_pct"]), fixed(r["peak_bytes"] / (1 << 20), 1), fixed(r["final_loss"], 4)]
        if rss:
            line.insert(-1, "-" if r["peak_rss_bytes"] is None else fixed(r["peak_rss_bytes"] / (1 << 20), 1))
        table.append(line)
    session.say(render(header, table))
    if rss:
        session.say("peak RSS: the process's peak resident memory while the row loaded its copy and trained "
                    "(torch and transformers included)\n")


def main(argv: list[str]) -> int:
    args = options.parse("ablate", argv)
    finished = False
    try:
        session = open_session(args)
        rows = ablate(session)
        if args.json:
            session.say(json_document(to_json(session, rows)))
        else:
            print_human(session, rows)
        finished = True
        return 0
    except UsageError as e:
        sys.stderr.write(f"kernmap ablate: {e}\n")
        return 2
    except (ValueError, OSError) as e:
        sys.stderr.write(f"kernmap ablate: {e}\n")
        return 1
    finally:
        distributed.stop(finished)
