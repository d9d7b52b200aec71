# peft LoRA on kernmap's kernels: kernelize after get_peft_model (or before: the same layers are bound); the
# gated MLP is fused around the LoRA projections, which it calls as modules.
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import kernmap

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
print(kernmap.kernelize(model, mode="training"))
model.train()  # from_pretrained returns the model in eval mode

optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
ids = torch.randint(3, 60, (4, 16), generator=torch.Generator().manual_seed(0))
for step in range(4):
    optimizer.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    print("step", step + 1, "loss", loss.item())
