"""Training-step speed: ember's ``GPT`` against transformers' ``GPT2LMHeadModel``, same shape.

    .venv/bin/python benchmarks/train_step.py [--steps N] [--compile] [--profile]

One step is forward, cross-entropy (as ``LMTask.loss``), backward, ``AdamW.step`` and
``zero_grad``, on the GPT-2 layout: d_model 384, 6 layers, 6 heads, seq 256, batch 16,
vocab 4096, fp32, learned positions, LayerNorm, GELU (tanh), biases, tied head, dropout 0.
It prints the losses of the first batch (must agree within 1e-4), then one table: median
step seconds and tokens/s of each model over ``--steps`` timed steps, and ember/peer.

After the table it prints the floor: the time this machine needs for the step's matrix
multiplies and attention alone (each GEMM of the forward and backward of every linear layer,
q/k/v fused, and SDPA forward + backward, timed one by one with ``torch.mm`` on the step's
shapes). No model that does the same arithmetic can step faster, so peer time / floor is
the largest ratio any implementation could reach against the peer here.

``--compile`` adds a third row: ember with ``torch.compile(block, fullgraph=True)`` on each
block, as ``ember.parallel.parallelize.apply_compile`` does. ``--profile`` runs
``torch.profiler`` (CPU) over 3 steps of each eager model and prints the top 10 ops by self
CPU time of each, then the ops whose self time per step differs most between the two.

Design choices:

- Same weights (``to_hf`` copies ours), same batch, same optimizer settings (AdamW, lr 1e-4,
  ``foreach=True`` as ``build_optimizer`` picks on CPU), and the loss computed the same way
  outside both models, so the only difference is the model code.
- The models are timed in turns (ember, peer, [compiled], ember, peer, ...) so that noise
  from the machine (other processes, frequency changes) falls on all of them alike; the
  median of the timed steps is reported.
- The compiled model is a separate copy built from the same seed: its first steps compile
  (tens of seconds), so it gets more warm-up steps than the eager models.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers
from printing import cpu_model, print_table

from ember.config import ModelConfig
from ember.model.gpt import GPT
from ember.model.hf import to_hf

BATCH, SEQ_LEN, VOCAB = 16, 256, 4096
LR = 1e-4
SEED = 0
WARMUP_STEPS = 2
COMPILE_WARMUP_STEPS = 4  # the first call compiles forward, the first backward compiles backward
PROFILE_STEPS = 3  # one step's profile swings by 10-30% per op on a shared 2-core machine

Step = Callable[[], float]


def model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        n_layer=6,
        n_head=6,
        d_model=384,
        max_seq_len=SEQ_LEN,
        pos="learned",
        norm="layernorm",
        mlp="gelu",
        bias=True,
        tie_embeddings=True,
        dropout=0.0,
    )


def ember_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def hf_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, use_cache=False).logits


def make_step(model: torch.nn.Module, logits_of, x: torch.Tensor, y: torch.Tensor) -> Step:
    """A closure running one training step and returning its loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)

    def step() -> float:
        logits = logits_of(model, x).float()  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))  # as LMTask.loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def timed(step: Callable[[], object]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    return statistics.median(timed(fn) for _ in range(reps))


def gemm_floor(cfg: ModelConfig, reps: int = 5) -> tuple[float, float]:
    """(seconds, GFLOP) of one step's matmuls and attention alone, each timed in isolation:
    for every linear layer (q/k/v fused, the cheapest arrangement), y = x W^T forward and
    dx = dy W, dW = dy^T x backward; plus SDPA (causal) forward and backward. Median of
    ``reps`` runs per GEMM."""
    n, d, hidden = BATCH * SEQ_LEN, cfg.d_model, 4 * cfg.d_model
    linears = [(d, 3 * d, cfg.n_layer), (d, d, cfg.n_layer), (d, hidden, cfg.n_layer)]
    linears += [(hidden, d, cfg.n_layer), (d, VOCAB, 1)]  # (in, out, how many per step)
    seconds = flops = 0.0
    g = torch.Generator().manual_seed(0)
    for d_in, d_out, count in linears:
        x, w = torch.randn(n, d_in, generator=g), torch.randn(d_out, d_in, generator=g)
        dy = torch.randn(n, d_out, generator=g)
        for a, b in ((x, w.t()), (dy, w), (dy.t(), x)):  # forward, grad input, grad weight
            seconds += count * median_seconds(lambda a=a, b=b: torch.mm(a, b), reps)
            flops += count * 2 * a.size(0) * a.size(1) * b.size(1)
    head_dim = d // cfg.n_head
    q, k, v = (torch.randn(BATCH, cfg.n_head, SEQ_LEN, head_dim, requires_grad=True) for _ in range(3))

    def attention() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))

    seconds += cfg.n_layer * median_seconds(attention, reps)
    # causal: half of QK^T and of PV, forward (2 GEMMs) and backward (4 GEMMs)
    flops += cfg.n_layer * 6 * BATCH * cfg.n_head * SEQ_LEN * SEQ_LEN * head_dim
    return seconds, flops / 1e9


def profile_steps(step: Step) -> dict[str, float]:
    """Self CPU milliseconds per op name, per step (mean of PROFILE_STEPS); prints the top 10."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILE_STEPS):
            step()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=10))
    return {e.key: e.self_cpu_time_total / 1000 / PROFILE_STEPS for e in averages}


def print_profile_diff(ours: dict[str, float], theirs: dict[str, float], n: int = 12) -> None:
    keys = sorted(ours.keys() | theirs.keys(), key=lambda k: -abs(ours.get(k, 0.0) - theirs.get(k, 0.0)))
    rows = [
        [
            k,
            f"{ours.get(k, 0.0):.1f}",
            f"{theirs.get(k, 0.0):.1f}",
            f"{ours.get(k, 0.0) - theirs.get(k, 0.0):+.1f}",
        ]
        for k in keys[:n]
    ]
    rows.append(
        [
            "total",
            f"{sum(ours.values()):.1f}",
            f"{sum(theirs.values()):.1f}",
            f"{sum(ours.values()) - sum(theirs.values()):+.1f}",
        ]
    )
    print_table(["op", "ember self ms", "HF self ms", "ember - HF"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model")
    parser.add_argument("--compile", action="store_true", help="also time ember with torch.compile per block")
    parser.add_argument("--profile", action="store_true", help="profile 3 steps of each eager model")
    args = parser.parse_args()

    cfg = model_config()
    ours = GPT.build(cfg, seed=SEED).train()
    hf = to_hf(ours).train()
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=generator)
    y = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=generator)
    tokens_per_step = BATCH * SEQ_LEN

    print(f"cpu: {cpu_model()} ({platform.machine()}), torch.get_num_threads() = {torch.get_num_threads()}")
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"HF attn_implementation = {hf.config._attn_implementation}"
    )
    print(
        f"shape: d_model {cfg.d_model}, {cfg.n_layer} layers, {cfg.n_head} heads, seq {SEQ_LEN}, "
        f"batch {BATCH}, vocab {VOCAB}, fp32; {ours.num_params():,} parameters"
    )

    steps: dict[str, Step] = {
        "ember GPT": make_step(ours, ember_logits, x, y),
        "HF GPT2LMHeadModel": make_step(hf, hf_logits, x, y),
    }
    first = {name: step() for name, step in steps.items()}  # first warm-up step: the parity check
    ours_loss, hf_loss = first.values()
    diff = abs(ours_loss - hf_loss)
    print(
        f"first-batch loss: ember {ours_loss:.6f}, HF {hf_loss:.6f}, |diff| {diff:.2e} "
        f"({'ok' if diff < 1e-4 else 'MISMATCH'}, tolerance 1e-4)"
    )
    if diff >= 1e-4:
        raise SystemExit("the two models disagree; the timing would compare different computations")
    for _ in range(WARMUP_STEPS - 1):
        for step in steps.values():
            step()

    if args.compile:
        compiled = GPT.build(cfg, seed=SEED).train()
        for name, block in list(compiled.layers.items()):  # as ember.parallel.parallelize.apply_compile
            compiled.layers[name] = torch.compile(block, fullgraph=True)
        compiled_step = make_step(compiled, ember_logits, x, y)
        try:
            start = time.perf_counter()
            for _ in range(COMPILE_WARMUP_STEPS):
                compiled_step()
            seconds = time.perf_counter() - start
            print(f"compiled ember: {COMPILE_WARMUP_STEPS} warm-up steps took {seconds:.1f} s")
            steps["ember GPT, compiled blocks"] = compiled_step
        except Exception as error:  # noqa: BLE001 - a benchmark reports and goes on
            first_line = (str(error).splitlines() or [""])[0][:200]
            print(f"torch.compile failed, skipping: {type(error).__name__}: {first_line}")

    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            times[name].append(timed(step))

    peer = statistics.median(times["HF GPT2LMHeadModel"])
    rows = []
    for name, samples in times.items():
        median = statistics.median(samples)
        rows.append(
            [
                name,
                f"{median:.3f}",
                f"{min(samples):.3f}",
                f"{max(samples):.3f}",
                f"{tokens_per_step / median:,.0f}",
                f"{peer / median:.2f}x",
            ]
        )
    print(f"\n{args.steps} timed steps per model (after warm-up), {tokens_per_step} tokens per step")
    print_table(["model", "median s/step", "min s", "max s", "tokens/s", "vs HF (tokens/s)"], rows)

    floor, gflop = gemm_floor(cfg)
    ours_median = statistics.median(times["ember GPT"])
    print(
        f"\nfloor: the step's GEMMs and attention alone take {floor:.3f} s here ({gflop:.0f} GFLOP, "
        f"{gflop / floor:.0f} GFLOP/s); ember's step is {ours_median / floor:.2f}x the floor, HF's "
        f"{peer / floor:.2f}x, so no implementation of these FLOPs can beat HF by more than "
        f"{peer / floor:.2f}x on this machine"
    )

    if args.profile:
        print(f"\nember GPT, {PROFILE_STEPS} steps, top 10 ops by self CPU time:")
        ours_ops = profile_steps(steps["ember GPT"])
        print(f"HF GPT2LMHeadModel, {PROFILE_STEPS} steps, top 10 ops by self CPU time:")
        hf_ops = profile_steps(steps["HF GPT2LMHeadModel"])
        print(f"ops whose self CPU time differs most (ms per step, mean of {PROFILE_STEPS}):")
        print_profile_diff(ours_ops, hf_ops)


if __name__ == "__main__":
    main()
