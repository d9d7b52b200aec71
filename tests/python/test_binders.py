"""The binder table of kernelize against the registry: every registered layer is bound by exactly one binder or
listed as op-only, and kernelize never raises on a module a binder cannot inspect."""

import torch
from torch import nn

import kernmap
from kernmap.binders import BINDERS, OP_ONLY_LAYERS


def test_every_registered_layer_has_one_binder_or_is_op_only():
    registered = {k["layer"] for k in kernmap.kernels() if k["provider"] == "reference"}
    bound = [b.layer for b in BINDERS]
    assert len(bound) == len(set(bound)), bound
    assert not set(bound) & set(OP_ONLY_LAYERS)
    assert set(bound) | set(OP_ONLY_LAYERS) == registered


class _Broken(nn.Module):
    """Looks like a gated MLP, but reading its projection's weight raises."""

    class _Proj(nn.Module):
        @property
        def weight(self):
            raise RuntimeError("weight is on another rank")

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = self._Proj(), self._Proj(), self._Proj()
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return x


def test_a_module_a_binder_cannot_inspect_falls_back_with_the_reason():
    model = nn.Sequential(_Broken())
    report = kernmap.kernelize(model, mode="training", device="cpu")
    (row,) = [r for r in report.rows if r.layer == "SiluAndMul"]
    assert row.fallback and row.kernel == "reference/silu_and_mul"
    assert "RuntimeError: weight is on another rank" in row.reason
    x = torch.randn(2, 3)
    assert torch.equal(model(x), x)


def test_a_gated_mlp_with_another_activation_gets_a_fallback_row():
    class GeluMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
            self.act_fn = nn.GELU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    report = kernmap.kernelize(GeluMLP(), mode="training", device="cpu")
    assert [(r.layer, r.fallback, r.reason) for r in report.rows] == [
        ("SiluAndMul", True, "act_fn GELU is not SiLU")]
