"""The one tolerance table of the tests, tests/tolerances.json (the C++ kernel suite reads it too): what each
figure is and where it comes from is written beside it there."""

import json
from pathlib import Path

import torch

TABLE = json.loads((Path(__file__).resolve().parents[1] / "tolerances.json").read_text())
_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def tol(dtype: torch.dtype, terms: int = 1) -> dict:
    """rtol and atol (torch.testing.assert_close's keywords) for a result computed from inputs of `dtype` that
    sums `terms` terms: the elementwise figures, atol widened by the rule "sum"."""
    figures = TABLE["elementwise"][_NAMES[dtype]]
    return dict(rtol=figures["rtol"], atol=figures["atol"] * max(terms, 1) ** TABLE["sum"]["atol_exponent"])


def loss_tol(dtype: torch.dtype) -> dict:
    """rtol and atol for a model's scalar loss."""
    return dict(TABLE["loss"][_NAMES[dtype]])


def linear_cross_entropy_tol(dtype: torch.dtype) -> dict:
    """The fused linear cross-entropy's figures against its reference: loss, grad (hidden, bias) and weight_grad,
    each a fraction of the largest |reference| of that result."""
    figures = TABLE["linear_cross_entropy"][_NAMES[dtype]]
    return {name: figures[name] for name in ("loss", "grad", "weight_grad")}


def model_gradient_bound(dtype: torch.dtype, largest: float) -> float:
    """The largest |difference| allowed in a bf16 or fp16 model gradient tensor whose largest magnitude is `largest`."""
    return TABLE["gradients_of_a_model"][_NAMES[dtype]]["max_fraction"] * largest


TRAINING_STEPS = TABLE["training_steps"]
