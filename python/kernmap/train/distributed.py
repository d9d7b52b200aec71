"""Data-parallel runs under ``torchrun``: the process group (gloo on CPU, the device's backend where there is
one), the model wrapped for DDP or FSDP2, every process's share of a batch, and the global numbers a step
reports (loss and grad_norm of the whole batch, the same on every process)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from .errors import UsageError

PARALLEL = ("none", "ddp", "fsdp2")


@dataclass
class Parallel:
    kind: str = "none"  # "none", "ddp" or "fsdp2"
    rank: int = 0
    world: int = 1
    device: str = "cpu"

    @property
    def main(self) -> bool:
        """The process that prints (rank 0)."""
        return self.rank == 0

    def rows(self, batch_size: int) -> slice:
        """This process's rows of a batch: an equal, contiguous share."""
        share = batch_size // self.world
        return slice(self.rank * share, (self.rank + 1) * share)

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP: the module wrapped; FSDP2: every decoder layer and the model sharded (fully_shard, in place)."""
        if self.kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model, device_ids=None if self.device == "cpu" else [self._index()])
        if self.kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self.device, (self.world,))
            for layer in decoder_layers(model):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model

    def sum(self, value: torch.Tensor) -> float:
        """The sum of a scalar over the processes (the value itself without a process group)."""
        if self.kind == "none":
            return float(value.detach())
        import torch.distributed as dist

        total = value.detach().to(torch.float64).reshape(1).clone()
        dist.all_reduce(total)
        return float(total)

    def barrier(self) -> None:
        if self.kind != "none":
            import torch.distributed as dist

            dist.barrier()

    def _index(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM (through peft's and DDP's wrappers): the units FSDP2
    shards one at a time."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def start(kind: str, batch_size: int, device: str) -> Parallel:
    """Joins the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment) for
    kind "ddp" or "fsdp2"; "none" runs alone. The batch must split evenly over the processes."""
    if kind not in PARALLEL:
        raise UsageError(f"--parallel must be one of {', '.join(PARALLEL)}, got {kind!r}")
    if kind == "none":
        return Parallel(device=device)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UsageError(f"--parallel {kind} runs under torchrun (python -m torch.distributed.run "
                         f"--nproc_per_node N -m kernmap ...): RANK and WORLD_SIZE are not set")
    import torch.distributed as dist

    backend = "gloo" if device == "cpu" else dist.get_default_backend_for_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    parallel = Parallel(kind, dist.get_rank(), dist.get_world_size(), device)
    if batch_size % parallel.world:
        stop()
        raise UsageError(f"--batch-size {batch_size} must be a multiple of the {parallel.world} processes")
    if device != "cpu":
        getattr(torch, device).set_device(parallel._index())
    return parallel


_left_group = False


def stop(finished: bool = True) -> None:
    """Leaves the process group, if one was joined. A run that finished waits at a barrier first, so that no
    process tears its group down while another still has collectives in flight on it (the last reductions of
    DDP and FSDP2 run on gloo's worker threads); one that failed leaves at once, since the others may never
    reach the barrier."""
    import torch.distributed as dist

    global _left_group
    if dist.is_available() and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()
        _left_group = True


def left_group() -> bool:
    """Whether this process joined a process group and left it (stop). gloo's worker threads can still hold
    the last collectives' works then, and release their tensors once the interpreter has begun to shut down:
    the Python decref that needs the GIL ends the process in std::terminate (pytorch/pytorch#179291; seen as
    an abort after a finished run, about once in 15-20 runs with other work on the cores). The command line
    leaves such a process without interpreter shutdown (kernmap/__main__.py)."""
    return _left_group
