"""The align verdict (kernmap/train/verdict.py) on the cases tests/cpp/test_verdict.cpp checks the C++ one with:
one definition, two implementations, the same answers."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from kernmap.train import verdict

CASES = json.loads((Path(__file__).resolve().parents[1] / "data" / "verdict_cases.json").read_text())["cases"]


def value(v):
    return float(v) if isinstance(v, str) else v


def series(run):
    return {m: [value(v) for v in run[m]] for m in ("loss", "grad_norm")}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_shared_cases(case):
    v = verdict.judge(series(case["original"]), series(case["kernelized"]), [series(r) for r in case["noise"]],
                      case["rtol"], case["noise_factor"])
    assert v.passed == case["expect"]["passed"]
    for metric in ("loss", "grad_norm"):
        got, want = getattr(v, metric), case["expect"][metric]
        assert got.passed == want["passed"], metric
        assert got.diff == pytest.approx([value(d) for d in want["diff"]], rel=1e-6, abs=1e-12), metric
        assert got.tolerance == pytest.approx(want["tolerance"], rel=1e-6), metric
        assert (got.max_diff_step, got.worst_step) == (want["max_diff_step"], want["worst_step"]), metric
        assert got.floor == sorted(got.floor)  # the floor never falls


def test_runs_of_different_lengths_are_an_error():
    with pytest.raises(ValueError, match="same number of steps, got original 2, kernelized 1, noise 2"):
        verdict.judge_metric([1.0, 1.0], [1.0], [[1.0, 1.0]], 1e-5)
    with pytest.raises(ValueError, match="same number of steps, got original 2, kernelized 2, noise 3"):
        verdict.judge_metric([1.0, 1.0], [1.0, 1.0], [[1.0, 1.0], [1.0, 1.0, 1.0]], 1e-5)


def test_the_cpp_command_judges_with_the_same_noise_factor():
    build = Path(os.environ.get("KERNMAP_BUILD", Path(__file__).resolve().parents[2] / "build" / "release"))
    out = subprocess.run([str(build / "kernmap"), "align", "--preset", "qwen2-tiny", "--steps", "2", "--seq-len",
                          "16", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["noise_factor"] == verdict.NOISE_FACTOR
