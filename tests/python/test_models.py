"""The C++ models against transformers on tiny random checkpoints that transformers writes: logits (fp32, relative
1e-5), loss and every parameter's gradient, with reference layers and kernelized; checkpoints written by kernmap
load in transformers with the same logits; malformed checkpoints are rejected with clear errors; `kernmap plan`.

The C++ side runs in tests/cpp/model_probe.cpp (built as kernmap_model_probe); tensors travel as safetensors."""

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("KERNMAP_BUILD", ROOT / "build" / "release"))
PROBE = BUILD / "tests" / "cpp" / "kernmap_model_probe"

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-6, max_position_embeddings=64)
FAMILIES = {
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=True,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Sparse layers 0 and 2, a dense MLP in layer 1 (mlp_only_layers); shared expert; no top-k renormalisation.
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(**COMMON, num_hidden_layers=3, num_experts=6,
                                                      num_experts_per_tok=2, moe_intermediate_size=16,
                                                      shared_expert_intermediate_size=24, mlp_only_layers=[1],
                                                      norm_topk_prob=False)),
    # decoder_sparse_step 2 (layer 1 sparse, layers 0 and 2 dense), renormalised top-k, no q/k/v bias.
    "qwen2_moe_step2": (Qwen2MoeForCausalLM, Qwen2MoeConfig(**COMMON, num_hidden_layers=3, num_experts=4,
                                                            num_experts_per_tok=2, moe_intermediate_size=16,
                                                            shared_expert_intermediate_size=24, decoder_sparse_step=2,
                                                            norm_topk_prob=True, qkv_bias=False)),
    # head_dim 12 != hidden / heads; q/k norm; attention bias.
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**COMMON, num_hidden_layers=2, head_dim=12, num_experts=6,
                                                      num_experts_per_tok=3, moe_intermediate_size=16,
                                                      norm_topk_prob=True, attention_bias=True)),
}


def probe(*args, check=True):
    out = subprocess.run([str(PROBE), *map(str, args)], capture_output=True, text=True, timeout=300)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def randomize(model, seed):
    """Weights far from transformers' tiny init, so that every path (biases, norms, routing) matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else (0.5 if ".gate." in name else 0.1) * noise)


def make_checkpoint(family, path, seed=0, **save_kwargs):
    cls, config = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(config).eval()
    randomize(model, seed)
    model.save_pretrained(path, **save_kwargs)
    return model


def inputs(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (2, 9), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def hf_run(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    made = {}
    for family in FAMILIES:
        made[family] = (make_checkpoint(family, root / family), root / family)
    # The same Qwen3-MoE weights, sharded by transformers.
    make_checkpoint("qwen3_moe", root / "qwen3_moe_sharded", max_shard_size="20KB")
    made["qwen3_moe_sharded"] = (made["qwen3_moe"][0], root / "qwen3_moe_sharded")
    return made


@pytest.mark.parametrize("mode", ["reference", "training"])
@pytest.mark.parametrize("family", list(FAMILIES) + ["qwen3_moe_sharded"])
def test_logits_loss_and_gradients_equal_transformers(checkpoints, family, mode, tmp_path):
    model, path = checkpoints[family]
    if family.endswith("sharded"):
        assert (path / "model.safetensors.index.json").exists()
    ids, labels = inputs(model.config.vocab_size)
    save_file({"input_ids": ids, "labels": labels}, tmp_path / "inputs.safetensors")
    report = json.loads(probe("run", path, tmp_path / "inputs.safetensors", tmp_path / "out.safetensors", mode).stdout)
    for layer in report["layers"]:
        assert layer["fallback"] == (mode == "reference"), layer
        assert layer["kernel"].startswith("reference/" if mode == "reference" else "kernmap/"), layer
    assert {layer["layer"] for layer in report["layers"]} >= ({"RMSNorm", "FusedAddRMSNorm", "rotary_pos_emb", "ForCausalLMLoss"} |
                                                              ({"SiluAndMul"} if family == "qwen2" else {"Experts"}))

    got = load_file(tmp_path / "out.safetensors")
    logits, loss, grads = hf_run(model, ids, labels)
    assert rel_err(got["logits"], logits) <= 1e-5
    assert abs(got["loss"].item() - loss.item()) <= 1e-5 * abs(loss.item())
    cpp_grads = {k[len("grad."):]: v for k, v in got.items() if k.startswith("grad.")}
    assert set(cpp_grads) == set(grads)
    for name, g in grads.items():
        assert rel_err(cpp_grads[name], g) <= 2e-5, name


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("shard", [0, 12000])
def test_checkpoint_written_by_kernmap_loads_in_transformers(checkpoints, family, shard, tmp_path):
    model, path = checkpoints[family]
    probe("save", path, tmp_path / "out", shard)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists() == (shard > 0)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(reloaded) is type(model)
    expected = model.state_dict()
    for name, tensor in reloaded.state_dict().items():  # bit for bit
        assert torch.equal(tensor, expected[name]), name
    ids, _ = inputs(model.config.vocab_size)
    with torch.no_grad():  # not bit for bit: BLAS paths depend on the weights' memory alignment
        assert rel_err(reloaded(input_ids=ids).logits, model(input_ids=ids).logits) <= 1e-6


@pytest.mark.parametrize("preset", ["qwen2-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny"])
def test_presets_load_in_transformers_with_the_same_logits(preset, tmp_path):
    probe("preset", preset, tmp_path / "p")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "p").eval()
    ids, labels = inputs(hf.config.vocab_size)
    save_file({"input_ids": ids, "labels": labels}, tmp_path / "inputs.safetensors")
    probe("run", tmp_path / "p", tmp_path / "inputs.safetensors", tmp_path / "out.safetensors", "inference")
    with torch.no_grad():
        assert rel_err(load_file(tmp_path / "out.safetensors")["logits"], hf(input_ids=ids).logits) <= 1e-5


# ---- malformed checkpoints ----


def read_raw(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_raw(path, header, buffer, raw_header=None):
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + buffer)


def first_tensor(header):
    return next(k for k in header if k != "__metadata__")


def corrupt_offsets_out_of_range(f):
    header, buf = read_raw(f)
    header[first_tensor(header)]["data_offsets"][1] = 1 << 40
    write_raw(f, header, buf)


def corrupt_overlap(f):
    header, buf = read_raw(f)
    # Two same-size tensors; the second is pointed at the first one's bytes.
    same = sorted((header[k]["data_offsets"][0], k) for k in header if k != "__metadata__" and header[k]["shape"] == [32])
    names = [same[0][1], same[-1][1]]  # the later one is moved onto the earlier one's bytes
    header[names[1]]["data_offsets"] = list(header[names[0]]["data_offsets"])
    write_raw(f, header, buf)


def corrupt_dtype(f):
    header, buf = read_raw(f)
    header[first_tensor(header)]["dtype"] = "F13"
    write_raw(f, header, buf)


def corrupt_shape_bytes(f):
    header, buf = read_raw(f)
    header["model.norm.weight"]["shape"] = [33]
    write_raw(f, header, buf)


def corrupt_utf8(f):
    header, buf = read_raw(f)
    raw = json.dumps(header).encode().replace(b"model.norm.weight", b"model.norm.w\xffight")
    write_raw(f, header, buf, raw)


def corrupt_nesting(f):
    _, buf = read_raw(f)
    write_raw(f, None, buf, b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}")


def corrupt_duplicate(f):
    header, buf = read_raw(f)
    raw = json.dumps(header).encode()
    entry = json.dumps({"model.norm.weight": header["model.norm.weight"]}).encode()[1:-1]
    write_raw(f, header, buf, raw[:-1] + b", " + entry + b"}")


def tensors_edit(edit):
    def apply(f):
        tensors = load_file(f)
        edit(tensors)
        save_file(tensors, f)
    return apply


MALFORMED = {
    "truncated": (lambda f: f.write_bytes(f.read_bytes()[:-10]), "file truncated?"),
    "shorter_than_length": (lambda f: f.write_bytes(b"\x01\x02"), "too short for the 8-byte header length"),
    "header_beyond_file": (lambda f: f.write_bytes(struct.pack("<Q", f.stat().st_size) + f.read_bytes()[8:]),
                           "reaches past the end of the file"),
    "header_too_large": (lambda f: f.write_bytes(struct.pack("<Q", 1 << 40) + f.read_bytes()[8:]),
                         "exceeds the limit"),
    "offsets_out_of_range": (corrupt_offsets_out_of_range, "reach past the data buffer"),
    "offsets_overlap": (corrupt_overlap, "overlap tensor"),
    "unknown_dtype": (corrupt_dtype, "unknown dtype 'F13'"),
    "shape_vs_bytes": (corrupt_shape_bytes, "tensor 'model.norm.weight': shape [33] of F32 needs 132 bytes, but "
                                            "data_offsets span 128"),
    "not_utf8": (corrupt_utf8, "header is not valid UTF-8"),
    "deep_nesting": (corrupt_nesting, "nested deeper than"),
    "duplicate_key": (corrupt_duplicate, "has the key 'model.norm.weight' twice"),
    "not_json": (lambda f: write_raw(f, None, read_raw(f)[1], b'{"a": [1, 2'), "header is not valid JSON"),
    # nlohmann's parser stops at a NUL byte: the header's JSON followed by a NUL and more bytes.
    "nul_after_json": (lambda f: write_raw(f, None, read_raw(f)[1],
                                           json.dumps(read_raw(f)[0]).encode() + b"\0 garbage"),
                       "header is not valid JSON: a NUL byte at offset"),
    "missing_tensor": (tensors_edit(lambda t: t.pop("model.norm.weight")), "missing tensor 'model.norm.weight'"),
    "wrong_shape_for_config": (tensors_edit(lambda t: t.update({"model.norm.weight": torch.ones(33)})),
                               "tensor 'model.norm.weight' has shape [33], but config.json gives [32]"),
    "integer_dtype": (tensors_edit(lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int32)})),
                      "has dtype I32; a parameter needs"),
    "unexpected_tensor": (tensors_edit(lambda t: t.update({"model.extra": torch.ones(2)})),
                          "tensor 'model.extra' is not a parameter"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoint_is_rejected_with_a_clear_error(checkpoints, case, tmp_path):
    corrupt, message = MALFORMED[case]
    shutil.copytree(checkpoints["qwen2"][1], tmp_path / "ckpt")
    corrupt(tmp_path / "ckpt" / "model.safetensors")
    out = probe("load", tmp_path / "ckpt", check=False)
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)  # an error, not a crash
    assert message in out.stderr
    if case not in ("missing_tensor", "unexpected_tensor", "wrong_shape_for_config", "integer_dtype"):
        assert "model.safetensors: safetensors:" in out.stderr


def test_sharded_index_cannot_point_outside_the_folder(checkpoints, tmp_path):
    shutil.copytree(checkpoints["qwen3_moe_sharded"][1], tmp_path / "ckpt")
    index_path = tmp_path / "ckpt" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "../../etc/passwd.safetensors"
    index_path.write_text(json.dumps(index))
    out = probe("load", tmp_path / "ckpt", check=False)
    assert out.returncode == 1 and "is not a .safetensors file name in the checkpoint folder" in out.stderr


def test_sharded_index_with_bytes_after_a_nul_is_refused(checkpoints, tmp_path):
    shutil.copytree(checkpoints["qwen3_moe_sharded"][1], tmp_path / "ckpt")
    index_path = tmp_path / "ckpt" / "model.safetensors.index.json"
    index_path.write_bytes(index_path.read_bytes() + b"\0{not json")
    out = probe("load", tmp_path / "ckpt", check=False)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "model.safetensors.index.json: not valid JSON: a NUL byte at offset" in out.stderr


def test_sharded_index_disagreeing_with_the_shards(checkpoints, tmp_path):
    shutil.copytree(checkpoints["qwen3_moe_sharded"][1], tmp_path / "ckpt")
    index_path = tmp_path / "ckpt" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][name] = shards[1]
    index_path.write_text(json.dumps(index))
    out = probe("load", tmp_path / "ckpt", check=False)
    # Either the shard it moved from holds a tensor the index does not place there, or (when it was that shard's
    # only tensor) the shard it moved to lacks it.
    assert out.returncode == 1, out.stderr
    assert (f"tensor '{name}' is listed in model.safetensors.index.json under" in out.stderr or
            f"missing tensor '{name}' (model.safetensors.index.json lists it in {shards[1]}, which lacks it)" in out.stderr)


# ---- kernmap plan ----


def test_plan_qwen3_moe_tiny_maps_every_layer_to_a_kernmap_kernel(run_cli):
    out = run_cli("plan", "--preset", "qwen3-moe-tiny", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["device"] == "cpu" and doc["mode"] == "training"
    layers = {layer["layer"] for layer in doc["layers"]}
    assert layers == {"RMSNorm", "FusedAddRMSNorm", "rotary_pos_emb", "Experts", "ForCausalLMLoss"}
    for layer in doc["layers"]:
        assert not layer["fallback"] and layer["kernel"].startswith("kernmap/"), layer
    text = run_cli("plan", "--preset", "qwen3-moe-tiny")
    assert "model.layers.0.mlp.experts" in text.stdout and "kernmap/experts" in text.stdout


def test_plan_reads_a_transformers_checkpoint_without_its_weights(checkpoints, tmp_path, run_cli):
    shutil.copy(checkpoints["qwen2_moe"][1] / "config.json", tmp_path / "config.json")  # config only
    out = run_cli("plan", "--model", str(tmp_path), "--mode", "inference", "--json")
    assert out.returncode == 0, out.stderr
    paths = {layer["path"]: layer for layer in json.loads(out.stdout)["layers"]}
    assert paths["model.layers.1.mlp"]["layer"] == "SiluAndMul"  # mlp_only_layers
    assert paths["model.layers.0.mlp.shared_expert"]["kernel"] == "kernmap/silu_and_mul"
    assert paths["model.layers.2.mlp.experts"]["kernel"] == "kernmap/experts"


def test_plan_errors(run_cli):
    assert "give exactly one of" in run_cli("plan").stderr
    assert "unknown preset 'nope'" in run_cli("plan", "--preset", "nope").stderr


def test_plan_shows_the_reference_and_the_reason_when_a_layer_is_disabled(run_cli):
    out = run_cli("plan", "--preset", "qwen3-moe-tiny", "--json", env={"KERNMAP_DISABLE": "Experts"})
    for layer in json.loads(out.stdout)["layers"]:
        if layer["layer"] == "Experts":
            assert layer["kernel"] == "reference/experts" and layer["reason"] == "disabled by KERNMAP_DISABLE"
        else:
            assert layer["kernel"].startswith("kernmap/") and not layer["fallback"], layer
