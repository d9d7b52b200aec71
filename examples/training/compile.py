# torch.compile of the whole kernelized model, one graph (fullgraph=True fails on any graph break): kernelize
# with compile=True, which binds only compile-safe kernels (kernmap's ops have Meta implementations).
import sys

import torch
from transformers import AutoModelForCausalLM

import kernmap

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(kernmap.kernelize(model, mode="training", compile=True))
compiled = torch.compile(model, fullgraph=True)
model.train()  # from_pretrained returns the model in eval mode

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(3, 60, (4, 16), generator=torch.Generator().manual_seed(0))
for step in range(3):
    optimizer.zero_grad()
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    print("step", step + 1, "loss", loss.item())
