"""Plugins from Python and the CLI, each in a fresh process (plugins stay loaded for the life of a process): loading
from KERNMAP_PATH at import, kernelize running the plugin's kernel, strict loading, import warnings, `kernmap
kernels` and `kernmap lock`. The test plugins are real shared libraries built by tests/plugins/CMakeLists.txt."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = Path(os.environ.get("KERNMAP_BUILD", ROOT / "build" / "release")) / "tests" / "plugins"

pytestmark = pytest.mark.skipif(not (PLUGINS / "libkmgood.so").is_file(),
                                reason=f"test plugins not built in {PLUGINS} (run scripts/setup)")


def process_facts():
    import torch

    return {"torch": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
            "cxx11_abi": bool(torch.compiled_with_cxx11_abi()), "arch": os.uname().machine, "os": "linux"}


def add_package(repo: Path, folder: str, name: str, plugin: str, **changes) -> Path:
    lib = repo / folder / "lib" / f"lib{plugin}.so"
    lib.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PLUGINS / f"lib{plugin}.so", lib)
    variant = {"library": f"lib/lib{plugin}.so", "sha256": hashlib.sha256(lib.read_bytes()).hexdigest(),
               **process_facts(), "toolkits": {}}
    variant.update(changes)
    manifest = {"name": name, "version": "1.0.0", "plugin_abi": 1, "description": f"test package {name}",
                "variants": [variant]}
    (repo / folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return lib


def run_python(code: str, **env):
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=300)


def test_import_loads_kernmap_path_and_kernelize_runs_the_plugin_kernel(tmp_path):
    lib = add_package(tmp_path, "kmgood", "kmgood", "kmgood")
    add_package(tmp_path, "throws", "kmthrows", "kmthrows")
    out = run_python(f"""
        import ctypes, json, os, warnings
        import torch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import kernmap
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

        report = kernmap.plugin_report()
        states = {{p["name"]: (p["state"], p["reason"]) for p in report["packages"]}}
        kernmap.register_mapping({{"RMSNorm": {{"cpu": {{"inference": "kmgood/rms_norm", "training": "kmgood/rms_norm"}}}}}})
        norm = Qwen2RMSNorm(11, eps=1e-6)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(4, 11)
        expected = norm(x)
        rows = kernmap.kernelize(norm, mode="training", device="cpu").rows
        plugin = ctypes.CDLL({str(os.path.realpath(lib))!r}, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        before = plugin.kmgood_calls()
        y = norm(x)
        print(json.dumps({{
            "warnings": [str(w.message) for w in caught],
            "states": states,
            "kernel": rows[0].kernel,
            "calls": plugin.kmgood_calls() - before,
            "max_error": (y - expected).abs().max().item(),
            "npu": kernmap.resolve("RMSNorm", "npu", "inference").kernel,
            "again": [(p["state"], p["reason"]) for p in kernmap.load_plugins()["packages"] if p["name"] == "kmgood"],
        }}))
    """, KERNMAP_PATH=str(tmp_path))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["states"]["kmgood"] == ["loaded", ""]
    assert doc["states"]["kmthrows"][0] == "refused"
    assert "boom from kmthrows" in doc["states"]["kmthrows"][1]
    assert any("plugin package" in w and "boom from kmthrows" in w for w in doc["warnings"]), doc["warnings"]
    assert doc["kernel"] == "kmgood/rms_norm"
    assert doc["calls"] == 1
    assert doc["max_error"] < 1e-6
    assert doc["npu"] == "kmgood/rms_norm_npu"
    assert doc["again"] == [["loaded", "already loaded (no-op)"]]


def test_strict_load_raises_with_the_report_and_import_never_raises(tmp_path):
    add_package(tmp_path, "bad-sha", "kmsha", "kmzero", sha256="0" * 64)
    out = run_python(f"""
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import kernmap
        try:
            kernmap.load_plugins([{str(tmp_path)!r}], strict=True)
            result = "no error"
        except kernmap.KernmapError as e:
            result = str(e)
        print(json.dumps({{"warnings": [str(w.message) for w in caught], "result": result,
                           "resolves": kernmap.resolve("RMSNorm", "cpu", "training").kernel}}))
    """, KERNMAP_PATH=str(tmp_path), KERNMAP_TOOLKITS="not-a-pair")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    # A malformed KERNMAP_TOOLKITS fails the import-time load: a warning, and kernmap still imports.
    assert any("KERNMAP_TOOLKITS: entry 'not-a-pair'" in w for w in doc["warnings"]), doc["warnings"]
    assert doc["resolves"] == "kernmap/rms_norm"
    assert "KERNMAP_TOOLKITS: entry 'not-a-pair'" in doc["result"]  # an explicit load raises it

    out = run_python(f"""
        import json, kernmap
        try:
            kernmap.load_plugins({str(tmp_path)!r}, strict=True)
            result = "no error"
        except kernmap.PluginError as e:
            result = [str(e), e.report["packages"][0]["state"]]
        print(json.dumps(result))
    """)
    assert out.returncode == 0, out.stderr
    message, state = json.loads(out.stdout.strip().splitlines()[-1])
    assert state == "refused"
    assert "1 plugin package(s) refused" in message and "sha256 mismatch" in message and "0" * 64 in message


def test_cli_lists_repositories_packages_and_reasons(tmp_path, run_cli):
    add_package(tmp_path, "kmgood", "kmgood", "kmgood")
    add_package(tmp_path, "old-torch", "kmold", "kmzero", torch="1.13")
    (tmp_path / "not-elf" / "lib").mkdir(parents=True)
    (tmp_path / "not-elf" / "lib" / "libkmzero.so").write_text("text")
    add_package(tmp_path, "zero", "kmzero", "kmzero")
    out = run_cli("kernels", "--json", env={"KERNMAP_PATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    plugins = json.loads(out.stdout)["plugins"]
    assert plugins["repositories"] == [{"path": str(tmp_path), "has_lock": False, "error": ""}]
    by_folder = {p["folder"]: p for p in plugins["packages"]}
    assert by_folder["kmgood"]["state"] == "loaded"
    assert by_folder["kmgood"]["kernels"] == ["kmgood/rms_norm", "kmgood/rms_norm_npu"]
    assert by_folder["old-torch"]["state"] == "skipped" and "needs torch 1.13" in by_folder["old-torch"]["reason"]
    assert by_folder["not-elf"]["state"] == "refused" and "no manifest.json" in by_folder["not-elf"]["reason"]
    assert by_folder["zero"]["state"] == "skipped"
    assert by_folder["zero"]["reason"] == "the plugin's score is 0: no acme NPU on this machine"
    assert "refused: no manifest.json" in out.stderr

    text = run_cli("kernels", env={"KERNMAP_PATH": str(tmp_path)})
    assert text.returncode == 0, text.stderr
    assert "Kernel repositories (KERNMAP_PATH)" in text.stdout
    assert "kmgood/rms_norm,kmgood/rms_norm_npu" in text.stdout
    assert "no acme NPU on this machine" in text.stdout


def test_cli_lock_pins_hashes_equal_to_hashlib_and_refuses_a_mismatch(tmp_path, run_cli):
    good = add_package(tmp_path, "kmgood", "kmgood", "kmgood")
    out = run_cli("lock", str(tmp_path))
    assert out.returncode == 0, out.stderr
    lock = json.loads((tmp_path / "kernmap.lock").read_text())
    # kernmap's own SHA-256 against Python's hashlib on a real shared library.
    assert lock == {"lock_version": 1,
                    "packages": {"kmgood": {"version": "1.0.0", "sha256": [hashlib.sha256(good.read_bytes()).hexdigest()]}}}

    # A locked repository loads; a library changed after locking is refused (its manifest updated to match).
    add_package(tmp_path, "kmgood", "kmgood", "kmrival")
    out = run_cli("kernels", "--json", env={"KERNMAP_PATH": str(tmp_path)})
    package = json.loads(out.stdout)["plugins"]["packages"][0]
    assert package["state"] == "refused"
    assert "kernmap.lock does not list sha256" in package["reason"]

    add_package(tmp_path, "kmrival", "kmrival", "kmrival", sha256="f" * 64)
    (tmp_path / "kernmap.lock").unlink()
    out = run_cli("lock", str(tmp_path))
    assert out.returncode == 1
    assert "not written" in out.stderr and "kmrival/manifest.json: variants[0].sha256" in out.stderr
    assert not (tmp_path / "kernmap.lock").exists()
