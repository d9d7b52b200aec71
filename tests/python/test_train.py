"""`kernmap train | align | ablate`: a 20-step SFT run of the C++ model equals the same run in PyTorch/transformers
(torch.optim.AdamW + clip_grad_norm_) step by step; kernelized runs align with the original on every preset, judged
against the noise run's floor; ablate's original runs transformers' default experts;
resume continues the exact loss sequence; a save killed mid-way leaves the previous checkpoint loadable;
malformed JSONL lines are reported with their numbers.

Batching (as in train/data.cpp, docs/training.md): step s takes examples (s*B + b) mod N, b < B, each
prompt + response, right-padded with token 0 to the longest; labels are the tokens on response positions and
-100 on prompt and padding."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

ROOT = Path(__file__).resolve().parents[2]

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-6, max_position_embeddings=64)
FAMILIES = {
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=False,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(**COMMON, num_hidden_layers=2, num_experts=6,
                                                      num_experts_per_tok=2, moe_intermediate_size=16,
                                                      shared_expert_intermediate_size=24, mlp_only_layers=[1])),
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**COMMON, num_hidden_layers=2, head_dim=12, num_experts=6,
                                                      num_experts_per_tok=2, moe_intermediate_size=16,
                                                      norm_topk_prob=True)),
}
STEPS, BATCH, LR, WD, MAX_NORM = 20, 2, 1e-3, 0.01, 1.0


@pytest.fixture
def kernmap(run_cli):
    """run_cli (conftest.py) that also checks the command succeeded, unless check=False."""

    def run(*args, check=True):
        out = run_cli(*args)
        if check:
            assert out.returncode == 0, out.stderr
        return out

    return run


def write_examples(path, vocab, n=7, seed=3):
    g = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):  # lengths vary, so batches are padded
        p, r = 3 + i % 4, 2 + (i * 5) % 7
        examples.append({"prompt_ids": torch.randint(vocab, (p,), generator=g).tolist(),
                         "response_ids": torch.randint(vocab, (r,), generator=g).tolist()})
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return examples


def batch(examples, step):
    rows = [examples[(step * BATCH + b) % len(examples)] for b in range(BATCH)]
    length = max(len(e["prompt_ids"]) + len(e["response_ids"]) for e in rows)
    ids = torch.zeros(BATCH, length, dtype=torch.long)
    labels = torch.full((BATCH, length), -100, dtype=torch.long)
    for b, e in enumerate(rows):
        p, r = e["prompt_ids"], e["response_ids"]
        ids[b, :len(p) + len(r)] = torch.tensor(p + r)
        labels[b, len(p):len(p) + len(r)] = torch.tensor(r)
    return ids, labels


def torch_sft(model, examples):
    """The reference loop: forward, loss, backward, clip, step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
    logs = []
    for step in range(STEPS):
        ids, labels = batch(examples, step)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        logs.append((loss.item(), grad_norm.item()))
    return logs


def make_checkpoint(family, path, seed=0):
    cls, config = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights far from the tiny init, so gradients are large enough to be clipped
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else (0.5 if ".gate." in name else 0.1) * noise)
    model.save_pretrained(path)
    return model.train()


@pytest.mark.parametrize("kernels", ["none", "all"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sft_run_equals_transformers(family, kernels, tmp_path, kernmap):
    model = make_checkpoint(family, tmp_path / "ckpt")
    examples = write_examples(tmp_path / "data.jsonl", model.config.vocab_size)
    ours = json.loads(kernmap("train", "--model", tmp_path / "ckpt", "--data", tmp_path / "data.jsonl", "--steps",
                              STEPS, "--batch-size", BATCH, "--lr", LR, "--weight-decay", WD, "--max-grad-norm",
                              MAX_NORM, "--kernels", kernels, "--json").stdout)
    theirs = torch_sft(model, examples)
    assert len(ours["steps"]) == STEPS
    clipped = 0
    for got, (loss, grad_norm) in zip(ours["steps"], theirs):
        assert got["loss"] == pytest.approx(loss, rel=1e-5, abs=0), got["step"]
        assert got["grad_norm"] == pytest.approx(grad_norm, rel=1e-5, abs=0), got["step"]
        clipped += grad_norm > MAX_NORM
    assert clipped > 0  # the clipping path ran
    assert theirs[-1][0] < theirs[0][0]  # and it learned


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["qwen2-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny"])
def test_align_passes_on_presets(preset, kernmap):
    out = json.loads(kernmap("align", "--preset", preset, "--steps", 20, "--seq-len", 64, "--json").stdout)
    assert out["passed"], (out["max_loss_rel"], out["max_grad_norm_rel"])
    assert all(not layer["fallback"] for layer in out["kernels"]["layers"])
    assert len(out["original"]) == len(out["noise"]) == len(out["kernelized"]) == 20
    for metric in ("loss", "grad_norm"):
        v = out["verdict"][metric]
        assert all(d <= t for d, t in zip(v["diff"], v["tolerance"]))
        assert all(t >= 1e-5 for t in v["tolerance"]) and v["floor"] == sorted(v["floor"])
        # the noise run really ran another kernel: it is not the original's run again, nor the kernelized one
        assert [s[metric] for s in out["noise"]] != [s[metric] for s in out["original"]]
    assert out["max_loss_rel"] == out["verdict"]["loss"]["max_diff"]


def test_align_human_output_has_the_noise_floor_and_a_verdict(kernmap):
    out = kernmap("align", "--preset", "qwen2-tiny", "--steps", 3, "--seq-len", 32).stdout
    assert "noise floor: the original with the selected layers on their float64 kernels" in out
    header = next(line for line in out.splitlines() if line.startswith("step"))
    assert header.split("  ")[0] == "step" and "noise" in header and "tolerance" in header
    assert "verdict: PASS" in out and "x noise floor" in out


def test_resume_continues_the_exact_sequence(tmp_path, kernmap):
    args = ["--preset", "qwen2-moe-tiny", "--seq-len", 48, "--json"]
    full = json.loads(kernmap("train", *args, "--steps", 12).stdout)["steps"]
    kernmap("train", *args, "--steps", 6, "--save", tmp_path / "ck")
    resumed = json.loads(kernmap("train", *args, "--steps", 12, "--resume", tmp_path / "ck").stdout)["steps"]
    assert [s["step"] for s in resumed] == list(range(7, 13))
    for a, b in zip(full[6:], resumed):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]


def test_killed_save_leaves_previous_checkpoint(tmp_path, kernmap):
    ck = tmp_path / "ck"
    args = ["--preset", "qwen2-tiny", "--seq-len", 32, "--json"]
    cmd = [ROOT / "scripts" / "kernmap", "train", *args, "--steps", 8, "--save", ck, "--save-every", 4]
    proc = subprocess.Popen([str(c) for c in cmd],
                            env={**os.environ, "KERNMAP_TEST_SAVE_PAUSE_S": "2"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    final, tmp = ck / "checkpoint.safetensors", ck / "checkpoint.safetensors.tmp"
    deadline = time.time() + 120
    while not final.exists() and time.time() < deadline:  # first save (step 4) done
        time.sleep(0.02)
    while not tmp.exists() and time.time() < deadline:  # second save (step 8) inside its pause
        time.sleep(0.02)
    assert tmp.exists() and proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = load_file(final)
    assert saved["trainer/step"].item() == 4
    full = json.loads(kernmap("train", *args, "--steps", 6).stdout)["steps"]
    resumed = json.loads(kernmap("train", *args, "--steps", 6, "--resume", ck).stdout)["steps"]
    assert [s["step"] for s in resumed] == [5, 6]
    assert [s["loss"] for s in resumed] == [s["loss"] for s in full[4:]]


def test_malformed_jsonl_lines_are_reported(tmp_path, kernmap):
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join([
        '{"prompt_ids": [1, 2], "response_ids": [3, 4]}',
        'not json',
        '{"prompt_ids": [1, 2]}',
        '{"prompt_ids": [1, 2], "response_ids": [3, 9999]}',
        '',
        '{"prompt_ids": [1], "response_ids": []}',
        '{"prompt_ids": [1, "x"], "response_ids": [2]}',
        '[1, 2]',
        '{"prompt_ids": [5, 6, 7], "response_ids": [8]}',
    ]) + "\n")
    args = ["train", "--preset", "qwen2-tiny", "--data", data, "--steps", 2]
    rejected = kernmap(*args, check=False)
    assert rejected.returncode == 1
    for line in (2, 3, 4, 6, 7, 8):
        assert f"line {line}:" in rejected.stderr, rejected.stderr
    assert "line 1:" not in rejected.stderr and "line 9:" not in rejected.stderr
    assert "6 malformed lines" in rejected.stderr and "outside the vocabulary" in rejected.stderr
    skipped = kernmap(*args, "--skip-bad-lines", "--json")
    out = json.loads(skipped.stdout)
    assert [s["line"] for s in out["skipped"]] == [2, 3, 4, 6, 7, 8]
    assert "line 4 skipped" in skipped.stderr
    assert len(out["steps"]) == 2


def test_ablate_rows_and_numbers(kernmap):
    out = json.loads(kernmap("ablate", "--preset", "qwen3-moe-tiny", "--steps", 3, "--warmup", 1, "--seq-len", 16,
                             "--json").stdout)
    rows = {r["name"]: r for r in out["rows"]}
    # Layers in module order (q_norm, the attention's rotary, the experts, the fused residual-add norms, the
    # loss); no dense MLP in this preset.
    assert list(rows) == ["original", "+RMSNorm", "+rotary_pos_emb", "+Experts", "+FusedAddRMSNorm",
                          "+ForCausalLMLoss", "all"]
    for r in rows.values():
        assert len(r["seconds"]) == 3 and r["p25_s"] <= r["median_s"] <= r["p75_s"] and r["peak_bytes"] > 0
        assert r["final_loss"] == pytest.approx(rows["original"]["final_loss"], rel=1e-5)
    assert rows["original"]["speedup_pct"] == 0
    # The original runs transformers' default experts implementation, as does every row without the kernel.
    assert out["experts_implementation"] == "grouped_mm"
    assert [r["experts"] for r in out["rows"]] == ["grouped_mm", "grouped_mm", "grouped_mm", "kernmap", "grouped_mm",
                                                "grouped_mm", "kernmap"]
    text = kernmap("ablate", "--preset", "qwen2-tiny", "--steps", 2, "--warmup", 0, "--seq-len", 16).stdout
    assert "+SiluAndMul" in text and "speedup %" in text and "peak MiB" in text
    assert "experts" not in text  # a dense model: no experts rows or note


def test_ablate_experts_baselines(kernmap):
    out = json.loads(kernmap("ablate", "--preset", "qwen3-moe-tiny", "--steps", 1, "--warmup", 0, "--seq-len", 16,
                             "--kernels", "Experts", "--experts-baseline", "eager,batched_mm", "--json").stdout)
    assert [(r["name"], r["experts"]) for r in out["rows"]] == [
        ("original", "grouped_mm"), ("original (experts eager)", "eager"),
        ("original (experts batched_mm)", "batched_mm"), ("+Experts", "kernmap"), ("all", "kernmap")]
    losses = [r["final_loss"] for r in out["rows"]]
    assert losses == pytest.approx([losses[0]] * len(losses), rel=1e-5)  # every implementation trains the same
    text = kernmap("ablate", "--preset", "qwen3-moe-tiny", "--steps", 1, "--warmup", 0, "--seq-len", 16).stdout
    assert "original (experts grouped_mm)" in text and "transformers' default" in text
    bad = kernmap("ablate", "--preset", "qwen3-moe-tiny", "--experts-baseline", "eager,loop", check=False)
    assert bad.returncode == 2 and "--experts-baseline" in bad.stderr and "'eager,loop'" in bad.stderr
