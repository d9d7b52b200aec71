"""Plugins from Python and the CLI, each in a fresh process (plugins stay loaded for the life of a process): loading
from KERNMAP_PATH at import, kernelize running the plugin's kernel, strict loading, import warnings, `kernmap
kernels` and `kernmap lock`, truncated and foreign libraries, and a full disk. The test plugins are real shared libraries built by tests/plugins/CMakeLists.txt."""

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


@pytest.mark.slow
def test_import_loads_kernmap_path_and_kernelize_runs_the_plugin_kernel(tmp_path):
    add_package(tmp_path, "kmgood", "kmgood", "kmgood")
    add_package(tmp_path, "throws", "kmthrows", "kmthrows")
    out = run_python(f"""
        import json, warnings
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
        before = torch.ops.kmgood.calls()
        y = norm(x)
        print(json.dumps({{
            "warnings": [str(w.message) for w in caught],
            "states": states,
            "kernel": rows[0].kernel,
            "calls": torch.ops.kmgood.calls() - before,
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


@pytest.mark.slow
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
    assert out.stderr.startswith(f"kernmap lock: {tmp_path}/kernmap.lock not written:"), out.stderr
    assert out.stderr.count("kernmap lock:") == 1, out.stderr  # the prefix once: the library adds none
    assert not (tmp_path / "kernmap.lock").exists()


def add_broken_package(repo: Path, folder: str, plugin: str, change) -> None:
    """A package whose library is a test plugin's bytes changed by `change`, with a manifest giving the changed
    file's sha256 (so only the checks of the library itself can refuse it)."""
    data = change((PLUGINS / f"lib{plugin}.so").read_bytes())
    add_package(repo, folder, "km" + folder, plugin, sha256=hashlib.sha256(data).hexdigest()).write_bytes(data)


def other_machine(data: bytes) -> bytes:
    """The library marked as built for another machine (its e_machine: aarch64, or x86_64 on aarch64)."""
    other = 62 if int.from_bytes(data[18:20], "little") == 183 else 183
    return data[:18] + other.to_bytes(2, "little") + data[20:]


def broken_repository(repo: Path) -> dict[str, str]:
    """Truncated libraries (1 KiB, 8 KiB, half) and one for another machine, each with a matching sha256; folder ->
    a part of the reason it must be refused with."""
    size = (PLUGINS / "libkmgood.so").stat().st_size
    for folder, keep in (("cut-1k", 1024), ("cut-8k", 8192), ("cut-half", size // 2)):
        add_broken_package(repo, folder, "kmgood", lambda b, keep=keep: b[:keep])
    add_broken_package(repo, "other-machine", "kmzero", other_machine)
    machine = "x86_64" if os.uname().machine == "aarch64" else "aarch64"
    return {"cut-1k": "but the file has 1024 bytes (truncated?)", "cut-8k": "but the file has 8192 bytes (truncated?)",
            "cut-half": f"but the file has {size // 2} bytes (truncated?)",
            "other-machine": f"built for {machine}, this machine is {os.uname().machine}"}


def test_import_and_every_command_survive_truncated_and_foreign_libraries(tmp_path, run_cli):
    reasons = broken_repository(tmp_path)
    add_package(tmp_path, "kmgood", "kmgood", "kmgood")
    env = {"KERNMAP_PATH": str(tmp_path)}
    # Before the ELF checks, dlopen mapped the cut files past their end: import kernmap and every command died of
    # SIGBUS (returncode -7), `kernmap lock` included.
    out = run_python("""
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import kernmap
        print(json.dumps({"warnings": [str(w.message) for w in caught],
                          "states": {p["folder"]: p["state"] for p in kernmap.plugin_report()["packages"]}}))
    """, **env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["states"] == {**dict.fromkeys(reasons, "refused"), "kmgood": "loaded"}
    for folder, reason in reasons.items():
        assert any(f"{folder} refused:" in w and reason in w for w in doc["warnings"]), (folder, doc["warnings"])

    commands = [("kernels",), ("plan", "--preset", "qwen2-tiny"), ("lock", tmp_path)]
    for command in commands:
        out = run_cli(*command, env=env)
        assert out.returncode == 0, (command, out.returncode, out.stderr)
        for folder, reason in reasons.items():
            assert folder in out.stderr and reason in out.stderr, (command, folder, out.stderr)


class FullDisk:
    """A 1 MiB tmpfs mounted on a folder; fill() uses its last page."""

    def __init__(self, root: Path):
        self.root = root

    def fill(self) -> None:
        with open(self.root / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError:
                pass


@pytest.fixture
def full_disk(tmp_path):
    """A FullDisk; skips where mounting is not allowed (mount needs root)."""
    root = tmp_path / "disk"
    root.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    yield FullDisk(root)
    subprocess.run(["umount", "-l", str(root)], check=False)


def test_a_full_disk_fails_lock_and_checkpoints_with_the_reason_and_no_partial_file(full_disk, run_cli):
    repo = full_disk.root / "repo"
    add_package(repo, "kmzero", "kmzero", "kmzero")
    checkpoint = full_disk.root / "ck"
    full_disk.fill()
    out = run_cli("lock", repo)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"kernmap lock: cannot write {repo}/kernmap.lock: write failed: No space left on "
                                  f"device (the partial {repo}/kernmap.lock.tmp was removed; {repo}/kernmap.lock is "
                                  "unchanged)"), out.stderr
    out = run_cli("train", "--preset", "qwen2-tiny", "--seq-len", 16, "--steps", 1, "--save", checkpoint)
    assert out.returncode == 1
    assert f"cannot write {checkpoint}/checkpoint.safetensors: write failed: No space left on device" in out.stderr
    assert sorted(p.name for p in full_disk.root.rglob("*") if p.suffix == ".tmp") == []
    assert not (repo / "kernmap.lock").exists() and not (checkpoint / "checkpoint.safetensors").exists()
