"""``python -m kernmap align``: the original model and the kernelized one trained on the same batches, and a
third run that measures how far correct arithmetic drifts on this machine and this model — the original with
every selected layer on its float64 kernel (the reference's math from float64, rounded where the reference
rounds: the most accurate kernel of the layer); per step the loss and grad_norm of each, their differences, and
the verdict (kernmap/train/verdict.py, the C++ command's rule). In a model with experts the noise and kernelized
runs replay the original's routing (kernmap/train/routing.py; --routing free: their own top-k, with a noise run
per layer alone on its float64 kernel). With --compile, torch.compile of the original and
of the kernelized model are judged too. The runs train one after another, so one model is held at a time.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from . import distributed, options
from .errors import UsageError
from .models import Setup, layers_of
from .output import fixed, json_document, progress_bar, render, sci
from .routing import Flips, RoutingTape, routers
from .session import Session, open_session
from .trainer import StepLog, Trainer
from .verdict import Verdict, judge

NOISE_RUN = ("the original with the selected layers on their float64 kernels (the reference's math from float64, "
             "rounded where it rounds), and in a model that routes tokens to experts each selected layer alone on "
             "its float64 kernel too; the largest drift of these runs")  # the C++ kNoiseRun
NOISE_RUN_REPLAYED = ("the original with the selected layers on their float64 kernels (the reference's math from "
                      "float64, rounded where it rounds)")  # the C++ kNoiseRunReplayed
ALONE = "noise: "  # the name of a noise run of one layer alone: "noise: RMSNorm"


@dataclass
class Run:
    name: str
    setup: Setup
    logs: list[StepLog] = field(default_factory=list)
    flips: list[Flips] = field(default_factory=list)  # per step, a run that replays the original's routing

    def series(self) -> dict[str, list[float]]:
        return {"loss": [s.loss for s in self.logs], "grad_norm": [s.grad_norm for s in self.logs]}


@dataclass
class AlignResult:
    runs: dict[str, Run]
    verdicts: dict[str, Verdict]  # every judged run's, by run name
    report: object  # the kernelized model's kernelize report
    noise_report: object  # the noise run's: the selected layers on their float64 kernels
    routing: str | None = None  # "replay" or "free" for a model with routers, None without

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts.values())


def routing_of(session: Session) -> str | None:
    """"replay" (the noise and kernelized runs replay the original's routing) or "free" for a model with routers
    (free: --routing free, or routers of a kind kernmap.train.routing does not know), None without."""
    if not any(hasattr(m, "top_k") and "Router" in type(m).__name__ for m in session.models.base.modules()):
        return None
    return "replay" if session.args.routing == "replay" and routers(session.models.base) else "free"


def noise_alone_layers(session: Session, routing: str | None) -> list[str]:
    """The selected layers that get a noise run of their own: with free routing in a model that routes tokens to
    experts, each (when more than one is selected) — a router's near-tie flips under one rounding and not
    another, so the one run of all of them samples that drift once and can miss it (docs/training.md, "The
    verdict"). Replayed routing needs none."""
    present = layers_of(session.models.base, session.parallel.device)
    selected = [layer for layer in present if layer in session.layers]
    return selected if routing != "replay" and "Experts" in present and len(selected) > 1 else []


def align(session: Session) -> AlignResult:
    args = session.args
    routing = routing_of(session)
    runs = [Run("original", Setup()), Run("noise", Setup(session.layers, float64=True))]
    runs += [Run(ALONE + layer, Setup(frozenset({layer}), float64=True))
             for layer in noise_alone_layers(session, routing)]
    runs += [Run("kernelized", Setup(session.layers))]
    if args.compile:
        runs += [Run("original+compile", Setup(compile=True)),
                 Run("kernelized+compile", Setup(session.layers, compile=True))]
    # The compiled runs route freely (a hook's bookkeeping would break torch.compile's graphs).
    tape = RoutingTape() if routing == "replay" else None
    reports = {}
    progress = progress_bar("align", session.parallel.main and not args.json)
    total = len(runs) * args.steps
    for run in runs:
        model, reports[run.name] = session.models.make(run.setup)
        replaying = tape is not None and run.name in ("noise", "kernelized")
        if tape is not None and (replaying or run.name == "original"):
            if replaying:
                tape.replay()
            else:
                tape.record()
            hooks = tape.attach(model)
        else:
            hooks = []
        trainer = Trainer(model, session.data, session.options, session.parallel, session.models.pad_id)
        for _ in range(args.steps):
            run.logs.append(trainer.step())
            if replaying:
                run.flips.append(tape.take_flips())
            if progress:
                progress(sum(len(r.logs) for r in runs), total)
        for h in hooks:
            h.remove()
        del trainer, model, hooks
    by_name = {r.name: r for r in runs}
    original = by_name["original"].series()
    noise = [r.series() for r in runs if r.name == "noise" or r.name.startswith(ALONE)]
    verdicts = {r.name: judge(original, r.series(), noise, args.rtol) for r in runs
                if r.name != "original" and r.name != "noise" and not r.name.startswith(ALONE)}
    return AlignResult(by_name, verdicts, reports["kernelized"], reports["noise"], routing)


def routing_json(result: AlignResult) -> dict | None:
    """The C++ command's "routing" document."""
    if result.routing != "replay":
        return None if result.routing is None else {"mode": "free"}
    return {"mode": "replay", "kernelized": [f.to_dict() for f in result.runs["kernelized"].flips],
            "noise": Flips.total(result.runs["noise"].flips).to_dict()}


def routing_line(result: AlignResult) -> str:
    """The C++ command's "routing flips" line."""
    kernelized = result.runs["kernelized"].flips
    total, noise = Flips.total(kernelized), Flips.total(result.runs["noise"].flips)
    steps = [str(i + 1) for i, f in enumerate(kernelized) if f.flipped]

    def count(f: Flips) -> str:
        return f"{f.flipped} of {f.tokens} routed tokens"

    where = (f" ({'steps' if len(steps) > 1 else 'step'} {', '.join(steps)}; largest margin {sci(total.max_margin)})"
             if total.flipped else "")
    noise_margin = f" (largest margin {sci(noise.max_margin)})" if noise.flipped else ""
    return (f"routing flips: the kernelized run's own routers would have sent {count(total)} to other experts{where}; "
            f"the noise run's {count(noise)}{noise_margin}")


def kernels_json(report) -> dict:
    """The kernelize report in the C++ command's shape ({"device", "mode", "layers": [...]})."""
    if report is None:
        return {"device": None, "mode": "training", "layers": []}
    return {"device": report.device, "mode": report.mode,
            "layers": [{"path": r.path, "module": r.module, "layer": r.layer, "kernel": r.kernel,
                        "fallback": r.fallback, "reason": r.reason} for r in report.rows]}


def to_json(session: Session, result: AlignResult) -> dict:
    main = result.verdicts["kernelized"]
    out = {"model": session.source.name, "passed": result.passed, "rtol": main.rtol,
           "noise_factor": main.noise_factor, "max_loss_rel": main.loss.max_diff,
           "max_grad_norm_rel": main.grad_norm.max_diff, "kernels": kernels_json(result.report),
           "noise_kernels": {r.layer: r.kernel for r in (result.noise_report.rows if result.noise_report else [])},
           "parallel": {"kind": session.parallel.kind, "world": session.parallel.world},
           "optim": session.options.optim,
           "lora": None if session.models.lora is None else vars(session.models.lora),
           "gradient_checkpointing": session.models.gradient_checkpointing,
           "experts_implementation": session.models.default_experts,
           "verdict": main.to_dict(), "noise_alone": {}, "compile": {}, "routing": routing_json(result)}
    for name, run in result.runs.items():
        steps = [s.to_dict() for s in run.logs]
        if name.startswith(ALONE):
            out["noise_alone"][name.removeprefix(ALONE)] = steps
        elif name.endswith("+compile"):
            out["compile"][name] = {"steps": steps, "verdict": result.verdicts.get(name, None) and
                                    result.verdicts[name].to_dict()}
        else:
            out[name] = steps
    return out


def bound_kernels(report) -> str:
    names = list(dict.fromkeys(r.kernel for r in (report.rows if report else []) if not r.fallback))
    return ", ".join(names) if names else "none (all reference)"


def step_table(original: list[StepLog], other: list[StepLog], name: str, verdict: Verdict) -> str:
    header = ["step", "loss original", f"loss {name}", "rel diff", "noise", "tolerance", "grad_norm original",
              f"grad_norm {name}", "rel diff", "noise", "tolerance"]
    rows = []
    for i, (a, b) in enumerate(zip(original, other)):
        loss, norm = verdict.loss, verdict.grad_norm
        rows.append([str(a.step), fixed(a.loss, 6), fixed(b.loss, 6), sci(loss.diff[i]), sci(loss.noise[i]),
                     sci(loss.tolerance[i]), fixed(a.grad_norm, 6), fixed(b.grad_norm, 6), sci(norm.diff[i]),
                     sci(norm.noise[i]), sci(norm.tolerance[i])])
    return render(header, rows)


def verdict_line(verdict: Verdict) -> str:
    """The C++ command's verdict line (cli/train_cmd.cpp)."""
    loss, norm = verdict.loss, verdict.grad_norm

    def closest(m) -> str:
        s = m.worst_step - 1
        return f"{sci(m.diff[s])} of {sci(m.tolerance[s])} (step {m.worst_step})"

    return (f"verdict: {'PASS' if verdict.passed else 'FAIL'} — largest relative difference: loss "
            f"{sci(loss.max_diff)} (step {loss.max_diff_step}), grad_norm {sci(norm.max_diff)} (step "
            f"{norm.max_diff_step}); closest to its tolerance: loss {closest(loss)}, grad_norm {closest(norm)}; "
            f"tolerance max(rtol {sci(verdict.rtol)}, {verdict.noise_factor:g} x noise floor), noise floor up to "
            f"loss {sci(loss.floor[-1])}, grad_norm {sci(norm.floor[-1])}")


def print_human(session: Session, result: AlignResult) -> None:
    args = session.args
    experts = session.models.default_experts
    replayed = result.routing == "replay"
    session.say(f"align {session.describe()}, {args.steps} steps, kernels: {bound_kernels(result.report)}\n"
                f"original: the model as transformers runs it{f' (experts {experts})' if experts else ''}; "
                f"noise floor: {NOISE_RUN_REPLAYED if replayed else NOISE_RUN}\n")
    if replayed:
        session.say("routing: the noise and kernelized runs send every token to the experts the original chose "
                    f"(--routing replay{'; the compiled runs route freely' if args.compile else ''})\n")
    original = result.runs["original"].logs
    for name, verdict in result.verdicts.items():
        session.say("\n" + step_table(original, result.runs[name].logs, name, verdict) + "\n")
        if replayed and name == "kernelized":
            session.say(routing_line(result) + "\n\n")
        session.say((f"{name}: " if len(result.verdicts) > 1 else "") + verdict_line(verdict) + "\n")


def main(argv: list[str]) -> int:
    args = options.parse("align", argv)
    finished = False
    try:
        session = open_session(args)
        result = align(session)
        if args.json:
            session.say(json_document(to_json(session, result)))
        else:
            print_human(session, result)
        finished = True
        return 0 if result.passed else 1
    except UsageError as e:
        sys.stderr.write(f"kernmap align: {e}\n")
        return 2
    except (ValueError, OSError) as e:
        sys.stderr.write(f"kernmap align: {e}\n")
        return 1
    finally:
        distributed.stop(finished)
