"""How many greedy ids of serve.py's workload could a change of summation order flip?

    .venv/bin/python benchmarks/greedy_margins.py [--requests 256] [--every 8] [--device cpu]

serve.py --device checks that every served greedy completion equals the batch-1 engine's. The two
paths sum in other orders (GEMMs of other batch shapes, the paged kernels), so their fp32 logits
differ by rounding, and a position whose two best logits are closer than that can flip. This
walks the same seeded model and requests greedily (one cached step a token) and prints the gap
between the two best logits at every position, next to the rounding between two orders measured
on the same positions: the cached steps' logits against one full forward's, every ``--every``-th
request. Positions whose gap is under that rounding are the expected flips.
"""

from __future__ import annotations

import argparse
import time

import torch
from printing import cpu_model
from serve import code_tokenizer, seeded_model, workload

from ember.infer.engine import KVCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--every", type=int, default=8, help="measure the rounding on every n-th request")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device(args.device)
    model = seeded_model("gpt2-small", device, args.seed)  # serve.py's
    n_valid = min(code_tokenizer().vocab_size, model.cfg.vocab_size)  # the engine masks ids past these
    gaps, rounding, start = [], [], time.perf_counter()
    with torch.inference_mode():
        for i, (prompt, n_out) in enumerate(workload(args.requests, args.seed, (16, n_valid))):
            cache, answer, steps = KVCache(len(prompt) + n_out, device=device), [], []
            logits = model(torch.tensor([prompt], device=device), cache=cache)[0, -1, :n_valid]
            for _ in range(n_out):
                top = logits.topk(2).values
                gaps.append((top[0] - top[1]).item())
                steps.append(logits)
                answer.append(int(logits.argmax()))
                logits = model(torch.tensor([answer[-1:]], device=device), cache=cache)[0, -1, :n_valid]
            if i % args.every == 0:  # the same positions' logits summed in another order
                full = model(torch.tensor([prompt + answer[:-1]], device=device))[0, len(prompt) - 1 :]
                rounding += (full[:, :n_valid] - torch.stack(steps)).abs().amax(dim=1).tolist()
    gap, diff = torch.tensor(gaps), torch.tensor(rounding)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    took = time.perf_counter() - start
    print(f"gpt2-small shape, init_std 0.1, fp32, on {name}, torch {torch.__version__}: {len(gaps):,} "
          f"greedy positions of {args.requests} requests, {n_valid} ids ({took:.0f} s)")  # fmt: skip
    print(f"gap between the two best logits: min {gap.min():.2e}, 1% {gap.quantile(0.01):.2e}, "
          f"median {gap.median():.2e}; under 1e-4: {(gap < 1e-4).sum()}, under 1e-3: {(gap < 1e-3).sum()}")
    print(f"rounding between two orders (the largest logit difference a position, {len(rounding):,} "
          f"positions): median {diff.median():.2e}, p99 {diff.quantile(0.99):.2e}, max {diff.max():.2e}")
    print(f"positions whose gap is under the largest rounding seen: {(gap < diff.max()).sum()}")


if __name__ == "__main__":
    main()
