"""`kernmap plan|train|align|ablate --verify` and `kernmap tune` (the C++ side of docs/mapping.md, "Verified and
tuned mappings"): every default kernel verifies on the presets; the kmverify test plugin's RMSNorm off in its
forward, and the one off only in its backward, fall back with the measured error in the report; tune's slow but
correct kernel loses, the wrong ones fail; the mapping file tune writes reproduces the choice in a new process
(`kernmap plan --mapping`), loads in Python as the same mapping, and a file Python's tune writes loads in the
command; bad command lines are refused with exit code 2 and the option named. No timing thresholds: only which
kernel loses."""

import json

import pytest

import kernmap
from test_plugins import PLUGINS, add_package

TINY = ("--preset", "qwen2-tiny", "--batch-size", "2", "--seq-len", "16")
FAST = ("--warmup", "0", "--reps", "2")

pytestmark = pytest.mark.skipif(not (PLUGINS / "libkmverify.so").is_file(),
                                reason=f"test plugins not built in {PLUGINS} (run scripts/setup)")


@pytest.fixture
def kmverify(tmp_path):
    """KERNMAP_PATH of a repository holding the kmverify plugin."""
    add_package(tmp_path / "repo", "kmverify", "kmverify", "kmverify")
    return {"KERNMAP_PATH": str(tmp_path / "repo")}


def mapping_file(tmp_path, kernel):
    path = tmp_path / "wrong.toml"
    path.write_text(f'[RMSNorm.cpu]\ntraining = "{kernel}"\n')
    return path


def test_plan_verify_binds_every_default_kernel_with_its_error(run_cli):
    for preset in ("qwen2-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny"):
        out = run_cli("plan", "--preset", preset, "--verify", "--batch-size", "2", "--seq-len", "16", "--json")
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)["layers"]
        assert rows
        for row in rows:
            assert not row["fallback"], row
            assert row["error"] <= row["tolerance"], row
    out = run_cli("plan", "--preset", "qwen2-tiny", "--json")  # not verified: the fields are null
    assert all(row["error"] is None and row["tolerance"] is None for row in json.loads(out.stdout)["layers"])


@pytest.mark.parametrize("kernel, what", [("kmverify/rms_norm_forward_off", "output"),
                                          ("kmverify/rms_norm_backward_off", "grad_x")])
def test_plan_verify_refuses_a_wrong_kernel_with_the_measured_error(run_cli, kmverify, tmp_path, kernel, what):
    wrong = mapping_file(tmp_path, kernel)
    plain = json.loads(run_cli("plan", "--preset", "qwen2-tiny", "--mapping", wrong, "--json", env=kmverify).stdout)
    assert {r["kernel"] for r in plain["layers"] if r["layer"] == "RMSNorm"} == {kernel}
    out = run_cli("plan", *TINY, "--verify", "--mapping", wrong, "--json", env=kmverify)
    assert out.returncode == 0, out.stderr
    rms = [r for r in json.loads(out.stdout)["layers"] if r["layer"] == "RMSNorm"]
    assert rms
    for r in rms:
        assert r["fallback"] and r["kernel"] == "reference/rms_norm", r
        assert r["reason"].startswith(f"verify: {what} max error ") and " > tolerance " in r["reason"], r
        assert r["error"] > r["tolerance"], r
    text = run_cli("plan", *TINY, "--verify", "--mapping", wrong, env=kmverify).stdout
    assert "error / tolerance" in text and f"verify: {what} max error" in text


def test_train_align_and_ablate_verify_report_the_errors(run_cli, kmverify, tmp_path):
    wrong = mapping_file(tmp_path, "kmverify/rms_norm_forward_off")
    out = run_cli("train", *TINY, "--steps", "1", "--verify", "--mapping", wrong, "--json", env=kmverify)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["kernels"]["layers"]
    assert all(r["reason"].startswith("verify: output") for r in rows if r["layer"] == "RMSNorm")
    assert all(r["error"] <= r["tolerance"] for r in rows if r["layer"] != "RMSNorm")
    text = run_cli("train", *TINY, "--steps", "1", "--verify", env=kmverify).stdout
    assert "kernels verified on the first batch:" in text and "error / tolerance" in text

    out = run_cli("align", *TINY, "--steps", "2", "--verify", "--mapping", wrong, "--json", env=kmverify)
    doc = json.loads(out.stdout)
    assert out.returncode == 0 and doc["passed"], out.stderr  # the wrong kernel fell back: nothing to fail
    assert {r["kernel"] for r in doc["kernels"]["layers"] if r["layer"] == "RMSNorm"} == {"reference/rms_norm"}

    out = run_cli("ablate", *TINY, "--warmup", "0", "--steps", "1", "--verify", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)["rows"]}
    assert all(e["error"] <= e["tolerance"] for e in rows["all"]["kernels"]["layers"])
    assert all(e["error"] is None for e in rows["original"]["kernels"]["layers"])


def test_plan_verify_bad_command_lines(run_cli):
    out = run_cli("plan", "--preset", "qwen2-tiny", "--verify", "--device", "npu")
    assert out.returncode == 2 and "--device must be cpu, got 'npu'" in out.stderr, out.stderr
    out = run_cli("plan", "--preset", "qwen2-tiny", "--data", "x.jsonl")
    assert out.returncode == 2 and "give --verify too" in out.stderr, out.stderr


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """`kernmap tune` of qwen2-tiny with kmverify loaded, to a TOML file; (doc, path, env)."""
    import os
    import subprocess

    from conftest import ROOT

    tmp = tmp_path_factory.mktemp("tune")
    add_package(tmp / "repo", "kmverify", "kmverify", "kmverify")
    env = dict(os.environ, KERNMAP_PATH=str(tmp / "repo"))
    out = subprocess.run([str(ROOT / "scripts" / "kernmap"), "tune", *TINY, *FAST, "--out", str(tmp / "tuned.toml"),
                          "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), tmp / "tuned.toml", {"KERNMAP_PATH": env["KERNMAP_PATH"]}


def candidates(doc, layer):
    return {c["kernel"]: c for r in doc["layers"] if r["layer"] == layer for c in r["candidates"]}


def test_tune_the_slow_kernel_loses_and_the_wrong_ones_fail(tuned):
    doc, _, _ = tuned
    rms = candidates(doc, "RMSNorm")
    winner = doc["mapping"]["RMSNorm"]["cpu"]["training"]
    assert winner not in ("kmverify/rms_norm_slow", "kmverify/rms_norm_forward_off", "kmverify/rms_norm_backward_off")
    slow = rms["kmverify/rms_norm_slow"]
    assert slow["verdict"].startswith("slower: ") and winner in slow["verdict"]
    assert slow["error"] <= slow["tolerance"] and slow["median_ms"] is not None
    for kernel, what in (("kmverify/rms_norm_forward_off", "output"), ("kmverify/rms_norm_backward_off", "grad_x")):
        assert rms[kernel]["verdict"].startswith(f"failed verify: {what} max error "), rms[kernel]
        assert rms[kernel]["median_ms"] is None
    for r in doc["layers"]:
        timed = [c for c in r["candidates"] if c["median_ms"] is not None]
        assert r["winner"] == min(timed, key=lambda c: c["median_ms"])["kernel"]


def test_tune_file_reproduces_the_choice_in_a_new_process_and_loads_in_python(tuned, run_cli):
    doc, path, env = tuned
    text = path.read_text()
    assert text.startswith("# kernmap tune: ") and "# versions: torch " in text and "ATen CPU level" in text
    assert "#   kmverify/rms_norm_slow: " in text
    assert json.loads((path.parent / "tuned.tune.json").read_text())["mapping"] == doc["mapping"]
    out = run_cli("plan", "--preset", "qwen2-tiny", "--mapping", path, "--json", env=env)
    assert out.returncode == 0, out.stderr
    bound = {(r["layer"], r["kernel"]) for r in json.loads(out.stdout)["layers"]}
    assert bound == {(layer, m["cpu"]["training"]) for layer, m in doc["mapping"].items()}
    assert kernmap.load_mapping_file(path) == doc["mapping"]  # the winners are built in: no plugin needed here


@pytest.mark.slow
def test_a_file_python_tune_writes_loads_in_the_command(tmp_path, run_cli):
    """Python's tune in a process of its own: this one holds other test files' Python kernels, which the command
    does not know."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("import sys, json; sys.path.insert(0, sys.argv[1]); import kernmap; from hf_models import batch, "
              "make_model; ids = batch(1); r = kernmap.tune(make_model('qwen2'), {'input_ids': ids, 'labels': ids}, "
              "sys.argv[2], compile=False, warmup=0, reps=2); print(json.dumps(r.winners))")
    out = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path / "py.toml")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    winners = json.loads(out.stdout.splitlines()[-1])
    out = run_cli("plan", "--preset", "qwen2-tiny", "--mapping", tmp_path / "py.toml", "--json")
    assert out.returncode == 0, out.stderr
    bound = {r["layer"]: r["kernel"] for r in json.loads(out.stdout)["layers"]}
    assert set(winners) & set(bound) >= {"RMSNorm", "SiluAndMul", "rotary_pos_emb", "ForCausalLMLoss"}
    for layer, kernel in winners.items():
        if layer in bound:
            assert bound[layer] == kernel, layer


@pytest.mark.parametrize("args, message", [
    ((), "give exactly one of --preset NAME"),
    (("--preset", "qwen2-tiny", "--model", "x"), "give exactly one of --preset NAME"),
    (("--preset", "qwen2-tiny", "--out", "tuned.yaml"), "--out must be a mapping file ending in .toml or .json, "
                                                        "got 'tuned.yaml'"),
    (("--preset", "qwen2-tiny", "--out", "/nonexistent-kernmap/tuned.toml"),
     "the folder /nonexistent-kernmap does not exist"),
    (("--preset", "qwen2-tiny", "--reps", "0"), "--reps must be an integer in [1, 1000000], got '0'"),
])
def test_tune_bad_command_lines(run_cli, args, message):
    out = run_cli("tune", *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "Exception raised from" not in out.stderr


def test_tune_out_under_a_file_is_refused_before_anything_runs(run_cli, tmp_path):
    (tmp_path / "file").write_text("")
    out = run_cli("tune", "--preset", "qwen2-tiny", "--out", tmp_path / "file" / "tuned.toml")
    assert out.returncode == 2 and f"the folder {tmp_path / 'file'} is not a folder" in out.stderr, out.stderr
