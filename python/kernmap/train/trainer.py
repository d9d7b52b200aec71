"""The SFT step of `python -m kernmap align | ablate`, the C++ Trainer's (train/trainer.cpp) in torch: forward
with the loss, backward, clip, update, every step on the batch the C++ command would take. Under DDP or FSDP2
each process runs its share of the batch and the step reports the whole batch's loss and grad_norm."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from .data import Dataset, Example, batch_examples, make_batch
from .distributed import Parallel

OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")  # transformers' TrainingArguments.optim names


@dataclass
class TrainOptions:
    """torch.optim.AdamW (betas 0.9, 0.999, eps 1e-8) and clip_grad_norm_, as the C++ command."""

    batch_size: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch"  # one of OPTIMIZERS


@dataclass
class StepLog:
    step: int  # 1-based
    loss: float
    grad_norm: float
    seconds: float  # forward + loss + backward + clip + update, wall clock
    cpu_seconds: float  # the same span in process CPU time (all threads)
    tokens: int  # non-padding tokens of the whole batch
    tokens_per_s: float

    def to_dict(self) -> dict:
        return {"step": self.step, "loss": self.loss, "grad_norm": self.grad_norm, "seconds": self.seconds,
                "tokens": self.tokens, "tokens_per_s": self.tokens_per_s}


def predicted_tokens(examples: list[Example]) -> int:
    """Labels the shifted loss counts: every response token but one at position 0 (nothing precedes it)."""
    return sum(len(e.response_ids) - (0 if e.prompt_ids else 1) for e in examples)


def full_value(t: torch.Tensor) -> float:
    """A scalar tensor's value; a DTensor (FSDP2's total norm) is gathered first."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


class Trainer:
    """Trains `model` (already wrapped for the parallel kind) on `data` from step 1."""

    def __init__(self, model: nn.Module, data: Dataset, options: TrainOptions, parallel: Parallel, pad_id: int):
        self.model, self.data, self.options, self.parallel = model, data, options, parallel
        self.pad_id = pad_id
        self.params = [p for p in model.parameters() if p.requires_grad]
        # adamw_torch: the single-tensor path (foreach=False), the arithmetic the C++ AdamW repeats; it makes two
        # temporaries the size of the largest parameter. adamw_torch_fused: one pass per parameter, none.
        fused = options.optim == "adamw_torch_fused"
        self.optimizer = torch.optim.AdamW(self.params, lr=options.lr, betas=(0.9, 0.999), eps=1e-8,
                                           weight_decay=options.weight_decay, foreach=False if not fused else None,
                                           fused=fused or None)
        self.steps = 0
        model.train()

    def _batch(self):
        examples = batch_examples(self.data, self.steps, self.options.batch_size)
        length = max(len(e.prompt_ids) + len(e.response_ids) for e in examples)
        mine = examples[self.parallel.rows(self.options.batch_size)]
        batch = make_batch(mine, self.pad_id, length)
        device = self.parallel.device
        return (batch.input_ids.to(device), batch.labels.to(device), predicted_tokens(examples),
                sum(len(e.prompt_ids) + len(e.response_ids) for e in examples))

    def step(self) -> StepLog:
        input_ids, labels, items, tokens = self._batch()
        distributed = self.parallel.kind != "none"
        # Alone, transformers' mean over the batch's tokens; distributed, each process's sum over the whole
        # batch's count, so that the processes' losses add up to the whole batch's mean. DDP and FSDP2 average
        # the gradients over the processes, hence the backward of world x that share.
        extra = {"num_items_in_batch": torch.tensor(items, device=input_ids.device)} if distributed else {}
        start, cpu_start = time.perf_counter(), time.process_time()

        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(input_ids=input_ids, labels=labels, use_cache=False, **extra).loss  # forward + loss
        (loss * self.parallel.world if distributed else loss).backward()  # backward
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.options.max_grad_norm)  # clip
        self.optimizer.step()  # update
        loss_value, norm_value = self.parallel.sum(loss), full_value(grad_norm)

        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        self.steps += 1
        return StepLog(self.steps, loss_value, norm_value, seconds, cpu_seconds, tokens, tokens / seconds)
