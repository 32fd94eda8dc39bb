"""Mamba on the CPU: ember's two scans against transformers' slow-path scan, and the cost of one
decode step of a Mamba model against an attention model as the context grows.

    .venv/bin/python benchmarks/mamba.py [--threads N] [--reps N]

1. The selective scan alone, fp32, batch 2, d_inner 256 (d_model 128, expand 2), d_state 16, at
   T = 64, 256, 1024: ``sequential_scan`` (one step per token), ``chunked_scan`` at chunks of 16,
   32 and 64, and the peer, transformers' ``mamba_selective_scan`` (the pure-PyTorch path that
   ``MambaForCausalLM`` runs without mamba-ssm's CUDA kernels: a loop over T). The least ms of
   ``--reps`` runs of the forward and of forward + backward; the ratio is the peer's time over ember's.
2. One decode step (batch 1, after a prefill of P tokens) of a 4-layer d_model 128 Mamba model
   and of the same-width Llama-layout attention model, P = 64 .. 1024: the recurrent state is
   the same size at any P, the KV cache grows with it.

docs/mamba.md quotes a run of this on the 2-core development machine.
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import torch

from ember.config import ModelConfig
from ember.infer.engine import KVCache
from ember.model.gpt import GPT
from ember.model.mamba import chunked_scan, sequential_scan


def best_ms(fn, reps: int) -> float:
    """The least of ``reps`` timings: on a shared machine other processes only ever add time."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def scan_inputs(T: int, batch: int = 2, d_inner: int = 256, d_state: int = 16):
    g = torch.Generator().manual_seed(0)
    u = torch.randn(batch, T, d_inner, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(batch, T, d_inner, generator=g) - 3)
    A = -torch.arange(1.0, d_state + 1).expand(d_inner, -1).contiguous()
    B, C = torch.randn(batch, T, d_state, generator=g), torch.randn(batch, T, d_state, generator=g)
    return [t.requires_grad_() for t in (u, dt, A, B, C)]


def hf_scan():
    from transformers.models.mamba import modeling_mamba

    def scan(u, dt, A, B, C):  # transformers' layout: (batch, d_inner, T) and (batch, d_state, T)
        y = modeling_mamba.mamba_selective_scan(u.transpose(1, 2), dt.transpose(1, 2), A,
                                                B.transpose(1, 2), C.transpose(1, 2))  # fmt: skip
        return y, None

    return scan


def scans(reps: int) -> None:
    peer = hf_scan()
    chunked = {f"chunked {c}": functools.partial(chunked_scan, chunk=c) for c in (16, 32, 64)}
    kinds = {"sequential": sequential_scan, **chunked, "transformers": peer}
    print("scan (batch 2, d_inner 256, d_state 16, fp32): best-of-reps ms, forward | forward + backward")
    print(f"{'T':>6} " + " ".join(f"{k:>22}" for k in kinds))
    for T in (64, 256, 1024):
        inputs = scan_inputs(T)
        row = {}
        for name, scan in kinds.items():

            def fwd(scan=scan, inputs=inputs):
                with torch.no_grad():
                    scan(*inputs)

            def both(scan=scan, inputs=inputs):
                y, _ = scan(*inputs)
                y.sum().backward()

            row[name] = (best_ms(fwd, reps), best_ms(both, max(1, reps // 2)))
        print(f"{T:>6} " + " ".join(f"{f:>9.1f} | {b:>9.1f}  " for f, b in row.values()))
        best = min((v[0], k) for k, v in row.items() if k.startswith("chunked"))
        hf = row["transformers"][0]
        print(f"       forward: transformers / sequential {hf / row['sequential'][0]:.2f}x, "
              f"transformers / best chunked ({best[1]}) {hf / best[0]:.2f}x")  # fmt: skip


def decode(reps: int) -> None:
    base = dict(
        vocab_size=4096, n_layer=4, d_model=128, n_head=2, max_seq_len=2048, norm="rmsnorm", bias=False
    )
    models = {
        "mamba": GPT.build(ModelConfig(**base, mixer="mamba", pos="none", mlp="none"), seed=0).eval(),
        "attention": GPT.build(ModelConfig(**base, pos="rope", mlp="swiglu"), seed=0).eval(),
    }
    print("\none decode step at batch 1 after a prefill of P tokens (d_model 128, 4 layers): best-of-reps ms")
    print(f"{'P':>6} " + " ".join(f"{k:>10}" for k in models) + "   params " +
          " ".join(f"{k} {m.num_params() / 1e6:.2f}M" for k, m in models.items()))  # fmt: skip
    for P in (64, 256, 1024):
        row = []
        for model in models.values():
            idx = torch.randint(0, 4096, (1, P), generator=torch.Generator().manual_seed(0))
            with torch.inference_mode():
                cache = KVCache(P + reps + 2)
                model(idx, cache=cache)
                step = functools.partial(model, idx[:, :1], cache=cache)
                row.append(best_ms(step, reps))
        print(f"{P:>6} " + " ".join(f"{ms:>10.2f}" for ms in row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}")
    scans(args.reps)
    decode(args.reps)


if __name__ == "__main__":
    main()
