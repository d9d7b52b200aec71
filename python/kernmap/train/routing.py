"""Replayed routing for ``python -m kernmap align``: the C++ ``kernmap::RoutingTape`` (include/kernmap/models.h)
for transformers' routers. The original run records every router call's top-k experts; the noise and kernelized
runs replay them: each router computes its probabilities as usual, but its tokens go to the recorded experts,
weighted by its own probabilities, so a rounding that tips a router's near-tie cannot part the runs by a discrete
step (docs/training.md, "Routing"). Where a replaying router's own choice differs from the recorded one as a set
of experts (a flip), the token is counted with the flip's margin ``(p_k - p_min) / p_k``: its own k-th largest
probability against its probability of the least likely recorded expert.

The routers are transformers' ``*TopKRouter`` modules of the families below, each returning ``(router_logits,
router_scores, router_indices)`` with the scores the top-k softmax probabilities (fp32), renormalised to sum 1
where the module's ``norm_topk_prob`` says so (always for Mixtral's, which has no such flag), cast to the scores'
dtype. Calls are kept per router module in call order, so gradient checkpointing's recomputation (a second call
in the same step, the same in every run) replays too."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

# transformers' router classes whose outputs the replay recomputes (their forward, after torch.topk).
ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter")


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers that can replay, in module order."""
    return [m for m in model.modules() if type(m).__name__ in ROUTERS]


@dataclass
class Flips:
    calls: int = 0  # router calls
    tokens: int = 0  # tokens routed
    flipped: int = 0  # tokens whose own top-k experts differ from the recorded ones
    max_margin: float = 0.0  # the largest margin among them (0 when none flipped)

    def add(self, other: Flips) -> None:
        self.calls += other.calls
        self.tokens += other.tokens
        self.flipped += other.flipped
        self.max_margin = max(self.max_margin, other.max_margin)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def total(spans: list[Flips]) -> Flips:
        out = Flips()
        for f in spans:
            out.add(f)
        return out


class RoutingTape:
    """Records the routers' choices of one run and replays them in others (see the module's docstring)."""

    def __init__(self):
        self.calls: list[list[torch.Tensor]] = []  # per router (module order), its calls' [T, k] int16
        self.next: list[int] = []
        self.replaying = False
        self.flips = Flips()

    def record(self) -> None:
        self.calls, self.next, self.replaying, self.flips = [], [], False, Flips()

    def replay(self) -> None:
        if not any(self.calls):
            raise RuntimeError("RoutingTape.replay: nothing was recorded")
        self.next, self.replaying, self.flips = [0] * len(self.calls), True, Flips()

    def take_flips(self) -> Flips:
        out, self.flips = self.flips, Flips()
        return out

    def attach(self, model: nn.Module) -> list:
        """Hooks the model's routers (module order) to the tape; returns the hooks' handles."""
        found = routers(model)
        if not self.replaying:
            self.calls = [[] for _ in found]
        elif len(found) != len(self.calls):
            raise RuntimeError(f"routing replay: the model has {len(found)} routers, the recording "
                               f"{len(self.calls)}")
        return [m.register_forward_hook(self._hook(i)) for i, m in enumerate(found)]

    def _hook(self, index: int):
        def hook(module, args, output):
            logits, scores, ids = output
            if not self.replaying:
                self.calls[index].append(ids.detach().to(torch.int16 if logits.shape[-1] <= 32768 else torch.int32))
                return None
            calls, n = self.calls[index], self.next[index]
            if n >= len(calls):
                raise RuntimeError(f"routing replay: call {n + 1} of router {index} is past the {len(calls)} "
                                   "calls recorded (the replaying run routes more often than the recorded one)")
            recorded = calls[n].to(ids.device)
            if recorded.shape != ids.shape:
                raise RuntimeError(f"routing replay: call {n + 1} of router {index} routes [tokens, k] = "
                                   f"{list(ids.shape)}, the recorded call {list(recorded.shape)} (the runs must see "
                                   "the same batches)")
            self.next[index] = n + 1
            self.flips.calls += 1
            self.flips.tokens += ids.shape[0]
            if torch.equal(ids.to(recorded.dtype), recorded):
                return None  # the router's own outputs: a free run's arithmetic
            replayed = recorded.long()
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            with torch.no_grad():
                flipped = (ids.sort(-1).values != replayed.sort(-1).values).any(-1)
                count = int(flipped.sum())
                if count:
                    p = probs.detach()
                    kth = p.gather(-1, ids).amin(-1)
                    least = p.gather(-1, replayed).amin(-1)
                    margin = torch.where(kth > 0, (kth - least) / kth, torch.zeros_like(kth))
                    worst = float(margin[flipped].max())
                    self.flips.flipped += count
                    if worst > self.flips.max_margin:  # a NaN margin (non-finite probabilities) is left out
                        self.flips.max_margin = worst
            top = probs.gather(-1, replayed)
            if getattr(module, "norm_topk_prob", True):
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(scores.dtype), replayed

        return hook
