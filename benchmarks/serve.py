"""Serving under load: `ember serve` at 1, 4, 16 and 64 concurrent clients against the same
requests run one after another through the batch-1 engine and through transformers' generate.

    .venv/bin/python benchmarks/serve.py --run runs/cpu-quick-600 [--requests 64] [--clients 1 4 16 64]
                                         [--seed 0] [serve.max_seqs=64 ...]

The workload is seeded: N requests whose prompt and output lengths are drawn from log-normal
distributions (long-tailed: medians 24 and 32 tokens, clipped to 1-160 and 1-96 so that each
fits the model's context), prompts of random ordinary token ids sent as ids, greedy, and
``ignore_eos`` so every request makes exactly its output length on every system. The server
is a separate process (``python -m ember serve RUN``); the clients are asyncio tasks with
aiohttp (as vLLM's benchmark), each streaming its request and starting the next when done, so
at most C are in flight.

Definitions as vLLM's benchmark_serving: TTFT, time from sending a request to its first
streamed token; TPOT, (latency - TTFT) / (output tokens - 1) per request; ITL, the gaps between
a request's streamed chunks; request and output-token throughput over the level's wall time.
After each level the server's /metrics must show no sequence running and no KV block in use
(no leak). "KV used" is the share of the slots of the blocks that running sequences held,
averaged over engine steps, that held a token's keys: 1 - the waste of partly filled blocks.

On a 2-core CPU the clients share the cores with the server; the figures include that cost.

Without ``--run``, on a device (issue 29's GPU serving check; ``--device cpu`` is its dry run):

    .venv/bin/python benchmarks/serve.py --device cuda [--model gpt2-small] [--clients 1 16 64 256]
        [--attention gather flex triton] [serve.max_seqs=256 serve.kv_memory=8e9 ...]

a seeded model of that shape (random weights, ``init_std`` 0.1 so greedy ids are not ties) is
served in this process: the scheduler is stepped directly, with C closed-loop clients (a
client submits its next request when its last finishes), so no HTTP stack is needed on the GPU
machine. A level serves max(--per-level, --waves x C) of the requests (all of them at most): with
a single wave, C requests started together, the rate would mostly measure the longest answers'
tail, when few sequences are left in flight. Per level: output tokens/s, TTFT and ITL p50/p99
(a token's time is the end of the step that made it), KV slots used of those held, the peak
share of the pool in use, the ratio to the batch-1 engine's tokens/s over all the requests one
after another (its decode steps in CUDA graphs on a GPU), and whether every greedy completion
equals the batch-1 engine's (fp32; the script exits 1 if one differs). ``--anatomy`` serves the
64-client level once more under torch.profiler: the device's kernels per output token and its
busy share of the wall, so a rate short of the target says whether the host or the device bounds it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from printing import cpu_model, print_table
from profiling import costliest, profiled

from ember.config import ModelConfig, load_config
from ember.data.tokenizer import Tokenizer
from ember.infer.engine import Engine
from ember.infer.paged import PAGED_ATTENTION
from ember.infer.sampling import Sampling
from ember.infer.scheduler import Scheduler
from ember.model.gpt import GPT
from ember.model.hf import to_hf

GPT2 = dict(pos="learned", norm="layernorm", mlp="gelu", bias=True)
MODELS = {  # --model: shapes of benchmarks/decode.py's, with GPT-2's padded vocabulary
    "tiny": dict(n_layer=2, n_head=4, d_model=64, vocab_size=512, **GPT2),
    "gpt2-small": dict(n_layer=12, n_head=12, d_model=768, vocab_size=50304, **GPT2),
}


def workload(n: int, seed: int, vocab: tuple[int, int]) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = min(160, max(1, round(rng.lognormvariate(3.2, 0.8))))  # median e^3.2 = 24
        o = min(96, max(1, round(rng.lognormvariate(3.5, 0.7))))  # median 33
        out.append(([rng.randrange(*vocab) for _ in range(p)], o))
    return out


def metrics(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {k: float(v) for k, v in (ln.split() for ln in text.splitlines() if not ln.startswith("#"))}


async def one(session, url: str, name: str, prompt: list[int], n_out: int) -> dict:
    body = {"model": name, "prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start, chunks, tokens = time.perf_counter(), [], 0
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            await r.read()
            return {"status": r.status}
        async for raw in r.content:  # one SSE line at a time
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if b'"usage"' in line and b'"choices": []' in line:
                tokens = int(line.split(b'"completion_tokens": ')[1].split(b",")[0])
            else:
                chunks.append(time.perf_counter())
    end = time.perf_counter()
    ttft = chunks[0] - start if chunks else end - start
    return {"status": 200, "ttft": ttft, "latency": end - start, "tokens": tokens,
            "tpot": (end - start - ttft) / (tokens - 1) if tokens > 1 else None,
            "itl": [b - a for a, b in zip(chunks, chunks[1:], strict=False)]}  # fmt: skip


async def level(url: str, name: str, requests, clients: int) -> tuple[list[dict], float]:
    import aiohttp  # (here and in main: the --device path needs no HTTP client on the GPU machine)

    queue = list(enumerate(requests))
    results: list[dict] = [{}] * len(requests)

    async def worker(session):
        while queue:
            i, (prompt, n_out) = queue.pop(0)
            results[i] = await one(session, url, name, prompt, n_out)

    connector = aiohttp.TCPConnector(limit=clients + 4)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(clients)))
        return results, time.perf_counter() - start


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def serve_level(scheduler: Scheduler, requests, clients: int, warm: bool = False) -> dict:
    """Closed-loop clients in this process; per-request token times and the level's figures."""
    queue, live, done, start = list(enumerate(requests)), {}, {}, time.perf_counter()
    held_peak, used0, held0 = 0, scheduler.slots_used, scheduler.slots_held
    while queue or live:
        while queue and len(live) < clients:
            i, (prompt, n_out) = queue.pop(0)
            [r] = scheduler.add(prompt, Sampling(n_out, temperature=0, ignore_eos=True))
            live[i] = (r, time.perf_counter(), [])
        scheduler.step()
        now = time.perf_counter()
        held_peak = max(held_peak, scheduler.blocks.in_use)
        for i, (r, sent, times) in list(live.items()):
            times += [now] * (len(r.row.ids) - len(times))
            if r.done:
                gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
                done[i] = (r.completion().token_ids, [times[0] - sent], gaps)
                del live[i]
    wall = time.perf_counter() - start
    used, held = scheduler.slots_used - used0, scheduler.slots_held - held0
    peak, tokens = held_peak / scheduler.blocks.num_blocks, sum(len(t) for t, _, _ in done.values())
    return {"wall": wall, "done": done, "kv": used / max(held, 1), "peak": peak, "tokens": tokens}


def anatomy(scheduler: Scheduler, attention: str, level: dict, clients: list[int], device) -> None:
    """The 64-client level (or the largest) once more under torch.profiler: the device's kernels
    per output token and its busy share of the wall, which says whether the host or the device
    bounds the rate, and the costliest kernels, which say what bounds the device."""
    c = 64 if 64 in clients else clients[-1]
    got = {}
    cuda = device.type == "cuda"
    kernels, wall, busy = profiled(lambda: got.update(serve_level(scheduler, level[c], c)), cuda)
    scheduler.blocks.block_of.clear(), scheduler.blocks.key_of.clear()
    busy, tokens = busy * 1e-6, got["tokens"]
    print(f"anatomy of {attention} at {c} clients: {tokens:,} tokens in {wall:.2f} s under the profiler, "
          f"{len(kernels) / tokens:.0f} kernels and {busy / tokens * 1e6:.0f} µs of them an output token: "
          f"the device busy {busy / wall:.0%} of the wall")  # fmt: skip
    costliest(kernels, tokens, "an output token")


def code_tokenizer() -> Tokenizer:
    """A 300-id BPE of code-like text: the seeded models' tokenizer (their ids are random anyway)."""
    return Tokenizer.train_bpe(" ".join(f"def f{i}(x): return x * {i} + {i % 7}" for i in range(400)), 300)


class NoModel(torch.nn.Module):
    """A forward that only takes the planned step (the cache's copy-on-writes, its checks) and
    returns zero logits: what is left of a step is the scheduler's own host work."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg, self.anchor = cfg, torch.nn.Parameter(torch.zeros(1))  # (its dtype and device)

    def forward(self, idx, cache, keep):
        cache.extend(idx.size(1))
        rows = keep[0].numel() if isinstance(keep, tuple) else int(keep.sum())
        return torch.zeros(rows, self.cfg.vocab_size)


def host_main(args) -> None:
    """``--host``: the scheduler's host work per output token at 64 clients, the model replaced
    by ``NoModel``, for the usual answers and for 1,024-token ones. A CUDA step replays a graph
    in a few launches, so this work is most of what is left of it on the host; its cost should
    not grow with an answer's length (it did: every token decoded all the answer's ids)."""
    torch.set_num_threads(1)
    cfg = ModelConfig(max_seq_len=2048, init_std=0.1, dropout=0.0, **MODELS["tiny"])
    engine = Engine(GPT.build(cfg, seed=args.seed).eval(), code_tokenizer())
    engine.model = NoModel(cfg)
    short = workload(256, args.seed, (16, engine.n_valid))
    long = [(prompt, 1024) for prompt, _ in short[:64]]
    print(f"scheduler host work, model stubbed, 64 clients; {cpu_model()}, torch {torch.__version__}")
    rows = []
    for attention in args.attention:
        per_token = {}
        for name, requests in (("median 33 tokens", short), ("1,024 tokens", long)):
            buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256) if PAGED_ATTENTION[attention].graphed else None
            scheduler = Scheduler(engine, kv_memory=int(1e8), max_batch_tokens=2048, max_seqs=256,
                                  paged_attention=attention, decode_buckets=buckets)  # fmt: skip
            times = []
            for _ in range(3):
                start = time.perf_counter()
                got = serve_level(scheduler, requests, 64)
                times.append(time.perf_counter() - start)
                scheduler.blocks.block_of.clear(), scheduler.blocks.key_of.clear()
            wall = statistics.median(times)
            per_token[name] = wall / got["tokens"] * 1e6
            rows.append([attention, name, f"{got['tokens']:,}", f"{per_token[name]:.1f}", ""])
        rows[-1][-1] = f"{per_token['1,024 tokens'] / per_token['median 33 tokens']:.2f}x"
    print_table(["attention", "answers", "output tokens", "host µs a token", "long / short"], rows)


TIE = 1e-3  # logits: the two candidates closer than this in fp32 are a near-tie (see divergence)


def sum_len(request: tuple[list[int], int]) -> int:
    """A request's prompt and answer tokens together: the cache length it needs."""
    return len(request[0]) + request[1]


def divergence(model, prompt: list[int], ref: list[int], got: list[int]) -> tuple[int, float]:
    """Where a served greedy answer first leaves the batch-1 engine's (``ref``), and how far the
    plain path (one full forward of the prompt and the answer so far, fp32, no cache) prefers
    ``ref``'s token there over ``got``'s, in logits. GEMMs of other batch shapes and the paged
    kernels sum in other orders than the batch-1 step: their rounding (about 1e-6 relative in
    fp32) can flip a near-tie but not a clear choice, so a margin near zero is rounding and a
    large one is a bug."""
    where = next((j for j, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
    if where is None:  # one answer is the other's start: lengths differ (not with ignore_eos)
        return min(len(ref), len(got)), float("inf")
    idx = torch.tensor([prompt + ref[:where]], device=next(model.parameters()).device)
    with torch.inference_mode():
        logits = model(idx)[0, -1].float()
    return where, (logits[ref[where]] - logits[got[where]]).item()


def seeded_model(name: str, device: torch.device, seed: int) -> GPT:
    """The device mode's model: ``MODELS[name]``'s shape, random weights (``init_std`` 0.1, so
    greedy ids are rarely ties), fp32, in eval mode (benchmarks/greedy_margins.py walks it too)."""
    cfg = ModelConfig(max_seq_len=512, init_std=0.1, dropout=0.0, **MODELS[name])
    return GPT.build(cfg, device=device, seed=seed).eval()


def one_after_another(engine: Engine, requests) -> tuple[list[list[int]], float, float]:
    """Each request's greedy answer from ``engine`` alone, one after another: the answers, output
    tokens/s and seconds. Untimed first, the shortest and the longest request, so the graphs of
    each cache length are captured and the kernels' first uses paid before the clock starts."""
    with torch.inference_mode():
        for prompt, n_out in (min(requests, key=sum_len), max(requests, key=sum_len)):
            engine.generate([prompt], Sampling(n_out, temperature=0, ignore_eos=True))
        start, answers = time.perf_counter(), []
        for prompt, n_out in requests:
            [c] = engine.generate([prompt], Sampling(n_out, temperature=0, ignore_eos=True))
            answers.append(c.token_ids)
        took = time.perf_counter() - start
    return answers, sum(len(t) for t in answers) / took, took


def invariant_reference(model, tokenizer, device, requests, plain: list[list[int]]) -> list[list[int]]:
    """The batch-1 engine's answers with ``batch_invariant`` (ember.kernels.invariant; graphed on
    a GPU), which the invariant scheduler's must equal bit for bit; its rate, and how many of its
    answers the plain engine's equal (the two sum in other orders: a near-tie may differ)."""
    engine = Engine(model, tokenizer, device=device, graphs=device.type == "cuda", batch_invariant=True)
    answers, rate, _ = one_after_another(engine, requests)
    same = sum(a == b for a, b in zip(answers, plain, strict=True))
    print(f"batch-1 engine, batch-invariant: {rate:,.0f} output tok/s; {same}/{len(answers)} answers equal "
          "the plain engine's; the served answers are held to these", flush=True)  # fmt: skip
    return answers


def device_main(args) -> None:
    """Issue 29's serving check in one process (module docstring)."""
    device = torch.device(args.device)
    serve = load_config("tiny", args.serve).serve
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 greedy parity with the batch-1 engine
    tokenizer = code_tokenizer()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = seeded_model(args.model, device, args.seed).to(dtype)
    engine = Engine(model, tokenizer, device=device)
    n = max(args.requests, max(args.clients))
    requests = workload(n, args.seed, (16, engine.n_valid))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    print(f"{args.model}: {model.num_params() / 1e6:.1f}M parameters, {args.dtype}, on {name}, "
          f"torch {torch.__version__}")  # fmt: skip
    # the batch-1 engine: the reference answers and the sequential rate; on a GPU its decode steps
    # replay from CUDA graphs (4x eager's tokens/s on an H200: the stricter baseline, and the faster)
    batch1 = Engine(model, tokenizer, device=device, graphs=device.type == "cuda")
    reference, sequential, took = one_after_another(batch1, requests)
    print(f"batch-1 engine{' (CUDA graphs)' if batch1.graphs else ''}, one request after another: "
          f"{sequential:,.0f} output tok/s ({took:.0f} s)", flush=True)  # fmt: skip
    if args.batch_invariant:  # the reference is the invariant engine's; the rate stays the faster plain one's
        reference = invariant_reference(model, tokenizer, device, requests, reference)
    rows, ties = [], []  # ties: per differing completion, whether it left at a near-tie
    steps = {"off": [False], "on": [True], "both": [False, True]}[args.async_steps]
    for attention, async_steps in [(a, x) for a in args.attention for x in steps]:
        road = attention + ("+async" if async_steps else "")
        buckets = tuple(serve.decode_buckets) if PAGED_ATTENTION[attention].graphed else None
        scheduler = Scheduler(engine, kv_memory=int(serve.kv_memory), block_size=serve.block_size,
                              max_batch_tokens=serve.max_batch_tokens, max_seqs=serve.max_seqs,
                              prefix_caching=serve.prefix_caching, paged_attention=attention,
                              decode_buckets=buckets, batch_invariant=args.batch_invariant,
                              async_steps=async_steps)  # fmt: skip
        level = {c: requests[: max(args.per_level, args.waves * c)] for c in args.clients}
        start = time.perf_counter()
        for clients in args.clients:  # warm-up: the very run, untimed (flex compiled, graphs captured)
            serve_level(scheduler, level[clients], clients)
            scheduler.blocks.block_of.clear(), scheduler.blocks.key_of.clear()  # no prefix-cache hits after
        for clients in args.clients:
            got = serve_level(scheduler, level[clients], clients)
            scheduler.blocks.block_of.clear(), scheduler.blocks.key_of.clear()
            ttft = [x * 1e3 for _, t, _ in got["done"].values() for x in t]
            itl = [x * 1e3 for _, _, gaps in got["done"].values() for x in gaps]
            same = sum(got["done"][i][0] == reference[i] for i in got["done"])
            for i in (i for i in got["done"] if got["done"][i][0] != reference[i]):
                where, margin = divergence(model, requests[i][0], reference[i], got["done"][i][0])
                ties.append(abs(margin) < TIE)
                verdict = "a near-tie" if ties[-1] else f"not a near-tie: >= {TIE:g}"
                print(f"{road}, {clients} clients: request {i} leaves the batch-1 answer at token "
                      f"{where} of {len(reference[i])}; there the full forward prefers its token by "
                      f"{margin:.2e} logits ({verdict})")  # fmt: skip
            rate = got["tokens"] / got["wall"]
            rows.append([road, str(clients), f"{len(got['done'])}", f"{rate:,.0f}",
                         f"{statistics.median(ttft):.1f} / {pct(ttft, 0.99):.1f}",
                         f"{statistics.median(itl):.1f} / {pct(itl, 0.99):.1f}" if itl else "",
                         f"{got['kv']:.1%}", f"{got['peak']:.0%}", f"{rate / sequential:.2f}x",
                         f"{same}/{len(got['done'])}"])  # fmt: skip
            print(f"{road}, {clients} clients: {rate:,.0f} output tok/s, {rate / sequential:.2f}x "
                  f"sequential, {same}/{len(got['done'])} equal ({time.perf_counter() - start:.0f} s "
                  "since the warm-up began)", flush=True)  # fmt: skip
        if args.anatomy:  # one more run of a level under the profiler: host- or device-bound?
            anatomy(scheduler, road, level, args.clients, device)
        graphs = scheduler.graphs and (sorted(scheduler.graphs.graphs) or "none (no CUDA, or failed)")
        print(f"{road}: {scheduler.preemptions} preemptions, {scheduler.blocks.num_blocks} blocks of "
              f"{serve.block_size}; decode buckets {buckets}, CUDA graphs: {graphs or 'off'}")  # fmt: skip
    print_table(["attention", "clients", "requests", "output tok/s", "TTFT ms p50 / p99", "ITL ms p50 / p99",
                 "KV used", "KV peak", "x sequential", "= batch-1"], rows)  # fmt: skip
    if ties:
        print(f"{len(ties)} greedy completions differ from the batch-1 engine's, {sum(ties)} of them at a "
              f"near-tie (the two tokens' fp32 logits within {TIE:g})")  # fmt: skip
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", help="the run directory to serve over HTTP; without it, --device")
    parser.add_argument("--device", default="cpu", help="without --run: serve a seeded --model here")
    parser.add_argument("--model", choices=MODELS, help="without --run (gpt2-small on cuda, tiny on cpu)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--attention", nargs="+", default=["gather", "flex"], choices=PAGED_ATTENTION)
    parser.add_argument("--async-steps", choices=("off", "on", "both"), default="off",
                        help="without --run: serve with serve.async_steps (each step launched before the "
                             "last one's ids are read back), without it, or both, one row each")  # fmt: skip
    parser.add_argument("--batch-invariant", action="store_true",
                        help="without --run: serve with serve.batch_invariant (--attention triton), "
                             "answers held to the batch-1 engine's, batch-invariant too, bit for bit")
    parser.add_argument("--per-level", type=int, default=32, help="without --run: at least this many a level")
    parser.add_argument("--waves", type=int, default=4,
                        help="without --run: a level of C clients serves waves x C requests (--requests at "
                        "most), so C stay in flight most of the time, not one wave and its tail")  # fmt: skip
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--anatomy", action="store_true",
                        help="without --run: the 64-client level once more under torch.profiler, the "
                        "device's busy share of the wall (host- or device-bound)")  # fmt: skip
    parser.add_argument("--host", action="store_true",
                        help="the scheduler's host work per output token at 64 clients, the model "
                        "stubbed, for 33- and 1,024-token answers (any machine)")  # fmt: skip
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the sequential baselines")
    parser.add_argument("--skip-hf", action="store_true", help="leave out transformers' generate")
    parser.add_argument("serve", nargs="*", metavar="serve.key=value", help="server settings")
    args = parser.parse_args()
    if args.host:
        return host_main(args)
    if args.batch_invariant and (args.run or args.host or args.attention != ["triton"]):
        parser.error("--batch-invariant serves a seeded model (no --run) with --attention triton alone")
    if args.run is None:
        args.model = args.model or ("gpt2-small" if args.device.startswith("cuda") else "tiny")
        return device_main(args)
    import httpx

    name, url = Path(args.run).resolve().name, f"http://127.0.0.1:{args.port}"
    engine = Engine.from_run(args.run)
    requests = workload(args.requests, args.seed, (16, engine.n_valid))
    out_tokens = sum(o for _, o in requests)
    print(f"{args.run}: {engine.model.num_params() / 1e6:.2f}M parameters; {cpu_model()}, "
          f"torch {torch.__version__}; baselines: {args.threads} thread(s)")  # fmt: skip
    plen, olen = [len(p) for p, _ in requests], [o for _, o in requests]
    print(f"{len(requests)} requests: prompts {statistics.median(plen):.0f} tokens median (max {max(plen)}), "
          f"outputs {statistics.median(olen):.0f} median (max {max(olen)}), {out_tokens:,} output tokens")  # fmt: skip # noqa: E501

    server = subprocess.Popen([sys.executable, "-m", "ember", "serve", args.run, "--port", str(args.port), *args.serve])  # fmt: skip # noqa: E501
    rows, tok_s = [], {}
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        asyncio.run(level(url, name, requests[:4], 4))  # warm-up
        for clients in args.clients:
            before = metrics(url)
            results, wall = asyncio.run(level(url, name, requests, clients))
            after = metrics(url)
            ok = [r for r in results if r["status"] == 200]
            errors = {r["status"] for r in results if r["status"] != 200}
            assert errors <= {429}, f"errors other than 429 at {clients} clients: {errors}"
            assert after["ember_requests_running"] == 0 and after["ember_kv_blocks_in_use"] == 0, (
                "leaked blocks"
            )
            assert sum(r["tokens"] for r in ok) == sum(o for (_, o), r in zip(requests, results, strict=True) if r["status"] == 200)  # fmt: skip # noqa: E501
            used = after["ember_kv_slots_used_total"] - before["ember_kv_slots_used_total"]
            held = after["ember_kv_slots_held_total"] - before["ember_kv_slots_held_total"]
            ttft = [r["ttft"] * 1e3 for r in ok]
            tpot = [r["tpot"] * 1e3 for r in ok if r["tpot"] is not None]
            itl = [x * 1e3 for r in ok for x in r["itl"]]
            tok_s[clients] = sum(r["tokens"] for r in ok) / wall
            rows.append([f"ember serve, {clients} clients",
                         f"{statistics.median(ttft):.0f} / {pct(ttft, 0.99):.0f}", f"{statistics.mean(tpot):.1f}",  # noqa: E501
                         f"{statistics.median(itl):.1f} / {pct(itl, 0.99):.1f}", f"{len(ok) / wall:.2f}",
                         f"{tok_s[clients]:,.0f}", f"{len(results) - len(ok)}", f"{used / max(held, 1):.1%}"])  # fmt: skip # noqa: E501
    finally:
        server.terminate()
        server.wait(30)

    def sequential(generate) -> float:
        start = time.perf_counter()
        for prompt, n_out in requests:
            generate(prompt, n_out)
        return out_tokens / (time.perf_counter() - start)

    def ours(prompt, n_out):
        [c] = engine.generate([prompt], Sampling(n_out, temperature=0, ignore_eos=True))
        assert len(c.token_ids) == n_out

    torch.set_num_threads(args.threads)  # on 2 cores the batch-1 engine is no faster with 2 (RESULTS.md)
    with torch.inference_mode():
        seq = sequential(ours)
        per_s = len(requests) / out_tokens  # requests/s per output token/s
        rows.append(
            ["batch-1 engine, one after another", "", "", "", f"{seq * per_s:.2f}", f"{seq:,.0f}", "0", ""]
        )
        if not args.skip_hf:
            hf = to_hf(engine.model).eval()

            def theirs(prompt, n_out):
                ids = torch.tensor([prompt])
                hf.generate(ids, do_sample=False, max_new_tokens=n_out, min_new_tokens=n_out, pad_token_id=0)

            h = sequential(theirs)
            rows.append(
                ["HF generate, one after another", "", "", "", f"{h * per_s:.2f}", f"{h:,.0f}", "0", ""]
            )
    print_table(["system", "TTFT ms p50 / p99", "TPOT ms", "ITL ms p50 / p99", "req/s", "output tok/s",
                 "errors (429)", "KV used"], rows)  # fmt: skip
    for clients, t in tok_s.items():
        print(f"{clients} clients: {t / seq:.2f}x the sequential engine's output tokens/s")


if __name__ == "__main__":
    main()
