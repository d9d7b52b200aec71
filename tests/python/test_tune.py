"""kernmap.tune(model, batch): every eligible kernel of each layer verified and timed on the model's live inputs;
a deliberately slow but correct kernel loses, a wrong one fails verification; the mapping file it writes is the
existing format, loads in a new process and reproduces the choice there; a model kernelized with the tuned
mapping trains as the original does (`python -m kernmap align` PASS). No timing thresholds: only which kernel
loses, never by how much."""

import contextlib
import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import kernmap
from kernmap.train import align
from hf_models import batch, make_model

FAST = dict(compile=False, warmup=1, reps=3)
BUILTIN = ("kernmap/", "reference/", "float64/", "transformers/")


@pytest.fixture(autouse=True)
def _clean_user_mappings():
    yield
    kernmap.clear_user_mappings()


def sample(seed=1):
    ids = batch(seed)
    return {"input_ids": ids, "labels": ids}


def _slow_rms_norm(x, weight, eps):
    time.sleep(0.05)  # correct, and slower than any kernel of a [2, 9, 32] RMSNorm
    return torch.ops.kernmap.reference_rms_norm(x, weight, eps)


def _wrong_silu_and_mul(gate, up):
    return torch.ops.kernmap.reference_silu_and_mul(gate, up) * (1 + 1e-3)


SLOW = kernmap.register_kernel(kernmap.Kernel(name="test_tune/rms_norm_slow", layer="RMSNorm", fn=_slow_rms_norm,
                                              has_backward=True))
WRONG = kernmap.register_kernel(kernmap.Kernel(name="test_tune/silu_and_mul_wrong", layer="SiluAndMul",
                                               fn=_wrong_silu_and_mul, has_backward=True))
NO_BACKWARD = kernmap.register_kernel(kernmap.Kernel(name="test_tune/rms_norm_no_backward", layer="RMSNorm",
                                                     fn=torch.ops.kernmap.reference_rms_norm))


def candidates(result, layer):
    return {c.kernel: c for r in result.layers if r.layer == layer for c in r.candidates}


@pytest.fixture(scope="module")
def qwen2_tuned():
    return kernmap.tune(make_model("qwen2"), sample(), **FAST)


def test_every_registered_kernel_of_each_layer_is_a_candidate(qwen2_tuned):
    layers = {r.layer for r in qwen2_tuned.layers}
    assert layers == {"RMSNorm", "SiluAndMul", "rotary_pos_emb", "ForCausalLMLoss"}  # SiLU: never called
    registered = {k["name"] for k in kernmap.kernels() if k["layer"] == "RMSNorm"}
    assert set(candidates(qwen2_tuned, "RMSNorm")) == registered
    rows = {r.layer: r for r in qwen2_tuned.layers}
    assert rows["RMSNorm"].calls == 5 and rows["RMSNorm"].shapes == ["2x9x32 float32 (5)"]


def test_a_slow_correct_kernel_loses_and_is_verified(qwen2_tuned):
    slow = candidates(qwen2_tuned, "RMSNorm")[SLOW.name]
    assert qwen2_tuned.winners["RMSNorm"] != SLOW.name
    assert slow.error <= slow.tolerance and slow.median_ms is not None
    assert slow.verdict.startswith("slower: ") and qwen2_tuned.winners["RMSNorm"] in slow.verdict


def test_a_wrong_kernel_fails_verification_and_is_not_timed(qwen2_tuned):
    wrong = candidates(qwen2_tuned, "SiluAndMul")[WRONG.name]
    assert qwen2_tuned.winners["SiluAndMul"] != WRONG.name
    assert wrong.verdict.startswith("failed verify: ") and " max error " in wrong.verdict
    assert wrong.median_ms is None
    assert wrong.error > wrong.tolerance


def test_a_kernel_that_cannot_run_here_says_why(qwen2_tuned):
    refused = candidates(qwen2_tuned, "RMSNorm")[NO_BACKWARD.name]
    assert refused.verdict == f"not eligible: {NO_BACKWARD.name} has no backward"
    assert refused.median_ms is None and refused.error is None


def test_the_winner_is_the_fastest_verified_candidate(qwen2_tuned):
    for r in qwen2_tuned.layers:
        timed = [c for c in r.candidates if c.median_ms is not None]
        assert r.winner == min(timed, key=lambda c: c.median_ms).kernel
        assert [c.kernel for c in r.candidates if c.verdict == "winner"] == [r.winner]


@pytest.mark.slow
def test_the_compiled_reference_is_a_candidate():
    result = kernmap.tune(make_model("qwen3_moe"), sample(), warmup=1, reps=2)
    rms = candidates(result, "RMSNorm")["reference/rms_norm (torch.compile)"]
    assert rms.median_ms is not None and rms.error <= rms.tolerance
    experts = candidates(result, "Experts")["reference/experts (torch.compile)"]
    assert experts.verdict == "not eligible: the reference is not compile-safe"
    assert not any(k.endswith("(torch.compile)") for k in result.winners.values())


def _python(script, *args):
    """Runs `script` in a new Python process (this directory on its path) and returns its last line's JSON."""
    out = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]);" + script,
                          os.path.dirname(__file__), *map(str, args)], check=True, capture_output=True, text=True,
                         env=os.environ).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_the_mapping_file_reproduces_the_choice_in_a_new_process(suffix, tmp_path):
    """Tuned in a process that has only the built-in kernels (this one holds every test file's registrations,
    which tune would rightly time too), loaded in another."""
    path = tmp_path / f"tuned{suffix}"
    result = _python(
        "import json; import torch, kernmap; from hf_models import batch, make_model; ids = batch(1);"
        "r = kernmap.tune(make_model('qwen3_moe'), {'input_ids': ids, 'labels': ids}, sys.argv[2], compile=False,"
        " warmup=1, reps=3);"
        "print(json.dumps({'winners': r.winners, 'mapping': r.mapping, 'path': str(r.path),"
        " 'table_path': str(r.table_path), 'candidates': [c.kernel for l in r.layers for c in l.candidates]}))",
        path)
    assert all(k.startswith(BUILTIN) for k in result["winners"].values())
    assert result["path"] == str(path) and result["table_path"] == str(tmp_path / "tuned.tune.json")
    table = json.loads((tmp_path / "tuned.tune.json").read_text())
    assert table["mapping"] == result["mapping"] and table["machine"]["torch"] == torch.__version__
    assert {r["layer"] for r in table["layers"]} == set(result["winners"])
    if suffix == ".toml":
        text = path.read_text()
        assert text.startswith("# kernmap tune") and f"torch {torch.__version__}" in text
        assert all(f"#   {kernel}: " in text for kernel in result["candidates"])
    doc = _python(
        "import json; import kernmap; from hf_models import make_model; kernmap.register_mapping(sys.argv[2]);"
        "report = kernmap.kernelize(make_model('qwen3_moe'), mode='training');"
        "print(json.dumps({'file': kernmap.load_mapping_file(sys.argv[2]),"
        " 'bound': sorted({(r.layer, r.kernel) for r in report.rows if r.layer != 'SiLU'})}))", path)
    assert doc["file"] == result["mapping"]
    assert doc["bound"] == sorted([layer, kernel] for layer, kernel in result["winners"].items())


def test_a_path_of_another_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"path must end in \.toml or \.json.*tuned\.yaml"):
        kernmap.tune(make_model("qwen2"), sample(), tmp_path / "tuned.yaml", **FAST)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_a_tuned_model_aligns_with_the_original(family, tmp_path):
    make_model(family).save_pretrained(tmp_path / family)
    result = kernmap.tune(make_model(family), sample(), tmp_path / "tuned.toml", **FAST)
    args = ["--model", tmp_path / family, "--steps", "6", "--seq-len", "24", "--batch-size", "2", "--json",
            "--mapping", tmp_path / "tuned.toml"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = align.main([str(a) for a in args])
    doc = json.loads(out.getvalue())
    assert code == 0 and doc["passed"], doc["verdict"]
    bound = {(row["layer"], row["kernel"]) for row in doc["kernels"]["layers"] if row["layer"] != "SiLU"}
    assert bound == set(result.winners.items())
