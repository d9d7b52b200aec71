"""The options of `python -m kernmap align | ablate`: the C++ command's (docs/training.md), and what a Python
run adds (a config.json, peft LoRA, gradient checkpointing, torch.compile, DDP/FSDP2 under torchrun, transformers'
experts implementations as ablate baselines)."""

from __future__ import annotations

import argparse
import math

from .distributed import PARALLEL
from .models import DTYPES
from .trainer import OPTIMIZERS

EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def integer(lo: int, hi: int):
    """A whole number in [lo, hi] (the C++ command's ranges, cli/train_cmd.cpp)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number from {lo} to {hi}, got '{text}'") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be a whole number from {lo} to {hi}, got '{text}'")
        return value

    return parse


def real(positive: bool):
    """A finite number, > 0 or >= 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if positive else '>='} 0, got '{text}'")
        return value

    return parse


MAX_STEPS = 1_000_000


def experts_list(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    for n in names:
        if n not in EXPERTS_IMPLEMENTATIONS:
            raise argparse.ArgumentTypeError(f"unknown experts implementation '{n}' (expected a comma list of "
                                             f"{', '.join(EXPERTS_IMPLEMENTATIONS)})")
    return names


def parser(command: str) -> argparse.ArgumentParser:
    what = {"align": "the original model and the kernelized one trained side by side, per step, and a verdict",
            "ablate": "step time of the original model, each kernel alone and all of them (rows interleaved)"}
    p = argparse.ArgumentParser(prog=f"python -m kernmap {command}", description=what[command])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help="a built-in tiny model (random weights from a fixed seed)")
    source.add_argument("--model", help="a Hugging Face folder (config.json + safetensors)")
    source.add_argument("--config", help="a config.json (random weights from a fixed seed)")
    p.add_argument("--data", help="JSONL of {\"prompt_ids\": [...], \"response_ids\": [...]} (default: synthetic)")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip malformed data lines (each reported)")
    p.add_argument("--steps", type=integer(1, MAX_STEPS), default=20)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--kernels", default="all", help="all, none or a comma list of layers")
    p.add_argument("--batch-size", type=integer(1, 65536), default=4)
    p.add_argument("--seq-len", type=integer(2, 1 << 20), default=128, help="synthetic data: tokens per example")
    p.add_argument("--examples", type=integer(1, 1 << 20), default=64, help="synthetic data: examples")
    p.add_argument("--lr", type=real(positive=True), default=1e-3)
    p.add_argument("--weight-decay", type=real(positive=False), default=0.01)
    p.add_argument("--max-grad-norm", type=real(positive=True), default=1.0)
    p.add_argument("--optim", choices=OPTIMIZERS, default="adamw_torch",
                   help="AdamW as transformers' Trainer names it: adamw_torch, torch's single-tensor AdamW (the C++ "
                        "command's arithmetic), or adamw_torch_fused, its fused kernel (the Trainer's default from "
                        "torch 2.8; no temporaries the size of a parameter)")
    p.add_argument("--threads", type=integer(0, 1024), default=0, help="torch intra-op threads, 0 for torch's default")
    p.add_argument("--device", default="cpu", help="torch device type (default cpu)")
    p.add_argument("--lora-r", type=integer(0, 65536), default=0, help="peft LoRA rank (0: no LoRA)")
    p.add_argument("--lora-alpha", type=real(positive=True), help="LoRA alpha (default: 2 x rank)")
    p.add_argument("--lora-target", default="all-linear", help="all-linear or a comma list of module names")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true",
                   help="add torch.compile of the original and of the kernelized model as runs")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile's backend for the --compile runs (default inductor)")
    p.add_argument("--parallel", choices=PARALLEL, default="none",
                   help="data parallel under torchrun: ddp or fsdp2 (gloo on CPU)")
    p.add_argument("--mapping", action="append", default=[], help="user mappings from a .json or .toml file")
    p.add_argument("--json", action="store_true")
    if command == "align":
        p.add_argument("--rtol", type=real(positive=True), help="1e-5 for float32, 2e-2 for bfloat16")
        p.add_argument("--routing", choices=("replay", "free"), default="replay",
                       help="a model with experts: the noise and kernelized runs send each token to the experts the "
                            "original chose (replay, counting the tokens their own routers would send elsewhere) or "
                            "route by their own top-k (free)")
    else:
        p.add_argument("--warmup", type=integer(0, MAX_STEPS), default=3)
        p.add_argument("--experts-baseline", type=experts_list, default=[],
                       help="more original rows with these transformers experts implementations "
                            "(eager, grouped_mm, batched_mm)")
        p.add_argument("--one-at-a-time", action="store_true",
                       help="train the rows one after another, one copy of the model (and its optimizer state) "
                            "in memory at a time (each row loads its copy from the source again), for models of "
                            "which a copy per row does not fit; the rows are "
                            "then not interleaved, so drift of the machine between rows is not evened out")
    return p


def parse(command: str, argv: list[str]) -> argparse.Namespace:
    args = parser(command).parse_args(argv)
    if command == "align" and args.rtol is None:
        args.rtol = 1e-5 if args.dtype == "float32" else 2e-2
    if args.lora_alpha is None:
        args.lora_alpha = 2.0 * args.lora_r
    return args
