# DDP or FSDP2 on kernmap's kernels, under torchrun:
#   python -m torch.distributed.run --standalone --nproc_per_node 2 distributed.py MODEL_DIR ddp|fsdp2
# kernelize first (it binds forwards, copies no weights), then wrap or shard as usual.
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM

import kernmap

dist.init_process_group("gloo")  # CPU; "nccl" on CUDA devices
rank, world = dist.get_rank(), dist.get_world_size()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
report = kernmap.kernelize(model, mode="training")
model.train()  # from_pretrained returns the model in eval mode
if sys.argv[2] == "ddp":
    model = DistributedDataParallel(model)
else:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(3, 60, (4 * world, 16), generator=torch.Generator().manual_seed(0))[4 * rank:4 * (rank + 1)]
for step in range(4):
    optimizer.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    dist.all_reduce(total := loss.detach().clone())
    if rank == 0:
        print("step", step + 1, "mean loss", total.item() / world, f"({len(report.replaced)} layers on kernmap)")
dist.barrier()  # no process leaves while another has collectives in flight
dist.destroy_process_group()
# gloo's worker threads can release the last collectives' tensors after the interpreter has begun to shut down,
# which aborts the process (pytorch/pytorch#179291): a finished run leaves without that shutdown.
sys.stdout.flush()
os._exit(0)
