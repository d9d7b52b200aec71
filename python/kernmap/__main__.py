"""``python -m kernmap align | ablate ...``: the C++ command's training runs for any transformers causal LM
(docs/python.md, "Training with kernmap"; docs/training.md). ``python -m kernmap COMMAND --help`` lists the
options."""

from __future__ import annotations

import os
import sys

USAGE = """usage: python -m kernmap <command> [options]

commands:
  align   (--preset NAME | --model DIR | --config FILE)   the original and the kernelized model trained side by
          side, per-step loss and grad_norm, and a verdict against the measured noise floor
  ablate  (--preset NAME | --model DIR | --config FILE)   step time: original (transformers' default experts),
          each kernel alone, all; interleaved, medians, speedup %, peak memory
  under torchrun: python -m torch.distributed.run --nproc_per_node N -m kernmap align ... --parallel ddp|fsdp2
"""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        (sys.stdout if argv else sys.stderr).write(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "align":
        from .train import align

        return align.main(rest)
    if command == "ablate":
        from .train import ablate

        return ablate.main(rest)
    sys.stderr.write(f"kernmap: unknown command '{command}'\n\n{USAGE}")
    return 2


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if "kernmap.train.distributed" in sys.modules and sys.modules["kernmap.train.distributed"].left_group():
        # A distributed run that left its process group: out without interpreter shutdown, during which gloo's
        # worker threads could abort the process (kernmap.train.distributed.left_group).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
