"""The kernmap command: registry listing with reasons, KERNMAP_DISABLE, the CPU level override, the JSON
documents (the benchmark's for shape only: a benchmark is not a test), --help of every command, and the
command line's errors: unknown commands and options, and every bad value named with the option, the value and
what is expected (exit code 2), never a crash or a backtrace."""

import json

import pytest
import torch


def decisions(doc):
    return {(d["layer"], d["device"], d["mode"]): d for d in doc["resolution"]}


def test_kernels_json_lists_builtins_and_defaults(run_cli):
    out = run_cli("kernels", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    names = {k["name"] for k in doc["kernels"]}
    assert {"kernmap/rms_norm", "kernmap/silu", "kernmap/silu_and_mul", "reference/rms_norm"} <= names
    d = decisions(doc)
    for layer, kernel in [("RMSNorm", "kernmap/rms_norm"), ("SiLU", "kernmap/silu"), ("SiluAndMul", "kernmap/silu_and_mul")]:
        for mode in ("inference", "training", "training+compile"):
            assert d[(layer, "cpu", mode)]["kernel"] == kernel
            assert not d[(layer, "cpu", mode)]["fallback"]
    npu = d[("RMSNorm", "npu", "training")]
    assert npu["kernel"] == "reference/rms_norm" and npu["fallback"] and npu["reason"] == "no mapping for npu"
    rms = next(k for k in doc["kernels"] if k["name"] == "kernmap/rms_norm")
    assert rms["layer"] == "RMSNorm" and "cpu" in rms["devices"] and "bfloat16" in rms["dtypes"]
    assert rms["has_backward"] is True and rms["op"] == "kernmap::rms_norm"
    assert set(doc["plugins"]) == {"packages", "process", "repositories"}


def test_kernmap_disable_forces_the_reference_with_a_reason(run_cli):
    doc = json.loads(run_cli("kernels", "--json", env={"KERNMAP_DISABLE": "RMSNorm"}).stdout)
    d = decisions(doc)
    assert d[("RMSNorm", "cpu", "training")]["kernel"] == "reference/rms_norm"
    assert d[("RMSNorm", "cpu", "training")]["reason"] == "disabled by KERNMAP_DISABLE"
    assert d[("SiluAndMul", "cpu", "training")]["kernel"] == "kernmap/silu_and_mul"
    doc = json.loads(run_cli("kernels", "--json", env={"KERNMAP_DISABLE": "all"}).stdout)
    assert all(r["fallback"] for r in doc["resolution"])


def test_cpu_level_override(run_cli):
    doc = json.loads(run_cli("kernels", "--json", env={"KERNMAP_CPU_ISA": "baseline"}).stdout)
    assert doc["cpu"]["level"] == "baseline"
    assert "baseline" in doc["cpu"]["supported"]
    bad = run_cli("kernels", "--json", env={"KERNMAP_CPU_ISA": "sse9"})
    assert "KERNMAP_CPU_ISA=sse9 is not a level" in bad.stderr


def byte_floor(row):
    """A bench row's byte floor (source, ms): its bytes at the copy rate, or its bytes read at the read rate
    where it states what it writes, whichever is longer."""
    copy = row["bytes"] / (row["copy_gbps"] * 1e6)
    if row["bytes_written"] is None:
        return "copy", copy
    read = (row["bytes"] - row["bytes_written"]) / (row["read_gbps"] * 1e6)
    return ("read", read) if read > copy else ("copy", copy)


def test_bench_json_document(run_cli):
    out = run_cli("bench", "ops", "--json", "--filter", "^rms_norm/bfloat16", "--warmup", "0", "--reps", "1")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    machine = doc["machine"]
    assert machine["copy_gbps"] > 0 and machine["threads"] >= 1 and machine["cpu_level"]
    # The copy limit: the faster of plain stores (torch's copy_) and streamed ones (no read of the lines written).
    assert machine["copy_plain_gbps"] > 0 and machine["copy_streamed_gbps"] > 0
    assert machine["copy_gbps"] == max(machine["copy_plain_gbps"], machine["copy_streamed_gbps"])
    assert machine["read_gbps"] > 0
    assert isinstance(machine["copy_huge_pages"], bool)
    assert machine["dense_gflops"] == {}  # rms_norm does no FLOPs worth a GEMM peak
    assert machine["cpu_model"] and machine["cpu_level"] in machine["cpu_levels_supported"]
    assert machine["levels_run"] == [machine["cpu_level"]]  # no --levels: the level in use
    assert set(machine["caches"]) == {"l1d_bytes", "l2_bytes", "l3_bytes"}
    assert machine["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert all(v >= 0 for v in machine["caches"].values())
    rows = doc["results"]
    assert {(r["op"], r["pass"], r["impl"]) for r in rows} == {
        ("rms_norm", p, i) for p in ("fwd", "fwd+bwd") for i in ("kernmap", "reference")}
    for r in rows:
        assert r["dtype"] == "bfloat16" and r["shape"] == "[4096, 3584]"
        assert r["median_ms"] > 0 and r["gbps"] > 0 and r["floor_ms"] > 0 and "gflops" not in r
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["faults_per_run"] >= 0
        assert r["flops"] == 0 and r["dense_gflops"] is None
        # The byte floor from the rates measured among the case's own repetitions (one per case): the bytes at
        # the copy rate, or the bytes read (all but the output and, fwd+bwd, dx and dw) at the read rate.
        n = 4096 * 3584 * 2
        assert r["bytes_written"] == (n if r["pass"] == "fwd" else 2 * n + 2 * 3584)
        assert r["copy_gbps"] > 0 and r["read_gbps"] > 0
        source, ms = byte_floor(r)
        assert r["floor_source"] == source and r["floor_ms"] == pytest.approx(ms)
        assert r["pct_of_copy"] == pytest.approx(100 * r["gbps"] / r["copy_gbps"])
        assert r["copy_gbps"] == max(r["copy_plain_gbps"], r["copy_streamed_gbps"])
        assert r["copy_by"] == ("streamed" if r["copy_streamed_gbps"] > r["copy_plain_gbps"] else "plain")
        # The case's probe moves the case's bytes (up to 512 MiB), as 4-byte floats read and written.
        assert r["copy_probe_bytes"] == min(8 * int(r["bytes"] // 8), 512 << 20)
    for p in ("fwd", "fwd+bwd"):
        assert len({r["copy_gbps"] for r in rows if r["pass"] == p}) == 1
        assert r["level"] == (machine["cpu_level"] if r["impl"] == "kernmap" else None)
        if r["impl"] == "reference":
            assert r["speedup_vs_reference"] == 1


def test_bench_timed_runs_do_not_page_fault(run_cli):
    # A 310 MB output freed and allocated again each run: with glibc's settings alone the forward came from
    # fresh memory (37,888 page faults, 5x the time) on every timed run of this very command (zen3-vm); the
    # bench's keeping allocator hands the freed block back (cli/bench_alloc.cpp).
    out = run_cli("bench", "ops", "--json", "--filter", "^silu_and_mul/float32", "--shape", r"^\[4096",
                  "--impl", "/kernmap$", "--warmup", "1", "--reps", "3")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["results"]
    assert {r["pass"] for r in rows} == {"fwd", "fwd+bwd"}
    for r in rows:
        assert r["peak_bytes"] >= 4096 * 18944 * 4
        assert r["faults_per_run"] < 256, r  # under 1 MiB of pages: the small blocks glibc serves


def test_bench_puts_the_cases_tensors_on_huge_pages_unless_told_not_to(run_cli):
    # The copy probes run on huge pages, and so do the cases' tensors of 16 MiB and more by default: inputs in
    # glibc's 4 KiB heap pages cost the memory-bound rows up to a third on xeon-amx-vm (cli/bench_alloc.cpp).
    # The mapped blocks are kept and handed out again like the others: no timed run page-faults.
    args = ("bench", "ops", "--json", "--filter", "^silu/bfloat16", "--shape", r"^\[4096", "--impl", "/kernmap$",
            "--warmup", "1", "--reps", "2")
    for extra, env, huge in (((), None, True), (("--system-pages",), None, False),
                             ((), {"KERNMAP_HUGE_PAGES": "0"}, False)):
        out = run_cli(*args, *extra, env=env)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert doc["machine"]["tensors_huge_pages"] is huge, (extra, env)
        assert {r["pass"] for r in doc["results"]} == {"fwd", "fwd+bwd"}
        assert all(r["median_ms"] > 0 and r["faults_per_run"] < 256 for r in doc["results"])
    text = run_cli(*[a for a in args if a != "--json"], "--system-pages")
    assert text.returncode == 0, text.stderr
    assert "on the system allocator's pages" in text.stdout


@pytest.mark.parametrize("aten", ["default", None])
def test_bench_names_torchs_level_and_says_when_a_kernmap_level_is_below_it(run_cli, aten):
    """Capping kernmap at baseline leaves torch's ops (the reference, a separate add) at torch's own level: the
    header says so unless ATEN_CPU_CAPABILITY caps torch too."""
    env = {"KERNMAP_CPU_ISA": "baseline", **({"ATEN_CPU_CAPABILITY": aten} if aten else {})}
    out = run_cli("bench", "ops", "--filter", "^rms_norm/float32", "--impl", "fwd/kernmap", "--warmup", "0",
                  "--reps", "1", env=env)
    assert out.returncode == 0, out.stderr
    torch_level = "DEFAULT" if aten else torch.backends.cpu.get_cpu_capability()
    assert f"torch's ops at {torch_level};" in out.stdout
    noted = "set ATEN_CPU_CAPABILITY too" in out.stdout
    assert noted == (torch_level != "DEFAULT")


def supported_levels(run_cli):
    return json.loads(run_cli("kernels", "--json").stdout)["cpu"]["supported"]


def test_bench_levels_all_times_kernmap_at_each_level_up_to_the_cap(run_cli):
    if "avx2" not in supported_levels(run_cli):
        pytest.skip("this CPU runs no avx2")
    out = run_cli("bench", "ops", "--json", "--filter", "^rms_norm/float32", "--levels", "all", "--warmup", "0",
                  "--reps", "1", env={"KERNMAP_CPU_ISA": "avx2"})
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["machine"]["levels_run"] == ["baseline", "avx2"] and doc["machine"]["cpu_level"] == "avx2"
    got = sorted((r["pass"], r["impl"], r["level"] or "") for r in doc["results"])
    assert got == sorted((p, *il) for p in ("fwd", "fwd+bwd")
                         for il in (("kernmap", "baseline"), ("kernmap", "avx2"), ("reference", "")))


@pytest.mark.slow
def test_bench_floor_of_a_product_is_the_fastest_dense_rate_its_level_can_use(run_cli):
    # bf16 grouped products: at a level without bf16 dot products the compute floor is the fp32 GEMM rate,
    # measured in the same run, whatever the bf16 GEMM rate; at a level below the CPU's own, the fp32 rate of a
    # CPU of that level (OpenBLAS's kernels for it), measured in the same run too.
    levels = supported_levels(run_cli)
    if len(levels) < 2:
        pytest.skip("this CPU runs one level only")
    wanted = levels[-2:]
    out = run_cli("bench", "ops", "--json", "--filter", "^grouped_mm/bfloat16", "--shape", "T256$",
                  "--impl", "/fwd/(kernmap|dense)$", "--levels", ",".join(wanted), "--warmup", "0", "--reps", "1")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    dense = doc["machine"]["dense_gflops"]
    assert set(dense) == {"float32", "bfloat16"} and min(dense.values()) > 0
    below = doc["machine"]["level_dense_gflops"]
    assert set(below) == {wanted[0]}  # the levels run below the CPU's own
    assert below[wanted[0]]["float32"] > 0, below
    if wanted == ["avx512bf16", "amx"]:
        assert below["avx512bf16"]["bfloat16"] > 0 and "avx512_core_bf16" in below["avx512bf16"]["bfloat16_source"]
    else:
        assert below[wanted[0]]["bfloat16"] is None and below[wanted[0]]["bfloat16_error"] is None
    rows = doc["results"]
    assert sorted(r["level"] or "" for r in rows) == sorted(["", *wanted])
    # fp32's dense rate measured again among each product case's repetitions (one figure per case), and the
    # run's rate the fastest of all its measurements.
    assert all(r["dense_gflops"] > 0 for r in rows) and len({r["dense_gflops"] for r in rows}) == 1
    assert dense["float32"] >= rows[0]["dense_gflops"]
    for r in rows:
        rates = {"gemm fp32": dense["float32"]}
        if r["level"] == wanted[0]:
            rates = {f"gemm fp32 at {wanted[0]}": below[wanted[0]]["float32"]}
        if r["level"] in ("avx512bf16", "amx", None):  # bf16 products, or the dense row (not kernmap's)
            if r["level"] == wanted[0] and below[wanted[0]]["bfloat16"]:
                # avx512bf16 below AMX tiles: bf16 by oneDNN held to the level's instructions.
                rates[f"gemm bf16 at {wanted[0]}"] = below[wanted[0]]["bfloat16"]
            else:
                rates["gemm bf16"] = dense["bfloat16"]
        source, rate = max(rates.items(), key=lambda kv: kv[1])
        memory_source, memory = byte_floor(r)
        compute = r["flops"] / (rate * 1e6)
        assert r["flops"] > 0 and r["floor_source"] == (source if compute > memory else memory_source), r
        assert r["floor_ms"] == pytest.approx(max(compute, memory))
        assert r["x_floor"] == pytest.approx(r["median_ms"] / r["floor_ms"])


OPENBLAS_BASELINE = ["Core2", "Penryn", "Dunnington", "Nehalem"]


@pytest.mark.slow
def test_bench_limit_is_the_fastest_openblas_core_kind_of_the_level(run_cli):
    out = run_cli("bench", "limit", "--level", "baseline", "--threads", "1", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["threads"] == 1 and list(doc["levels"]) == ["baseline"]
    level = doc["levels"]["baseline"]
    assert [c["core"] for c in level["cores"]] == OPENBLAS_BASELINE
    assert all(c["gflops"] > 0 and c["error"] is None for c in level["cores"]), level
    best = max(level["cores"], key=lambda c: c["gflops"])
    assert level["float32"] == best["gflops"] and level["source"] == "OpenBLAS " + best["core"]
    assert level["library"].startswith("OpenBLAS") and level["error"] is None


def test_bench_limit_measures_one_core_kind_and_refuses_an_unknown_one(run_cli):
    # The child process measure_level_limit runs: one JSON line; a kind OpenBLAS does not run is refused (it
    # would silently fall back to the CPU's own kind otherwise).
    out = run_cli("bench", "limit", "--openblas-core", "Core2", "--threads", "1")
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout)
    assert line["core"] == "Core2" and line["gflops"] > 0 and "Core2" in line["library"]
    bad = run_cli("bench", "limit", "--openblas-core", "Pentium9")
    assert bad.returncode == 1
    assert "not the requested 'Pentium9'" in bad.stderr and "Traceback" not in bad.stderr


def test_bench_limit_measures_bf16_with_onednn_held_to_avx512bf16(run_cli):
    # The child measure_level_bf16 runs for avx512bf16 below AMX tiles: oneDNN's verbose lines name the
    # implementation of every product (avx512_core_bf16, none on the tiles), then one JSON line.
    if "avx512bf16" not in supported_levels(run_cli):
        pytest.skip("this CPU has no AVX512-BF16")
    out = run_cli("bench", "limit", "--onednn-isa", "AVX512_CORE_BF16", "--threads", "1")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    line = json.loads(lines[-1])
    assert line["isa"] == "AVX512_CORE_BF16" and line["gflops"] > 0
    ran = [ln for ln in lines if ln.startswith("onednn_verbose") and ",exec," in ln]
    assert ran and all("matmul" in ln and "avx512_core_bf16" in ln and "amx" not in ln for ln in ran), ran
    bad = run_cli("bench", "limit", "--onednn-isa", "AVX9000")
    assert bad.returncode == 2 and "--onednn-isa" in bad.stderr and "AVX9000" in bad.stderr


@pytest.mark.slow
def test_bench_limit_gives_avx512bf16_a_bf16_rate_below_amx_only(run_cli):
    levels = supported_levels(run_cli)
    if "avx512bf16" not in levels:
        pytest.skip("this CPU has no AVX512-BF16")
    out = run_cli("bench", "limit", "--level", "avx512bf16", "--threads", "1", "--json")
    assert out.returncode == 0, out.stderr
    level = json.loads(out.stdout)["levels"]["avx512bf16"]
    if "amx" in levels:  # below the machine's tiles: measured, and named
        assert level["bfloat16"] > 0 and level["bfloat16_source"].startswith("oneDNN ")
        assert "avx512_core_bf16" in level["bfloat16_source"] and level["bfloat16_error"] is None
        text = run_cli("bench", "limit", "--level", "avx512bf16", "--threads", "1").stdout
        assert "; bf16 " in text and "avx512_core_bf16" in text, text
    else:  # the machine's own level: its products are the machine's
        assert level["bfloat16"] is None and level["bfloat16_error"] is None


@pytest.mark.parametrize("library, why", [("/nonexistent/libopenblas.so.0", "cannot load OpenBLAS from"),
                                          ("libm.so.6", "is not OpenBLAS: it lacks cblas_sgemm")])
def test_bench_limit_without_a_usable_openblas_says_why(run_cli, library, why):
    env = {"KERNMAP_OPENBLAS": library}
    out = run_cli("bench", "limit", "--level", "baseline", env=env)
    assert out.returncode == 1
    assert "baseline: not measured (" in out.stdout and why in out.stdout and library in out.stdout, out.stdout
    doc = json.loads(run_cli("bench", "limit", "--level", "baseline", "--json", env=env).stdout)
    level = doc["levels"]["baseline"]
    assert level["float32"] is None and why in level["error"]
    assert all(c["gflops"] is None and why in c["error"] for c in level["cores"])


@pytest.mark.slow
def test_bench_ops_without_openblas_holds_a_lower_level_to_the_machines_rate_and_says_so(run_cli):
    levels = supported_levels(run_cli)
    if len(levels) < 2:
        pytest.skip("this CPU runs one level only")
    args = ["bench", "ops", "--filter", "^grouped_mm/float32", "--shape", "T256$", "--impl", "^grouped_mm/fwd/kernmap$",
            "--levels", levels[0], "--warmup", "0", "--reps", "1"]
    out = run_cli(*args, "--json", env={"KERNMAP_OPENBLAS": "/nonexistent/libopenblas.so.0"})
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    below = doc["machine"]["level_dense_gflops"][levels[0]]
    assert below["float32"] is None and "cannot load OpenBLAS" in below["error"]
    (row,) = doc["results"]
    assert row["level"] == levels[0] and row["floor_source"] in ("gemm fp32", "copy", "read")


def test_bench_limit_refuses_a_level_this_cpu_does_not_run(run_cli):
    levels = supported_levels(run_cli)
    missing = [lv for lv in ("avx2", "avx512", "avx512bf16", "amx") if lv not in levels]
    if missing:
        out = run_cli("bench", "limit", "--level", missing[-1])
        assert out.returncode == 2
        assert f"this CPU does not run level '{missing[-1]}' (it runs {', '.join(levels)})" in out.stderr
    out = run_cli("bench", "limit", "--level", "sse9")
    assert out.returncode == 2 and "--level" in out.stderr and "sse9" in out.stderr


TINY = ["--preset", "qwen2-tiny", "--steps", 2, "--seq-len", 8, "--batch-size", 2, "--threads", 1]


def test_train_json_document(run_cli):
    out = run_cli("train", *TINY, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert list(doc) == ["model", "data", "skipped", "kernels", "steps"]
    assert doc["model"] == "qwen2-tiny" and doc["data"].startswith("synthetic(64 x 8 tokens") and doc["skipped"] == []
    assert doc["kernels"]["device"] == "cpu" and doc["kernels"]["layers"]
    assert [s["step"] for s in doc["steps"]] == [1, 2]
    for s in doc["steps"]:
        assert list(s) == ["step", "loss", "grad_norm", "seconds", "tokens", "tokens_per_s", "skipped"]
        assert s["loss"] > 0 and s["grad_norm"] > 0 and s["tokens"] > 0


def test_align_json_document_numbers_round_trip(run_cli):
    rtol = 0.1 + 0.2  # 0.30000000000000004: 17 significant digits, printed exactly or not at all
    out = run_cli("align", *TINY, "--rtol", repr(rtol), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert list(doc) == ["model", "passed", "rtol", "noise_factor", "max_loss_rel", "max_grad_norm_rel", "kernels",
                         "noise_kernels", "verdict", "original", "noise", "noise_alone", "kernelized", "routing"]
    assert doc["rtol"] == rtol and doc["passed"] is True
    assert len(doc["original"]) == len(doc["noise"]) == len(doc["kernelized"]) == 2
    assert doc["max_loss_rel"] <= rtol and doc["max_grad_norm_rel"] <= rtol
    assert doc["routing"] is None  # a dense model routes nothing


MOE = ["--preset", "qwen3-moe-tiny", "--steps", 2, "--seq-len", 8, "--batch-size", 2, "--threads", 1]


def test_align_replays_the_original_routing_in_a_model_with_experts(run_cli):
    out = run_cli("align", *MOE, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    routing = doc["routing"]
    assert routing["mode"] == "replay" and doc["noise_alone"] == {}
    # Each step: qwen3-moe-tiny's 2 routers route the batch's 2 x 8 tokens once each.
    assert [list(s) for s in routing["kernelized"]] == [["calls", "tokens", "flipped", "max_margin"]] * 2
    assert all(s["calls"] == 2 and s["tokens"] == 32 and 0 <= s["flipped"] <= 32 for s in routing["kernelized"])
    assert routing["noise"]["calls"] == 4 and routing["noise"]["tokens"] == 64
    human = run_cli("align", *MOE)
    assert human.returncode == 0, human.stderr
    assert "routing: the noise and kernelized runs send every token to the experts the original chose" in human.stdout
    assert "routed tokens to other experts" in human.stdout
    free = json.loads(run_cli("align", *MOE, "--routing", "free", "--json").stdout)
    assert free["routing"] == {"mode": "free"}
    # Routing freely, a model with experts gets a noise run per selected layer, that layer alone on float64.
    assert set(free["noise_alone"]) == set(free["noise_kernels"])
    bad = run_cli("align", *MOE, "--routing", "fixed")
    assert bad.returncode != 0 and "--routing must be one of replay, free, got 'fixed'" in bad.stderr


def test_ablate_json_document(run_cli):
    out = run_cli("ablate", *TINY, "--warmup", 0, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["model"] == "qwen2-tiny"
    # Rows in model order: the C++ decoder layer registers its attention (rotary), its mlp, then its norms (layer
    # 0's input norm plain, the others fused with the residual add), as transformers does; the loss last.
    assert [r["name"] for r in doc["rows"]] == ["original", "+rotary_pos_emb", "+SiluAndMul", "+RMSNorm",
                                                "+FusedAddRMSNorm", "+ForCausalLMLoss", "all"]
    for r in doc["rows"]:
        assert list(r) == ["name", "experts", "median_s", "p25_s", "p75_s", "speedup_pct", "min_s", "median_cpu_s",
                           "cpu_speedup_pct", "peak_bytes", "final_loss", "seconds"]
        assert len(r["seconds"]) == 2 and isinstance(r["peak_bytes"], int) and r["peak_bytes"] > 0


def test_plan_json_document(run_cli):
    out = run_cli("plan", "--preset", "qwen2-moe-tiny", "--mode", "inference", "--device", "npu", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["device"] == "npu" and doc["mode"] == "inference"
    assert doc["layers"] and all(e["fallback"] and e["reason"] == "no mapping for npu" for e in doc["layers"])


def test_mapping_files_before_and_after_the_command_apply_in_order(run_cli, tmp_path):
    first, second = tmp_path / "first.json", tmp_path / "second.toml"
    first.write_text('{"RMSNorm": {"cpu": "reference/rms_norm"}, "SiluAndMul": {"cpu": "reference/silu_and_mul"}}')
    second.write_text('[RMSNorm]\ncpu = "kernmap/rms_norm"\n')
    out = run_cli("--mapping", first, "plan", "--preset", "qwen2-tiny", "--json", "--mapping", second)
    assert out.returncode == 0, out.stderr
    kernels = {e["path"]: e["kernel"] for e in json.loads(out.stdout)["layers"]}
    # the later file's entry replaced the first's (layer 0's input norm: the others are fused with the residual add)
    assert kernels["model.layers.0.input_layernorm"] == "kernmap/rms_norm"
    assert kernels["model.layers.0.mlp"] == "reference/silu_and_mul"


# Every option each command has had, so that none is lost.
COMMON = ["--preset", "--model", "--data", "--skip-bad-lines", "--steps", "--dtype", "--kernels", "--batch-size",
          "--seq-len", "--examples", "--lr", "--weight-decay", "--max-grad-norm", "--threads", "--json"]
OPTIONS = {
    ("kernels",): ["--json"],
    ("lock",): ["DIR"],
    ("bench",): ["ops"],
    ("bench", "ops"): ["--json", "--filter", "--shape", "--impl", "--levels", "--warmup", "--reps"],
    ("plan",): ["--preset", "--model", "--mode", "--device", "--json"],
    ("train",): COMMON + ["--save", "--save-every", "--resume"],
    ("align",): COMMON + ["--rtol"],
    ("ablate",): COMMON + ["--warmup"],
}


@pytest.mark.parametrize("command", list(OPTIONS), ids=" ".join)
def test_every_command_has_help(run_cli, command):
    out = run_cli(*command, "--help")
    assert out.returncode == 0, out.stderr
    assert f"Usage: kernmap {' '.join(command)}" in out.stdout and out.stderr == ""
    for option in OPTIONS[command]:
        assert option in out.stdout, option


def option_line(help_text, option):
    return next(line for line in help_text.splitlines() if line.lstrip().startswith(option + " "))


def test_help_states_the_defaults(run_cli):
    text = run_cli("train", "--help").stdout
    for option, default in [("--steps", "default 20"), ("--batch-size", "default 4"), ("--seq-len", "default 128"),
                            ("--examples", "default 64"), ("--lr", "default 0.001"), ("--weight-decay", "default 0.01"),
                            ("--max-grad-norm", "default 1)"), ("--dtype", "default float32"),
                            ("--kernels", "default all"), ("--threads", "default 0")]:
        assert default in option_line(text, option), option
    assert "default 3" in option_line(run_cli("ablate", "--help").stdout, "--warmup")
    bench = run_cli("bench", "ops", "--help").stdout
    assert "default 11" in option_line(bench, "--reps") and "default 3" in option_line(bench, "--warmup")
    assert "default training" in option_line(run_cli("plan", "--help").stdout, "--mode")


def test_top_level_help_and_usage(run_cli):
    for args in (["--help"], ["-h"], ["help"]):
        out = run_cli(*args)
        assert out.returncode == 0 and out.stderr == ""
        for command in ("kernels", "lock", "bench", "plan", "train", "align", "ablate"):
            assert f"\n  {command} " in out.stdout, command
        assert "--mapping FILE" in out.stdout and "KERNMAP_PATH" in out.stdout
    bare = run_cli()
    assert bare.returncode == 2 and bare.stdout == "" and "Usage: kernmap" in bare.stderr


@pytest.mark.parametrize("args, message", [
    (["frobnicate"], "kernmap: unknown command 'frobnicate'\n"),
    (["--frobnicate"], "kernmap: unknown option '--frobnicate'\n"),
    (["--mapping", "x.toml"], "kernmap: no command given\n"),
    (["train", "--preset", "qwen2-tiny", "--frob"],
     "kernmap train: unknown option '--frob' (kernmap train --help lists its options)\n"),
    (["train", "--preset", "qwen2-tiny", "--rtol", "1"],  # align's option
     "kernmap train: unknown option '--rtol' (kernmap train --help lists its options)\n"),
    (["kernels", "extra"], "kernmap kernels: unexpected argument 'extra' (kernmap kernels --help lists its options)\n"),
    (["bench", "ops", "--frob"], "kernmap bench: unknown option '--frob' (kernmap bench ops --help lists its options)\n"),
    (["bench"], "kernmap bench: expected 'bench ops' or 'bench limit', got 'bench'\n"),
    (["lock"], "kernmap lock: DIR is required\n"),
    (["lock", "a", "b"], "kernmap lock: unexpected argument 'b' (kernmap lock --help lists its options)\n"),
    (["plan"], "kernmap plan: give exactly one of --preset NAME (one of qwen2-tiny, qwen2-moe-tiny, "
               "qwen3-moe-tiny) or --model DIR\n"),
    (["align", "--preset", "qwen2-tiny", "--model", "m"],
     "kernmap align: give exactly one of --preset NAME (qwen2-tiny, qwen2-moe-tiny, qwen3-moe-tiny) or --model DIR\n"),
    (["train", "--preset", "qwen2-tiny", "--save-every", "2"], "kernmap train: --save-every needs --save DIR (where to save)\n"),
])
def test_command_line_mistakes_exit_2(run_cli, args, message):
    out = run_cli(*args)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stderr.startswith(message), out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["train", "--steps", "10x"], "--steps must be an integer in [1, 1000000], got '10x'"),
    (["train", "--steps", "abc"], "--steps must be an integer in [1, 1000000], got 'abc'"),
    (["train", "--steps", "99999999999999999999"], "--steps must be an integer in [1, 1000000], got '99999999999999999999'"),
    (["train", "--steps", "0"], "--steps must be an integer in [1, 1000000], got '0'"),
    (["train", "--steps", "1e3"], "--steps must be an integer in [1, 1000000], got '1e3'"),
    (["train", "--steps", ""], "--steps needs an integer in [1, 1000000]"),
    (["train", "--steps"], "--steps needs an integer in [1, 1000000]"),
    (["train", "--steps", "--json"], "--steps needs an integer in [1, 1000000]"),
    (["train", "--lr", "nan"], "--lr must be a finite number > 0, got 'nan'"),
    (["train", "--lr", "0"], "--lr must be a finite number > 0, got '0'"),
    (["train", "--lr", "1e999"], "--lr must be a finite number > 0, got '1e999'"),
    (["train", "--lr", "0.001x"], "--lr must be a finite number > 0, got '0.001x'"),
    (["train", "--weight-decay", "-0.5"], "--weight-decay must be a finite number >= 0, got '-0.5'"),
    (["train", "--weight-decay", "inf"], "--weight-decay must be a finite number >= 0, got 'inf'"),
    (["train", "--max-grad-norm", "-1"], "--max-grad-norm must be a finite number > 0, got '-1'"),
    (["train", "--max-grad-norm", "inf"], "--max-grad-norm must be a finite number > 0, got 'inf'"),
    (["train", "--threads", "3000000000"], "--threads must be an integer in [0, 1024], got '3000000000'"),
    (["train", "--threads", "-1"], "--threads must be an integer in [0, 1024], got '-1'"),
    (["train", "--batch-size", "0"], "--batch-size must be an integer in [1, 65536], got '0'"),
    (["train", "--batch-size", "9223372036854775807"],
     "--batch-size must be an integer in [1, 65536], got '9223372036854775807'"),
    (["train", "--seq-len", "100000000000"], "--seq-len must be an integer in [2, 1048576], got '100000000000'"),
    (["train", "--seq-len", "1"], "--seq-len must be an integer in [2, 1048576], got '1'"),
    (["train", "--examples", "0"], "--examples must be an integer in [1, 1048576], got '0'"),
    (["train", "--save-every", "-1"], "--save-every must be an integer in [0, 1000000], got '-1'"),
    (["train", "--dtype", "float16"], "--dtype must be one of float32, bfloat16, got 'float16'"),
    (["train", "--examples", "1048576", "--seq-len", "1048576"],
     "--examples x --seq-len must be at most 134217728 synthetic tokens (held in memory, 8 bytes each), "
     "got 1048576 x 1048576"),
    (["train", "--batch-size", "65536", "--seq-len", "1024"],
     "--batch-size x --seq-len must be at most 16777216 tokens a step, got 65536 x 1024"),
    (["train", "--kernels", "RMSNorm,Rotary"],
     "--kernels: unknown layer 'Rotary' (expected all, none or a comma list of "
     "Experts, ForCausalLMLoss, FusedAddRMSNorm, GroupedMM, RMSNorm, SiLU, SiluAndMul, rotary_pos_emb)"),
    (["align", "--rtol", "-1"], "--rtol must be a finite number > 0, got '-1'"),
    (["align", "--rtol", "nan"], "--rtol must be a finite number > 0, got 'nan'"),
    (["ablate", "--warmup", "-1"], "--warmup must be an integer in [0, 1000000], got '-1'"),
    (["plan", "--mode", "train"],
     "--mode must be one of inference, training, inference+compile, training+compile, fallback, got 'train'"),
    (["bench", "ops", "--reps", "zero"], "--reps must be an integer in [1, 100000], got 'zero'"),
    (["bench", "ops", "--warmup", "-3"], "--warmup must be an integer in [0, 100000], got '-3'"),
    (["bench", "ops", "--levels", "avx2,sse9"],
     "--levels: unknown level 'sse9' (expected all or a comma list of baseline, avx2, avx512, avx512bf16, amx)"),
    (["bench", "ops", "--levels", "avx2,"],
     "--levels: unknown level '' (expected all or a comma list of baseline, avx2, avx512, avx512bf16, amx)"),
])
def test_bad_values_name_the_option_the_value_and_what_is_expected(run_cli, args, message):
    command, rest = args[0], args[1:]
    preset = [] if command == "bench" else ["--preset", "qwen2-tiny"]
    out = run_cli(command, *preset, *rest)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stderr == f"kernmap {command}: {message}\n"
    assert out.stdout == ""


def test_bench_levels_above_the_cap_are_refused(run_cli):
    out = run_cli("bench", "ops", "--levels", "baseline,avx2", env={"KERNMAP_CPU_ISA": "baseline"})
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("kernmap bench: --levels: level 'avx2' cannot run in this process "
                          "(it runs baseline; KERNMAP_CPU_ISA=baseline caps it)\n")


def test_unknown_device_lists_the_device_types(run_cli):
    out = run_cli("plan", "--preset", "qwen2-tiny", "--device", "cdua")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("kernmap plan: --device must be a torch device type (")
    assert out.stderr.endswith("), got 'cdua'\n")
    known = out.stderr.split("(", 1)[1].rsplit(")", 1)[0].split(", ")
    assert {"cpu", "cuda", "xpu", "mps", "meta", "hip", "npu", "rocm"} <= set(known)
    for device in ("cuda", "meta", "npu"):
        assert run_cli("plan", "--preset", "qwen2-tiny", "--device", device).returncode == 0, device


def test_lock_errors_name_the_command_once(run_cli, tmp_path):
    out = run_cli("lock", tmp_path / "missing")
    assert out.returncode == 1
    assert out.stderr.startswith("kernmap lock: ") and out.stderr.count("kernmap lock:") == 1, out.stderr
    assert "not a folder" in out.stderr


SMALL_DATA = ["--preset", "qwen2-tiny", "--seq-len", "8", "--examples", "4", "--batch-size", "2"]


def test_resume_with_steps_not_above_the_checkpoint_is_refused(run_cli, tmp_path):
    out = run_cli("train", *SMALL_DATA, "--steps", "2", "--save", tmp_path)
    assert out.returncode == 0, out.stderr
    out = run_cli("train", *SMALL_DATA, "--steps", "2", "--resume", tmp_path)
    assert out.returncode == 2
    assert f"--steps 2 is not above the step of {tmp_path}'s checkpoint (2)" in out.stderr


def test_a_diverging_run_stops_naming_the_step_or_skips_with_the_flag(run_cli):
    # An absurd learning rate makes the weights overflow after the first update: step 2's loss is not finite.
    out = run_cli("train", *SMALL_DATA, "--steps", "4", "--lr", "1e30")
    assert out.returncode == 1 and "step 2" in out.stderr, out.stderr
    out = run_cli("train", *SMALL_DATA, "--steps", "4", "--lr", "1e30", "--skip-non-finite", "--json")
    assert out.returncode == 0, out.stderr
    steps = json.loads(out.stdout)["steps"]
    assert [s["skipped"] for s in steps] == [False, True, True, True]
