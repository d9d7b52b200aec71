"""Training runs that prove a kernel mapping on any transformers causal LM, from Python: ``python -m kernmap
align`` (does the kernelized model train the same?) and ``python -m kernmap ablate`` (how much faster is a step,
per kernel?), with the C++ command's data, batching, optimiser, tables, JSON and verdict (docs/training.md), plus
peft LoRA, gradient checkpointing, torch.compile and DDP/FSDP2 under torchrun."""
