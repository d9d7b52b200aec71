"""docs/python.md, "Training with kernmap": every example of examples/training/ is shown there as it is, and runs on
a tiny Qwen2 checkpoint (with a tokenizer) with every layer on kernmap's kernels; the Trainer and SFTTrainer runs
train as the same runs without kernmap (KERNMAP_DISABLE=all) by align's verdict, the noise run being the example with
every layer on its float64 kernel (rtol 1e-5: SFTTrainer's correct runs drift 1.3e-5 apart by step 4 here)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernmap.train.verdict import judge_metric

from hf_models import save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "training"
DOC = ROOT / "docs" / "python.md"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("example") / "qwen2"
    save_checkpoint("qwen2", path)
    return path


def run(*command, env=None):
    out = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **(env or {})),
                         cwd=EXAMPLES)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
    return out.stdout


def losses(stdout):
    line = next(line for line in stdout.splitlines() if line.startswith("losses "))
    return [float(v) for v in re.findall(r"[-+0-9.e]+", line.removeprefix("losses "))]


def assert_all_kernelized(stdout):
    summary = next(line for line in stdout.splitlines() if line.startswith("kernmap.kernelize on cpu"))
    assert summary.endswith(" 0 fallbacks") and " 0 of " not in summary, summary


def test_every_example_is_shown_in_the_docs_as_it_is():
    doc = DOC.read_text()
    section = doc[doc.index("## Training with kernmap"):]
    files = sorted(EXAMPLES.glob("*.py"))
    assert files
    for path in files:
        assert f"```python\n{path.read_text()}```" in section, f"{path.name} is not in docs/python.md as it is"


@pytest.mark.slow
@pytest.mark.parametrize("example", ["hf_trainer", "trl_sft"])
def test_trainers_train_the_same_losses_with_kernmap(example, checkpoint, tmp_path):
    script = EXAMPLES / f"{example}.py"
    kernelized = run(sys.executable, script, checkpoint, tmp_path / "a")
    assert_all_kernelized(kernelized)
    original = run(sys.executable, script, checkpoint, tmp_path / "b", env={"KERNMAP_DISABLE": "all"})
    noise = run(sys.executable, Path(__file__).with_name("float64_run.py"), script, checkpoint, tmp_path / "c")
    assert "float64/rms_norm" in noise
    assert len(losses(kernelized)) == 4
    verdict = judge_metric(losses(original), losses(kernelized), [losses(noise)], rtol=1e-5)
    assert verdict.passed, verdict


@pytest.mark.slow
@pytest.mark.parametrize("example", ["peft_lora", "compile", "checkpointing"])
def test_single_process_examples_run(example, checkpoint):
    out = run(sys.executable, EXAMPLES / f"{example}.py", checkpoint)
    assert_all_kernelized(out)
    assert len(re.findall(r"^step \d+ loss \d", out, flags=re.M)) >= 3


@pytest.mark.torchrun
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_distributed_example_runs_under_torchrun(parallel, checkpoint):
    out = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
              EXAMPLES / "distributed.py", checkpoint, parallel)
    steps = re.findall(r"^step \d+ mean loss \d", out, flags=re.M)
    assert len(steps) == 4  # rank 0 alone prints
