# Gradient (activation) checkpointing on kernmap's kernels: the decoder layers recompute their forward, kernmap's
# kernels included, in the backward.
import sys

import torch
from transformers import AutoModelForCausalLM

import kernmap

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(kernmap.kernelize(model, mode="training"))
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.train()

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(3, 60, (4, 16), generator=torch.Generator().manual_seed(0))
for step in range(4):
    optimizer.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    print("step", step + 1, "loss", loss.item())
