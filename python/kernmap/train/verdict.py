"""The verdict of an alignment run: one definition for the C++ command (train/verdict.cpp) and Python, written
out in docs/training.md ("The verdict") and checked against the same cases (tests/data/verdict_cases.json) by
tests/cpp/test_verdict.cpp and tests/python/test_verdict.py.

Per step s and metric m (loss, grad_norm):

    diff(s)      = |kernelized(s) - original(s)| / |original(s)|
    noise(s)     = max over the noise runs of |noise_run(s) - original(s)| / |original(s)|   (non-finite: 0)
    floor(s)     = max(noise(1..s))
    tolerance(s) = max(rtol, NOISE_FACTOR * floor(s))

PASS when diff(s) <= tolerance(s) at every step for both metrics (a non-finite diff fails). The noise run is the
original with every selected layer on its float64 kernel (the reference's math from float64, rounded where the
reference rounds): a correct kernel whose results differ from the reference's by rounding, as a fused kernel's
do, so its drift from the original is how far AdamW carries correct arithmetic's rounding on this machine and this
model. A model that routes tokens to experts gets one more noise run per selected layer, that layer alone on its
float64 kernel (align.py): a router's near-tie flips under one rounding and not another, so a single run samples
that drift once. A non-finite noise value counts as 0, so a broken noise run can only tighten the verdict."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# How far above the noise floor a correct kernel's difference may lie (docs/training.md, "The verdict": the
# measurements behind it). The C++ kNoiseFactor is the same number.
NOISE_FACTOR = 10.0
TINY = 1e-30  # the denominator's floor, so an original value of 0 gives a finite difference


def rel_diff(value: float, original: float) -> float:
    d = abs(value - original) / max(abs(original), TINY)
    return d if math.isfinite(d) else math.inf


@dataclass
class MetricVerdict:
    diff: list[float]
    noise: list[float]
    floor: list[float]
    tolerance: list[float]
    max_diff: float  # the largest diff, at max_diff_step (1-based; the last of equals)
    max_diff_step: int
    worst_step: int  # the step closest to (or furthest beyond) its tolerance: largest diff / tolerance
    passed: bool

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Verdict:
    loss: MetricVerdict
    grad_norm: MetricVerdict
    rtol: float
    noise_factor: float
    passed: bool

    def to_dict(self) -> dict:
        return {"passed": self.passed, "rtol": self.rtol, "noise_factor": self.noise_factor,
                "loss": self.loss.to_dict(), "grad_norm": self.grad_norm.to_dict()}


def judge_metric(original: Sequence[float], kernelized: Sequence[float], noise_runs: Sequence[Sequence[float]],
                 rtol: float, noise_factor: float = NOISE_FACTOR) -> MetricVerdict:
    steps = len(original)
    # The noise length named is the first that differs from the original's (the first run's when none does).
    noise_steps = next((len(r) for r in noise_runs if len(r) != steps), len(noise_runs[0]) if noise_runs else steps)
    if len(kernelized) != steps or noise_steps != steps:
        raise ValueError(f"judge: the runs must have the same number of steps, got original {steps}, "
                         f"kernelized {len(kernelized)}, noise {noise_steps}")
    diff, noise, floor, tolerance = [], [], [], []
    running = 0.0
    for s, (o, k) in enumerate(zip(original, kernelized)):
        diff.append(rel_diff(k, o))
        # A broken noise run cannot widen the tolerance.
        noise.append(max([d for d in (rel_diff(r[s], o) for r in noise_runs) if math.isfinite(d)], default=0.0))
        running = max(running, noise[-1])
        floor.append(running)
        tolerance.append(max(rtol, noise_factor * running))
    max_diff, max_diff_step, worst_step, worst_ratio = 0.0, 0, 0, -1.0
    for s, (d, t) in enumerate(zip(diff, tolerance), start=1):
        if d >= max_diff:
            max_diff, max_diff_step = d, s
        ratio = d / t if t > 0 else (math.inf if d > 0 else 0.0)
        if ratio > worst_ratio:
            worst_ratio, worst_step = ratio, s
    passed = all(d <= t for d, t in zip(diff, tolerance))
    return MetricVerdict(diff, noise, floor, tolerance, max_diff, max_diff_step, worst_step, passed)


def judge(original: dict[str, Sequence[float]], kernelized: dict[str, Sequence[float]],
          noise_runs: Sequence[dict[str, Sequence[float]]], rtol: float,
          noise_factor: float = NOISE_FACTOR) -> Verdict:
    """Runs as {"loss": [...], "grad_norm": [...]}, one value per step; noise_runs a list of such runs."""
    loss = judge_metric(original["loss"], kernelized["loss"], [r["loss"] for r in noise_runs], rtol, noise_factor)
    grad_norm = judge_metric(original["grad_norm"], kernelized["grad_norm"], [r["grad_norm"] for r in noise_runs],
                             rtol, noise_factor)
    return Verdict(loss, grad_norm, rtol, noise_factor, loss.passed and grad_norm.passed)
