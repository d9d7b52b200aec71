#!/usr/bin/env bash
# ctest "examples": the CMake package and the two examples, as a user would use them.
#   1. cmake --install this build into WORK/prefix, and check the installed CLI runs with no environment;
#   2. examples/consumer: configure + build against WORK/prefix (find_package(kernmap)), run it (must pass);
#   3. find_package(kernmap) with a KERNMAP_TORCH_DIR that is not torch, or another torch: a clear error;
#   4. examples/plugin: configure + build, cmake --install into the repository WORK/repo, check the package
#      folder and its manifest.json (docs/plugins.md: fields, sha256 of the installed library);
#   5. tests/examples/plugin_host: load the installed plugin and check its kernels;
#   6. KERNMAP_PATH=WORK/repo: kernmap kernels shows the plugin loaded, kernmap plan --mapping FILE chooses its
#      RMSNorm kernel, kernmap lock pins it, and a changed library is refused with a clear error.
# Ninja, and ccache when present; WORK is emptied first and left behind for inspection.
set -euo pipefail

usage() { echo "usage: run_examples.sh --source DIR --build DIR --work DIR --cmake CMAKE --python PYTHON" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --source) src="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --cmake) cmake="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    *) usage ;;
  esac
done
[ -n "${src:-}" ] && [ -n "${build:-}" ] && [ -n "${work:-}" ] && [ -n "${cmake:-}" ] && [ -n "${python:-}" ] || usage

step() { printf '\n== %s (%ds)\n' "$*" "$SECONDS"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

rm -rf "$work"
mkdir -p "$work"
prefix="$work/prefix"
repo="$work/repo"
configure_args=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix")
if command -v ccache >/dev/null; then configure_args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi

step "install kernmap into $prefix"
"$cmake" --install "$build" --prefix "$prefix" >"$work/install.log" || { cat "$work/install.log"; fail "cmake --install"; }
for f in include/kernmap/layers.h include/kernmap/plugin.h lib/libkernmap.so lib/libkernmap_models.so \
         lib/libkernmap_train.so bin/kernmap lib/cmake/kernmap/kernmapConfig.cmake \
         lib/cmake/kernmap/kernmapConfigVersion.cmake lib/cmake/kernmap/kernmapTargets.cmake; do
  [ -e "$prefix/$f" ] || fail "the install has no $f"
done
# The installed CLI finds libkernmap and torch through its RPATH alone.
env -i PATH=/usr/bin:/bin "$prefix/bin/kernmap" kernels >"$work/kernels.txt" 2>&1 ||
  { cat "$work/kernels.txt"; fail "the installed bin/kernmap does not run without an environment"; }
grep -q 'kernmap/rms_norm' "$work/kernels.txt" || fail "installed 'kernmap kernels' does not list kernmap/rms_norm"
echo "installed: headers, libraries, bin/kernmap (runs), lib/cmake/kernmap"

step "examples/consumer: configure, build, run"
"$cmake" -S "$src/examples/consumer" -B "$work/consumer" "${configure_args[@]}" >"$work/consumer-configure.log" ||
  { cat "$work/consumer-configure.log"; fail "configuring examples/consumer"; }
"$cmake" --build "$work/consumer" || fail "building examples/consumer"
"$work/consumer/consumer" || fail "examples/consumer exited with status $?"

step "find_package(kernmap) refuses a torch it cannot use, naming KERNMAP_TORCH_DIR"
# A folder that is not torch, and one that is another torch version (the files kernmapConfig.cmake looks at).
fake="$work/torch-2.99"
mkdir -p "$fake/lib" "$fake/include/ATen" "$fake/include/torch/csrc/api/include/torch" "$fake/include/torch/headeronly"
touch "$fake/lib/libtorch_cpu.so" "$fake/lib/libc10.so" "$fake/include/ATen/ATen.h" \
      "$fake/include/torch/csrc/api/include/torch/version.h"
printf '#define TORCH_VERSION_MAJOR 2\n#define TORCH_VERSION_MINOR 99\n#define TORCH_VERSION_PATCH 0\n' \
  >"$fake/include/torch/headeronly/version.h"
for case in "$work/no-torch|$work/no-torch/lib/libtorch_cpu.so does not exist" \
            "$fake|it is torch 2.99.0, kernmap was built against torch"; do
  dir="${case%%|*}" expected="${case#*|}"
  if "$cmake" -S "$src/examples/consumer" -B "$work/refused" "${configure_args[@]}" -DKERNMAP_TORCH_DIR="$dir" \
       >"$work/refused.log" 2>&1; then
    fail "configuring with KERNMAP_TORCH_DIR=$dir succeeded"
  fi
  # CMake wraps the message: compare with the line breaks and indentation removed.
  tr -s ' \n' ' ' <"$work/refused.log" | grep -qF -- "KERNMAP_TORCH_DIR ($dir) cannot be used: ${expected}" ||
    { cat "$work/refused.log"; fail "configuring with KERNMAP_TORCH_DIR=$dir: not the expected error"; }
  rm -rf "$work/refused"
  echo "refused KERNMAP_TORCH_DIR=$dir: $expected"
done

step "examples/plugin: configure (KERNMAP_TORCH_DIR given), build, install into the repository $repo"
torch_dir="$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
"$cmake" -S "$src/examples/plugin" -B "$work/plugin" "${configure_args[@]}" -DKERNMAP_TORCH_DIR="$torch_dir" \
  >"$work/plugin-configure.log" ||
  { cat "$work/plugin-configure.log"; fail "configuring examples/plugin"; }
"$cmake" --build "$work/plugin" || fail "building examples/plugin"
"$cmake" --install "$work/plugin" --prefix "$repo" || fail "installing examples/plugin"

step "check the package folder $repo/kmexample"
"$python" - "$repo/kmexample" "$prefix/include/kernmap/plugin.h" <<'PY'
import hashlib, json, os, platform, re, sys
package, plugin_h = sys.argv[1], sys.argv[2]
files = sorted(os.path.relpath(os.path.join(d, f), package) for d, _, fs in os.walk(package) for f in fs)
assert files == ["lib/libkmexample.so", "manifest.json"], f"package folder holds {files}"
with open(os.path.join(package, "manifest.json")) as f:
    m = json.load(f)
assert set(m) == {"name", "version", "plugin_abi", "description", "variants"}, f"manifest fields: {sorted(m)}"
assert m["name"] == "kmexample" and m["version"] == "0.1.0", (m["name"], m["version"])
abi = int(re.search(r"#define KERNMAP_PLUGIN_ABI_VERSION (\d+)", open(plugin_h).read()).group(1))
assert m["plugin_abi"] == abi and type(m["plugin_abi"]) is int, f"plugin_abi {m['plugin_abi']!r}, header {abi}"
assert isinstance(m["variants"], list) and len(m["variants"]) == 1, m["variants"]
v = m["variants"][0]
assert set(v) == {"library", "sha256", "torch", "cxx11_abi", "arch", "os", "toolkits"}, f"variant fields {sorted(v)}"
assert v["library"] == "lib/libkmexample.so", v["library"]
with open(os.path.join(package, v["library"]), "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()
assert re.fullmatch(r"[0-9a-f]{64}", v["sha256"]) and v["sha256"] == digest, f"sha256 {v['sha256']} != file {digest}"
import torch
assert v["torch"] == ".".join(torch.__version__.split(".")[:2]), f"torch {v['torch']} vs {torch.__version__}"
assert v["cxx11_abi"] is bool(torch.compiled_with_cxx11_abi()), v["cxx11_abi"]
assert v["arch"] == platform.machine() and v["os"] == "linux" and v["toolkits"] == {}, v
print(f"manifest.json: {m['name']} {m['version']}, plugin_abi {abi}, torch {v['torch']}, sha256 {digest[:16]}... matches")
PY
# A staged install (DESTDIR) writes the manifest into the staging folder, with the staged library's sha256.
DESTDIR="$work/staged" "$cmake" --install "$work/plugin" --prefix /opt/kernels >/dev/null || fail "staged install"
staged="$work/staged/opt/kernels/kmexample"
[ -f "$staged/manifest.json" ] || fail "DESTDIR install: no $staged/manifest.json"
grep -q "\"sha256\": \"$(sha256sum "$staged/lib/libkmexample.so" | cut -d' ' -f1)\"" "$staged/manifest.json" ||
  fail "DESTDIR install: the manifest's sha256 is not the staged library's"
# The plugin reaches kernmap only through the host struct: it must not link libkernmap.
if readelf -d "$repo/kmexample/lib/libkmexample.so" | grep -q 'libkernmap'; then fail "libkmexample.so links libkernmap"; fi
for sym in kernmap_plugin_abi_version kernmap_plugin_score kernmap_plugin_register; do
  nm -D --defined-only "$repo/kmexample/lib/libkmexample.so" | grep -qw "$sym" || fail "libkmexample.so does not export $sym"
done

step "tests/examples/plugin_host: load the installed plugin and check its kernels"
"$cmake" -S "$src/tests/examples/plugin_host" -B "$work/plugin_host" "${configure_args[@]}" >"$work/plugin_host-configure.log" ||
  { cat "$work/plugin_host-configure.log"; fail "configuring tests/examples/plugin_host"; }
"$cmake" --build "$work/plugin_host" || fail "building tests/examples/plugin_host"
"$work/plugin_host/plugin_host" "$repo/kmexample" || fail "plugin_host"

step "KERNMAP_PATH=$repo: kernmap kernels lists kmexample as loaded"
KERNMAP_PATH="$repo" "$prefix/bin/kernmap" kernels >"$work/kernels-repo.txt" 2>&1 ||
  { cat "$work/kernels-repo.txt"; fail "kernmap kernels with KERNMAP_PATH=$repo"; }
sed -n '/Kernel repositories/,$p' "$work/kernels-repo.txt"
grep -Eq 'kmexample.*0\.1\.0.*loaded' "$work/kernels-repo.txt" || fail "kernmap kernels does not show kmexample 0.1.0 loaded"
grep -q 'kmexample/rms_norm_npu' "$work/kernels-repo.txt" || fail "kernmap kernels does not list kmexample/rms_norm_npu"
# The plugin's default covers the device kernmap does not map (npu); the CPU default stays kernmap's own.
grep -Eq '^RMSNorm +npu +training +kmexample/rms_norm_npu' "$work/kernels-repo.txt" ||
  fail "RMSNorm on npu does not resolve to the plugin's default kmexample/rms_norm_npu"

step "kernmap plan: the mapping file chooses the plugin's kernel for every RMSNorm"
cat >"$work/mapping.toml" <<'TOML'
# RMSNorm on CPU from the kmexample plugin, training and inference
[RMSNorm.cpu]
training = "kmexample/rms_norm"
inference = "kmexample/rms_norm"
TOML
plan() { KERNMAP_PATH="$1" "$prefix/bin/kernmap" plan --preset qwen2-tiny "${@:2}"; }
plan "$repo" >"$work/plan-default.txt" || { cat "$work/plan-default.txt"; fail "kernmap plan without a mapping"; }
grep -q 'kmexample' "$work/plan-default.txt" && fail "without a mapping file, plan chose a plugin kernel"
plan "$repo" --mapping "$work/mapping.toml" | tee "$work/plan.txt" || fail "kernmap plan --mapping"
# qwen2-tiny has one RMSNorm layer (layer 0's input norm; every other norm is fused with its residual add).
[ "$(grep -c 'RMSNorm *kmexample/rms_norm ' "$work/plan.txt")" = 1 ] ||
  fail "kernmap plan does not choose kmexample/rms_norm for the RMSNorm layer of qwen2-tiny"

step "kernmap lock: the locked repository still loads; a changed library is refused with a clear error"
"$prefix/bin/kernmap" lock "$repo" || fail "kernmap lock $repo"
grep -q "\"kmexample\"" "$repo/kernmap.lock" || fail "kernmap.lock does not pin kmexample"
plan "$repo" --mapping "$work/mapping.toml" | grep -q 'kmexample/rms_norm' || fail "the locked repository: plan"
cp -r "$repo" "$work/tampered"
printf 'x' >>"$work/tampered/kmexample/lib/libkmexample.so"
KERNMAP_PATH="$work/tampered" "$prefix/bin/kernmap" kernels >"$work/kernels-tampered.txt" 2>&1 || true
grep -Eq 'kmexample.*refused' "$work/kernels-tampered.txt" && grep -q 'sha256' "$work/kernels-tampered.txt" ||
  { cat "$work/kernels-tampered.txt"; fail "a changed library is not refused for its sha256"; }
# The mapping file then names a kernel nobody registered: the command stops with the location and exit code 2.
set +e
plan "$work/tampered" --mapping "$work/mapping.toml" >"$work/plan-tampered.txt" 2>&1
status=$?
set -e
[ "$status" = 2 ] || { cat "$work/plan-tampered.txt"; fail "plan with a refused plugin's kernel exited $status, not 2"; }
grep -q 'mapping.toml:3' "$work/plan-tampered.txt" && grep -q 'kmexample/rms_norm' "$work/plan-tampered.txt" ||
  { cat "$work/plan-tampered.txt"; fail "the error does not name the file, the line and the kernel"; }
grep -E 'refused|mapping.toml' "$work/kernels-tampered.txt" "$work/plan-tampered.txt" | head -4

step "PASS"
