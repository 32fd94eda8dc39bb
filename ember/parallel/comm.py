"""``ember bench comm --nproc N``: how fast the ranks talk, collective by collective.

    ember bench comm --nproc 4                        # gloo on CPU, 1 KiB ... 256 MiB
    ember bench comm --nproc 8 --device cuda          # NCCL
    ember bench comm --nproc 2 --max-bytes 1M --out runs/comm

Each collective of a training step (all-reduce for DDP's gradients, all-gather and
reduce-scatter for FSDP's parameters and gradients, all-to-all for expert or sequence
parallelism, send/recv between pipeline stages) runs over message sizes growing 4x at a time.
A size's time is the mean over enough iterations to fill ``--seconds``, taken on the slowest
rank (a collective is as fast as its last rank). Then, with nccl-tests' definitions
(its PERFORMANCE.md), for a message of S bytes taking t seconds on n ranks:

    algorithm bandwidth  algbw = S / t
    bus bandwidth        busbw = algbw x factor, the bytes each rank's link really carries:
        all-reduce       2 (n - 1) / n      (a reduce-scatter then an all-gather)
        all-gather       (n - 1) / n        (S: the gathered output)
        reduce-scatter   (n - 1) / n        (S: the input before scattering)
        all-to-all       (n - 1) / n        (S: each rank's whole buffer)
        send/recv        1                  (each rank sends S to the next, around a ring)

so busbw compares with the hardware's link speed whatever n is. Each collective's result is
checked once per size against the values it must give (nccl-tests' "#wrong"): a fast wrong
answer is not a bandwidth. Rank 0 prints the table and writes ``comm.json`` and, with the
``plots`` extra, ``comm.png`` (bus bandwidth against size) to ``--out``.

Written by hand because measuring the collectives is the point: the collectives themselves are
``torch.distributed``'s.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ember.atomic import write_text_atomic

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
# torch 2.13 renamed the single-tensor forms (the old names warn); the GPU machine runs 2.11
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``collective`` on ``n`` ranks (module docstring)."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective == "send_recv":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}; one of {COLLECTIVES}")


@dataclass
class Row:
    collective: str
    bytes: int  # S: the message size in nccl-tests' sense (module docstring)
    ranks: int
    seconds: float  # per call, the slowest rank's mean
    iters: int
    wrong: int  # elements that differed from the expected result

    @property
    def algbw(self) -> float:
        return self.bytes / self.seconds

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.collective, self.ranks)


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """Message sizes from ``min_bytes`` growing 4x while within ``max_bytes`` (fp32: multiples of
    4 bytes per rank)."""
    out, s = [], max(min_bytes, 4)
    while s <= max_bytes:
        out.append(s)
        s *= 4
    return out


def _op(collective: str, nbytes: int, rank: int, n: int, device: torch.device):
    """(call, check): ``call()`` runs the collective once on buffers of the message's size;
    ``check()`` returns how many elements differ from what it must give."""
    count = max(nbytes // 4 // n, 1) * n  # elements of S, a multiple of n
    part = count // n
    base = float(rank + 1)
    if collective == "all_reduce":
        x = torch.full((count,), base, device=device)

        def call():
            x.fill_(base)
            dist.all_reduce(x)

        return call, lambda: int((x != n * (n + 1) / 2).sum())
    if collective == "all_gather":
        x, out = torch.full((part,), base, device=device), torch.empty(count, device=device)
        expect = torch.arange(1, n + 1, device=device, dtype=torch.float32).repeat_interleave(part)
        return lambda: _all_gather(out, x), lambda: int((out != expect).sum())
    if collective == "reduce_scatter":
        x, out = torch.full((count,), base, device=device), torch.empty(part, device=device)
        return lambda: _reduce_scatter(out, x), lambda: int((out != n * (n + 1) / 2).sum())
    if collective == "all_to_all":  # chunk j of rank r holds r * n + j; after: chunk j holds j * n + r
        x = (rank * n + torch.arange(n, device=device, dtype=torch.float32)).repeat_interleave(part)
        out = torch.empty(count, device=device)
        expect = (torch.arange(n, device=device, dtype=torch.float32) * n + rank).repeat_interleave(part)
        return lambda: dist.all_to_all_single(out, x), lambda: int((out != expect).sum())
    if collective == "send_recv":  # a ring: send to the next rank, receive from the previous
        x, out = torch.full((count,), base, device=device), torch.empty(count, device=device)
        nxt, prev = (rank + 1) % n, (rank - 1) % n

        def call():
            ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, out, prev)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return call, lambda: int((out != prev + 1).sum())
    raise ValueError(f"unknown collective {collective!r}; one of {COLLECTIVES}")


def measure(collective: str, nbytes: int, device: torch.device, seconds: float = 0.2) -> Row:
    """One row: warm up, check the result, then time enough calls to fill about ``seconds``."""
    rank, n = dist.get_rank(), dist.get_world_size()
    call, check = _op(collective, nbytes, rank, n, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(iters: int) -> float:
        dist.barrier()
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        sync()
        t = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(t, dist.ReduceOp.MAX)  # the slowest rank's time, so every rank agrees on iters
        return float(t)

    for _ in range(3):  # warm-up (connections, allocations)
        call()
    wrong = torch.tensor([check()], device=device)
    dist.all_reduce(wrong)
    once = timed(1)
    iters = max(1, min(100, int(seconds / max(once, 1e-6))))
    return Row(collective, max(nbytes // 4 // n, 1) * n * 4, n, timed(iters), iters, int(wrong))


def run(min_bytes: int, max_bytes: int, out: Path | None, seconds: float) -> list[Row]:
    """Every collective at every size, under torchrun (``ember bench comm`` launches it)."""
    cuda = os.environ.get("EMBER_COMM_DEVICE", "cpu") == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rows = [measure(c, s, device, seconds) for c in COLLECTIVES for s in sizes(min_bytes, max_bytes)]
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        report(rows, out, "nccl" if cuda else "gloo")
    return rows


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.4g} {unit}"
        nbytes /= 1024
    raise AssertionError


def report(rows: list[Row], out: Path | None, backend: str) -> None:
    """The table on stdout; comm.json and comm.png in ``out``."""
    n = rows[0].ranks if rows else 0
    print(f"ember bench comm: {n} ranks, {backend}; time per call on the slowest rank; GB/s = 1e9 bytes/s")
    header = ["collective", "size", "time us", "iters", "algbw GB/s", "busbw GB/s", "wrong"]
    table = [[r.collective, _human(r.bytes), f"{r.seconds * 1e6:,.1f}", str(r.iters), f"{r.algbw / 1e9:.3f}",
              f"{r.busbw / 1e9:.3f}", str(r.wrong)] for r in rows]  # fmt: skip
    widths = [max(len(x[i]) for x in [header, *table]) for i in range(len(header))]
    for i, line in enumerate([header, *table]):
        print("| " + " | ".join(c.rjust(w) if i and j else c.ljust(w) for j, (c, w) in enumerate(zip(line, widths, strict=True))) + " |")  # fmt: skip # noqa: E501
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    if any(r.wrong for r in rows):
        print("WRONG RESULTS: some collective gave values it must not; the bandwidths above mean nothing")
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    data = {"ranks": n, "backend": backend,
            "rows": [{**asdict(r), "algbw": r.algbw, "busbw": r.busbw} for r in rows]}  # fmt: skip
    write_text_atomic(out / "comm.json", json.dumps(data, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {out / 'comm.json'} (no plot: pip install -e '.[plots]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for c in dict.fromkeys(r.collective for r in rows):
        mine = [r for r in rows if r.collective == c]
        ax.plot([r.bytes for r in mine], [r.busbw / 1e9 for r in mine], marker="o", label=c)
    ax.set(xscale="log", xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
           title=f"{n} ranks, {backend}")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "comm.png", dpi=120)
    plt.close(fig)
    print(f"wrote {out / 'comm.json'} and {out / 'comm.png'}")
