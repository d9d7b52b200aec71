"""The Python mapping API is the C++ registry (one source of truth): registrations, scopes, Python callables as
kernels with descriptors, the Report and its fallback reasons, and transformers' experts-implementation hook."""

import copy
import itertools

import pytest
import torch

import kernmap
from hf_models import batch, make_model


@pytest.fixture(autouse=True)
def _clean_user_mappings():
    yield
    kernmap.clear_user_mappings()


class Recorder:
    """A Python kernel that records its calls and computes with a given function."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def python_kernel(name, layer, fn, **descriptor):
    return kernmap.register_kernel(kernmap.Kernel(name=name, layer=layer, fn=Recorder(fn), **descriptor))


RMS_FP32_NO_BACKWARD = python_kernel("test/rms_norm_fp32", "RMSNorm", torch.ops.kernmap.reference_rms_norm,
                                     devices=("cpu",), dtypes=("float32",), has_backward=False)


def test_builtin_cpp_kernels_and_python_kernels_share_one_registry():
    names = {k["name"]: k for k in kernmap.kernels()}
    assert names["kernmap/rms_norm"]["op"] == "kernmap::rms_norm"  # registered by C++ at library load
    assert names["test/rms_norm_fp32"]["op"] == "" and names["test/rms_norm_fp32"]["dtypes"] == ["float32"]
    assert names["test/rms_norm_fp32"]["has_backward"] is False
    kernmap.register_mapping({"RMSNorm": {"cpu": {"inference": "test/rms_norm_fp32"}}})
    assert kernmap.effective_mapping()["RMSNorm"]["cpu"] == {"inference": "test/rms_norm_fp32"}
    d = kernmap.resolve("RMSNorm", "cpu", "inference", torch.float32)
    assert (d.kernel, d.source, d.fallback) == ("test/rms_norm_fp32", "user", False)
    assert d.callable() is RMS_FP32_NO_BACKWARD.fn


def test_errors_come_from_the_cpp_registry():
    with pytest.raises(kernmap.KernmapError, match="unknown layer 'NoSuchLayer'"):
        kernmap.register_mapping({"NoSuchLayer": {"cpu": "kernmap/rms_norm"}})
    with pytest.raises(kernmap.KernmapError, match="implements layer 'RMSNorm'"):
        kernmap.register_mapping({"SiLU": {"cpu": "kernmap/rms_norm"}})
    with pytest.raises(kernmap.KernmapError, match="is not registered"):
        kernmap.register_mapping({"RMSNorm": {"cpu": "nobody/rms_norm"}})
    with pytest.raises(kernmap.KernmapError, match="sometimes"):
        kernmap.register_mapping({"RMSNorm": {"cpu": {"sometimes": "kernmap/rms_norm"}}})
    with pytest.raises(kernmap.KernmapError, match="already"):
        kernmap.register_kernel(kernmap.Kernel(name="test/rms_norm_fp32", layer="RMSNorm", fn=lambda *a: None))


def test_use_mapping_scopes_nest_inherit_and_end():
    assert kernmap.resolve("RMSNorm", "cpu", "inference").kernel == "kernmap/rms_norm"
    with kernmap.use_mapping({"RMSNorm": {"cpu": "test/rms_norm_fp32"}}):
        assert kernmap.resolve("RMSNorm", "cpu", "inference").source == "scoped"
        with kernmap.use_mapping({"SiLU": {"cpu": {}}}, inherit=False):
            assert kernmap.resolve("RMSNorm", "cpu", "inference").reason == "no mapping for cpu"
        assert kernmap.resolve("RMSNorm", "cpu", "inference").kernel == "test/rms_norm_fp32"
    assert kernmap.resolve("RMSNorm", "cpu", "inference").kernel == "kernmap/rms_norm"


def test_python_supports_check_runs_inside_cpp_resolution():
    kernel = kernmap.register_kernel(kernmap.Kernel(
        name="test/rms_norm_wide", layer="RMSNorm", fn=torch.ops.kernmap.reference_rms_norm, has_backward=True,
        supports=lambda inputs: None if inputs["shapes"] and inputs["shapes"][0][-1] >= 64 else "needs H >= 64"))
    with kernmap.use_mapping({"RMSNorm": {"cpu": kernel}}):
        assert kernmap.resolve("RMSNorm", "cpu", "training", shapes=[[4, 32], [32]]).reason == "needs H >= 64"
        assert kernmap.resolve("RMSNorm", "cpu", "training", shapes=[[4, 64], [64]]).kernel == "test/rms_norm_wide"


def test_python_kernel_runs_in_a_kernelized_model():
    model = make_model("qwen2")
    reference = copy.deepcopy(model)
    with kernmap.use_mapping({"RMSNorm": {"cpu": "test/rms_norm_fp32"}}):
        report = kernmap.kernelize(model, mode="inference")
    rows = report.by_layer()["RMSNorm"]
    assert {r.kernel for r in rows} == {"test/rms_norm_fp32"} and not any(r.fallback for r in rows)
    before = RMS_FP32_NO_BACKWARD.fn.calls
    with torch.no_grad():
        torch.testing.assert_close(model(batch()).logits, reference(batch()).logits)
    assert RMS_FP32_NO_BACKWARD.fn.calls - before == len(rows)


def test_report_fallback_reasons_dtype_backward_and_disable(monkeypatch):
    with kernmap.use_mapping({"RMSNorm": {"cpu": "test/rms_norm_fp32"}}):
        bf16 = kernmap.kernelize(make_model("qwen2", torch.bfloat16), mode="inference")
        training = kernmap.kernelize(make_model("qwen2"), mode="training")
    for report, reason in ((bf16, "dtype bfloat16 not supported by test/rms_norm_fp32"),
                           (training, "test/rms_norm_fp32 has no backward")):
        rows = report.by_layer()["RMSNorm"]
        assert all(r.fallback and r.kernel == "reference/rms_norm" and r.reason == reason for r in rows), str(report)
        assert not any(r.fallback for r in report.rows if r.layer != "RMSNorm")
        assert reason in str(report)

    monkeypatch.setenv("KERNMAP_DISABLE", "SiluAndMul")
    report = kernmap.kernelize(make_model("qwen2_moe"), mode="training")
    disabled = [r for r in report.rows if r.reason == "disabled by KERNMAP_DISABLE"]
    assert [r.path for r in disabled] == ["model.layers.0.mlp.shared_expert", "model.layers.1.mlp.shared_expert"]
    assert len(report.fallbacks) == 2


def test_report_table_and_dict():
    report = kernmap.kernelize(make_model("qwen3_moe"), mode="training")
    text = str(report)
    assert text.splitlines()[0] == "kernmap.kernelize on cpu (training): 16 of 16 layers replaced, 0 fallbacks"
    experts_line = next(line for line in text.splitlines() if line.startswith("model.layers.1.mlp.experts "))
    assert experts_line.split() == ["model.layers.1.mlp.experts", "Qwen3MoeExperts", "Experts", "kernmap/experts",
                                    "default", "mapping", "(training)"]
    assert report.to_dict()["rows"][0] == {"path": "", "module": "Qwen3MoeForCausalLM", "layer": "ForCausalLMLoss",
                                           "kernel": "kernmap/linear_cross_entropy", "fallback": False,
                                           "reason": report.rows[0].reason, "error": None, "tolerance": None}
    assert "error / tolerance" not in text  # only a verified report has the column (tests/python/test_verify.py)


def test_use_fallback_false_raises_with_the_report_and_leaves_the_model_alone(monkeypatch):
    model = make_model("llama")
    monkeypatch.setenv("KERNMAP_DISABLE", "RMSNorm")
    with pytest.raises(kernmap.KernelizeError, match="disabled by KERNMAP_DISABLE") as info:
        kernmap.kernelize(model, mode="training", use_fallback=False)
    assert len(info.value.report.fallbacks) == 5
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_training_with_a_kernel_without_backward_falls_back_and_still_trains():
    no_backward = python_kernel("test/experts_no_backward", "Experts", torch.ops.kernmap.experts, has_backward=False)
    model = make_model("mixtral")
    with kernmap.use_mapping({"Experts": {"cpu": no_backward}}):
        report = kernmap.kernelize(model, mode="training")
    assert {r.reason for r in report.by_layer()["Experts"]} == {"test/experts_no_backward has no backward"}
    model(batch(), labels=batch()).loss.backward()
    assert no_backward.fn.calls == 0
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None


# ---- transformers' experts-implementation hook ------------------------------------------------------------------


_recording_serial = itertools.count()


def recording_experts():
    # a fresh name per call: kernels stay registered for the process, and id() of a freed object repeats
    return python_kernel(f"test/experts_recording_{next(_recording_serial)}", "Experts", torch.ops.kernmap.experts,
                         has_backward=True)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_from_pretrained_with_experts_implementation_kernmap(family, tmp_path):
    model = make_model(family)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, experts_implementation="kernmap")
    assert loaded.config._experts_implementation == "kernmap"
    kernel = recording_experts()
    with kernmap.use_mapping({"Experts": {"cpu": kernel}}):
        out = loaded(batch(), labels=batch())
    assert kernel.fn.calls == 2  # one per decoder layer
    want = model(batch(), labels=batch())
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
    out.loss.backward()  # the call-time resolution picked a training kernel (it has a backward)


def test_set_experts_implementation_kernmap_uses_the_resolved_kernel():
    model = make_model("qwen3_moe")
    want = model(batch()).logits
    model.set_experts_implementation("kernmap")
    assert model.config._experts_implementation == "kernmap"
    kernel = recording_experts()
    with kernmap.use_mapping({"Experts": {"cpu": kernel}}), torch.no_grad():
        got = model(batch()).logits
    assert kernel.fn.calls == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_experts_layout_kernmap_does_not_take_falls_back_with_a_reason():
    model = make_model("qwen2_moe")
    reference = copy.deepcopy(model)
    experts = model.model.layers[0].mlp.experts
    experts.has_bias = True  # as if the class carried expert biases (GPT-OSS style)
    experts.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(4, 32))
    experts.down_proj_bias = torch.nn.Parameter(torch.zeros(4, 32))
    report = kernmap.kernelize(model, mode="training")
    rows = report.by_layer()["Experts"]
    assert rows[0].fallback and rows[0].reason == "expert biases not supported by kernmap experts"
    assert not rows[1].fallback
    torch.testing.assert_close(model(batch()).logits, reference(batch()).logits, rtol=1e-5, atol=1e-5)
