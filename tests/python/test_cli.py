"""The kernmap command: registry listing with reasons, KERNMAP_DISABLE, the CPU level override, and the
benchmark's JSON document (shape only: a benchmark is not a test)."""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def kernmap(*args, env=None):
    full_env = dict(os.environ, **(env or {}))
    out = subprocess.run([str(ROOT / "scripts" / "kernmap"), *args], capture_output=True, text=True, env=full_env,
                         timeout=300)
    return out


def decisions(doc):
    return {(d["layer"], d["device"], d["mode"]): d for d in doc["resolution"]}


def test_kernels_json_lists_builtins_and_defaults():
    out = kernmap("kernels", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    names = {k["name"] for k in doc["kernels"]}
    assert {"kernmap/rms_norm", "kernmap/silu", "kernmap/silu_and_mul", "reference/rms_norm"} <= names
    d = decisions(doc)
    for layer, kernel in [("RMSNorm", "kernmap/rms_norm"), ("SiLU", "kernmap/silu"), ("SiluAndMul", "kernmap/silu_and_mul")]:
        for mode in ("inference", "training", "training+compile"):
            assert d[(layer, "cpu", mode)]["kernel"] == kernel
            assert not d[(layer, "cpu", mode)]["fallback"]
    npu = d[("RMSNorm", "npu", "training")]
    assert npu["kernel"] == "reference/rms_norm" and npu["fallback"] and npu["reason"] == "no mapping for npu"


def test_kernmap_disable_forces_the_reference_with_a_reason():
    doc = json.loads(kernmap("kernels", "--json", env={"KERNMAP_DISABLE": "RMSNorm"}).stdout)
    d = decisions(doc)
    assert d[("RMSNorm", "cpu", "training")]["kernel"] == "reference/rms_norm"
    assert d[("RMSNorm", "cpu", "training")]["reason"] == "disabled by KERNMAP_DISABLE"
    assert d[("SiluAndMul", "cpu", "training")]["kernel"] == "kernmap/silu_and_mul"
    doc = json.loads(kernmap("kernels", "--json", env={"KERNMAP_DISABLE": "all"}).stdout)
    assert all(r["fallback"] for r in doc["resolution"])


def test_cpu_level_override():
    doc = json.loads(kernmap("kernels", "--json", env={"KERNMAP_CPU_ISA": "baseline"}).stdout)
    assert doc["cpu"]["level"] == "baseline"
    assert "baseline" in doc["cpu"]["supported"]
    bad = kernmap("kernels", "--json", env={"KERNMAP_CPU_ISA": "sse9"})
    assert "KERNMAP_CPU_ISA=sse9 is not a level" in bad.stderr


def test_bench_json_document():
    out = kernmap("bench", "ops", "--json", "--filter", "rms_norm/bfloat16", "--warmup", "0", "--reps", "1")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["machine"]["copy_gbps"] > 0
    rows = doc["results"]
    assert {(r["op"], r["pass"], r["impl"]) for r in rows} == {
        ("rms_norm", p, i) for p in ("fwd", "fwd+bwd") for i in ("kernmap", "reference")}
    for r in rows:
        assert r["dtype"] == "bfloat16" and r["shape"] == "[4096, 3584]"
        assert r["median_ms"] > 0 and r["gbps"] > 0


def test_bad_arguments_are_reported():
    out = kernmap("bench", "ops", "--reps", "zero")
    assert out.returncode == 1 and "--reps must be an integer, got 'zero'" in out.stderr
    out = kernmap("frobnicate")
    assert out.returncode == 2 and "unknown command 'frobnicate'" in out.stderr
