"""The layer binders of `kernmap.kernelize`: one per layer a transformers model bears, each in its own file. A
binder says how the layer is found in a model (transformers' ``kernel_layer_name`` marker, or the module's
shape), why a module that looks like it cannot take the layer's kernel, and how its forward is bound and
restored. kernelize tries them in this order; the first that recognises a module owns it.

Adding a layer (docs/adding-a-kernel.md): its ops and layer record in C++, then a binder file here and its line
in BINDERS. Layers that no module bears (they are ops other layers call) are listed in OP_ONLY_LAYERS, with why;
a test checks that every registered layer is in exactly one of the two."""

from __future__ import annotations

from .base import Binder
from .causal_lm_loss import CausalLMLossBinder
from .experts import ExpertsBinder
from .gated_mlp import GatedMLPBinder
from .rms_norm import RMSNormBinder
from .rotary import RotaryBinder
from .silu import SiLUBinder

BINDERS: tuple[Binder, ...] = (RMSNormBinder(), SiLUBinder(), GatedMLPBinder(), ExpertsBinder(), RotaryBinder(),
                               CausalLMLossBinder())

# Registered layers without a module of their own, and why.
OP_ONLY_LAYERS = {
    "GroupedMM": "the expert products inside Experts (transformers' grouped_mm); no module bears it",
    "FusedAddRMSNorm": ("the residual add sits in transformers' decoder-layer forwards, not in a module; binding "
                        "them was measured to gain nothing at real sizes (docs/ops.md); the C++ models use it"),
}

__all__ = ["BINDERS", "Binder", "OP_ONLY_LAYERS"]
