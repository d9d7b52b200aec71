"""Mapping files from Python and the CLI: one C++ parser behind kernmap.load_mapping_file, register_mapping(path),
use_mapping(path) and `kernmap ... --mapping FILE`; equivalent JSON and TOML files give one mapping, and a bad file
gives the location and the problem (Python: KernmapError; CLI: exit code 2, no crash)."""

import json

import pytest

import kernmap

TOML = """\
# RMSNorm on cpu: the reference for inference, the fused kernel for training
[RMSNorm.cpu]
inference = "reference/rms_norm"
training = "kernmap/rms_norm"

[SiluAndMul]
cpu = "reference/silu_and_mul"   # shorthand: the fallback entry
"""

JSON = {
    "kernmap_mapping": 1,
    "RMSNorm": {"cpu": {"inference": "reference/rms_norm", "training": "kernmap/rms_norm"}},
    "SiluAndMul": {"cpu": "reference/silu_and_mul"},
}

EXPECTED = {
    "RMSNorm": {"cpu": {"inference": "reference/rms_norm", "training": "kernmap/rms_norm"}},
    "SiluAndMul": {"cpu": {"fallback": "reference/silu_and_mul"}},
}


@pytest.fixture(autouse=True)
def _clean_user_mappings():
    yield
    kernmap.clear_user_mappings()


@pytest.fixture
def files(tmp_path):
    toml = tmp_path / "kernmap.toml"
    toml.write_text(TOML)
    js = tmp_path / "kernmap.json"
    js.write_text(json.dumps(JSON))
    return toml, js


def test_json_and_toml_load_to_the_same_mapping(files):
    toml, js = files
    assert kernmap.load_mapping_file(toml) == EXPECTED
    assert kernmap.load_mapping_file(str(js)) == EXPECTED


def test_register_mapping_takes_a_path(files):
    toml, _ = files
    assert kernmap.resolve("RMSNorm", "cpu", "inference").kernel == "kernmap/rms_norm"
    kernmap.register_mapping(toml)  # a pathlib.Path
    d = kernmap.resolve("RMSNorm", "cpu", "inference")
    assert (d.kernel, d.source) == ("reference/rms_norm", "user")
    assert kernmap.resolve("RMSNorm", "cpu", "training").kernel == "kernmap/rms_norm"
    assert kernmap.resolve("SiluAndMul", "cpu", "training").kernel == "reference/silu_and_mul"


def test_use_mapping_takes_a_path_and_ends_with_the_block(files):
    _, js = files
    with kernmap.use_mapping(str(js)):
        d = kernmap.resolve("SiluAndMul", "cpu", "inference")
        assert (d.kernel, d.source) == ("reference/silu_and_mul", "scoped")
    assert kernmap.resolve("SiluAndMul", "cpu", "inference").kernel == "kernmap/silu_and_mul"


def test_python_kernel_named_in_a_file(tmp_path):
    # A kernel registered from Python before the file is loaded is a known kernel (validation happens at load).
    kernel = kernmap.Kernel(name="mfpy/rms_norm", layer="RMSNorm", fn=lambda x, w, eps: x, devices=("cpu",))
    kernmap.register_kernel(kernel)
    path = tmp_path / "py.toml"
    path.write_text('RMSNorm.cpu.inference = "mfpy/rms_norm"\n')
    with kernmap.use_mapping(path):
        assert kernmap.resolve("RMSNorm", "cpu", "inference").kernel == "mfpy/rms_norm"


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("layer.toml", '[RMSNrom]\ncpu = "kernmap/rms_norm"\n', "layer.toml:1:2: unknown layer 'RMSNrom' (known: "),
        ("device.toml", '[RMSNorm]\ncdua = "kernmap/rms_norm"\n', "device.toml:2:1: unknown device 'cdua'"),
        ("mode.toml", '[RMSNorm.cpu]\ntrain = "kernmap/rms_norm"\n',
         "mode.toml:2:1: unknown mode 'train' (accepted: inference, training, inference+compile, training+compile, "
         "fallback)"),
        ("kernel.json", '{"RMSNorm": {"cpu": {"training": "kernmap/rms_nrom"}}}',
         "kernel.json: /RMSNorm/cpu/training: unknown kernel 'kernmap/rms_nrom'"),
        ("other.json", '{"RMSNorm": {"cpu": "kernmap/silu"}}',
         "other.json: /RMSNorm/cpu: kernel 'kernmap/silu' for layer 'RMSNorm' on device 'cpu' (fallback) implements "
         "layer 'SiLU', not 'RMSNorm'"),
        ("type.toml", "[RMSNorm]\ncpu = 7\n", "type.toml:2:7: device 'cpu' of layer 'RMSNorm' must map to a kernel name "
         "(a string) or a table {mode: kernel}, got an integer"),
        ("syntax.json", '{"RMSNorm": {"cpu": }}', "syntax.json:1:21: invalid JSON: syntax error"),
        ("mapping.yaml", "RMSNorm: {}\n", "mapping.yaml: unknown mapping file type '.yaml' (expected a file name ending "
         "in .json or .toml)"),
    ],
)
def test_errors_give_location_and_problem(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(kernmap.KernmapError) as info:
        kernmap.load_mapping_file(path)
    assert str(info.value).startswith(f"{tmp_path}/{message}"), str(info.value)
    with pytest.raises(kernmap.KernmapError):
        kernmap.register_mapping(path)
    assert kernmap.resolve("RMSNorm", "cpu", "training").source == "default"  # nothing was registered


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(kernmap.KernmapError, match="cannot open the mapping file: No such file or directory"):
        kernmap.register_mapping(tmp_path / "nope.toml")


def plan_kernels(stdout):
    return {row["path"]: row["kernel"] for row in json.loads(stdout)["layers"]}


def test_cli_plan_shows_the_mapped_kernel(files, run_cli):
    toml, js = files
    base = run_cli("plan", "--preset", "qwen2-tiny", "--mode", "inference", "--json")
    assert base.returncode == 0, base.stderr
    assert plan_kernels(base.stdout)["model.layers.0.input_layernorm"] == "kernmap/rms_norm"
    for path in (toml, js):
        out = run_cli("plan", "--preset", "qwen2-tiny", "--mode", "inference", "--json", "--mapping", str(path))
        assert out.returncode == 0, out.stderr
        kernels = plan_kernels(out.stdout)
        assert kernels["model.layers.0.input_layernorm"] == "reference/rms_norm"
        assert kernels["model.layers.0.mlp"] == "reference/silu_and_mul"


def test_cli_applies_mapping_files_in_order(tmp_path, files, run_cli):
    toml, _ = files
    later = tmp_path / "later.json"
    later.write_text('{"RMSNorm": {"cpu": "kernmap/rms_norm"}}')
    out = run_cli("plan", "--preset", "qwen2-tiny", "--mode", "inference", "--json", "--mapping", str(toml),
                      f"--mapping={later}")
    assert out.returncode == 0, out.stderr
    kernels = plan_kernels(out.stdout)
    assert kernels["model.layers.0.input_layernorm"] == "kernmap/rms_norm"  # the later file's (RMSNorm, cpu) entry replaced the first's
    assert kernels["model.layers.0.mlp"] == "reference/silu_and_mul"  # the first file's other entries stay


def test_cli_kernels_command_takes_mapping(files, run_cli):
    toml, _ = files
    doc = json.loads(run_cli("kernels", "--json", "--mapping", str(toml)).stdout)
    d = {(r["layer"], r["device"], r["mode"]): r for r in doc["resolution"]}
    assert d[("RMSNorm", "cpu", "inference")]["kernel"] == "reference/rms_norm"
    assert d[("RMSNorm", "cpu", "training")]["kernel"] == "kernmap/rms_norm"


@pytest.mark.parametrize("command", [["kernels"], ["plan", "--preset", "qwen2-tiny"], ["train", "--preset", "qwen2-tiny"],
                                     ["align", "--preset", "qwen2-tiny"], ["ablate", "--preset", "qwen2-tiny"],
                                     ["bench", "ops"]])
def test_cli_bad_mapping_file_stops_every_command_with_exit_code_2(tmp_path, command, run_cli):
    bad = tmp_path / "bad.toml"
    bad.write_text('[RMSNorm.cpu]\ntraining = "kernmap/nope"\n')
    out = run_cli(*command, "--mapping", str(bad))
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stderr == (f"kernmap {command[0]}: {bad}:2:12: unknown kernel 'kernmap/nope' for layer 'RMSNorm' on "
                          "device 'cpu' (training) (registered kernels of layer 'RMSNorm': float64/rms_norm, "
                          "kernmap/rms_norm, reference/rms_norm)\n")
    assert out.stdout == ""


def test_cli_mapping_without_a_file(run_cli):
    out = run_cli("plan", "--preset", "qwen2-tiny", "--mapping")
    assert out.returncode == 2
    assert out.stderr == "kernmap plan: --mapping needs a file (.json or .toml)\n"


def test_cli_usage_mentions_mapping(run_cli):
    assert "--mapping FILE" in run_cli("--help").stdout


def test_huge_and_deep_files_are_refused_cleanly(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200000 + "]" * 200000)
    with pytest.raises(kernmap.KernmapError, match=r"deep.json: (/0)+: nested deeper than 16 levels"):
        kernmap.load_mapping_file(deep)
    huge = tmp_path / "huge.toml"
    huge.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(kernmap.KernmapError, match="huge.toml: the file is larger than the 1048576-byte limit"):
        kernmap.load_mapping_file(huge)
