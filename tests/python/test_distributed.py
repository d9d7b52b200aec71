"""DDP and FSDP2 on kernmap's kernels, two processes under torchrun (gloo): `python -m kernmap align --parallel
ddp|fsdp2` on tiny Qwen2 and Qwen3-MoE checkpoints. The kernelized distributed run equals the unkernelized
distributed run (the verdict PASSes), both equal one process training on the whole batch, step by step (fp32,
rtol 1e-5), and only rank 0 prints."""

import contextlib
import functools
import io
import json
import os
import subprocess
import sys

import pytest

from kernmap.train import align

from hf_models import make_model

pytestmark = pytest.mark.torchrun  # every test here starts processes under torchrun (conftest.py)

ARGS = ["--steps", "5", "--seq-len", "16", "--examples", "16", "--batch-size", "4"]
RTOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    for family in ("qwen2", "qwen3_moe"):
        make_model(family).save_pretrained(root / family)
    return root


def torchrun(*args, nproc=2, timeout=600):
    """`python -m kernmap ARGS` under torchrun with `nproc` processes on this machine."""
    # faulthandler: a process that aborts prints every thread's Python stack (which call it died in).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           "-m", "kernmap", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)


@functools.cache
def one_process(*args):
    """`python -m kernmap align ARGS --json` in this process, alone (once per command line)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = align.main([str(a) for a in args] + ["--json"])
    doc = json.loads(out.getvalue())
    assert code == 0, doc["verdict"]
    return doc


def assert_same_steps(got, want, what):
    assert [s["tokens"] for s in got] == [s["tokens"] for s in want], what
    for a, b in zip(got, want, strict=True):
        for metric in ("loss", "grad_norm"):
            assert a[metric] == pytest.approx(b[metric], rel=RTOL), (what, metric, a["step"])


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_processes_equal_the_unkernelized_run_and_one_process(parallel, family, checkpoints):
    out = torchrun("align", "--model", checkpoints / family, *ARGS, "--parallel", parallel, "--json")
    if out.returncode != 0:  # the whole tail of both streams (an assertion's repr would cut it short)
        pytest.fail(f"torchrun exited {out.returncode}\n--- stdout\n{out.stdout[-2000:]}\n--- stderr\n"
                    f"{out.stderr[-12000:]}", pytrace=False)
    doc = json.loads(out.stdout)  # one document: rank 0 alone prints
    assert doc["passed"], doc["verdict"]
    assert doc["parallel"] == {"kind": parallel, "world": 2}
    assert not [r for r in doc["kernels"]["layers"] if r["fallback"]]
    # Kernelized and unkernelized distributed runs agree within rtol (not only within the noise floor).
    assert_same_steps(doc["kernelized"], doc["original"], "kernelized vs original, both distributed")
    alone = one_process("--model", str(checkpoints / family), *ARGS)
    assert_same_steps(doc["original"], alone["original"], "distributed vs one process, original")
    assert_same_steps(doc["kernelized"], alone["kernelized"], "distributed vs one process, kernelized")


def test_a_batch_that_does_not_split_over_the_processes_exits_2(checkpoints):
    out = torchrun("align", "--model", checkpoints / "qwen2", "--steps", "1", "--batch-size", "3", "--parallel",
                   "ddp")
    assert out.returncode != 0
    assert "--batch-size 3 must be a multiple of the 2 processes" in out.stderr
