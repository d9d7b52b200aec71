"""`python -m kernmap ablate`: the C++ command's rows for any transformers causal LM — the original as transformers
runs it (a MoE model's default experts, grouped_mm), more originals per --experts-baseline, each kernel of the model
alone, all, and with --compile the compiled original and all — with step times, speedups, peak memory and final
losses (the same in every row: the kernels change the time, not the training); JSON and table; under torchrun."""

import contextlib
import io
import json
import mmap
import os
import subprocess
import sys

import pytest
import torch

from kernmap.train import ablate
from kernmap.train.distributed import Parallel
from kernmap.train.models import Models, Setup, Source

FAST = ["--steps", "2", "--warmup", "1", "--seq-len", "16", "--batch-size", "2", "--threads", "1"]


def run_ablate(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = ablate.main([str(a) for a in args])
    return code, out.getvalue()


def test_moe_rows_json_and_numbers():
    code, text = run_ablate("--preset", "qwen3-moe-tiny", *FAST, "--experts-baseline", "eager,batched_mm", "--json")
    assert code == 0
    doc = json.loads(text)
    assert doc["experts_implementation"] == "grouped_mm"
    names = [r["name"] for r in doc["rows"]]
    assert names[:3] == ["original", "original (experts eager)", "original (experts batched_mm)"]
    assert set(names[3:-1]) == {"+RMSNorm", "+rotary_pos_emb", "+Experts", "+SiLU", "+ForCausalLMLoss"} and names[-1] == "all"
    experts = {r["name"]: r["experts"] for r in doc["rows"]}
    assert experts["original"] == experts["+RMSNorm"] == "grouped_mm"
    assert experts["original (experts eager)"] == "eager" and experts["+Experts"] == experts["all"] == "kernmap"
    first = doc["rows"][0]
    assert first["speedup_pct"] == 0
    for row in doc["rows"]:
        assert len(row["seconds"]) == 2 and row["min_s"] <= row["median_s"]
        assert row["peak_bytes"] > 0
        assert row["final_loss"] == pytest.approx(first["final_loss"], rel=1e-5), row["name"]


@pytest.mark.slow
def test_one_row_at_a_time_gives_the_same_rows_and_losses():
    code, text = run_ablate("--preset", "qwen3-moe-tiny", *FAST, "--json")
    interleaved = json.loads(text)
    code_one, text_one = run_ablate("--preset", "qwen3-moe-tiny", *FAST, "--one-at-a-time", "--json")
    one = json.loads(text_one)
    assert code == code_one == 0
    assert interleaved["interleaved"] is True and one["interleaved"] is False
    assert [r["name"] for r in one["rows"]] == [r["name"] for r in interleaved["rows"]]
    for a, b in zip(one["rows"], interleaved["rows"], strict=True):
        assert len(a["seconds"]) == 2 and a["peak_bytes"] > 0
        assert a["final_loss"] == b["final_loss"], a["name"]  # each row trains its own copy on the same batches
        assert b["peak_rss_bytes"] is None  # interleaved rows share the process: no peak of their own
        # the process's own peak while the row ran: at least torch's libraries and the row's tensors
        assert a["peak_rss_bytes"] > max(ablate.peak_rss() / 4, a["peak_bytes"]), a["name"]
    code, text = run_ablate("--preset", "qwen2-tiny", *FAST, "--one-at-a-time")
    assert code == 0 and "rows one at a time (not interleaved)" in text.splitlines()[0]
    assert "peak RSS MiB" in text and "peak RSS: the process's peak resident memory" in text


def test_peak_rss_resets_to_what_the_process_holds():
    # A fresh anonymous mapping, each page touched: new resident memory whatever the allocator already holds
    # (a heap that keeps freed blocks, as the benches set it, would serve a tensor from resident pages).
    size = 64 << 20
    assert ablate.reset_peak_rss()
    held = ablate.peak_rss()
    block = mmap.mmap(-1, size)
    for i in range(0, size, mmap.PAGESIZE):
        block[i] = 1
    grown = ablate.peak_rss()
    block.close()
    assert grown >= held + (60 << 20)
    assert ablate.reset_peak_rss() and ablate.peak_rss() < grown - (32 << 20)  # the unmapped block left the peak


def test_released_models_load_each_copy_from_the_source():
    source = Source(preset="qwen2-tiny")
    models = Models(source.load(), Parallel(), source=source)
    first = {k: v.clone() for k, v in models.make(Setup())[0].state_dict().items()}
    models.release()
    assert all(p.device.type == "meta" for p in models.base.parameters())  # the loaded weights are freed
    assert models.base.config.model_type == "qwen2"  # what the tables print stays
    for _ in range(2):  # every copy made after release is a fresh load equal to the first copy
        copy = models.make(Setup())[0].state_dict()
        assert copy.keys() == first.keys()
        assert all(torch.equal(copy[k], first[k]) for k in first)
    with pytest.raises(ValueError, match="no source"):
        Models(source.load(), Parallel()).release()


def test_fused_adamw_rows():
    code, text = run_ablate("--preset", "qwen2-tiny", *FAST, "--kernels", "RMSNorm", "--json")
    single = json.loads(text)
    code_f, text_f = run_ablate("--preset", "qwen2-tiny", *FAST, "--kernels", "RMSNorm", "--optim",
                                "adamw_torch_fused", "--json")
    fused = json.loads(text_f)
    assert code == code_f == 0 and single["optim"] == "adamw_torch" and fused["optim"] == "adamw_torch_fused"
    for a, b in zip(fused["rows"], single["rows"], strict=True):  # the same training, another AdamW kernel
        assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-4), a["name"]
    assert fused["rows"][0]["final_loss"] == pytest.approx(fused["rows"][1]["final_loss"], rel=1e-5)
    code, text = run_ablate("--preset", "qwen2-tiny", *FAST, "--optim", "adamw_torch_fused")
    assert code == 0 and text.splitlines()[0].startswith("ablate qwen2-tiny (qwen2, float32)")
    assert ", adamw_torch_fused" in text.splitlines()[0]


def test_fused_adamw_is_torch_fused_adamw():
    from kernmap.train.trainer import Trainer, TrainOptions
    from kernmap.train.data import synthetic_dataset

    model = Source(preset="qwen2-tiny").load()
    data = synthetic_dataset(model.config.vocab_size, 4, 8)
    fused = Trainer(model, data, TrainOptions(optim="adamw_torch_fused"), Parallel(), 0).optimizer
    single = Trainer(model, data, TrainOptions(), Parallel(), 0).optimizer
    assert fused.defaults["fused"] is True and not fused.defaults["foreach"]
    assert single.defaults["foreach"] is False and not single.defaults["fused"]


def test_dense_table_and_compile_rows():
    code, text = run_ablate("--preset", "qwen2-tiny", *FAST, "--compile", "--compile-backend", "aot_eager")
    assert code == 0
    lines = text.splitlines()
    assert lines[0].startswith("ablate qwen2-tiny (qwen2, float32)")
    assert not any("experts" in line for line in lines[:2])  # a dense model has no experts baseline
    header = next(i for i, line in enumerate(lines) if line.startswith("kernels"))
    rows = [line.split("  ")[0].strip() for line in lines[header + 2:]]
    assert rows[0] == "original" and rows[-3:] == ["all", "original+compile", "all+compile"]
    assert "+SiluAndMul" in rows and "+RMSNorm" in rows


@pytest.mark.torchrun
def test_under_torchrun_rank_0_prints_one_document():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                          "kernmap", "ablate", "--preset", "qwen2-tiny", *FAST[:-2], "--kernels", "RMSNorm",
                          "--parallel", "ddp", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    doc = json.loads(out.stdout)
    assert doc["parallel"] == {"kind": "ddp", "world": 2}
    assert [r["name"] for r in doc["rows"]] == ["original", "+RMSNorm", "all"]
