"""The floor that a batch-1 decode step's chain of dependencies sets, apart from its bytes.

    python benchmarks/decode_floor.py --device cuda        # on a GPU (a few seconds)
    .venv/bin/python benchmarks/decode_floor.py --device cpu   # the plumbing, interpreted

Issue 29 point 3 asks for bf16 gpt2-small at >= 25% of the HBM bound: 172.7 MiB a token (decode.py's
gpt2-small shape), 44 µs at an H200's 4.1 TB/s copy bandwidth, so at most 176 µs a token. But a
token is a chain of steps, each reading what the last one wrote: ember's fused step launches 67
kernels a token (five a block, the embedding, the head and its reduction), and the persistent
step passes 61 grid-wide counts (``ember.kernels.persistent``). This script times those chains
with no bytes in them:

- **launches**: N kernels of one program an SM, each program reading a word that the kernel
  before wrote (its program 0 writes the next), replayed from one CUDA graph, launched plain and
  as programmatic dependents (PDL: the fused step's road);
- **phases**: one kernel of one program an SM passing N grid-wide counts, with the persistent
  step's own wait (``ember.kernels.decode._wait``: an acquire read of a counter each program adds
  one to, with release, when it is done).

It prints the µs a link, the chain a token (67 launches or 61 phases) and the tokens/s and share
of the bound that the chain alone allows: no step with that structure can do better, however
fast its products stream their weights. On a CPU the kernels run under Triton's interpreter, one
program: the times mean nothing there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ember.kernels  # noqa: F401,E402 -- before triton: it sets the interpreter on a CPU

# isort: split
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from kernels import bench  # noqa: E402 -- benchmarks/kernels.py's: do_bench's median ms on CUDA

from ember.kernels import sm_count  # noqa: E402
from ember.kernels.decode import _wait  # noqa: E402

LAUNCHES, PHASES = 67, 61  # the fused step's kernels a token; the persistent step's waits (62 stages)
BOUND_MIB = 172.7  # decode.py's gpt2-small shape, bf16: bytes read a token


@triton.jit
def _link(X, PDL: tl.constexpr):
    """Read the word the kernel before wrote; program 0 writes the next one."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    v = tl.load(X)
    if tl.program_id(0) == 0:
        tl.store(X, v + 1)


@triton.jit
def _phases(SYNC, n, programs):
    """``n`` stages; each program waits for all ``programs`` to finish the last, then adds one
    (Triton lowers the wait's atomic read of 0 with acquire to an acquire load: ld.acquire)."""
    tl.atomic_add(SYNC, 1, sem="release")  # stage 0 waits for nothing
    for stage in range(1, n):
        _wait(2, SYNC, stage, programs)
        tl.atomic_add(SYNC + stage, 1, sem="release")


def launch_chain(device: torch.device, n: int, pdl: bool) -> float:
    """µs a launch of ``n`` dependent one-program-an-SM kernels, replayed from one CUDA graph."""
    programs = sm_count(device.index or 0) if device.type == "cuda" else 1
    x = torch.zeros(1, dtype=torch.int32, device=device)
    extra = {"launch_pdl": True} if pdl else {}

    def chain():
        for _ in range(n):
            _link[(programs,)](x, PDL=pdl, **extra)

    if device.type != "cuda":
        return bench(chain, device.type) / n * 1e3
    chain()  # compile before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    before = int(x.item())
    ms = bench(graph.replay, device.type)
    assert int(x.item()) > before, "the chain did not run"
    return ms / n * 1e3


def phase_chain(device: torch.device, n: int) -> float:
    """µs a phase of one kernel of one program an SM passing ``n`` grid-wide counts."""
    programs = sm_count(device.index or 0) if device.type == "cuda" else 1
    sync = torch.zeros(n, dtype=torch.int32, device=device)

    def run():
        sync.zero_()
        _phases[(programs,)](sync, n, programs)

    ms = bench(run, device.type)
    assert int(sync[-1].item()) == programs, "a phase was not passed by every program"
    return ms / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--links", type=int, default=600, help="links timed in one chain (default 600)")
    ap.add_argument("--bound-mib", type=float, default=BOUND_MIB, help="bytes a token, MiB (decode.py's)")
    args = ap.parse_args()
    device = torch.device(args.device)
    from decode import copy_bandwidth
    from printing import print_table

    links = args.links if device.type == "cuda" else 4
    bandwidth = copy_bandwidth(device, mib=256 if device.type == "cuda" else 8)
    bytes_us = args.bound_mib * 2**20 / bandwidth * 1e6
    bound = 1e6 / bytes_us
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreted: plumbing)"
    print(f"{where}; torch {torch.__version__}, Triton {triton.__version__}; copy bandwidth "
          f"{bandwidth / 1e9:,.0f} GB/s: {args.bound_mib} MiB a token take {bytes_us:.1f} µs, "
          f"a bound of {bound:,.0f} tokens/s")  # fmt: skip
    rows = []
    pdl_ok = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    roads = [("launches, graphed", LAUNCHES, lambda: launch_chain(device, links, False))]
    if pdl_ok:
        roads.append(("launches, graphed, PDL", LAUNCHES, lambda: launch_chain(device, links, True)))
    roads.append(("phases of one kernel", PHASES, lambda: phase_chain(device, links)))
    for name, per_token, fn in roads:
        us = fn()
        chain = us * per_token
        best = 1e6 / max(chain, bytes_us)
        rows.append([name, f"{us:.2f}", f"{per_token}", f"{chain:.0f}", f"{best:,.0f}", f"{best / bound:.0%}",
                     f"{1e6 / (chain + bytes_us) / bound:.0%}"])  # fmt: skip
    print_table(["chain", "µs a link", "links a token", "µs a token", "tok/s at most",
                 "of the bound", "with the bytes after"], rows)  # fmt: skip
    print("'tok/s at most': the chain alone, or the bytes alone where they take longer; 'with the bytes "
          "after': the chain and the bytes not overlapped at all (a step's products wait for their "
          "inputs, but read their weights ahead: the truth lies between)")


if __name__ == "__main__":
    main()
