"""``python -m kernmap.bench [--json] [--filter REGEX] [--warmup N] [--reps N] [--tokens-scale X]``

transformers' own modules against ``torch.compile`` of the same modules and against kernmap, side by side in one
run: RMSNorm, the residual add + RMSNorm, the rotary embedding (28 query heads, 4 key/value heads, head_dim 128) and
the SiLU-and-mul product at Qwen2-7B sizes (H 3584, I 18944), the whole gated MLP (Qwen2MLP), and
the MoE experts layer at Qwen3-30B-A3B sizes (128 experts, top-8, H 2048, I 768) with transformers' ``eager``,
``grouped_mm`` and ``batched_mm`` implementations and ``kernmap``, and the LM head with transformers'
``ForCausalLMLoss`` at Qwen2-0.5B (H 896, V 151936) and Qwen2-7B (H 3584, V 152064) sizes, N 2048 rows, against
kernmap's fused linear cross-entropy and against the bare matrix products every implementation computes (one
forward, three for forward+backward: the floor of any exact one). Forward, and forward+backward. Token counts are sized for a 2-core machine
with a few GB of free memory (``batched_mm`` gathers one weight copy per token-expert pair). Repetitions of one
case's implementations are interleaved; medians after warm-up. Each implementation's peak extra memory is
measured: the most CPU memory in tensors one run holds above what was live before it (kernmap's count of c10's
CPU allocator and its large-block cache; BLAS and oneDNN scratch are not counted). The JSON has the shape of
``kernmap bench ops --json``; ``speedup_vs_reference`` is against transformers' eager module.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kernmap


@dataclass
class Impl:
    name: str
    run: Callable[[], None]


@dataclass
class Case:
    op: str
    pass_: str
    dtype: str
    shape: str
    bytes: float
    impls: list[Impl]
    flops: float = 0.0  # the case's arithmetic, when it is a product (GFLOP/s is reported then)
    max_reps: int | None = None  # cases of seconds a run cap --reps (and --warmup at 1)


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    peak_bytes: float  # the most CPU memory in tensors one run held above what was live before it


def keep_freed_memory() -> None:
    """As `kernmap bench ops`: glibc would unmap every freed block over 32 MiB and page-fault it back on the next
    call, a cost of the allocator rather than of any implementation."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except OSError:
        pass


def time_interleaved(impls: list[Impl], warmup: int, reps: int, memory: bool = True) -> list[Timing]:
    """Medians after warm-up, the implementations' runs interleaved; the largest peak extra memory of the timed
    runs, as `kernmap bench ops` counts it (after warm-up: torch.compile's first run holds its compiler's
    tensors). memory=False leaves CPU memory uncounted (peak_bytes 0), as kernmap.tune times."""
    if memory:
        kernmap.count_cpu_memory()
    ms: list[list[float]] = [[] for _ in impls]
    peak = [0.0] * len(impls)
    for r in range(warmup + reps):
        for i, impl in enumerate(impls):
            if memory:
                kernmap.reset_cpu_memory_peak()
                before = kernmap.cpu_memory()["in_use"]
            t0 = time.perf_counter()
            impl.run()
            t1 = time.perf_counter()
            if r >= warmup:
                if memory:
                    peak[i] = max(peak[i], kernmap.cpu_memory()["peak"] - before)
                ms[i].append((t1 - t0) * 1e3)
    out = []
    for m, p in zip(ms, peak):
        m.sort()
        out.append(Timing(m[len(m) // 2], m[0], m[-1], p))
    return out


def copy_gbps(reps: int) -> float:
    n = 1 << 26
    src, dst = torch.rand(n), torch.empty(n)
    (timing,) = time_interleaved([Impl("copy", lambda: dst.copy_(src))], 2, max(reps, 5))
    return 2.0 * n * 4 / (timing.median_ms * 1e6)


def forward(fn, *inputs) -> Callable[[], None]:
    def run():
        with torch.no_grad():
            fn(*inputs)
    return run


def forward_backward(fn, inputs: list[torch.Tensor], grad: torch.Tensor, params=()) -> Callable[[], None]:
    """fwd+bwd with a fixed upstream gradient; grads dropped between runs so no accumulation is timed."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]

    def run():
        y = fn(*inputs)
        y.backward(grad)
        for t in (*inputs, *params):
            t.grad = None
    return run


def forward_backward_pair(fn, inputs: list[torch.Tensor], grads: tuple[torch.Tensor, torch.Tensor],
                          n_grad: int, params=()) -> Callable[[], None]:
    """fwd+bwd of a two-output fn, gradients for both outputs; the first n_grad inputs and params require grad.
    The gradients are returned (torch.autograd.grad), not accumulated into leaves: in a model these inputs are
    other layers' outputs, and a leaf's AccumulateGrad would copy a gradient that reaches two leaves (the
    residual add's, which x and the residual share) — a copy no decoder layer makes."""
    inputs = [t.detach().clone().requires_grad_(i < n_grad) for i, t in enumerate(inputs)]
    wrt = [*inputs[:n_grad], *params]

    def run():
        a, b = fn(*inputs)
        torch.autograd.grad([a, b], wrt, list(grads))
    return run


def compiled(fn):
    return torch.compile(fn, dynamic=False)


# ---- cases --------------------------------------------------------------------------------------------------------


def rms_norm_cases(dtype: torch.dtype, scale: float) -> list[Case]:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    T, H = int(4096 * scale), 3584  # Qwen2-7B hidden size
    eager = Qwen2RMSNorm(H, eps=1e-6).to(dtype)
    with torch.no_grad():
        eager.weight.copy_(1 + 0.1 * torch.randn(H))
    kern = copy.deepcopy(eager)
    kernmap.kernelize(kern, mode="training", device="cpu")
    comp = compiled(copy.deepcopy(eager))
    x, dy = torch.randn(T, H).to(dtype), torch.randn(T, H).to(dtype)
    e = x.element_size()
    shape = f"[{T}, {H}]"
    fwd_bytes = e * (2 * T * H + H)
    mods = (("transformers", eager), ("torch.compile", comp), ("kernmap", kern))
    return [
        Case("RMSNorm", "fwd", str(dtype)[6:], shape, fwd_bytes, [Impl(n, forward(m, x)) for n, m in mods]),
        Case("RMSNorm", "fwd+bwd", str(dtype)[6:], shape, fwd_bytes + e * (3 * T * H + 2 * H),
             [Impl(n, forward_backward(m, [x], dy, params=list(getattr(m, "_orig_mod", m).parameters())))
              for n, m in mods]),
    ]


def add_rms_norm_cases(dtype: torch.dtype, scale: float) -> list[Case]:
    """The residual add and the RMSNorm after it, as transformers' decoder layer computes them
    (``hidden_states = residual + hidden_states; residual = hidden_states; norm(hidden_states)``), against the add
    followed by kernmap's rms_norm and against kernmap's fused add_rms_norm."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    T, H = int(4096 * scale), 3584  # Qwen2-7B hidden size
    norm = Qwen2RMSNorm(H, eps=1e-6).to(dtype)
    w = norm.weight

    def eager(x, residual):
        h = residual + x
        return norm(h), h

    def separate(x, residual):
        h = residual + x
        return torch.ops.kernmap.rms_norm(h, w, 1e-6), h

    def fused(x, residual):
        return torch.ops.kernmap.add_rms_norm(x, residual, w, 1e-6)

    impls = (("transformers", eager), ("torch.compile", compiled(eager)), ("add + kernmap rms_norm", separate),
             ("kernmap", fused))
    x, r, gy, gs = (torch.randn(T, H).to(dtype) for _ in range(4))
    n = x.element_size() * T * H
    shape = f"[{T}, {H}]"
    return [
        Case("FusedAddRMSNorm", "fwd", str(dtype)[6:], shape, 4 * n, [Impl(k, forward(f, x, r)) for k, f in impls]),
        Case("FusedAddRMSNorm", "fwd+bwd", str(dtype)[6:], shape, 8 * n,
             [Impl(k, forward_backward_pair(f, [x, r], (gy, gs), 2, (w,))) for k, f in impls]),
    ]


def rotary_cases(dtype: torch.dtype, scale: float) -> list[Case]:
    """apply_rotary_pos_emb at Qwen2-7B attention sizes (28 query heads, 4 key/value heads, head_dim 128) in the
    attention's layout: [B, heads, S, D] views of the [B, S, heads, D] projections; cos, sin [B, S, D]."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    S, Hq, Hkv, D = int(4096 * scale), 28, 4, 128
    q = torch.randn(1, S, Hq, D).to(dtype).transpose(1, 2)
    k = torch.randn(1, S, Hkv, D).to(dtype).transpose(1, 2)
    cos, sin = torch.randn(1, S, D).to(dtype), torch.randn(1, S, D).to(dtype)
    grads = (torch.randn(q.shape).to(dtype), torch.randn(k.shape).to(dtype))
    impls = (("transformers", apply_rotary_pos_emb), ("torch.compile", compiled(apply_rotary_pos_emb)),
             ("kernmap", torch.ops.kernmap.apply_rotary))
    e = q.element_size()
    pass_bytes = e * (2 * (q.numel() + k.numel()) + 2 * S * D)
    shape = f"q [1, {Hq}, {S}, {D}] k [1, {Hkv}, {S}, {D}] (views)"
    return [
        Case("rotary_pos_emb", "fwd", str(dtype)[6:], shape, pass_bytes,
             [Impl(n, forward(f, q, k, cos, sin)) for n, f in impls]),
        # clone() keeps the views' strides: each implementation gets its own [B, heads, S, D] views of [B, S, heads, D].
        Case("rotary_pos_emb", "fwd+bwd", str(dtype)[6:], shape, 2 * pass_bytes,
             [Impl(n, forward_backward_pair(f, [q, k, cos, sin], grads, 2)) for n, f in impls]),
    ]


def _decoder_step(layer, fused: bool):
    """One transformers pre-norm decoder layer between residual adds, taking the previous block's output and the
    residual stream and returning this layer's MLP output and the stream: `h = residual + x; h2 = h +
    attn(input_norm(h)); return mlp(post_norm(h2)), h2`. With fused, both adds go into the norms after them
    (kernmap's add_rms_norm), as a model-level FusedAddRMSNorm binding would run every layer."""
    add_norm = torch.ops.kernmap.add_rms_norm

    def step(x, residual, position_embeddings):
        inorm, pnorm = layer.input_layernorm, layer.post_attention_layernorm
        if fused:
            n, h = add_norm(x, residual, inorm.weight, inorm.variance_epsilon)
        else:
            h = residual + x
            n = inorm(h)
        a, _ = layer.self_attn(hidden_states=n, attention_mask=None, position_embeddings=position_embeddings)
        if fused:
            n2, h2 = add_norm(a, h, pnorm.weight, pnorm.variance_epsilon)
        else:
            h2 = h + a
            n2 = pnorm(h2)
        return layer.mlp(n2), h2
    return step


def decoder_layer_cases(dtype: torch.dtype, scale: float) -> list[Case]:
    """What binding FusedAddRMSNorm into transformers' decoder layers would gain: a Qwen2 decoder layer at
    Qwen2-0.5B and Qwen2-7B sizes (sdpa attention, every other kernmap kernel bound) with its two residual adds
    separate and fused into the norms, forward+backward side by side."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    sizes = {"Qwen2-0.5B": (dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                                 num_key_value_heads=2), 2048),
             "Qwen2-7B": (dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                               num_key_value_heads=4), 512)}
    cases = []
    for name, (dims, tokens) in sizes.items():
        T = int(tokens * scale)
        config = Qwen2Config(**dims, attn_implementation="sdpa")
        layer = Qwen2DecoderLayer(config, 0).to(dtype)
        kernmap.kernelize(layer, mode="training", device="cpu")
        rotary = Qwen2RotaryEmbedding(config)
        x, r = (torch.randn(1, T, config.hidden_size).to(dtype) for _ in range(2))
        pe = rotary(x, torch.arange(T).unsqueeze(0))
        grads = (torch.randn_like(x), torch.randn_like(x))
        params = list(layer.parameters())

        def impl(fused, pe=pe, x=x, r=r, grads=grads, params=params, layer=layer):  # this size's, not the last's
            return forward_backward_pair(lambda a, b, f=_decoder_step(layer, fused): f(a, b, pe), [x, r], grads, 2,
                                         params)

        e = x.element_size()
        cases.append(Case("DecoderLayer", "fwd+bwd", str(dtype)[6:], f"{name} [{T}, {config.hidden_size}]",
                          3 * e * sum(p.numel() for p in params),
                          [Impl("separate adds", impl(False)), Impl("fused add + norm", impl(True))]))
    return cases


def silu_and_mul_cases(dtype: torch.dtype, scale: float) -> list[Case]:
    from transformers.activations import ACT2FN

    T, I = int(2048 * scale), 18944  # Qwen2-7B intermediate size
    act = ACT2FN["silu"]

    def eager(gate, up):  # Qwen2MLP's product: act_fn(gate_proj(x)) * up_proj(x)
        return act(gate) * up

    impls = (("transformers", eager), ("torch.compile", compiled(eager)), ("kernmap", torch.ops.kernmap.silu_and_mul))
    gate, up, dy = (torch.randn(T, I).to(dtype) for _ in range(3))
    e, n = gate.element_size(), T * I
    shape = f"[{T}, {I}]"
    return [
        Case("SiluAndMul", "fwd", str(dtype)[6:], shape, e * 3 * n, [Impl(k, forward(f, gate, up)) for k, f in impls]),
        Case("SiluAndMul", "fwd+bwd", str(dtype)[6:], shape, e * 8 * n,
             [Impl(k, forward_backward(f, [gate, up], dy)) for k, f in impls]),
    ]


def gated_mlp_cases(dtype: torch.dtype, scale: float) -> list[Case]:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    T, H, I = int(128 * scale), 3584, 18944
    eager = Qwen2MLP(Qwen2Config(hidden_size=H, intermediate_size=I, hidden_act="silu")).to(dtype)
    kern = copy.deepcopy(eager)
    kernmap.kernelize(kern, mode="training", device="cpu")
    comp = compiled(copy.deepcopy(eager))
    x, dy = torch.randn(T, H).to(dtype), torch.randn(T, H).to(dtype)
    e = x.element_size()
    weights = e * 3 * H * I
    shape = f"[{T}, {H}] x I {I}"
    mods = (("transformers", eager), ("torch.compile", comp), ("kernmap", kern))
    return [
        Case("GatedMLP", "fwd", str(dtype)[6:], shape, weights + e * (2 * T * H + 3 * T * I),
             [Impl(n, forward(m, x)) for n, m in mods]),
        Case("GatedMLP", "fwd+bwd", str(dtype)[6:], shape, 3 * weights + e * (4 * T * H + 9 * T * I),
             [Impl(n, forward_backward(m, [x], dy, params=list(getattr(m, "_orig_mod", m).parameters())))
              for n, m in mods]),
    ]


def experts_cases(dtype: torch.dtype, scale: float) -> list[Case]:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    T, H, I, E, k = int(16 * scale), 2048, 768, 128, 8  # Qwen3-30B-A3B; batched_mm gathers 9 MB of weights per pair
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k)
    base = Qwen3MoeExperts(config)
    with torch.no_grad():
        base.gate_up_proj.normal_(0, 0.02)
        base.down_proj.normal_(0, 0.02)
    base = base.to(dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g).softmax(-1).to(dtype)
    x, dy = torch.randn(T, H).to(dtype), torch.randn(T, H).to(dtype)

    def variant(implementation: str):
        module = copy.copy(base)  # shares the weights; its own config picks the implementation
        module.config = copy.copy(base.config)
        module.config._experts_implementation = implementation
        return lambda h: module(h, ids, weights)

    names = ("eager", "grouped_mm", "batched_mm", "kernmap")
    e = x.element_size()
    weight_bytes = e * 3 * E * H * I
    shape = f"T {T}, E {E}, top-{k}, H {H}, I {I}"
    params = [base.gate_up_proj, base.down_proj]
    impl_label = {"eager": "transformers"}
    return [
        Case("Experts", "fwd", str(dtype)[6:], shape, weight_bytes + e * 2 * T * H,
             [Impl(impl_label.get(n, n), forward(variant(n), x)) for n in names]),
        Case("Experts", "fwd+bwd", str(dtype)[6:], shape, 3 * weight_bytes + e * 4 * T * H,
             [Impl(impl_label.get(n, n), forward_backward(variant(n), [x], dy, params=params)) for n in names]),
    ]


LCE_SIZES = {"Qwen2-0.5B": (896, 151936), "Qwen2-7B": (3584, 152064)}  # hidden size, vocabulary


def linear_cross_entropy_cases(dtype: torch.dtype, scale: float,
                               sizes: tuple[str, ...] = tuple(LCE_SIZES)) -> list[Case]:
    """The LM head and the loss as transformers computes them in a causal LM's training step (``logits =
    lm_head(hidden)``, ``ForCausalLMLoss(logits, ...)``: [N, V] logits, their fp32 copy, log-softmax and their
    gradients), against kernmap's fused op (chunks of rows, no [N, V] tensor), labels already shifted."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    cases = []
    for name in sizes:
        H, V = LCE_SIZES[name]
        N = int(2048 * scale)
        hidden = torch.randn(N, H).to(dtype)  # a final norm's output
        weight = (torch.randn(V, H) * (2 / H**0.5)).to(dtype)  # a trained head's scale: logits of a few units
        labels = torch.randint(V, (N,))

        def eager(h, w, V=V, labels=labels):
            return ForCausalLMLoss(torch.nn.functional.linear(h, w), None, V, shift_labels=labels)

        def fused(h, w, labels=labels):
            return torch.ops.kernmap.linear_cross_entropy(h, w, labels)

        def products(h=hidden, w=weight):  # what every implementation computes, the logits standing in for their gradient
            z = h @ w.t()
            return z @ w, z.t() @ h

        impls = (("transformers", eager), ("torch.compile", compiled(eager)), ("kernmap", fused))
        e, product = hidden.element_size(), 2.0 * N * H * V
        shape = f"{name} N {N}, H {H}, V {V}"
        reps = 5 if H < 2048 else 3  # a run takes seconds (3 products of 0.5-2.2 TFLOP)
        one = torch.ones(())
        cases += [
            Case("ForCausalLMLoss", "fwd", str(dtype)[6:], shape, e * (N * H + V * H),
                 [*(Impl(k, forward(f, hidden, weight)) for k, f in impls),
                  Impl("1 product", forward(lambda h, w: h @ w.t(), hidden, weight))], product, reps),
            Case("ForCausalLMLoss", "fwd+bwd", str(dtype)[6:], shape, e * (2 * N * H + 3 * V * H),
                 [*(Impl(k, forward_backward(f, [hidden, weight], one)) for k, f in impls),
                  Impl("3 products", forward(products))], 3 * product, reps),
        ]
    return cases


FAMILIES = {
    "RMSNorm": (rms_norm_cases, (torch.float32, torch.bfloat16)),
    "FusedAddRMSNorm": (add_rms_norm_cases, (torch.float32, torch.bfloat16)),
    "rotary_pos_emb": (rotary_cases, (torch.float32, torch.bfloat16)),
    "SiluAndMul": (silu_and_mul_cases, (torch.float32, torch.bfloat16)),
    "GatedMLP": (gated_mlp_cases, (torch.bfloat16,)),
    "Experts": (experts_cases, (torch.bfloat16,)),
    "DecoderLayer": (decoder_layer_cases, (torch.float32, torch.bfloat16)),
    "ForCausalLMLoss": (linear_cross_entropy_cases, (torch.float32, torch.bfloat16)),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernmap.bench", description=__doc__.split("\n\n")[1])
    parser.add_argument("--json", action="store_true", help="machine-readable output (shape of `kernmap bench ops`)")
    parser.add_argument("--filter", default=".*", help="regex over 'layer/dtype', e.g. 'RMSNorm|Experts'")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--tokens-scale", type=float, default=1.0, help="multiplies every case's token count")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.reps < 1 or args.tokens_scale <= 0:
        parser.error("--warmup must be >= 0, --reps >= 1, --tokens-scale > 0")
    try:
        pattern = re.compile(args.filter)
    except re.error as e:
        parser.error(f"--filter {args.filter!r} is not a valid regular expression: {e}")

    keep_freed_memory()
    torch.manual_seed(0)
    copy_bw = copy_gbps(args.reps)
    progress = not args.json and sys.stderr.isatty()
    rows = []
    planned = [(name, dt) for name, (_, dts) in FAMILIES.items() for dt in dts
            if pattern.search(f"{name}/{str(dt)[6:]}")]
    for i, (name, dtype) in enumerate(planned):
        if progress:
            print(f"\r[{i + 1}/{len(planned)}] {name} {str(dtype)[6:]}...        ", end="", file=sys.stderr, flush=True)
        for case in FAMILIES[name][0](dtype, args.tokens_scale):
            warmup, reps = args.warmup, args.reps
            if case.max_reps is not None:
                warmup, reps = min(warmup, 1), min(reps, case.max_reps)
            timings = time_interleaved(case.impls, warmup, reps)
            reference = timings[0].median_ms
            for impl, t in zip(case.impls, timings):
                gbps = case.bytes / (t.median_ms * 1e6)
                row = {"op": case.op, "pass": case.pass_, "dtype": case.dtype, "shape": case.shape,
                       "impl": impl.name, "median_ms": round(t.median_ms, 4), "min_ms": round(t.min_ms, 4),
                       "max_ms": round(t.max_ms, 4), "gbps": round(gbps, 2),
                       "pct_of_copy": round(100 * gbps / copy_bw, 1),
                       "speedup_vs_reference": round(reference / t.median_ms, 3), "peak_bytes": t.peak_bytes}
                if case.flops:  # as `kernmap bench ops`: only for products
                    row["gflops"] = round(case.flops / (t.median_ms * 1e6), 1)
                rows.append(row)
    if progress:
        print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    machine = {"copy_gbps": round(copy_bw, 2), "threads": torch.get_num_threads(),
               "cpu_level": torch.backends.cpu.get_cpu_capability()}
    if args.json:
        print(json.dumps({"machine": machine, "results": rows}))
        return 0
    # The plain copy_ (whose stores read every line they write) with warm caches: a relative scale for the
    # layers' rows, not a floor; `kernmap bench ops` floors each kernel at the faster of this and a streamed copy
    # of the case's own bytes, a read rate, and runs from memory (docs/development.md, "Benchmarks").
    print(f"machine: copy bandwidth {copy_bw:.1f} GB/s (Tensor.copy_, read + write; not a floor: `kernmap bench ops` "
          f"measures those), {machine['threads']} threads, ATen CPU level "
          f"{machine['cpu_level']}; {args.warmup} warm-up + {args.reps} timed reps, interleaved, medians\n")
    header = ["layer", "pass", "dtype", "shape", "impl", "median ms", "min..max ms", "GB/s", "% copy", "GFLOP/s",
              "peak MB", "vs eager"]
    table = [[r["op"], r["pass"], r["dtype"], r["shape"], r["impl"], f"{r['median_ms']:.3f}",
              f"{r['min_ms']:.2f}..{r['max_ms']:.2f}", f"{r['gbps']:.1f}", f"{r['pct_of_copy']:.1f}%",
              f"{r['gflops']:.1f}" if "gflops" in r else "", f"{r['peak_bytes'] / 1e6:.1f}",
              f"{r['speedup_vs_reference']:.2f}x"] for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(header)]
    for line in [header, ["-" * w for w in widths], *table]:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
