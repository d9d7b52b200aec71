"""The fused causal-LM loss's figures (docs/ops.md, "Fused linear cross-entropy"), measured in one run:

1. A Qwen2-0.5B-shaped training step (hidden 896, intermediate 4864, 2 decoder layers, vocabulary 151,936, tied
   embeddings, batch 2 x 512 tokens, SGD step): transformers as shipped against `kernmap.kernelize(model,
   mode="training")` (with --compiled also transformers under `torch.compile`), fp32 and bf16. Each run in a worker process of its own, so that a step's peak
   resident memory is that run's alone (the kernel's high-water mark, VmHWM, reset through /proc/self/clear_refs
   before each step); the workers take turns, one step each, the order alternating, so that the machine's drift
   hits both alike. Per step: loss, seconds, peak RSS. Medians after warm-up.
2. The op's forward+backward at H 896, V 151936, N 2048 against transformers' lm_head + ForCausalLMLoss and
   torch.compile of it: `python -m kernmap.bench`'s case (interleaved repetitions, medians, each
   implementation's peak extra memory in tensors), fp32 and bf16.

    source scripts/env.sh && python scripts/causal_lm_loss_figures.py [--steps 20] [--warmup 3] [--json FILE] [--compiled]
        [--tokens 512] [--dtypes float32,bfloat16] [--parts steps,op] [--op-reps 5]

A benchmark, not a test: on a shared machine the figures are noisy, and only ratios measured side by side mean
anything."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time

import torch

from kernmap.train.ablate import peak_rss, reset_peak_rss

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BATCH = 2
LR = 1e-2


def qwen2_half_b_two_layers(tokens: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=2, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=tokens)
    torch.manual_seed(0)  # both workers build the same weights
    return Qwen2ForCausalLM(config)


def peak_rss_reset() -> None:
    if not reset_peak_rss():
        raise RuntimeError("cannot reset the peak resident set size (/proc/self/clear_refs)")


def peak_rss_bytes() -> int:
    peak = peak_rss()
    if peak is None:
        raise RuntimeError("no VmHWM in /proc/self/status")
    return int(peak)


def worker(conn, dtype_name: str, run: str, tokens: int) -> None:
    """One run's model; answers each step number with (loss, seconds, peak RSS bytes)."""
    import kernmap

    model = qwen2_half_b_two_layers(tokens).to(DTYPES[dtype_name])
    report = kernmap.kernelize(model, mode="training") if run == "kernelized" else None
    model.train()
    forward = torch.compile(model) if run == "compiled" else model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    conn.send(None if report is None else [(r.path, r.layer, r.kernel, r.fallback) for r in report.rows])
    while (step := conn.recv()) is not None:
        ids = torch.randint(0, model.config.vocab_size, (BATCH, tokens), generator=torch.Generator().manual_seed(step))
        peak_rss_reset()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        seconds = time.perf_counter() - start
        conn.send((loss.item(), seconds, peak_rss_bytes()))


def training_steps(dtype_name: str, steps: int, warmup: int, tokens: int, compiled: bool) -> dict:
    ctx = multiprocessing.get_context("spawn")
    runs = {}
    for name in ("transformers", "kernelized") + (("compiled",) if compiled else ()):
        parent, child = ctx.Pipe()
        process = ctx.Process(target=worker, args=(child, dtype_name, name, tokens))
        process.start()
        runs[name] = (parent, process)
    report = {name: conn.recv() for name, (conn, _) in runs.items()}["kernelized"]
    log = {name: [] for name in runs}
    names = list(runs)
    for step in range(steps):
        for name in names if step % 2 == 0 else names[::-1]:
            conn = runs[name][0]
            conn.send(step)
            log[name].append(conn.recv())
    for conn, process in runs.values():
        conn.send(None)
        process.join()

    out = {"dtype": dtype_name, "steps": steps, "warmup": warmup, "batch": [BATCH, tokens],
           "layers": sorted({(layer, kernel) for _, layer, kernel, fallback in report if not fallback})}
    for name, rows in log.items():
        timed = rows[warmup:]
        out[name] = {"losses": [r[0] for r in rows], "seconds": [r[1] for r in rows],
                     "peak_rss": [r[2] for r in rows], "median_s": statistics.median(r[1] for r in timed),
                     "max_peak_rss": max(r[2] for r in timed), "median_peak_rss": statistics.median(r[2] for r in timed)}
    base, kern = out["transformers"], out["kernelized"]
    out["speedup"] = base["median_s"] / kern["median_s"]
    out["peak_rss_ratio"] = kern["max_peak_rss"] / base["max_peak_rss"]
    out["max_loss_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(base["losses"], kern["losses"]))
    if compiled:
        comp = out["compiled"]
        out["speedup_vs_compiled"] = comp["median_s"] / kern["median_s"]
        out["peak_rss_ratio_vs_compiled"] = kern["max_peak_rss"] / comp["max_peak_rss"]
    return out


def op_case(dtype_name: str, warmup: int, reps: int) -> dict:
    from kernmap import bench

    bench.keep_freed_memory()
    torch.manual_seed(0)
    (case,) = [c for c in bench.linear_cross_entropy_cases(DTYPES[dtype_name], 1.0, ("Qwen2-0.5B",))
               if c.pass_ == "fwd+bwd"]
    timings = bench.time_interleaved(case.impls, warmup, reps)
    N, H, V = 2048, 896, 151936
    gradients = DTYPES[dtype_name].itemsize * (N * H + V * H)  # the results: the gradients of hidden and weight
    impls = {impl.name: {"median_ms": t.median_ms, "min_ms": t.min_ms, "max_ms": t.max_ms,
                         "peak_bytes": t.peak_bytes, "above_gradients_bytes": t.peak_bytes - gradients}
             for impl, t in zip(case.impls, timings)}
    kern = impls["kernmap"]
    return {"dtype": dtype_name, "shape": case.shape, "warmup": warmup, "reps": reps, "gradient_bytes": gradients,
            "impls": impls,
            "speedup": {k: v["median_ms"] / kern["median_ms"] for k, v in impls.items() if k != "kernmap"},
            # what is left to gain over each: its time above the three products every implementation computes
            "above_products_ms": {k: v["median_ms"] - impls["3 products"]["median_ms"] for k, v in impls.items()},
            "peak_fraction": {k: kern["peak_bytes"] / v["peak_bytes"] for k, v in impls.items() if k != "kernmap"},
            "above_gradients_fraction": {k: kern["above_gradients_bytes"] / v["above_gradients_bytes"]
                                         for k, v in impls.items() if k != "kernmap"}}


def print_step(r: dict) -> None:
    base, kern = r["transformers"], r["kernelized"]
    print(f"\ntraining step, {r['dtype']}, batch {r['batch'][0]} x {r['batch'][1]} tokens: {r['steps']} steps, medians "
          f"after {r['warmup']} warm-up; kernels: "
          + ", ".join(k for _, k in r["layers"]))
    print("step  loss transformers  loss kernelized   s transformers  s kernelized  RSS MB transformers  RSS MB kernelized")
    for i in range(r["steps"]):
        print(f"{i + 1:4d}  {base['losses'][i]:17.7f}  {kern['losses'][i]:15.7f}  {base['seconds'][i]:15.3f}  "
              f"{kern['seconds'][i]:12.3f}  {base['peak_rss'][i] / 1e6:19.0f}  {kern['peak_rss'][i] / 1e6:17.0f}")
    print(f"median step: transformers {base['median_s']:.3f} s, kernelized {kern['median_s']:.3f} s -> "
          f"{r['speedup']:.3f}x faster (target >= 1.15x)")
    print(f"peak RSS (largest of the timed steps): transformers {base['max_peak_rss'] / 1e6:.0f} MB, kernelized "
          f"{kern['max_peak_rss'] / 1e6:.0f} MB -> {r['peak_rss_ratio']:.3f}x (target <= 0.5x)")
    print(f"losses: largest relative difference over {r['steps']} steps {r['max_loss_rel_diff']:.2e}"
          + (" (fp32 target rtol 1e-5)" if r["dtype"] == "float32" else ""))
    if "compiled" in r:
        comp = r["compiled"]
        print("transformers under torch.compile, per step (s, RSS MB): " + ", ".join(
            f"{s:.2f} {m / 1e6:.0f}" for s, m in zip(comp["seconds"], comp["peak_rss"])))
        print(f"median step: torch.compile {comp['median_s']:.3f} s, kernelized {kern['median_s']:.3f} s -> "
              f"{r['speedup_vs_compiled']:.3f}x; peak RSS torch.compile {comp['max_peak_rss'] / 1e6:.0f} MB, "
              f"kernelized {r['peak_rss_ratio_vs_compiled']:.3f}x of it")


def print_op(r: dict) -> None:
    print(f"\nForCausalLMLoss fwd+bwd, {r['dtype']}, {r['shape']}: {r['reps']} timed reps after {r['warmup']} "
          f"warm-up, interleaved; the gradients themselves are {r['gradient_bytes'] / 1e6:.0f} MB")
    print("impl           median ms     min..max ms      peak MB  above the gradients MB")
    for name, v in r["impls"].items():
        print(f"{name:13s}  {v['median_ms']:9.0f}  {v['min_ms']:7.0f}..{v['max_ms']:<7.0f}  "
              f"{v['peak_bytes'] / 1e6:9.0f}  {v['above_gradients_bytes'] / 1e6:10.0f}")
    for name in ("transformers", "torch.compile"):
        print(f"kernmap vs {name}: {r['speedup'][name]:.2f}x faster (target >= 1.3x), peak "
              f"{100 * r['peak_fraction'][name]:.1f}% of its (target <= 10%), above the gradients "
              f"{100 * r['above_gradients_fraction'][name]:.1f}%")
    print("time above the 3 products: " + ", ".join(f"{k} {v:.0f} ms" for k, v in r["above_products_ms"].items()
                                                    if k != "3 products"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="training steps left out of the medians")
    parser.add_argument("--op-reps", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per sequence of the training step's batch of 2")
    parser.add_argument("--parts", default="steps,op", help="steps, op or both")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument("--compiled", action="store_true",
                        help="also run transformers under torch.compile (a third worker; its first steps compile)")
    args = parser.parse_args()
    dtypes, parts = args.dtypes.split(","), args.parts.split(",")
    if (args.steps <= args.warmup or args.warmup < 0 or args.op_reps < 1 or args.tokens < 2
            or not set(dtypes) <= set(DTYPES) or not set(parts) <= {"steps", "op"}):
        parser.error("--steps must exceed --warmup >= 0, --op-reps >= 1, --tokens >= 2, --dtypes a comma list of "
                     "float32, bfloat16, --parts of steps, op")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU level "
          f"{torch.backends.cpu.get_cpu_capability()}; a shared machine: figures are noisy, ratios side by side")
    results = {"steps": [], "op": []}
    for dtype in dtypes if "steps" in parts else ():
        results["steps"].append(training_steps(dtype, args.steps, args.warmup, args.tokens, args.compiled))
        print_step(results["steps"][-1])
    for dtype in dtypes if "op" in parts else ():
        results["op"].append(op_case(dtype, 1, args.op_reps))
        print_op(results["op"][-1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
