"""One GPU's training step: ember's trainer against transformers' model, same batch, one script.

    python benchmarks/gpu_train.py                          # CUDA: gpt2-small, 16 × 1024, bf16
    python benchmarks/gpu_train.py --rows ember ember-muon  # some rows only
    python benchmarks/gpu_train.py --model llama-small      # GQA, RoPE, SwiGLU (LlamaForCausalLM)
    python benchmarks/gpu_train.py --set model.d_model=2048 model.n_head=16 --rows ember ember-fp8 --floor
    .venv/bin/python benchmarks/gpu_train.py --device cpu   # a tiny-shape dry run of every row

Rows (tokens/s, MFU against 989 TFLOP/s, the H100/H200 dense bf16 peak, whatever the card):

- ``hf-eager``, ``hf-compiled``: ``GPT2LMHeadModel`` (or ``LlamaForCausalLM``; SDPA attention)
  holding ember's initial weights (``to_hf``), bf16 autocast, loss as ``LMTask.loss``, clip 1.0,
  fused AdamW: the step a transformers user writes; compiled is ``torch.compile`` of the model.
- ``ember``: the preset's own step (``Trainer.train_step``: on one GPU ``train.compile_scope=auto``
  compiles forward and loss as one graph; bf16, clip, the non-finite guard on the device, fused
  AdamW) on the same batch; ``ember-block`` compiles each block instead (the default until the
  H200 measured the whole graph 24% faster: benchmarks/RESULTS.md); ``ember-triton``
  (``train.kernels=triton``: ember's norms, RoPE, attention and the fused linear + loss),
  ``ember-muon`` (``train.optimizer=muon``: batched bf16 Newton–Schulz), ``ember-fp8`` and
  ``ember-fp8-rowwise`` (``train.precision=fp8``: torchao float8 block linears), ``ember-fp8-mlp``
  and ``ember-fp8-all`` (``train.fp8_linears``: the MLPs' alone, or with the head). A row that
  cannot run on this machine says why (its ConfigError) instead of a number.
- issue 29's levers: ``ember-whole`` (``train.compile_scope=model``, what ``auto`` picks on one
  GPU: forward and loss in one graph, so the fp32 cast of the logits fuses into the
  cross-entropy), ``ember-graphs`` and ``ember-whole-graphs`` (``train.compile_mode=reduce-overhead``:
  CUDA graphs, per block or whole), ``ember-flash`` and ``ember-cudnn`` (``train.sdpa``: one
  attention backend, on ``ember``). Not in the default rows: name them (``--rows``).

Each row: ``--warmup`` steps (compilation), then ``--steps`` steps timed between two
``torch.cuda.synchronize()`` calls; tokens/s = steps × B × T / seconds; peak GiB is the caching
allocator's peak over the row (``ember`` against ``ember-triton``: issue 28's train.kernels row).
The ember rows step through ``train_step`` with the guard on the device (as ``Trainer.run``
does), so their loop never waits for the GPU between steps. ``--anatomy`` then profiles three
more steps of each ember row: the device's time a step by kind of kernel (GEMM, attention,
inductor's fused kernels, optimizer, other), how busy it was, and the MFU the GEMMs' rate alone
would give: where a row's time goes on the way to the 45% target. ``--floor`` times, after the
``ember`` row, the step's matrix products (each linear's forward and two backward products, the
head's, every layer's SDPA forward and backward) back to back with nothing between them, in bf16
and the linears again in fp8 (``torch._scaled_mm``, operands cast beforehand): the MFU those
alone reach bounds the row's, and the fp8 products' saving bounds ``train.precision=fp8``'s
speed-up (issue 29 points 1 and 2: a target out of reach shows its bound). With ``--device cpu`` the
shapes shrink (2 layers, d_model 64, 4 × 32 tokens, fp32, no compile) and the tiny corpus
supplies the tokenizer: it checks that every row builds and steps, not speed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from printing import cpu_model, print_table
from profiling import profiled

from ember.analysis.plan import model_config_for
from ember.config import load_config
from ember.data.manifest import read_manifest
from ember.data.prepare import prepare
from ember.errors import EmberError
from ember.model.gpt import GPT, Attention, block_linears
from ember.model.hf import to_hf
from ember.parallel.parallelize import unwrap
from ember.train.trainer import scratch_trainer

PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16 (datasheet), the yardstick
ROWS = {  # name: ember overrides (None: transformers' GPT-2, compiled or not)
    "hf-eager": None,
    "hf-compiled": None,
    "ember": [],
    "ember-block": ["train.compile=true", "train.compile_scope=block"],  # the default before the H200
    "ember-triton": ["train.kernels=triton"],
    "ember-muon": ["train.optimizer=muon"],
    "ember-fp8": ["train.precision=fp8"],
    "ember-fp8-rowwise": ["train.precision=fp8-rowwise"],
    "ember-fp8-mlp": ["train.precision=fp8", "train.fp8_linears=mlp"],  # the MLPs' linears alone
    "ember-fp8-all": ["train.precision=fp8", "train.fp8_linears=all"],  # the blocks' and the head
    # issue 29's levers (ember-flash, ember-cudnn: one change from "ember"):
    "ember-whole": ["train.compile=true", "train.compile_scope=model"],  # forward + loss: the CE fused in
    "ember-graphs": ["train.compile=true", "train.compile_scope=block", "train.compile_mode=reduce-overhead"],  # fmt: skip # noqa: E501
    "ember-whole-graphs": ["train.compile=true", "train.compile_scope=model", "train.compile_mode=reduce-overhead"],  # fmt: skip # noqa: E501
    "ember-autotune": ["train.compile=true", "train.compile_mode=max-autotune-no-cudagraphs"],  # minutes
    "ember-flash": ["train.sdpa=flash"],
    "ember-cudnn": ["train.sdpa=cudnn"],
}
DEFAULT = ["ember", "hf-compiled", "ember-block", "ember-triton", "ember-fp8", "ember-muon", "hf-eager"]
CPU = ["model.n_layer=2", "model.n_head=4", "model.d_model=64", "model.vocab_size=512",
       "model.max_seq_len=32", "train.precision=fp32", "train.compile=false"]  # fmt: skip


def config(args, overrides: list[str]):
    """``--model`` at ``--accum`` micro-batches of ``--batch`` rows a step, or its CPU shrink, its
    data prepared."""
    shape = [f"train.seq_len={args.seq_len}", f"train.micro_batch={args.batch}", "train.max_steps=1000000",
             f"train.batch_tokens={args.accum * args.batch * args.seq_len}",
             f"train.device={args.device}"]  # fmt: skip
    cfg = load_config(args.model, [*shape, *(CPU if args.device == "cpu" else []), *args.set, *overrides])
    if args.device == "cpu":
        cfg = replace(cfg, data=load_config("tiny").data)  # a corpus prepared in seconds
    try:
        read_manifest(cfg.data.dir)
    except (EmberError, OSError):
        print(f"preparing {cfg.data.dir} (once) ...", flush=True)
        prepare(cfg, log=lambda _: None)
    return replace(cfg, model=model_config_for(cfg))  # a tokenizer-sized vocabulary (llama-small's) resolved


def timed(step, args) -> float:
    """Seconds per step after the warm-up, the device drained at both ends."""
    for _ in range(args.warmup):
        step()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    return (time.perf_counter() - start) / args.steps


KINDS = {  # kernel name (lower case) -> what it does, first match (attention's names hold "cutlass" too)
    "attention": ("flash", "fmha", "cudnn", "attention", "attn"),
    "GEMM": ("gemm", "nvjet", "cutlass", "sm90_", "sm80_", "cublas", "matmul", "_mm_"),
    "optimizer": ("multi_tensor", "adam", "foreach", "newton", "muon"),
    "fused by inductor (triton_)": ("triton_",),
}


def anatomy(row: str, step, args, gemm_flops_per_token: float) -> None:
    """--anatomy: three steps under torch.profiler, the device's time a step by kind of kernel,
    how busy it was, and the GEMMs' own rate (their FLOPs, 6N a token, over their time: the
    attention's 12·L·H·hd·T are left out of both): what stands between the row and its MFU target."""
    cuda, steps = args.device == "cuda", 3

    def three():
        for _ in range(steps):
            step()

    kernels, wall, busy_us = profiled(three, cuda)
    kinds: dict[str, list[float]] = {}
    for name, t in kernels:
        kind = next((k for k, keys in KINDS.items() if any(key in name.lower() for key in keys)), "other")
        kinds.setdefault(kind, []).append(t)
    busy, ms = sum(t for _, t in kernels), lambda us: us / steps / 1e3
    print(f"anatomy of {row}: {len(kernels) / steps:.0f} kernels a step, {ms(busy):.1f} ms of them a step "
          f"in {wall / steps * 1e3:.1f} ms of wall (the device busy {busy_us / wall / 1e6:.0%})")  # fmt: skip
    rows = [[kind, f"{len(ts) / steps:.0f}", f"{ms(sum(ts)):.2f}", f"{sum(ts) / busy:.0%}"]
            for kind, ts in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))]  # fmt: skip
    print_table(["kind", "kernels a step", "ms a step", "share of device time"], rows)
    flops = gemm_flops_per_token * args.accum * args.batch * args.seq_len
    if cuda and kinds.get("GEMM"):
        rate = flops / (ms(sum(kinds["GEMM"])) * 1e-3)
        print(f"the step's {flops / 1e12:.1f} TFLOP in the GEMMs' time alone: {rate / 1e12:.0f} TFLOP/s, "
              f"an MFU of {100 * rate / PEAK_FLOPS:.0f}% if every other kernel were gone")  # fmt: skip


def products(model: torch.nn.Module, tokens: int) -> dict[str, list[tuple[int, int, int]]]:
    """(M, K, N) of every product a training step makes with a weight on ``tokens`` tokens, by
    group: each linear's forward Y = X Wᵀ, then its backward dX = dY W and dW = dYᵀ X."""
    groups: dict[str, list[torch.nn.Module]] = {"attention's linears": [], "MLP's linears": []}
    for parent, _, m in block_linears(model):
        groups["attention's linears" if isinstance(parent, Attention) else "MLP's linears"].append(m)
    groups["head"] = [model.output]
    return {
        group: [shape for m in mods for shape in ((tokens, m.in_features, m.out_features),
                (tokens, m.out_features, m.in_features), (m.out_features, tokens, m.in_features))]
        for group, mods in groups.items()
    }  # fmt: skip


def median_ms(fn, cuda: bool, reps: int = 7) -> float:
    """Median milliseconds of ``fn()`` after one untimed call, the device drained around each."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def product_ms(shapes: list[tuple[int, int, int]], device: str, fp8: bool) -> float:
    """The products run back to back: bf16 ``mm`` (fp32 on a CPU), or ``torch._scaled_mm`` on
    float8 operands cast beforehand with tensorwise scales (torchao's "fp8" recipe without its
    casts and amax reductions: the fp8 tensor cores' own rate). One operand pair per shape."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pairs = {}
    for M, K, N in set(shapes):
        a, w = torch.randn(M, K, device=device, dtype=dtype), torch.randn(N, K, device=device, dtype=dtype)
        pairs[M, K, N] = (a, w.t()) if not fp8 else (a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).t())
    one = torch.ones((), device=device)

    def run():
        for shape in shapes:
            a, b = pairs[shape]
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=dtype) if fp8 else torch.mm(a, b)

    return median_ms(run, device == "cuda")


def attention_ms(cfg, batch: int, seq_len: int, device: str) -> float:
    """Every layer's causal SDPA forward and backward (the default backend), bf16 on CUDA."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hd, kv = cfg.d_model // cfg.n_head, cfg.n_kv_head or cfg.n_head
    q, k, v = (torch.randn(batch, h, seq_len, hd, device=device, dtype=dtype, requires_grad=True)
               for h in (cfg.n_head, kv, kv))  # fmt: skip
    g = torch.randn(batch, cfg.n_head, seq_len, hd, device=device, dtype=dtype)

    def run():
        for _ in range(cfg.n_layer):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != cfg.n_head)
            torch.autograd.grad(o, (q, k, v), g)

    return median_ms(run, device == "cuda")


def floor(args, step_seconds: float, flops_per_token: float) -> None:
    """--floor: the step's matrix products and attention alone, without anything between them,
    in bf16 and (the linears) in fp8: how far 45% MFU and fp8's 1.2× can be reached at this
    model's widths, whatever the rest of the step does. With ``step_seconds`` (the ``ember`` row):
    the time outside them, and the most fp8 products could save of that step."""
    cfg = config(args, []).model
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = args.batch * args.seq_len
    cuda, rows, ms = args.device == "cuda", [], {}
    for group, shapes in products(model, tokens).items():
        flop = sum(2 * M * K * N for M, K, N in shapes)
        ms[group] = product_ms(shapes, args.device, fp8=False)
        ms[group + " fp8"] = product_ms(shapes, args.device, fp8=True)
        rows.append([group, f"{len(shapes)}", f"{flop / 1e12:.2f}", f"{ms[group]:.2f}",
                     f"{flop / ms[group] / 1e9:.0f}", f"{ms[group + ' fp8']:.2f}",
                     f"{ms[group] / ms[group + ' fp8']:.2f}x"])  # fmt: skip
    ms["attention"] = attention_ms(cfg, args.batch, args.seq_len, args.device)
    hd = cfg.d_model // cfg.n_head
    flop = 12 * cfg.n_layer * cfg.n_head * hd * args.seq_len * tokens  # as GPT.flops_per_token counts it
    rows.append(["attention (SDPA, fwd + bwd)", f"{cfg.n_layer}", f"{flop / 1e12:.2f}",
                 f"{ms['attention']:.2f}", f"{flop / ms['attention'] / 1e9:.0f}", "", ""])  # fmt: skip
    print(f"floor: the step's products alone, {tokens:,} tokens, back to back ({'bf16' if cuda else 'fp32'}; "
          "fp8: e4m3 operands cast beforehand, tensorwise scales)")  # fmt: skip
    print_table(["products", "count", "TFLOP a step", "ms", "TFLOP/s", "fp8 ms", "fp8 x"], rows)
    alone = sum(ms[g] for g in ("attention's linears", "MLP's linears", "head", "attention"))
    step_flop = flops_per_token * tokens
    if cuda:
        target = step_flop / (0.45 * PEAK_FLOPS) * 1e3
        print(f"floor: the step's {step_flop / 1e12:.1f} TFLOP in these {alone:.1f} ms alone: an MFU of "
              f"{100 * step_flop / (alone * 1e-3) / PEAK_FLOPS:.1f}% if nothing else ran; 45% is a step "
              f"of {target:.1f} ms, {target - alone:.1f} ms for all the rest (norms, activations, loss, "
              "optimizer)")  # fmt: skip
    step = step_seconds * 1e3
    mlp, attn, head = (ms[g] - ms[g + " fp8"] for g in ("MLP's linears", "attention's linears", "head"))
    ceiling = lambda saved: f"{step / (step - saved):.2f}x"  # noqa: E731
    print(f"floor: the ember row's {step:.1f} ms step spends {step - alone:.1f} ms outside them; fp8 "
          f"products at these rates would make it at most {ceiling(mlp + attn)} bf16's speed for the block "
          f"linears (torchao's filter), {ceiling(mlp)} for the MLP's alone, {ceiling(mlp + attn + head)} "
          "with the head too, before any cast or scale (issue 29 pt 2 asks 1.2x)")  # fmt: skip


def ember_row(args, overrides, x, y, row: str = "ember") -> tuple[float, float]:
    with scratch_trainer(config(args, overrides)) as trainer:
        trainer.deferred = True  # the guard on the device, as in Trainer.run

        def step():
            trainer.set_lr(0.5)
            trainer.train_step([x, y])
            trainer.step += 1

        seconds = timed(step, args)
        if args.anatomy:  # (a profiler that fails costs the anatomy, not the row's timing)
            gemm = unwrap(trainer.model).flops_per_token(0)  # 6N: the products' alone, no attention
            print(f"{row}: timed {seconds * 1e3:.1f} ms a step", flush=True)
            try:
                anatomy(row, step, args, gemm)
            except Exception as err:  # noqa: BLE001
                print(f"anatomy of {row}: failed: {str(err).splitlines()[0][:100]}", flush=True)
        return seconds, trainer.flops_per_token


def hf_row(args, compiled: bool, x, y) -> tuple[float, float]:
    if args.accum > 1:
        raise EmberError("--accum times ember's rows only (transformers' step here has no accumulation)")
    with scratch_trainer(config(args, ["train.compile=false"])) as trainer:  # ember's initial weights
        model = to_hf(trainer.model.float().cpu()).to(args.device).train()
        flops_per_token = trainer.flops_per_token
    model.config._attn_implementation = "sdpa"
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), fused=args.device == "cuda")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    def step():
        with torch.autocast(args.device, dtype=dtype, enabled=args.device == "cuda"):
            logits = forward(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())  # as LMTask.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(step, args), flops_per_token


def losses_row(args, overrides) -> tuple[list[float], float]:
    """``--loss-steps`` steps of the config on its own data (the trainer's loader and seed, the
    schedule of a run that long): each step's loss, and the seconds per step after the first 20
    (compilation and warm-up), loader included."""
    cfg = config(args, [*overrides, f"train.max_steps={args.loss_steps}", "train.warmup_steps=20"])
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with scratch_trainer(cfg) as trainer:
        trainer.deferred = True  # the guard on the device, as in Trainer.run: no host read a step
        batches = trainer.loader.iterate()
        losses = [trainer.advance(batches)[0] for _ in range(20)]
        sync()
        start = time.perf_counter()
        losses += [trainer.advance(batches)[0] for _ in range(args.loss_steps - 20)]
        sync()
        per_step = (time.perf_counter() - start) / max(args.loss_steps - 20, 1)
        return torch.stack(losses).float().tolist(), per_step


def compare_losses(args) -> None:
    """Issue 29's fp8 bar: the mean loss of the last 20 of ``--loss-steps`` steps against the
    first row's (bf16, ``ember``), same seed and batches."""
    base = base_row = base_s = None
    for row in args.rows:
        if ROWS[row] is None:
            print(f"{row}: --loss-steps compares ember's rows", flush=True)
            continue
        try:
            losses, per_step = losses_row(args, ROWS[row])
        except EmberError as e:
            print(f"{row}: refused: {e}", flush=True)
            continue
        tail = sum(losses[-20:]) / len(losses[-20:])
        base, base_row, base_s = (tail, row, per_step) if base is None else (base, base_row, base_s)
        print(f"{row}: loss {losses[0]:.4f} -> {tail:.4f} (mean of the last 20 of {len(losses)} steps), "
              f"{100 * (tail / base - 1):+.2f}% against {base_row}; "
              f"{args.batch * args.seq_len / per_step:,.0f} tokens/s after step 20 "
              f"({base_s / per_step:.2f}x)",
              flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--model", default="gpt2-small", choices=("gpt2-small", "llama-small"))
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="config overrides for every row (wider: model.d_model=2048 model.n_head=16)")
    parser.add_argument("--rows", nargs="+", default=DEFAULT, choices=list(ROWS), help=f"default: {' '.join(DEFAULT)}")  # fmt: skip # noqa: E501
    parser.add_argument("--batch", type=int, default=None, help="rows per step (cuda 16, cpu 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="(cuda 1024, cpu 32)")
    parser.add_argument("--accum", type=int, default=1,
                        help="micro-batches per optimizer step, ember's rows (Muon's step amortized)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (cuda 20, cpu 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (cuda 5, cpu 1)")
    parser.add_argument("--anatomy", action="store_true",
                        help="after each ember row: 3 steps profiled, the device's time by kind of kernel")
    parser.add_argument("--floor", action="store_true",
                        help="after the ember row: the step's products alone, bf16 and fp8 (MFU's ceiling)")
    parser.add_argument("--loss-steps", type=int, default=0,
                        help="instead: train the rows this many steps on real data, compare the final losses")
    args = parser.parse_args()
    if args.loss_steps < 0 or args.loss_steps and args.loss_steps < 20:
        parser.error("--loss-steps: 0 (off) or at least 20 (the last 20 steps are averaged)")
    if args.floor and args.accum > 1:
        parser.error("--floor times one micro-batch's products against a one-micro-batch step: drop --accum")
    cuda = args.device == "cuda"
    for key, on_cuda, on_cpu in (("batch", 16, 4), ("seq_len", 1024, 32), ("steps", 20, 2), ("warmup", 5, 1)):
        if getattr(args, key) is None:
            setattr(args, key, on_cuda if cuda else on_cpu)
    torch.backends.cuda.matmul.allow_tf32 = True
    name = torch.cuda.get_device_name() if cuda else cpu_model()
    print(f"{' '.join([args.model, *args.set])}{' (CPU shrink)' if not cuda else ''} on {name}; "
          f"B={args.batch} × T={args.seq_len}"
          f"{f' × {args.accum} micro-batches' if args.accum > 1 else ''}, "
          f"{args.steps} steps after {args.warmup}; torch {torch.__version__}")  # fmt: skip
    if args.loss_steps:
        return compare_losses(args)
    vocab = config(args, []).model.vocab_size
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, vocab, (args.accum * args.batch, args.seq_len), generator=g) for _ in range(2))
    x, y = x.to(args.device), y.to(args.device)
    flops_per_token, results = None, {}
    peaks = {}  # row: the caching allocator's peak over the row (CUDA)
    for row in args.rows:
        began = time.perf_counter()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            if ROWS[row] is None:
                results[row], flops_per_token = hf_row(args, row == "hf-compiled", x, y)
            else:
                results[row], flops_per_token = ember_row(args, ROWS[row], x, y, row)
        except EmberError as e:  # a lever this machine cannot run: say why
            results[row] = f"refused: {e}"
        except Exception as e:  # noqa: BLE001 -- a row that breaks is a finding; the next rows still run
            results[row] = f"failed: {type(e).__name__}: {e}"
        took = f"(the row took {time.perf_counter() - began:.0f} s with its compilation)"
        if isinstance(results[row], float):  # as it comes, so a stage cut at its limit keeps it
            tps = args.accum * args.batch * args.seq_len / results[row]
            mfu = f", MFU {100 * flops_per_token * tps / PEAK_FLOPS:.1f}%" if cuda else ""
            peaks[row] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            peak = f", peak {peaks[row]:.1f} GiB" if cuda else ""
            print(f"{row}: {tps:,.0f} tokens/s{mfu}{peak} {took}", flush=True)
            if args.floor and row == "ember":
                floor(args, results[row], flops_per_token)
        else:
            print(f"{row}: {results[row]} {took}", flush=True)
        if cuda:
            torch.cuda.empty_cache()
    base = next((results[k] for k in ("hf-compiled", "hf-eager") if isinstance(results.get(k), float)), None)
    table = []
    for row, s in results.items():
        if isinstance(s, str):
            table.append([row, s[:110], "", "", "", ""])
            continue
        tps = args.accum * args.batch * args.seq_len / s
        mfu = f"{100 * flops_per_token * tps / PEAK_FLOPS:.1f}%" if cuda else ""
        peak = f"{peaks[row]:.1f}" if peaks.get(row) is not None else ""
        table.append([row, f"{tps:,.0f}", f"{s * 1e3:.1f}", mfu, peak, f"{base / s:.2f}x" if base else ""])
    heads = ["row", "tokens/s", "ms/step", "MFU of 989 TFLOP/s", "peak GiB", "vs hf (compiled if run)"]
    print_table(heads, table)


if __name__ == "__main__":
    main()
