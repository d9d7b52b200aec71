"""Runs `python -m kernmap align ARGS` twice in this process — with the built-in kernels, then, for 3 steps (it
fails at the first), with RMSNorm mapped to a kernel wrong by 1e-3 (the reference's output times 1 + 1e-3) — and
prints both JSON documents on one line. tests/python/test_py_align.py runs it once per CPU level (KERNMAP_CPU_ISA is read when the library loads)
and thread count."""

import contextlib
import io
import json
import sys

import torch

import kernmap
from kernmap.train import align

PERTURBED = kernmap.Kernel(
    name="test/rms_norm_perturbed", layer="RMSNorm", has_backward=True, devices=("cpu",),
    fn=lambda x, weight, eps: torch.ops.kernmap.reference_rms_norm(x, weight, eps) * (1 + 1e-3))


def run(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = align.main(argv)
    doc = json.loads(out.getvalue())
    doc["exit_code"] = code
    return doc


if __name__ == "__main__":
    argv = sys.argv[1:] + ["--json"]
    correct = run(argv)
    with kernmap.use_mapping({"RMSNorm": {"cpu": PERTURBED}}):
        perturbed = run(argv + ["--steps", "3"])
    print(json.dumps({"correct": correct, "perturbed": perturbed}))
