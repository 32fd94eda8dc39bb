"""Continuous batching: requests join and leave the running batch at every step, over the
paged KV cache of ember/infer/paged.py (Yu et al. 2022, Orca; vLLM's scheduler).

    scheduler = Scheduler(Engine.from_run("runs/tiny"), kv_memory=2**26)
    a = scheduler.add(prompt_ids, Sampling(64, temperature=0))
    b = scheduler.add(other_ids, Sampling(32, temperature=0.8, seed=7))
    while not scheduler.idle:
        for request, piece in scheduler.step():      # text released this step
            print(request.id, piece)
    a.completion()                                    # engine.Completion, as Engine.generate's

A step packs into one forward of at most ``max_batch_tokens`` tokens and ``max_seqs`` sequences
every running sequence, oldest first (one token, or the next prompt chunk: chunked prefill, so
a long prompt never stalls the others for more than one step's budget), then waiting requests
first come first served. docs/serve.md ("Continuous batching") has the step at length.

Design choices:

- **Preemption takes the newest running sequence** when a block is needed and none is free: its
  blocks are freed and it is recomputed later from the head of the queue; its sampler keeps its
  state, so a seeded answer continues as if nothing happened. No new request is admitted in a
  step that preempted, and one that could not fit even alone is refused when added, so the
  oldest sequence can always finish.
- **What a request sees does not depend on the others**: its own blocks, its own generator
  (``seed`` + answer index), fp32 logits equal to its own forward (tests/test_scheduler.py:
  greedy answers equal the batch-1 engine's token for token, with and without preemptions and
  prefix-cache hits). Text and stops follow the engine's rules (``engine.Row``). Without
  ``batch_invariant`` a near-tie may flip; with it every product sums in one fixed order
  (ember.kernels.invariant) and attention is the triton cache's, so the logits equal
  ``Engine(batch_invariant=True)``'s bit for bit (tests/test_invariant.py: fp32 under the
  interpreter here, on CUDA where a GPU runs it; docs/serve.md).
- **A model with Mamba layers** keeps each running sequence's recurrent state in a slot of the
  cache's state pools, taken at admission and given back with its blocks; ``max_seqs`` slots,
  since no more sequences run at once (the memory is not taken from ``kv_memory``). Prefix
  caching is off for it (a cached prefix's keys come without the state after them), and its
  ``n`` answers each read the prompt, as separate sequences, instead of forking one.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ember.errors import EmberError
from ember.infer.engine import Completion, Engine, Row, cuda_graph, invariant_mode, sample_next
from ember.infer.paged import (
    PAGED_ATTENTION,
    BlockManager,
    PagedKVCache,
    PagedSequence,
    attention_road,
    blocks_for,
    to_device,
)
from ember.infer.sampling import Sampling
from ember.model.gpt import layer_mixers


def top_logprobs(logp: torch.Tensor, k: int) -> dict[int, float]:
    """{id: log-probability} of the ``k`` likeliest ids of a log-probability row (V,)."""
    values, indices = logp.topk(k)
    return dict(zip(indices.tolist(), values.tolist(), strict=True))


def padded_tokens(n: int) -> int:
    """The tokens a step of ``n`` that is not decode-only is padded to (one CUDA graph a shape):
    a multiple of a quarter of the power of two below ``n``, at least of 16, so past 64 tokens at
    most a quarter of the step is pads, in four shapes a doubling. The power of two above ``n``
    (FlexAttention's buckets) fed 1.43x the tokens of the 64-client level's steps with prompt
    chunks (benchmarks/serve.py's workload), and in fp32 a step's products cost in proportion."""
    quarter = max(16, 1 << max(0, (n - 1).bit_length() - 3))
    return -(-n // quarter) * quarter


def fed_tokens(work: list[tuple[Request, int]]) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
    """The ids a step of ``work`` feeds, joined; each sequence's last one's index among them (S,);
    and where an id drawn by the last step is still on the device (``Scheduler(async_steps=True)``),
    its index among them and in that step's draw, (2, P), or None."""
    ids = [t for r, n in work for t in r.seq.tokens[r.seq.computed : r.seq.computed + n]]
    last = [end - 1 for end in itertools.accumulate(n for _, n in work)]
    drawn = [(at, r.pending) for at, (r, _) in zip(last, work, strict=True) if r.pending is not None]
    return ids, torch.tensor(last), torch.tensor(drawn).t() if drawn else None


def feed_drawn(ids: torch.Tensor, feeds: torch.Tensor | None, drawn: torch.Tensor | None) -> None:
    """Write the ids the last step drew on the device into the row ``ids`` (1, T), in place."""
    if feeds is not None:
        feeds = to_device(feeds, ids.device)
        ids[0, feeds[0]] = drawn[feeds[1]]


class StepGraphs:
    """Steps padded to a few shapes and, on CUDA, replayed from one CUDA graph per shape (gpt-fast,
    vLLM): a step of a small model is mostly kernel launches, which a graph replays at once. A
    decode-only step of S sequences is padded to the next of ``buckets`` (batch sizes); any other
    step (prompt chunks among the decodes) to ``padded_tokens`` of its tokens, and each sequence's
    logits are picked from its last token by index, not by a mask, so the step has no shape that
    depends on the data. Needs the flex or the triton cache: their shapes depend on the bucket
    alone, where the gather's follow the longest sequence. A graph records kernels on a GPU stream
    and replays them on the same buffers, so everything it reads lives in buffers kept per shape
    (ids, the picked positions, and the cache's plan, copied in before each replay); a CPU has no
    such streams, so there the same padded step runs eagerly, which is what tests/test_paged_flex.py
    checks. Capture happens on a shape's first use, after two warm-up forwards of that very batch
    (they rewrite the same keys into the same slots, so they change nothing)."""

    def __init__(
        self, model: torch.nn.Module, cache: PagedKVCache, buckets: tuple[int, ...], capture: bool,
        mode: Callable = contextlib.nullcontext,
    ):
        self.model, self.cache, self.buckets, self.capture = model, cache, sorted(buckets), capture
        self.mode = mode  # what the model runs under (Scheduler's batch_invariant)
        self.static: dict[int, list[torch.Tensor]] = {}  # tokens fed -> rows, ids, picked, the cache's plan
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # tokens fed -> graph, logits
        # one memory pool for every shape's graph (vLLM's): a private pool each would hold its own
        # activations, and the shapes are many (24 up to 2,048 tokens); each replay's logits are copied out
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def shape(self, work: list[tuple[Request, int]]) -> int:
        """The tokens ``work`` is padded to: a decode bucket, or ``padded_tokens`` of its tokens."""
        if all(n == 1 for _, n in work) and len(work) <= self.buckets[-1]:
            return next(b for b in self.buckets if b >= len(work))
        return padded_tokens(sum(n for _, n in work))

    def __call__(self, work: list[tuple[Request, int]], drawn: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (len(work), V) of each sequence's last fed token, from one step padded to ``shape``;
        ``drawn``: the last step's ids on the device, for the sequences whose id is not read yet."""
        L, cache = self.shape(work), self.cache
        K = min(L, cache.rows)  # rows of logits: a sequence has one, and fewer than cache.rows run
        cache.plan([(r.seq, n) for r, n in work], pad_to=L)
        fed, last, feeds = fed_tokens(work)
        ids, picked = torch.zeros(1, L, dtype=torch.long), torch.zeros(K, dtype=torch.long)
        ids[0, : len(fed)] = torch.tensor(fed)
        picked[: len(work)] = last
        device = cache.slots.device
        planned = [to_device(ids, device), to_device(picked, device), *cache.replayed()]
        if L not in self.static:  # the shape's buffers, made once
            self.static[L] = [torch.zeros(K, dtype=torch.long, device=device), *(t.clone() for t in planned)]
        rows, *static = self.static[L]
        for buffer, t in zip(static, planned, strict=True):
            buffer.copy_(t)
        feed_drawn(static[0], feeds, drawn)
        cache.read_from(static[2:])
        cache.extend(L)  # copy-on-writes now: a replay would not see them

        def forward() -> torch.Tensor:
            with self.mode():  # (the model's ops alone: the plan's host work and a replay need none)
                return self.model(static[0], cache=cache, keep=(rows, static[1]))  # (K, V)

        if not self.capture:
            return forward()[: len(work)]
        if L not in self.graphs:
            try:
                self.graphs[L] = cuda_graph(forward, 2, device, self.pool)
            except RuntimeError as e:  # untested on this GPU stack: serve on, padded and eager, and say so
                warnings.warn(f"CUDA graph capture failed, steps run eagerly: {e}", stacklevel=2)
                self.capture = False
                return forward()[: len(work)]
        graph, logits = self.graphs[L]
        graph.replay()
        return logits[: len(work)].clone()  # the buffer is overwritten by the next replay


@dataclass(eq=False)
class Request:
    """One sequence of text to generate; ``row`` holds its text state as the engine's rows do."""

    id: int
    sampling: Sampling
    seq: PagedSequence
    row: Row
    state: str = "waiting"  # waiting | running | finished
    forks: list[Request] = field(default_factory=list)  # answers 2..n, started from this one's prompt
    logprobs_top: int | None = None  # record each sampled token's log-probability and this many alternatives
    logprobs: list[tuple[int, float, dict[int, float]]] = field(default_factory=list)
    job: Any = None  # the server's handle
    read: tuple[int, int] = (0, 0)  # ids and logprobs whose text is read: what its events cover
    pending: int | None = None  # its row in the draw not yet read back (its last token a placeholder)

    @property
    def done(self) -> bool:
        return self.state == "finished"

    def completion(self) -> Completion:
        return self.row.completion()


class Scheduler:
    """Continuous batching of an ``Engine``'s model over a paged KV cache (module docstring).
    The pool holds ``num_blocks`` blocks, or as many as ``kv_memory`` bytes hold."""

    def __init__(
        self,
        engine: Engine,
        kv_memory: int | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_batch_tokens: int = 512,
        max_seqs: int = 64,
        prefix_caching: bool = True,
        paged_attention: str = "auto",
        decode_buckets: tuple[int, ...] | None = None,
        batch_invariant: bool = False,
        async_steps: bool = False,
    ):
        self.recurrent = "mamba" in layer_mixers(engine.model.cfg)  # Mamba layers: state slots (docstring)
        paged_attention = attention_road(paged_attention, engine.device, self.recurrent, batch_invariant)
        if paged_attention not in PAGED_ATTENTION:
            choices = ", ".join(["auto", *PAGED_ATTENTION])
            raise EmberError(f"serve.paged_attention={paged_attention}: choose one of {choices}")
        kind = PAGED_ATTENTION[paged_attention]
        if self.recurrent and kind.graphed:
            raise EmberError(
                f"serve.paged_attention={paged_attention} is for attention-only models: its padded steps "
                "have no place for a Mamba layer's state; serve this model with serve.paged_attention=gather"
            )
        self.mode = contextlib.nullcontext  # what each forward runs under
        if batch_invariant:
            if paged_attention != "triton":
                raise EmberError(
                    f"serve.batch_invariant needs serve.paged_attention=triton, not {paged_attention}: that "
                    "kernel's sums run in one order whatever the batch; gather's and flex's do not"
                )
            self.mode = invariant_mode(engine.model, engine.device)
        if max_batch_tokens < 1 or max_seqs < 1:
            raise EmberError(
                f"serve.max_batch_tokens and serve.max_seqs must be >= 1; got {max_batch_tokens}, {max_seqs}"
            )
        if num_blocks is None:
            dtype = next(engine.model.parameters()).dtype
            num_blocks = blocks_for(kv_memory or 2**26, engine.model.cfg, block_size, dtype)
        self.engine = engine
        prefix_caching &= not self.recurrent  # cached keys come without the Mamba state at their end
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching, max_seqs if self.recurrent else 0)
        self.cache = kind(self.blocks, engine.device, max_seqs=max_seqs, max_len=engine.model.cfg.max_seq_len)
        self.graphs = None  # steps padded to fixed shapes (CUDA graphs on a GPU): flex or triton, bucketed
        if decode_buckets and self.cache.graphed:
            capture = torch.device(engine.device).type == "cuda"
            self.graphs = StepGraphs(engine.model, self.cache, decode_buckets, capture, self.mode)
        self.max_batch_tokens, self.max_seqs = max_batch_tokens, max_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first
        self.unread: list[Request] = []  # took an id in the last step; its text is read in the next (step)
        self.events: list[tuple[Request, str]] = []  # read, not yet returned (a step that fails loses none)
        self.on_read: Callable[[list[tuple[Request, str]]], None] | None = None  # gets them at once instead
        if async_steps and self.recurrent:
            raise EmberError("serve.async_steps is for attention-only models: a Mamba layer's state would "
                             "take a step past a sequence's end; serve this model with serve.async_steps=false")  # fmt: skip # noqa: E501
        self.async_steps = async_steps
        self.inflight: tuple | None = None  # the last draw not read back: answers, ids, host copy, event
        self._ids = itertools.count()
        self.preemptions = self.tokens_generated = 0
        self.slots_used = self.slots_held = 0  # summed over steps: cached tokens, and block slots they own

    def add(
        self, prompt: str | list[int], sampling: Sampling, n: int = 1, logprobs: int | None = None
    ) -> list[Request]:
        """Queue ``n`` answers to one prompt (text or ids); answer i samples with ``seed + i``.
        ``logprobs``: record each token's log-probability and that many likeliest alternatives.
        Raises EmberError for a prompt that cannot fit, as ``Engine.generate`` does."""
        sampling.check_seed(n)
        [(ids, _)] = self.engine._encode([prompt], sampling.max_new_tokens, truncate=False)
        bs = self.blocks.block_size
        need = -(-(len(ids) + sampling.max_new_tokens) // bs) * n  # blocks its answers may come to hold
        if need > self.blocks.num_blocks:
            raise EmberError(
                f"{n} answer(s) to a prompt of {len(ids)} tokens with max_tokens {sampling.max_new_tokens} "
                f"need {need} KV blocks of {bs} tokens; the pool has {self.blocks.num_blocks}: lower n or "
                "max_tokens, or raise serve.kv_memory"
            )
        requests = []
        for i in range(n):
            seq, row = PagedSequence(list(ids)), Row(i, ids, 0, self.engine.generator(sampling, i))
            requests.append(Request(next(self._ids), sampling, seq, row, logprobs_top=logprobs))
        if self.recurrent:  # each reads the prompt itself: a Mamba state is not shared as blocks are
            self.waiting.extend(requests)
        else:
            requests[0].forks = requests[1:]  # they join when the first has read the prompt
            self.waiting.append(requests[0])
        return requests

    def cancel(self, request: Request) -> None:
        """Drop a request wherever it is; its blocks are free at once. Its other answers go on."""
        if request.forks:  # answers still waiting on its prompt: the next one reads it instead
            heir, heir.forks = request.forks[0], request.forks[1:]
            request.forks = []
            self.waiting.appendleft(heir)
        request.pending = None  # an id drawn for it and not read back is dropped
        if request in self.unread:  # its text is read, with no event: the completion holds all its ids
            self.unread.remove(request)
            request.row.release(self.engine.tokenizer, request.sampling.stop, request.sampling.max_new_tokens)
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
            self.blocks.release(request.seq)
        else:  # a fork not started yet
            for parent in [*self.waiting, *self.running]:
                if request in parent.forks:
                    parent.forks.remove(request)
        if request.row.finish_reason is None:
            request.row.finish_reason = "cancelled"
        request.state = "finished"

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.unread or self.events or self.inflight)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.release(request.seq)  # its tokens stay: they are recomputed on readmission
        request.state = "waiting"
        self.waiting.appendleft(request)
        self.preemptions += 1

    def _schedule(self) -> list[tuple[Request, int]]:
        """This step's work, [(request, tokens to feed)], blocks reserved (module docstring)."""
        budget, work, preempted = self.max_batch_tokens, [], False
        for request in list(self.running):
            if request.state != "running" or budget == 0 or self._last(request):
                continue  # preempted in this loop, no budget left (it waits a step), or ending
            seq = request.seq
            n = min(len(seq.tokens) - seq.computed, budget)
            while request.state == "running" and self.blocks.blocks_needed(seq, n) > self.blocks.num_free:
                self._preempt(self.running[-1])  # the newest, maybe this one
                preempted = True
            if request.state == "running":
                self.blocks.reserve(seq, n)
                work.append((request, n))
                budget -= n
        while self.waiting and budget and len(self.running) < self.max_seqs and not preempted:
            request = self.waiting[0]
            seq = request.seq
            self.blocks.admit(seq)
            n = min(len(seq.tokens) - seq.computed, budget)
            if self.blocks.blocks_needed(seq, n) > self.blocks.num_free:
                self.blocks.release(seq)  # no room yet: it stays first in line
                break
            self.blocks.reserve(seq, n)
            self.waiting.popleft()
            request.state = "running"
            self.running.append(request)
            work.append((request, n))
            budget -= n
        return work

    @torch.inference_mode()
    def step(self) -> list[tuple[Request, str]]:
        """One forward over the scheduled tokens; [(request, text piece)] for every request
        whose text grew (a finished request appears once more with "" if it released none).

        A request without stop strings has its text read one step late: its ids alone decide
        its end (an end id, or max_tokens), so its sampled id is fed and its blocks are freed at
        once, while the decoding of its text and its event wait for the next step, where they
        run after that step's forward is launched and before its logits are read back. On a GPU
        that host work then overlaps the device's (vLLM's async output processing); on a CPU the
        forward has already run by then. A request with stop strings reads its text at once,
        since the text may end it. Those events come one step late, unless ``on_read`` takes
        them as soon as they are read (the server's loop does).

        With ``async_steps`` the ids themselves are read back one step late: this step is
        scheduled, planned and launched while the last one runs, its row taking the last draw's
        ids on the device (docs/serve.md, "Async steps")."""
        work = self._schedule()
        drawn = self.inflight[1] if self.inflight else None  # (on the device)
        logits = (self.graphs or self._forward)(work, drawn) if work else None  # (len(work), V)
        read = self._read(self.unread)  # the last step's text, while the device runs this one
        self.unread = []
        if self.on_read and read:
            self.on_read(read)
        else:
            self.events += read
        if self.inflight:  # async_steps: the last step's ids, read back while this step runs
            self._take_drawn()
        if logits is not None:
            answers = self._answers(work, logits.float())
            if answers:
                self.inflight = answers, *self._copied(self._draw(answers))
                for i, (request, _) in enumerate(answers):  # a placeholder: its id is on the device till read
                    request.pending = i
                    request.seq.tokens.append(-1)
                if not self.async_steps:
                    self._take_drawn()
            for request in self.running:  # KV memory written by tokens, against the blocks the sequences hold
                self.slots_used += request.seq.computed
                self.slots_held += len(request.seq.table) * self.blocks.block_size
        events, self.events = self.events, []
        return events

    def _answers(self, work: list[tuple[Request, int]], logits: torch.Tensor) -> list[tuple[Request, Tensor]]:
        """Commit the step's work; (request, its logits row (V,)) of every sequence that draws an id
        now (its prompt read, its n answers forked off it), but those that ended since."""
        if self.engine.n_valid < logits.size(-1):
            logits[:, self.engine.n_valid :] = float("-inf")
        answers = []
        for (request, n), row_logits in zip(work, logits, strict=True):
            if request.row.finish_reason is not None:
                continue  # ended by the id read back after this step began (async_steps), or cancelled
            seq = request.seq
            self.blocks.commit(seq, n)
            if seq.computed < len(seq.tokens):
                continue  # a prompt chunk: nothing to sample yet
            for fork in request.forks:  # n answers: the others share the prompt's blocks from here
                fork.seq, fork.state = self.blocks.fork(seq), "running"
                self.running.append(fork)
            answers += [(answer, row_logits) for answer in [request, *request.forks]]
            request.forks = []
        return answers

    def _take_drawn(self) -> None:
        """Read back the ids drawn last (one sync with the device) and take them; the text of
        those with stop strings is read at once, the others' in the next step."""
        (answers, _, host, copied), self.inflight = self.inflight, None
        if copied is not None:
            copied.synchronize()  # the copy alone: a .tolist() would wait for the step launched since
        taken = []
        for (request, row_logits), token in zip(answers, host.tolist(), strict=True):
            if request.pending is None:
                continue  # cancelled while its id was on the device
            self._take(request, row_logits, token)
            taken.append(request)
        self.events += self._read([request for request in taken if request.sampling.stop])
        self.unread = [request for request in taken if not request.sampling.stop]

    def _forward(self, work: list[tuple[Request, int]], drawn: Tensor | None = None) -> Tensor:
        """Logits (len(work), V) of each sequence's last fed token, from one packed forward."""
        self.cache.plan([(r.seq, n) for r, n in work])
        ids, last, feeds = fed_tokens(work)
        device = self.engine.device
        ids, last = to_device(torch.tensor([ids]), device), to_device(last, device)
        feed_drawn(ids, feeds, drawn)
        keep = (torch.zeros_like(last), last)  # each sequence's last fed token (indices: a bool mask syncs)
        with self.mode():
            return self.engine.model(ids, cache=self.cache, keep=keep)

    @staticmethod
    def _copied(drawn: Tensor) -> tuple[Tensor, Tensor, torch.cuda.Event | None]:
        """``drawn``, a copy of it on the way to pinned host memory, and the event that marks the
        copy done (None off CUDA, where ``drawn`` is the host's already): reading it back then
        waits for the draw, not for the next step's forward queued behind it (vLLM's)."""
        if drawn.device.type != "cuda":
            return drawn, drawn, None
        host = torch.empty(drawn.shape, dtype=drawn.dtype, pin_memory=True)
        host.copy_(drawn, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return drawn, host, copied

    def _last(self, request: Request) -> bool:
        """Whether the id drawn for ``request`` and not read back yet ends it, whatever it is
        (its max_tokens'th): then it is not fed again."""
        return request.pending is not None and len(request.row.ids) + 1 >= request.sampling.max_new_tokens

    @staticmethod
    def _draw(answers: list[tuple[Request, Tensor]]) -> Tensor:
        """Each sequence's next id, on the device (len(answers),): one ``sample_next`` per group of
        equal sampling settings, each row with its own generator, so that an id does not depend
        on who else runs."""
        groups: dict[tuple, list[int]] = {}
        for i, (request, _) in enumerate(answers):
            s = request.sampling
            groups.setdefault((s.temperature, s.top_k or None, s.top_p), []).append(i)
        drawn = None
        for (temperature, top_k, top_p), members in groups.items():
            logits = torch.stack([answers[i][1] for i in members])
            generators = [answers[i][0].row.generator for i in members]
            ids = sample_next(logits, temperature, top_k, top_p, generators)
            if len(members) == len(answers):
                return ids
            if drawn is None:
                drawn = ids.new_empty(len(answers))
            drawn[to_device(torch.tensor(members), ids.device)] = ids
        return drawn

    def _take(self, request: Request, logits: torch.Tensor, token: int) -> None:
        """Append ``token``, drawn from ``request``'s logits (V,); free its blocks if its ids end it."""
        s, row = request.sampling, request.row
        if request.logprobs_top is not None:  # the model's distribution, before temperature and filters
            logp = logits.log_softmax(-1)
            request.logprobs.append((token, logp[token].item(), top_logprobs(logp, request.logprobs_top)))
        row.take(token, self.engine.ends(s.ignore_eos), s.stop, s.max_new_tokens)
        self.tokens_generated += 1
        request.seq.tokens[-1], request.pending = token, None  # in the placeholder's stead
        if row.finish_reason is not None:
            self._retire(request)

    def _read(self, requests: list[Request]) -> list[tuple[Request, str]]:
        """Each request's text after its last ``_take``: its event, if any; a stop string ends it."""
        events = []
        for request in requests:
            s = request.sampling
            piece = request.row.release(self.engine.tokenizer, s.stop, s.max_new_tokens)
            request.read = (len(request.row.ids), len(request.logprobs))
            if request.row.finish_reason is not None:
                self._retire(request)  # (ended by its text, or retired already: by its ids)
                request.state = "finished"
            if piece or request.done:
                events.append((request, piece))
        return events

    def _retire(self, request: Request) -> None:
        """An ended request leaves the queues, its blocks free (a second call changes nothing)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:  # preempted while its last id was on the device (async_steps)
            self.waiting.remove(request)
        self.blocks.release(request.seq)

    def run(self) -> None:
        """Step until every queued request has finished."""
        while not self.idle:
            self.step()
