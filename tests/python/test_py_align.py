"""`python -m kernmap align`: the C++ command's run for any transformers causal LM. It passes on tiny checkpoints
of all seven families, with peft LoRA and gradient checkpointing; its original run is the C++ command's run
(same data, batches, optimiser) to 1e-5; a kernel wrong by 1e-3 in one layer fails at every CPU level and thread
count while the built-in kernels pass (each level in this process, through kernmap.set_cpu_level); its presets
are the C++ command's; bad command lines exit 2."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernmap
from kernmap.train import align, presets

from hf_models import FAMILIES, expected_layers, make_model

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("KERNMAP_BUILD", ROOT / "build" / "release"))
FAST = ["--steps", "6", "--seq-len", "24", "--batch-size", "2"]


def run_align(*args):
    """align.main in this process: (exit code, stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = align.main([str(a) for a in args])
    return code, out.getvalue()


def align_json(*args):
    code, text = run_align(*args, "--json")
    doc = json.loads(text)
    assert code == (0 if doc["passed"] else 1)
    return doc


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    for family in FAMILIES:
        make_model(family).save_pretrained(root / family)
    return root


@pytest.mark.parametrize("family", list(FAMILIES))
def test_align_passes_on_a_tiny_checkpoint_of_every_family(family, checkpoints):
    doc = align_json("--model", checkpoints / family, *FAST)
    assert doc["passed"], doc["verdict"]
    bound = {}
    for row in doc["kernels"]["layers"]:
        assert not row["fallback"], row
        bound[row["layer"]] = bound.get(row["layer"], 0) + 1
    assert bound == expected_layers(family)
    assert len(doc["original"]) == len(doc["noise"]) == len(doc["kernelized"]) == 6
    moe = family in ("qwen2_moe", "qwen3_moe", "mixtral")
    assert doc["experts_implementation"] == ("grouped_mm" if moe else None)  # transformers' default
    # A model that routes tokens replays the original's routing in the noise and kernelized runs (no per-layer
    # noise runs), counting per step the tokens its own routers would have sent elsewhere.
    assert doc["noise_alone"] == {}
    if moe:
        routing = doc["routing"]
        assert routing["mode"] == "replay" and len(routing["kernelized"]) == 6
        # 2 decoder layers' routers, each called once a step on the batch's 2 x 24 tokens
        assert all(s["calls"] == 2 and s["tokens"] == 96 for s in routing["kernelized"])
        assert routing["noise"]["calls"] == 12
    else:
        assert doc["routing"] is None


def test_free_routing_samples_each_layer_alone(checkpoints):
    doc = align_json("--model", checkpoints / "qwen3_moe", *FAST, "--routing", "free")
    assert doc["passed"], doc["verdict"]
    assert doc["routing"] == {"mode": "free"}
    # Routing freely, a model with experts gets a noise run per layer, that layer alone on its float64 kernel.
    bound = {row["layer"] for row in doc["kernels"]["layers"] if not row["fallback"]}
    assert set(doc["noise_alone"]) == bound
    assert all(len(steps) == 6 for steps in doc["noise_alone"].values())


# RMSNorm's reference output times 1 + 1e-3: a kernel wrong on purpose.
PERTURBED = kernmap.Kernel(
    name="test/rms_norm_perturbed", layer="RMSNorm", has_backward=True, devices=("cpu",),
    fn=lambda x, weight, eps: torch.ops.kernmap.reference_rms_norm(x, weight, eps) * (1 + 1e-3))


def rel(value, original):
    return abs(value - original) / abs(original)


@pytest.mark.slow
def test_the_qwen2_moe_preset_passes_on_the_largest_drift_of_its_noise_runs():
    # With the one noise run of every layer on float64 this FAILed: grad_norm 6.0e-5 (step 18) against a floor
    # of 3.1e-6 — a router near-tie the kernelized run tipped and that run did not; ForCausalLMLoss's and
    # RMSNorm's float64 kernels alone tip it too (6.0e-5), so with their runs in the floor it PASSes.
    # Routing freely (replayed, the runs cannot part on a tie: test_routing.py, the C++ test_align).
    doc = align_json("--preset", "qwen2-moe-tiny", "--steps", "20", "--routing", "free")
    assert doc["passed"], doc["verdict"]
    runs = [doc["noise"], *doc["noise_alone"].values()]
    assert len(runs) == 7  # all six layers together, and each alone
    for metric in ("loss", "grad_norm"):
        noise = doc["verdict"][metric]["noise"]
        for s, original in enumerate(doc["original"]):
            want = max(rel(run[s][metric], original[metric]) for run in runs)
            assert noise[s] == pytest.approx(want, rel=1e-9, abs=1e-15), (metric, s)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_align_with_lora_passes_and_fuses_the_lora_mlp(family, checkpoints):
    doc = align_json("--model", checkpoints / family, *FAST, "--lora-r", "4")
    assert doc["passed"], doc["verdict"]
    assert doc["lora"] == {"r": 4, "alpha": 8.0, "target": "all-linear"}
    layers = {row["layer"] for row in doc["kernels"]["layers"] if not row["fallback"]}
    assert layers >= ({"RMSNorm", "SiluAndMul"} if family == "qwen2" else {"RMSNorm", "Experts"})
    # every bound module is inside peft's wrapper (the causal LM itself, for ForCausalLMLoss)
    assert all(row["path"].startswith("base_model.model") for row in doc["kernels"]["layers"])


def test_align_with_gradient_checkpointing_passes(checkpoints):
    doc = align_json("--model", checkpoints / "qwen3_moe", *FAST, "--gradient-checkpointing")
    assert doc["passed"] and doc["gradient_checkpointing"]
    # the recomputation in the backward replays too: each router twice a step
    assert all(s["calls"] == 4 for s in doc["routing"]["kernelized"])


@pytest.mark.slow
def test_compile_adds_the_compiled_original_and_kernelized_runs(checkpoints):
    # aot_eager: the fake-tensor trace and autograd graphs of torch.compile without inductor's code generation
    # (minutes on 2 cores; test_kernelize_models.py runs inductor)
    doc = align_json("--model", checkpoints / "qwen2", "--steps", "2", "--seq-len", "16", "--batch-size", "2",
                     "--compile", "--compile-backend", "aot_eager")
    assert set(doc["compile"]) == {"original+compile", "kernelized+compile"}
    for name, run in doc["compile"].items():
        assert len(run["steps"]) == 2 and run["verdict"]["passed"], name
    assert doc["passed"]


def write_jsonl(path, vocab, n=7, seed=3):
    g = torch.Generator().manual_seed(seed)
    lines = []
    for i in range(n):  # lengths vary, so batches are padded
        p, r = 3 + i % 4, 2 + (i * 5) % 7
        lines.append(json.dumps({"prompt_ids": torch.randint(vocab, (p,), generator=g).tolist(),
                                 "response_ids": torch.randint(vocab, (r,), generator=g).tolist()}))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("data", ["jsonl", "synthetic"])
def test_the_original_run_is_the_cpp_commands_run(data, checkpoints, tmp_path):
    """Same data (the synthetic set through the same mt19937_64 draws), batches, loss, AdamW and clipping: the
    Python original and `kernmap train --kernels none` on one checkpoint agree step by step."""
    args = ["--model", checkpoints / "qwen2", "--steps", "8", "--batch-size", "2", "--kernels", "none"]
    if data == "jsonl":
        write_jsonl(tmp_path / "data.jsonl", 64)
        args += ["--data", tmp_path / "data.jsonl"]
    else:
        args += ["--seq-len", "12", "--examples", "5"]
    ours = align_json(*args)["original"]
    cpp = subprocess.run([str(BUILD / "kernmap"), "train", *map(str, args), "--json"], capture_output=True,
                         text=True, timeout=300)
    assert cpp.returncode == 0, cpp.stderr
    theirs = json.loads(cpp.stdout)["steps"]
    assert [s["tokens"] for s in ours] == [s["tokens"] for s in theirs]
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), a["step"]


def test_human_output_and_exit_codes(checkpoints):
    code, text = run_align("--model", checkpoints / "qwen2", *FAST)
    assert code == 0
    lines = text.splitlines()
    assert lines[0].startswith("align ") and "kernels: kernmap/" in lines[0]
    assert "noise floor: the original with the selected layers on their float64 kernels" in lines[1]
    header = next(line for line in lines if line.startswith("step"))
    assert header.split() == ["step", "loss", "original", "loss", "kernelized", "rel", "diff", "noise",
                              "tolerance", "grad_norm", "original", "grad_norm", "kernelized", "rel", "diff",
                              "noise", "tolerance"]
    assert lines[-1].startswith("verdict: PASS — largest relative difference: loss ")
    with kernmap.use_mapping({"RMSNorm": {"cpu": PERTURBED}}):
        code, text = run_align("--model", checkpoints / "qwen2", *FAST)
    assert code == 1 and text.splitlines()[-1].startswith("verdict: FAIL")


@pytest.fixture
def cpu_level():
    """kernmap.set_cpu_level for one test: the level in use before it is restored after."""
    before = kernmap.cpu_level()
    yield kernmap.set_cpu_level
    kernmap.set_cpu_level(before)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("level", kernmap.supported_cpu_levels())
def test_a_kernel_wrong_by_1e3_fails_and_the_builtin_kernels_pass_everywhere(level, threads, cpu_level):
    """In this process at each level (kernmap.set_cpu_level; the _threads fixture restores the thread count): the
    built-in kernels pass 10 steps, RMSNorm wrong by 1e-3 fails 3 (it fails at the first)."""
    cpu_level(level)
    argv = ["--preset", "qwen3-moe-tiny", "--steps", "10", "--seq-len", "32", "--threads", str(threads)]
    correct = align_json(*argv)
    assert correct["passed"], correct["verdict"]
    with kernmap.use_mapping({"RMSNorm": {"cpu": PERTURBED}}):
        perturbed = align_json(*argv, "--steps", "3")
    assert kernmap.cpu_level() == level and torch.get_num_threads() == threads
    assert not perturbed["passed"]
    assert any(r["kernel"] == "test/rms_norm_perturbed" for r in perturbed["kernels"]["layers"])
    norm = perturbed["verdict"]["grad_norm"]
    assert norm["diff"][0] > norm["tolerance"][0]  # wrong from the first step


def test_the_cpp_presets_are_the_same_models(tmp_path):
    for name in ("qwen2-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny"):
        subprocess.run([str(BUILD / "tests" / "cpp" / "kernmap_model_probe"), "preset", name, str(tmp_path / name)],
                       check=True, capture_output=True, timeout=300)
        cpp = json.loads((tmp_path / name / "config.json").read_text())
        config = presets.preset_config(name)
        ours = config.to_dict()
        for key, value in cpp.items():
            if key in ("architectures", "transformers_version", "dtype", "torch_dtype", "rope_theta",
                       "rope_scaling", "use_sliding_window", "sliding_window", "max_window_layers"):
                continue
            mine = getattr(config, key, None)  # through the config's attribute map (num_experts, ...)
            if key == "head_dim" and mine is None:  # Qwen2's config derives it
                mine = ours["hidden_size"] // ours["num_attention_heads"]
            assert mine == value, (name, key, mine, value)
        assert ours["rope_parameters"]["rope_theta"] == cpp.get("rope_theta", 1e6)


@pytest.mark.parametrize("args, message", [
    (["--preset", "qwen2-tiny", "--kernels", "RMSNorm,Dropout"], "--kernels: unknown layer 'Dropout'"),
    (["--preset", "gpt9"], "--preset: unknown preset 'gpt9'"),
    (["--preset", "qwen2-tiny", "--parallel", "ddp"], "--parallel ddp runs under torchrun"),
])
def test_command_lines_that_cannot_run_exit_2(args, message, capsys):
    code, _ = run_align(*args)
    assert code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--preset", "qwen2-tiny", "--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),
    (["--preset", "qwen2-tiny", "--steps", "0"], "argument --steps: must be a whole number from 1 to 1000000"),
    (["--preset", "qwen2-tiny", "--model", "x"], "not allowed with argument --preset"),
    (["--preset", "qwen2-tiny", "--optim", "sgd"], "argument --optim: invalid choice: 'sgd'"),
])
def test_bad_values_exit_2_naming_the_option(args, message):
    out = subprocess.run([sys.executable, "-m", "kernmap", "align", *args], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_malformed_jsonl_lines_are_reported_as_the_cpp_command_reports_them(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join([
        '{"prompt_ids": [1, 2], "response_ids": [3, 4]}', 'not json', '{"prompt_ids": [1, 2]}',
        '{"prompt_ids": [1, 2], "response_ids": [3, 9999]}', '', '{"prompt_ids": [1], "response_ids": []}',
        '{"prompt_ids": [1, "x"], "response_ids": [2]}', '[1, 2]', '{"prompt_ids": [5, 6, 7], "response_ids": [8]}',
    ]) + "\n")
    code, _ = run_align("--preset", "qwen2-tiny", "--data", data, "--steps", "1")
    ours = capsys.readouterr().err
    cpp = subprocess.run([str(BUILD / "kernmap"), "align", "--preset", "qwen2-tiny", "--data", str(data), "--steps",
                          "1"], capture_output=True, text=True, timeout=300)
    assert code == cpp.returncode == 1
    def problems(err):
        # Each JSON parser names a syntax error in its own words, after "not valid JSON: ".
        return [line.strip().split(": not valid JSON: ")[0] for line in err.splitlines()
                if line.strip().startswith("line ")]

    assert problems(ours) == problems(cpp.stderr)
    assert [p.split(":")[0] for p in problems(ours)] == [f"line {n}" for n in (2, 3, 4, 6, 7, 8)]
    assert "line 2: not valid JSON: Expecting value" in ours
