"""ember's kernels against torch eager, torch.compile and Liger-Kernel on the same shapes.

    python benchmarks/kernels.py --device cuda          # one table: gpt2-small and llama-small shapes
    .venv/bin/python benchmarks/kernels.py --device cpu # the plumbing, tiny shapes, Triton interpreted

Each row times one op, forward and backward (the int8 product: forward only, it is a decode op),
with ``triton.testing.do_bench`` on CUDA (median ms of repeated runs after warm-up, caches
flushed), each call launched from Python. Memory-bound ops are also timed replayed from a CUDA
graph ("graph ms", ``do_bench_cudagraph``): on these shapes their launches from Python take
longer than their kernels (the H200 lease of 2026-11-26: 0.15-0.9 ms for ops whose bytes take
25-50 µs), so the graph's time is the kernel's own. They report the fraction of the device's
nominal HBM bandwidth their bytes reach in that time (the bytes each op must move at least:
docs/kernels.md); attention and the fused linear cross-entropy are compute-bound and report
TFLOP/s. "vs eager" is eager's time over this row's (> 1: faster), launched or from graphs.
The norms' "ember 1 row" rows run them as before ``ember.kernels.norm.rows_per_program`` and
the backward's configs (``norm.FORWARD`` = (1, 4), ``norm.BACKWARD`` = (4, 1, 1)): the forward
one row a program (not a tile of 4 at 768 wide; on the H200 lease of 2026-11-27 the tile alone
timed 0.070 against 0.071 ms), the backward's loop unpipelined; their "ember untimed" rows run
the forward's and the backward's first configs (``norm.forward_configs``: 4 rows of 768 and 4
warps a program; ``norm.BACKWARD_CONFIGS``: 4 programs an SM, 4 rows ahead), where "ember" takes
the ones ``ember.kernels.fastest`` timed fastest.
RoPE's "ember as before" row runs it as that lease timed it (``rope.CONFIG``: tiles of 4,096, 4
warps; k's loads after q's stores, ``rope.LOADS_FIRST`` off); softmax's runs its long rows as that lease did
(``softmax.BEFORE``: a program a row, each block's loads after the last), where "ember" takes
the tuner's pick of ``softmax.LONG_CONFIGS``, printed after the table.
Fused linear cross-entropy also reports the allocator's peak over the call. On a CPU the
Triton kernels run under the interpreter: times mean nothing there, the run only shows that
every row works.

    .venv/bin/python benchmarks/kernels.py --host [--device cpu]  # the wrappers' own host time
    python benchmarks/kernels.py --ops rms_norm layer_norm softmax rope_qk  # some rows only
    python benchmarks/kernels.py --ops paged_attention  # serving's decode attention, gather against ember's

``--host`` times what a call costs the host besides its launches: every Triton launch (ember's
and Liger's) is replaced by a no-op, and each op runs forward and backward on a small input,
ember's through its plain road (``ember.kernels.kernel_op``), ember's through the registered
custom op (the road torch.compile takes), Liger's (where installed) and torch eager, in µs a call.
On a GPU a memory-bound op at training sizes is host-bound when launched from Python (above),
so this is the part of its time that is the wrapper's.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

import ember.kernels  # noqa: F401  (sets TRITON_INTERPRET=1 when there is no CUDA)
from ember.model.gpt import apply_rotary

HBM = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # nominal bytes/s of the device's memory


def liger():
    try:
        from liger_kernel.transformers import functional

        return functional
    except Exception:  # not installed, or broken against this torch / Triton
        return None


def bench(fn, device: str) -> float:
    """Median ms of ``fn()``."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # (default: the mean)
    fn()
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def bench_graph(fn, device: str) -> float | str:
    """Median ms of ``fn()`` replayed from a CUDA graph: the kernels' own time, without the
    host's launches (a memory-bound op on these shapes takes tens of µs, its launches from
    Python hundreds); the reason instead where ``fn`` cannot be captured, "" off CUDA."""
    if device != "cuda":
        return ""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    except Exception as err:  # noqa: BLE001 -- a row that cannot be captured says why
        torch.cuda.synchronize()
        return "failed: " + str(err).splitlines()[0][:40]


def fwd_bwd(op, inputs, grad=None):
    """A closure running op(*inputs) and its backward, with gradients to every float input. The
    outputs' gradients (ones, without ``grad``) are made at the first call and reused, so that a
    timed call is the op's forward and backward alone: before, each call also filled them, one
    more write of every output (a sixth of the norms' bytes), in every row of the lease's tables
    up to 2026-11-27."""
    made = []

    def run():
        for t in inputs:
            if isinstance(t, torch.Tensor):
                t.grad = None
        out = op(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        if not made:
            made.extend(torch.ones_like(o) if grad is None else grad for o in outs)
        torch.autograd.backward(outs, made)

    return run


ONE_ROW = {"FORWARD": (1, 4), "BACKWARD": (4, 1, 1)}  # ember.kernels.norm's settings before
# untimed: norm.forward_configs' first (4 rows of 768, 4 warps) and norm.BACKWARD_CONFIGS' first, 4
# programs an SM loading 4 rows ahead (the H200 lease of 2026-11-27 22:17: RMSNorm 63% of the
# bound), where "ember" takes the tuner's picks
FIRST = {"BACKWARD": (4, 5, 1)}  # and "FORWARD": norm.forward_configs(...)[0], at the row's width
ROPE_BEFORE = {"CONFIG": (4096, 4), "LOADS_FIRST": False}  # ember.kernels.rope's


def overriding(module, op, inputs, **values):
    """``fwd_bwd(op, inputs)`` run with ``module``'s settings set to ``values``, each put back
    after the call: a kernel's old road as its own row in the table, to keep the faster on this
    GPU. The settings hold over the backward too, which reads them at its own launch (until
    2026-11-27 they held over the forward alone, so these rows' backwards ran the new road). The
    norms' "ember 1 row": one row a program forward, the backward's loop unpipelined; RoPE's
    "ember as before": tiles of 4,096 elements, k's loads after q's stores, as the H200 lease
    timed it, and "ember untimed": the first of ``rope.CONFIGS``; softmax's: ``softmax.BEFORE``,
    untuned."""
    run = fwd_bwd(op, inputs)

    def call():
        saved = {name: getattr(module, name) for name in values}
        for name, value in values.items():
            setattr(module, name, value)
        try:
            return run()
        finally:
            for name, value in saved.items():
                setattr(module, name, value)

    return call


def peak_mb(fn, device: str) -> float:
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def param(*shape, dtype, device, scale=1.0):
    return (scale * torch.randn(*shape, device=device)).to(dtype).requires_grad_()


def cases(shape: dict, dtype, device: str):
    """(op name, shape label, {impl: closure}, bytes moved, FLOPs) for every kernel."""
    from ember.kernels import attention, cross_entropy, norm, rope, softmax

    lg = liger()
    N, C, V, B, T, H, Hkv, hd = (shape[k] for k in ("N", "C", "V", "B", "T", "H", "Hkv", "hd"))
    e = torch.finfo(dtype).bits // 8
    x, w, b = (
        param(N, C, dtype=dtype, device=device),
        param(C, dtype=dtype, device=device),
        param(C, dtype=dtype, device=device),
    )
    rms = lambda x, w: F.rms_norm(x, (C,), w, 1e-5)  # noqa: E731
    lnm = lambda x, w, b: F.layer_norm(x, (C,), w, b, 1e-5)  # noqa: E731
    lnm_ember = lambda x, w, b: norm.layer_norm(x, w, b, 1e-5)  # noqa: E731
    first = norm.forward_configs(1 << (C - 1).bit_length())[0]  # the forward's config untimed
    yield (
        "rms_norm",
        f"{N}x{C}",
        {
            "eager": fwd_bwd(rms, (x, w)),
            "compile": fwd_bwd(torch.compile(rms), (x, w)),
            **(
                {"liger": fwd_bwd(lambda x, w: lg.liger_rms_norm(x, w, 1e-5, in_place=False), (x, w))}
                if lg
                else {}
            ),  # noqa: E501
            "ember": fwd_bwd(lambda x, w: norm.rms_norm(x, w, 1e-5), (x, w)),
            "ember 1 row": overriding(norm, lambda x, w: norm.rms_norm(x, w, 1e-5), (x, w), **ONE_ROW),
            "ember untimed": overriding(norm, lambda x, w: norm.rms_norm(x, w, 1e-5), (x, w), **FIRST,
                                        FORWARD=first),
        },
        5 * N * C * e,
        0,
    )
    yield (
        "layer_norm",
        f"{N}x{C}",
        {
            "eager": fwd_bwd(lnm, (x, w, b)),
            "compile": fwd_bwd(torch.compile(lnm), (x, w, b)),
            **({"liger": fwd_bwd(lg.liger_layer_norm, (x, w, b, 1e-5))} if lg else {}),
            "ember": fwd_bwd(lnm_ember, (x, w, b)),
            "ember 1 row": overriding(norm, lnm_ember, (x, w, b), **ONE_ROW),
            "ember untimed": overriding(norm, lnm_ember, (x, w, b), **FIRST, FORWARD=first),
        },
        5 * N * C * e,
        0,
    )
    s = param(N // 4, V, dtype=dtype, device=device)
    sm = lambda s: torch.softmax(s, dim=-1)  # noqa: E731
    yield (
        "softmax",
        f"{N // 4}x{V}",
        {
            "eager": fwd_bwd(sm, (s,)),
            "compile": fwd_bwd(torch.compile(sm), (s,)),
            **({"liger": fwd_bwd(lg.liger_softmax, (s,))} if lg else {}),
            "ember": fwd_bwd(softmax.softmax, (s,)),
            "ember as before": overriding(softmax, softmax.softmax, (s,), LONG=softmax.BEFORE),
        },
        5 * s.numel() * e,
        0,
    )
    q = param(B, T, H, hd, dtype=dtype, device=device).transpose(1, 2).detach().requires_grad_()
    k = param(B, T, Hkv, hd, dtype=dtype, device=device).transpose(1, 2).detach().requires_grad_()
    angles = torch.outer(torch.arange(T, device=device).float(), torch.rand(hd // 2, device=device))
    cos, sin = angles.cos()[None, None], angles.sin()[None, None]  # (1, 1, T, hd/2) as the model passes
    both = lambda q, k: (apply_rotary(q, (cos, sin)), apply_rotary(k, (cos, sin)))  # noqa: E731
    rope_ember = lambda q, k: rope.rope_qk(q, k, cos, sin)  # noqa: E731
    full_cos, full_sin = torch.cat((cos, cos), -1)[0], torch.cat((sin, sin), -1)[0]  # Liger's (1, T, hd)
    yield (
        "rope_qk",
        f"B{B} T{T} H{H}/{Hkv} hd{hd}",
        {
            "eager": fwd_bwd(both, (q, k)),
            "compile": fwd_bwd(torch.compile(both), (q, k)),
            **(
                {"liger": fwd_bwd(lambda q, k: lg.liger_rope(q, k, full_cos, full_sin), (q, k))} if lg else {}
            ),
            "ember": fwd_bwd(rope_ember, (q, k)),
            "ember as before": overriding(rope, rope_ember, (q, k), **ROPE_BEFORE),
            "ember untimed": overriding(rope, rope_ember, (q, k), CONFIG=rope.CONFIGS[0]),
        },
        4 * (q.numel() + k.numel()) * e,
        0,
    )
    h, W = param(N, C, dtype=dtype, device=device), param(V, C, dtype=dtype, device=device, scale=0.02)
    y = torch.randint(0, V, (N,), device=device)
    ce = lambda h, W: F.cross_entropy((h @ W.T).float(), y)  # noqa: E731
    one = torch.ones((), device=device)
    yield (
        "linear_cross_entropy",
        f"{N}x{C} -> {V}",
        {
            "eager": fwd_bwd(ce, (h, W), one),
            "compile": fwd_bwd(torch.compile(ce), (h, W), one),
            **(
                {"liger": fwd_bwd(lambda h, W: lg.liger_fused_linear_cross_entropy(h, W, y), (h, W), one)}
                if lg
                else {}
            ),  # noqa: E501
            "ember": fwd_bwd(lambda h, W: cross_entropy.linear_cross_entropy(h, W, y), (h, W), one),
        },
        0,
        6 * N * C * V,
    )
    q, k, v = (param(B, n, T, hd, dtype=dtype, device=device) for n in (H, Hkv, Hkv))
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != Hkv)  # noqa: E731
    impls = {"sdpa": fwd_bwd(sdpa, (q, k, v))}
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash(q, k, v):
            kk, vv = (t.repeat_interleave(H // Hkv, 1) for t in (k, v))  # the flash backend has no GQA
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)

        impls["sdpa-flash"] = fwd_bwd(flash, (q, k, v))
    impls["ember"] = fwd_bwd(lambda q, k, v: attention.flash_attention(q, k, v, causal=True), (q, k, v))
    flops = 3.5 * 2 * B * H * T * T * hd  # forward 4BHT²hd, halved by the mask; backward 2.5x the forward
    yield "attention", f"B{B} T{T} H{H}/{Hkv} hd{hd}", impls, 0, flops


def int8_cases(shape: dict, dtype, device: str):
    from ember.kernels import int8

    K = shape["C"]
    for n in (3 * K, 4 * K, shape["V"]):
        W = 0.02 * torch.randn(n, K, device=device)
        s = W.abs().amax(1) / 127
        Q = torch.round(W / s[:, None]).to(torch.int8)
        x = torch.randn(1, K, device=device, dtype=dtype)
        Wd = (Q.float() * s[:, None]).to(dtype)
        dq = torch.compile(lambda x, Q, s: F.linear(x, Q.to(x.dtype)) * s.to(x.dtype))
        impls = {
            "eager": lambda x=x, Wd=Wd: F.linear(x, Wd),  # the dense product: what int8 must beat
            "compile": lambda x=x, Q=Q, s=s, dq=dq: dq(x, Q, s),
            "ember": lambda x=x, Q=Q, s=s: int8.int8_linear(x, Q, s),
        }
        yield "int8_linear (decode)", f"1x{K} @ {n}x{K}", impls, n * K + 4 * n + 2 * e_(x) * (K + n), 0


def paged_cases(shape: dict, dtype, device: str):
    """Serving's decode attention over a paged pool (issue 29 pt 4): S sequences of L held
    positions, one new query each, their blocks shuffled over the pool. "eager" is the gather
    road (each sequence's slots copied out, then SDPA), "compile" the same compiled, "ember" the
    kernel reading the pool in place (ember/kernels/paged.py). Bytes: every held key and value
    read once, the queries and outputs."""
    from ember.kernels.paged import paged_attention, tiles_for

    H, Hkv, hd = shape["H"], shape["Hkv"], shape["hd"]
    S, L, bs = (64, 256, 16) if device == "cuda" else (4, 40, 4)
    blocks = S * L // bs
    k_pool, v_pool = (param(blocks * bs, Hkv, hd, dtype=dtype, device=device) for _ in range(2))
    tables = torch.randperm(blocks, device=device).int().view(S, L // bs)
    slots = (tables.long()[:, :, None] * bs + torch.arange(bs, device=device)).view(S, L)
    q = param(S, H, hd, dtype=dtype, device=device)
    q_pos, tiles = torch.full((S,), L - 1, device=device), tiles_for([1] * S, S).to(device)

    def gather(q, k_pool, v_pool):
        k = k_pool[slots].transpose(1, 2)  # (S, Hkv, L, hd)
        v = v_pool[slots].transpose(1, 2)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=H != Hkv)[:, :, 0]

    compiled = torch.compile(gather)
    impls = {
        "eager": lambda: gather(q, k_pool, v_pool),
        "compile": lambda: compiled(q, k_pool, v_pool),
        "ember": lambda: paged_attention(q, k_pool, v_pool, tables, q_pos, tiles, bs),
    }
    nbytes = (2 * S * L * Hkv * hd + 2 * S * H * hd) * e_(q)
    yield "paged_attention (decode)", f"S{S} L{L} H{H}/{Hkv} hd{hd} block {bs}", impls, nbytes, 0


def e_(t):
    return t.element_size()


def host_main(device: str) -> None:
    """--host: µs of host time per forward and backward, Triton launches stubbed out (docstring)."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit
    from printing import cpu_model, print_table

    from ember.kernels import norm, rope, softmax

    for kind in (jit.JITFunction, interpreter.InterpretedFunction):
        kind.__getitem__ = lambda self, grid: lambda *args, **kwargs: None
    lg = liger()
    f32 = dict(dtype=torch.float32, device=device)
    x, w, b, q, k = (param(*s, **f32) for s in [(64, 768), (768,), (768,), (1, 4, 16, 64), (1, 2, 16, 64)])
    angles = torch.rand(16, 32, device=device)
    cos, sin = angles.cos()[None, None], angles.sin()[None, None]
    full = torch.cat((cos, cos), -1)[0], torch.cat((sin, sin), -1)[0]
    norm_op, rope_op = torch.ops.ember.norm, torch.ops.ember.rope  # the registered ops: compile's road
    ops = {  # op -> {impl: (fn, inputs)}
        "rms_norm": {
            "eager": (lambda x, w: F.rms_norm(x, (768,), w, 1e-5), (x, w)),
            "ember": (lambda x, w: norm.rms_norm(x, w, 1e-5), (x, w)),
            "ember, registered op": (lambda x, w: norm_op(x, None, w, None, 1e-5, True)[0], (x, w)),
            "liger": (lambda x, w: lg.liger_rms_norm(x, w, 1e-5, in_place=False), (x, w)),
        },
        "layer_norm": {
            "eager": (lambda x, w, b: F.layer_norm(x, (768,), w, b, 1e-5), (x, w, b)),
            "ember": (lambda x, w, b: norm.layer_norm(x, w, b, 1e-5), (x, w, b)),
            "ember, registered op": (lambda x, w, b: norm_op(x, None, w, b, 1e-5, False)[0], (x, w, b)),
            "liger": (lambda x, w, b: lg.liger_layer_norm(x, w, b, 1e-5), (x, w, b)),
        },
        "softmax": {
            "eager": (lambda x: torch.softmax(x, -1), (x,)),
            "ember": (softmax.softmax, (x,)),
            "ember, registered op": (torch.ops.ember.softmax, (x,)),
            "liger": (lambda x: lg.liger_softmax(x), (x,)),
        },
        "rope_qk": {
            "eager": (lambda q, k: (apply_rotary(q, (cos, sin)), apply_rotary(k, (cos, sin))), (q, k)),
            "ember": (lambda q, k: rope.rope_qk(q, k, cos, sin), (q, k)),
            "ember, registered op": (lambda q, k: rope_op(q, k, cos, sin, False), (q, k)),  # noqa: E501
            "liger": (lambda q, k: lg.liger_rope(q, k, *full), (q, k)),
        },
    }
    rows = []
    for op, impls in ops.items():
        us = {}
        for impl, (fn, inputs) in impls.items():
            if impl == "liger" and lg is None:
                continue
            run = fwd_bwd(fn, inputs)
            for _ in range(100):
                run()
            times = []
            for _ in range(7):  # the median of 7 rounds of 300 calls
                start = time.perf_counter()
                for _ in range(300):
                    run()
                times.append((time.perf_counter() - start) / 300 * 1e6)
            us[impl] = sorted(times)[3]
        for impl, t in us.items():
            vs = f"{us['liger'] / t:.2f}x" if "liger" in us else ""
            rows.append([op, impl, f"{t:.0f}", vs])
    where = torch.cuda.get_device_name() if device == "cuda" else cpu_model()
    print(f"host µs per forward + backward, launches stubbed; {where}, torch {torch.__version__}, "
          f"liger {'yes' if lg else 'absent'}")  # fmt: skip
    print_table(["op", "impl", "host µs", "Liger's / this"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--host", action="store_true", help="the wrappers' host time, launches stubbed out")
    parser.add_argument("--ops", nargs="+", metavar="OP", help="only these rows (rms_norm layer_norm softmax "
                        "rope_qk linear_cross_entropy attention int8_linear paged_attention); all by default")
    args = parser.parse_args()
    device = args.device
    if args.host:
        return host_main(device)
    if device == "cuda":
        name = torch.cuda.get_device_name()
        hbm = next((v for k, v in HBM.items() if k in name), None)
        dtype = torch.bfloat16
        shapes = {
            "gpt2-small": dict(N=16 * 1024, C=768, V=50304, B=16, T=1024, H=12, Hkv=12, hd=64),
            "llama-small": dict(N=16 * 1024, C=768, V=50304, B=16, T=1024, H=12, Hkv=4, hd=64),
            "hd128": dict(N=16 * 1024, C=768, V=50304, B=4, T=2048, H=16, Hkv=4, hd=128),
        }
    else:
        name, hbm, dtype = "CPU (Triton interpreted: times are meaningless)", None, torch.float32
        shapes = {"tiny": dict(N=64, C=32, V=101, B=2, T=32, H=4, Hkv=2, hd=16)}
    print(f"kernels on {name}, {dtype}, torch {torch.__version__}, liger {'yes' if liger() else 'absent'}")
    header = ["op", "shape", "impl", "ms", "graph ms", "bound", "vs eager", "graph vs eager", "peak MiB"]
    rows = []
    seen = set()
    for label, shape in shapes.items():
        groups = list(cases(shape, dtype, device))
        if label != "hd128":
            groups += list(int8_cases(shape, dtype, device)) + list(paged_cases(shape, dtype, device))
        for op, where, impls, nbytes, flops in groups:
            if (op, where) in seen or (label == "hd128" and op != "attention"):
                continue
            if args.ops and op.split()[0] not in args.ops:
                continue
            seen.add((op, where))
            base = base_graph = None
            for impl, fn in impls.items():
                try:
                    ms = bench(fn, device)
                except Exception as err:  # a peer that does not run here is a row, not a crash
                    why = "failed: " + str(err).splitlines()[0][:60]
                    rows.append([op, f"{label} {where}", impl, why, "", "", "", "", ""])
                    continue
                # memory-bound rows also from a CUDA graph; the bound is then the graph's
                graph = bench_graph(fn, device) if nbytes else ""
                own = graph if isinstance(graph, float) else ms
                base = ms if impl in ("eager", "sdpa") else base
                base_graph = graph if impl == "eager" and isinstance(graph, float) else base_graph
                if nbytes:
                    rate = nbytes / (own * 1e-3)  # bytes/s
                    bound = f"{rate / hbm:.0%} of HBM" if hbm else f"{rate / 1e9:.1f} GB/s"
                else:
                    bound = f"{flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s"
                mem = peak_mb(fn, device) if op == "linear_cross_entropy" else math.nan
                vs = f"{base / ms:.2f}x" if base else ""
                vs_graph = f"{base_graph / graph:.2f}x" if base_graph and isinstance(graph, float) else ""
                rows.append(
                    [
                        op,
                        f"{label} {where}",
                        impl,
                        f"{ms:.3f}",
                        f"{graph:.3f}" if isinstance(graph, float) else graph,
                        bound,
                        vs,
                        vs_graph,
                        "" if math.isnan(mem) else f"{mem:,.0f}",
                    ]
                )
                print(json.dumps(dict(zip(header, rows[-1], strict=True))), flush=True)
    from printing import print_table

    print_table(header, rows)
    from ember.kernels import PICKS

    # what the tuner kept: the norm forward's (rows a program, warps), the backward's (programs an
    # SM, stages, warps' multiple), softmax's long rows' (columns a block, warps, stages, programs an
    # SM, L2 hints), RoPE's (positions a program, warps)
    for key, config in PICKS.items():
        print(f"{key[0]} {key[1:]}: the tuner kept {config}")
    if args.json:
        with open(args.json, "w") as f:
            table = [dict(zip(header, r, strict=True)) for r in rows]
            json.dump({"device": name, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
