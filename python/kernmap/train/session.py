"""What align and ablate share: the options applied (threads, mapping files), the process group, the loaded
model and the data, and the one-line description both print first."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

import kernmap

from . import distributed
from .data import Dataset, read_jsonl, synthetic_dataset
from .distributed import Parallel
from .models import Lora, Models, Source, parse_kernels
from .trainer import TrainOptions


@dataclass
class Session:
    args: argparse.Namespace
    parallel: Parallel
    source: Source
    models: Models
    data: Dataset
    layers: frozenset[str]
    options: TrainOptions

    def describe(self) -> str:
        config = self.models.base.config
        text = (f"{self.source.name} ({config.model_type}, {self.source.dtype}), data {self.data.source} "
                f"({len(self.data.examples)} examples), batch {self.options.batch_size}")
        if self.models.lora is not None:
            lora = self.models.lora
            text += f", LoRA r {lora.r} alpha {lora.alpha:g} on {lora.target}"
        if self.options.optim != "adamw_torch":
            text += f", {self.options.optim}"
        if self.models.gradient_checkpointing:
            text += ", gradient checkpointing"
        if self.parallel.kind != "none":
            text += f", {self.parallel.kind} over {self.parallel.world} processes"
        return text

    def say(self, text: str) -> None:
        if self.parallel.main:
            sys.stdout.write(text)
            sys.stdout.flush()


def open_session(args: argparse.Namespace) -> Session:
    """Applies the options and loads model and data; the caller closes the process group (distributed.stop)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    for path in args.mapping:
        kernmap.register_mapping(path)
    layers = parse_kernels(args.kernels)
    parallel = distributed.start(args.parallel, args.batch_size, args.device)
    source = Source(preset=args.preset, model_dir=args.model, config_path=args.config, dtype=args.dtype)
    base = source.load()
    lora = Lora(args.lora_r, args.lora_alpha, args.lora_target) if args.lora_r > 0 else None
    models = Models(base, parallel, lora, args.gradient_checkpointing, args.compile_backend, source)
    vocab = base.config.vocab_size
    if args.data:
        data = read_jsonl(args.data, vocab, args.skip_bad_lines)
        if parallel.main:
            for issue in data.skipped:
                sys.stderr.write(f"{args.data}: line {issue.line} skipped: {issue.problem}\n")
    else:
        data = synthetic_dataset(vocab, args.examples, args.seq_len)
    options = TrainOptions(args.batch_size, args.lr, args.weight_decay, args.max_grad_norm, args.optim)
    return Session(args, parallel, source, models, data, layers, options)
