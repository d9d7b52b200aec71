"""The NPU mapping's logic, with a stand-in for torch_npu: no NPU exists on this machine, so a module with the
same three functions (npu_rms_norm, npu_swiglu, npu_grouped_matmul) records each call's arguments and computes
the documented math on CPU tensors. kernelize(device="npu") then routes a real transformers model through it."""

import copy
import types

import pytest
import torch

import kernmap
from hf_models import batch, make_model


class StandInTorchNpu(types.ModuleType):
    """Records calls; checks torch_npu's argument conventions; computes with ATen."""

    def __init__(self):
        super().__init__("torch_npu_stand_in")
        self.calls = []

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        self.calls.append(("npu_rms_norm", tuple(x.shape), epsilon))
        h = x.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + epsilon)
        return gamma * (h * rstd).to(x.dtype), rstd

    def npu_swiglu(self, x, dim=-1):
        self.calls.append(("npu_swiglu", tuple(x.shape), dim))
        gate, up = x.chunk(2, dim=dim)
        return torch.nn.functional.silu(gate) * up

    def npu_grouped_matmul(self, x, weight, *, group_list, split_item, group_type, group_list_type):
        assert isinstance(x, list) and isinstance(weight, list) and len(x) == len(weight) == 1
        assert (split_item, group_type, group_list_type) == (2, 0, 0)  # one output; cumulative group ends
        assert group_list.dtype == torch.int64 and group_list.shape == (weight[0].shape[0],)
        self.calls.append(("npu_grouped_matmul", tuple(x[0].shape), tuple(weight[0].shape)))
        out, start = [], 0
        for e, end in enumerate(group_list.tolist()):
            out.append(x[0][start:end] @ weight[0][e])
            start = end
        return [torch.cat(out)]


@pytest.fixture(scope="module")
def npu():
    stand_in = StandInTorchNpu()
    kernmap.npu.register(stand_in)
    return stand_in


def test_npu_defaults_resolve_to_torch_npu_kernels(npu):
    for layer, kernel in (("RMSNorm", "npu/rms_norm"), ("SiluAndMul", "npu/silu_and_mul"),
                          ("GroupedMM", "npu/grouped_mm"), ("Experts", "npu/experts")):
        for mode in ("inference", "training"):
            d = kernmap.resolve(layer, "npu", mode, torch.bfloat16)
            assert (d.kernel, d.source, d.fallback) == (kernel, "default", False)
    d = kernmap.resolve("RMSNorm", "npu", "training+compile")
    assert d.fallback and d.reason == "npu/rms_norm is not compile-safe"
    assert kernmap.resolve("RMSNorm", "npu", "inference", torch.float64).reason == \
        "dtype float64 not supported by npu/rms_norm"
    assert kernmap.resolve("RMSNorm", "cpu", "training").kernel == "kernmap/rms_norm"  # cpu untouched


def test_npu_grouped_mm_matches_reference(npu):
    a, b = torch.randn(7, 5), torch.randn(3, 6, 5).transpose(1, 2)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)
    fn = kernmap.resolve("GroupedMM", "npu", "training").callable()
    torch.testing.assert_close(fn(a, b, offs), torch.ops.kernmap.reference_grouped_mm(a, b, offs))
    assert npu.calls[-1] == ("npu_grouped_matmul", (7, 5), (3, 5, 6))


@pytest.mark.parametrize("family", ["qwen2", "qwen2_moe"])
def test_kernelize_for_npu_routes_every_layer_through_torch_npu(npu, family):
    model = make_model(family)
    reference = copy.deepcopy(model)
    report = kernmap.kernelize(model, mode="training", device="npu")
    kernels = {r.layer: r.kernel for r in report.rows if not r.fallback}
    assert kernels.get("RMSNorm") == "npu/rms_norm"
    if family == "qwen2_moe":
        assert kernels["Experts"] == "npu/experts" and kernels["SiluAndMul"] == "npu/silu_and_mul"
    else:
        assert kernels["SiluAndMul"] == "npu/silu_and_mul"
    # SiLU has no NPU kernel in the mapping: the report says so.
    assert {r.reason for r in report.rows if r.layer == "SiLU"} == {"no mapping for npu"}

    npu.calls.clear()
    ids = batch()
    got = model(ids, labels=ids)
    want = reference(ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    got.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")

    names = [c[0] for c in npu.calls]
    assert names.count("npu_rms_norm") == len(report.by_layer()["RMSNorm"])
    assert all(c[2] == model.config.rms_norm_eps for c in npu.calls if c[0] == "npu_rms_norm")
    assert all(c[2] == -1 for c in npu.calls if c[0] == "npu_swiglu")
    if family == "qwen2_moe":
        # per layer: the shared expert's swiglu, and the experts' two grouped products around one swiglu
        assert names.count("npu_grouped_matmul") == 4 and names.count("npu_swiglu") == 4
    else:
        assert names.count("npu_swiglu") == 2 and "npu_grouped_matmul" not in names
