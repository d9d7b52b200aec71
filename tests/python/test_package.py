"""The installed package (what scripts/setup installs from build/release: cmake/PythonPackage.cmake) and the
benchmark's command line."""

import json
import os
import subprocess
import sys

import pytest


def run(args, env_drop=(), cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env["TRANSFORMERS_VERBOSITY"] = "error"
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def test_installed_package_imports_outside_the_repository(tmp_path):
    probe = ("import kernmap, json; print(json.dumps([kernmap.__file__, str(kernmap.library_path()), "
             "kernmap.resolve('RMSNorm', 'cpu', 'training').kernel]))")
    r = run(["-c", probe], env_drop=("PYTHONPATH", "KERNMAP_LIBRARY"), cwd=tmp_path)
    if r.returncode != 0 and "No module named 'kernmap'" in r.stderr:
        pytest.skip("kernmap is not installed in this environment (scripts/setup installs it)")
    assert r.returncode == 0, r.stderr
    module, library, kernel = json.loads(r.stdout.splitlines()[-1])
    assert "site-packages" in module and library.endswith("kernmap/libkernmap.so") and "site-packages" in library
    assert kernel == "kernmap/rms_norm"


@pytest.mark.slow
def test_import_costs_torchs_import_and_the_experts_implementation_registers_when_transformers_moe_does():
    """`import kernmap` imports neither transformers nor torch._dynamo (seconds each, paid by every process that
    imports kernmap); transformers' MoE integration, imported after it (as a MoE model's modeling file imports
    it), has the "kernmap" experts implementation at once, and the hook is gone."""
    probe = ("import json, sys, kernmap, kernmap.experts as e; "
             "before = sorted(m for m in ('transformers', 'torch._dynamo') if m in sys.modules); "
             "from transformers.models.qwen3_moe import modeling_qwen3_moe; "
             "from transformers.integrations import moe; "
             "print(json.dumps([before, 'kernmap' in moe.ALL_EXPERTS_FUNCTIONS, e._hf_moe is moe, "
             "e._HOOK in sys.meta_path]))")
    r = run(["-c", probe])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == [[], True, True, False]
    # transformers imported first: registered at kernmap's import
    r = run(["-c", "import json, transformers.integrations.moe as moe, kernmap; "
                   "print(json.dumps('kernmap' in moe.ALL_EXPERTS_FUNCTIONS))"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) is True


@pytest.mark.slow
def test_bench_json_has_the_shape_of_kernmap_bench_ops():
    r = run(["-m", "kernmap.bench", "--json", "--filter", "SiluAndMul/float32", "--warmup", "0", "--reps", "1",
             "--tokens-scale", "0.01"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["machine"].keys() == {"copy_gbps", "threads", "cpu_level"}
    rows = out["results"]
    assert [(x["pass"], x["impl"]) for x in rows] == [
        (p, i) for p in ("fwd", "fwd+bwd") for i in ("transformers", "torch.compile", "kernmap")]
    assert rows[0].keys() == {"op", "pass", "dtype", "shape", "impl", "median_ms", "min_ms", "max_ms", "gbps",
                              "pct_of_copy", "speedup_vs_reference", "peak_bytes"}
    assert all(x["op"] == "SiluAndMul" and x["dtype"] == "float32" and x["median_ms"] > 0 for x in rows)
    assert rows[0]["speedup_vs_reference"] == 1.0
    # Peak extra memory of a run: the forward holds at least its output (T x I fp32), the backward two gradients.
    T, I = int(2048 * 0.01), 18944
    assert all(x["peak_bytes"] >= 4 * T * I for x in rows)
    assert all(x["peak_bytes"] >= 2 * 4 * T * I for x in rows if x["pass"] == "fwd+bwd")


def test_bench_rejects_a_bad_filter():
    r = run(["-m", "kernmap.bench", "--filter", "("])
    assert r.returncode == 2 and "not a valid regular expression" in r.stderr
