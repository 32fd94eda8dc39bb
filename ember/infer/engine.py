"""Text generation: a preallocated KV cache, sampling, batched and streaming decoding.

    engine = Engine.from_run("runs/tiny")                      # or Engine(model, tokenizer)
    [c] = engine.generate(["def main("], Sampling(max_new_tokens=64, temperature=0.8, top_k=50))
    print(c.text, c.finish_reason)                             # finish_reason: eos | stop | length
    for row, piece in engine.stream(["Once", "In the"], Sampling(64, stop=["\\n\\n"])):
        print(row, piece, end="", flush=True)

The model is touched only through ``model(idx, cache=cache)`` (the ``KVCache`` protocol of
ember/model/gpt.py); hand-written because the cache is what ember studies (DESIGN). ``KVCache``
is the eager one; ``StaticKVCache`` lets ``Engine(..., compile=True)`` run the decode step as one
``torch.compile(fullgraph=True)`` graph, and ``Engine(..., graphs=True)`` replays that step from a
CUDA graph (``GraphedDecode``; benchmarks/decode.py times all three). docs/serve.md ("The
engine") has the cache contract and each choice below at length.

Design choices:

- **Ragged batches are left-padded, and the cache hides the pads** (positions restart at a row's
  first real token; a mask keeps queries off pads), so a row's logits equal those of a forward
  over it alone (tested to 1e-5, as HF ``generate`` with left padding). Cost: the prefill runs
  the longest prompt's length for every row.
- **A repeated prompt is prefilled once** (GRPO's group, ``n > 1``), then copied to its rows.
- **A finished row keeps its slot** (as nanochat): compacting would copy the cache on every
  finish; continuous batching over a paged cache is scheduler.py's job.
- **Each row samples from its own generator**, seeded ``seed + row``: in fp32 a completion does
  not depend on the other prompts in the call (in bf16 the padded batch rounds differently).
- **Sampling filters in HF's order**: temperature, top-k, then top-p; ``temperature=0`` is
  greedy; ids beyond the tokenizer's (the vocab is padded to a multiple of 64) are never sampled.
- **Streaming text is the suffix of a full decode**, holding back a trailing U+FFFD and any tail
  that could start a stop string, so emitted text is never taken back. ``<|eos|>``,
  ``<|end_turn|>`` (ember/data/chat.py) and stop strings end a row and never appear in the text.
- The prompt is encoded as given, with no ``<|bos|>``: the trainer's stream has none.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from ember.data.chat import END_TURN
from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.infer.sampling import Sampling
from ember.model.gpt import layer_mixers, sdpa_attention
from ember.run import load_run


def distinct_left_padded(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | None
) -> tuple[Tensor, list[int], list[int]]:
    """The distinct id sequences among ``rows`` (first seen first), left-padded with ``pad_id``
    into one (distinct, width) tensor; the pad count of each; and each row's index into them.
    The engine prefills a repeated prompt once with it, GRPO's update a group's prompt."""
    distinct: dict[tuple[int, ...], int] = {}
    inverse = [distinct.setdefault(tuple(row), len(distinct)) for row in rows]
    width = max(map(len, distinct))
    pad = [width - len(p) for p in distinct]
    ids = torch.tensor([[pad_id] * n + list(p) for n, p in zip(pad, distinct, strict=True)], device=device)
    return ids, pad, inverse


def visible(slots: Tensor, pad: Tensor, n_keys: int) -> Tensor:
    """(B, 1, T, n_keys) bool, True where the query in slot ``slots[t]`` may read a key slot:
    the row's real keys (not among its ``pad[b]`` leading pads) up to itself. A pad query
    reads only itself, so no softmax row is empty; slots not yet written lie after every query."""
    key = torch.arange(n_keys, device=slots.device)  # (S,)
    query = slots[:, None]  # (T, 1)
    real = key >= pad[:, None, None]  # (B, 1, S)
    return ((key <= query) & real | (key == query))[:, None]


class KVCache:
    """Keys and values of every attention layer, up to ``max_len`` slots per row, attended with
    SDPA over the slots held; ``pad``: each row's left-pad slots (module docstring). A layer's
    buffers, (B, n_kv_head, max_len, head_dim), are allocated on its first ``attend`` in the
    dtype and device of the keys it receives (a tensor-parallel shard, a wrapped or quantized
    ``wk``, autocast need no special case) and never grow. ``device`` is where positions are made.
    """

    def __init__(self, max_len: int, pad: Sequence[int] | None = None, device: torch.device | None = None):
        self.max_len, self.device = max_len, device
        self.k: dict[str, Tensor] = {}  # layer -> (B, n_kv_head, max_len, head_dim)
        self.v: dict[str, Tensor] = {}
        self.states: dict[str, tuple[Tensor, ...]] = {}  # Mamba layer -> its recurrent state, (B, ...) each
        self.pos = 0  # slots held in every row
        self.held = 0  # slots attention reads
        self.pad: Tensor | None = None  # (B,) left-pad slots per row, None when there are none
        if pad is not None and any(pad):
            if min(pad) < 0 or max(pad) >= max_len:
                raise ValueError(f"pad {list(pad)} does not fit rows of {max_len} slots")
            self.pad = torch.tensor(list(pad), device=device)

    def extend(self, T: int) -> Tensor:
        if self.pos + T > self.max_len:  # the engine sizes the cache; reaching here is a bug
            raise IndexError(f"KV cache of {self.max_len} slots cannot take {self.pos} + {T}")
        self.slots = torch.arange(self.pos, self.pos + T, device=self.device)  # (T,)
        self.pos = self.held = self.pos + T
        if self.pad is None:
            self.mask = None  # sdpa_attention's causal mask
            return self.slots
        self.mask = visible(self.slots, self.pad, self.held)  # (B, 1, T, held)
        return (self.slots - self.pad[:, None]).clamp(min=0)  # (B, T); pads sit at 0

    def select(self, rows: Tensor) -> None:
        """Keep rows ``rows`` (indices, repeats allowed) of every buffer: the engine prefills a
        repeated prompt once and copies its row out with this."""
        for buffers in (self.k, self.v):
            for layer, buffer in buffers.items():
                buffers[layer] = buffer.index_select(0, rows)
        for layer, state in self.states.items():
            self.states[layer] = tuple(t.index_select(0, rows) for t in state)
        if self.pad is not None and self.pad.size(0) > 1:  # StaticKVCache's (1,) zeros broadcast
            self.pad = self.pad[rows]

    def recur(self, layer: str, x: Tensor, mix: Callable) -> Tensor:
        """A Mamba layer's ``mix`` over the batch from its state (None before its first call), with
        the new tokens' left pads, (B, T) bool (None when there are none): the layer zeroes its pads'
        inputs, so a row's state is the state of its real tokens alone (ember/model/mamba.py)."""
        pads = None if self.pad is None else self.slots[None, :] < self.pad[:, None]  # (B, T)
        y, self.states[layer] = mix(x, self.states.get(layer), pads)
        return y

    def attend(self, layer: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if layer not in self.k:
            self.k[layer] = k.new_zeros(k.size(0), k.size(1), self.max_len, k.size(3))
            self.v[layer] = v.new_zeros(v.size(0), v.size(1), self.max_len, v.size(3))
        keys = self.k[layer].index_copy_(2, self.slots, k)[:, :, : self.held]  # (B, n_kv_head, held, hd)
        values = self.v[layer].index_copy_(2, self.slots, v)[:, :, : self.held]
        return sdpa_attention(q, keys, values, 0.0, self.mask)  # (B, n_head, T, hd)


class StaticKVCache(KVCache):
    """A ``KVCache`` whose step has no Python-side state: the position is a tensor and
    attention reads all ``max_len`` slots under a mask (slots not yet written are hidden),
    so every decode step has the same shapes and ``torch.compile(model, fullgraph=True)``
    traces it once (gpt-fast's static cache). The buffers are allocated by the first,
    eager forward (the prefill). Nothing checks for overflow: size it for the whole call.
    Cost: each step attends over ``max_len`` keys, however few are held. (On the CPU an opaque
    custom op running SDPA over the held slots only was measured too: no faster, the op's own
    overhead eats the saving.)"""

    def __init__(self, max_len: int, pad: Sequence[int] | None = None, device: torch.device | None = None):
        super().__init__(max_len, pad, device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)  # a tensor: no Python int to guard on
        self.held = max_len
        if self.pad is None:
            self.pad = torch.zeros(1, dtype=torch.long, device=device)  # one row of 0 pads broadcasts

    def extend(self, T: int) -> Tensor:
        self.slots = self.pos + torch.arange(T, device=self.device)  # (T,)
        self.pos += T
        self.mask = visible(self.slots, self.pad, self.held)  # (B or 1, 1, T, max_len)
        return (self.slots - self.pad[:, None]).clamp(min=0)  # (B or 1, T)


class InvariantKVCache(StaticKVCache):
    """A ``StaticKVCache`` attended by the serving cache's paged kernel (ember.kernels.paged), each
    row one sequence whose table lists its own slots in order, so a token's attention sums in the
    order a served token's does: ``Engine(batch_invariant=True)``, the batch-1 reference that
    ``serve.batch_invariant``'s completions equal bit for bit. A layer's keys lie as the pool's
    do, (rows · max_len + 1, n_kv_head, head_dim): row b's position j at slot b · max_len + j, a
    left pad's at the last slot, which nothing reads. ``max_len`` is rounded up to whole blocks."""

    BLOCK = 16  # positions a table entry covers (any size would do: the order is the kernel's)

    def __init__(self, max_len: int, pad: Sequence[int] | None = None, device: torch.device | None = None):
        super().__init__(-(-max_len // self.BLOCK) * self.BLOCK, pad, device)
        self.plans: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # (rows, T) -> tables, tiles

    def extend(self, T: int) -> Tensor:
        self.slots = self.pos + torch.arange(T, device=self.device)  # (T,)
        self.pos += T
        self.positions = (self.slots - self.pad[:, None]).clamp(min=0)  # (B or 1, T); pads at 0
        self.step = None  # the forward's write slots and kernel inputs, made by its first layer
        return self.positions

    def select(self, rows: Tensor) -> None:
        L = self.max_len
        for buffers in (self.k, self.v):
            for layer, pool in buffers.items():
                kept = pool[:-1].view(-1, L, *pool.shape[1:]).index_select(0, rows).flatten(0, 1)
                buffers[layer] = torch.cat([kept, pool[-1:]])
        if self.pad.size(0) > 1:
            self.pad = self.pad[rows]

    def plan(self, B: int, T: int) -> tuple[Tensor, Tensor]:
        """The tables (B, max_len / BLOCK) and the kernel's tiles of B rows of T new tokens, made
        once per shape (the eager steps before a CUDA graph's capture make the decode step's)."""
        if (B, T) not in self.plans:
            from ember.kernels.paged import BLOCK_M, tiles_for

            tables = torch.arange(B * self.max_len // self.BLOCK, dtype=torch.int32).view(B, -1)
            tiles = tiles_for([T] * B, B * -(-T // BLOCK_M))
            self.plans[B, T] = tables.to(self.device), tiles.to(self.device)
        return self.plans[B, T]

    def attend(self, layer: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        from ember.kernels.paged import paged_attention

        (B, H, T, hd), L = q.shape, self.max_len
        if layer not in self.k:
            self.k[layer] = k.new_zeros(B * L + 1, k.size(1), hd)
            self.v[layer] = v.new_zeros(B * L + 1, v.size(1), hd)
        if self.step is None:  # once a forward, not a layer
            real = self.slots >= self.pad[:, None]  # (B or 1, T)
            first = torch.arange(B, device=q.device)[:, None] * L  # each row's slot 0
            at = torch.where(real, first + self.positions, B * L).flatten()
            self.step = (at, self.positions.expand(B, T).reshape(-1), *self.plan(B, T))
        at, q_pos, tables, tiles = self.step
        keys = self.k[layer].index_copy_(0, at, k.transpose(1, 2).reshape(B * T, -1, hd))
        values = self.v[layer].index_copy_(0, at, v.transpose(1, 2).reshape(B * T, -1, hd))
        q = q.transpose(1, 2).reshape(B * T, H, hd)
        out = paged_attention(q, keys, values, tables, q_pos, tiles, self.BLOCK)
        return out.view(B, T, H, hd).transpose(1, 2)  # (B, n_head, T, hd)


def invariant_mode(model: nn.Module, device: torch.device, compile: bool = False, kernels: str = "torch"):
    """``ember.kernels.invariant.batch_invariant``, the mode a batch-invariant engine or scheduler
    runs each forward under, once ``model`` and ``device`` are known to run it; else an EmberError."""
    from ember.kernels import triton_ready
    from ember.model.quant import QuantLinear

    if compile or kernels != "torch":
        raise EmberError(
            "batch-invariant decoding runs its own products and attention in eager steps (replayed from "
            "CUDA graphs with --graphs): drop compile and kernels=triton"
        )
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise EmberError(
            "batch-invariant decoding needs float weights: a quantized linear picks its kernel by the "
            "rows it is given (ember/model/quant.py); serve the unquantized run, or without batch invariance"
        )
    ok, why = triton_ready(device)
    if not ok:
        raise EmberError(f"batch-invariant decoding runs ember's Triton kernels: {why}")
    from ember.kernels.invariant import batch_invariant

    return batch_invariant


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """logits (B, V) with everything outside the top-k, then outside the nucleus, set to -inf."""
    if top_k and top_k < logits.size(-1):
        kept = logits.topk(top_k, dim=-1).indices  # (B, top_k)
        mask = torch.ones_like(logits, dtype=torch.bool).scatter_(-1, kept, False)
        logits = logits.masked_fill(mask, float("-inf"))
    if top_p is not None and top_p < 1:
        # Holtzman et al. 2020: the smallest set of most likely tokens whose mass reaches top_p.
        probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)  # (B, V)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens; 0 for the first
        drop_sorted = before >= top_p
        mask = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(mask, float("-inf"))
    return logits


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
) -> Tensor:
    """logits (B, V) -> next ids (B,): argmax when ``temperature == 0``, else a draw from
    softmax(filter_logits(logits / temperature)) using ``generator``, or one generator per row
    (a list), so that a row draws the same id alone or in any batch. Arguments as checked by
    ``Sampling``.

    The draw is by inverse CDF: one uniform ``u`` per row, and the first id whose cumulative
    probability exceeds ``u`` times the row's total. One batched search instead of a
    ``torch.multinomial`` per row, which was 55% of a 256-row GRPO rollout on the 2-core CPU."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(dim=-1)  # (B, V)
    if isinstance(generator, Sequence):
        u = torch.cat([torch.rand(1, generator=g, device=probs.device) for g in generator])  # (B,)
    else:
        u = torch.rand(probs.size(0), generator=generator, device=probs.device)
    cdf = probs.cumsum(dim=-1)  # (B, V)
    target = u[:, None] * cdf[:, -1:]  # below the total: some id's cdf exceeds it
    return (cdf <= target).sum(dim=-1).clamp(max=probs.size(-1) - 1)  # zero-probability ids are never drawn


@dataclass
class Completion:
    """One prompt's result."""

    text: str  # generated text, without <|eos|> and without the stop string
    token_ids: list[int]  # generated ids (up to and including the one that completed a stop string)
    finish_reason: str  # "eos", "stop" or "length"
    prompt_tokens: int  # prompt tokens the model saw
    dropped_tokens: int = 0  # prompt tokens cut from the front by truncate=True
    end_id: int | None = None  # the <|eos|> or <|end_turn|> id that ended it (finish_reason "eos")


@dataclass
class Row:
    """The text state of one prompt: ids so far, what has been emitted, why it ended."""

    row: int
    prompt: list[int]
    dropped: int
    generator: torch.Generator | None
    ids: list[int] = field(default_factory=list)
    text: str = ""  # emitted so far
    finish_reason: str | None = None
    end_id: int | None = None
    # the incremental decoder's state (``decoded``): the text of ids[:read], the ids the next
    # window starts from, and that window's head, the text of ids[start:read] read alone
    stable: str = field(default="", repr=False)
    start: int = field(default=0, repr=False)
    read: int = field(default=0, repr=False)
    head: str = field(default="", repr=False)

    def completion(self) -> Completion:
        assert self.finish_reason is not None
        return Completion(
            self.text, self.ids, self.finish_reason, len(self.prompt), self.dropped, self.end_id
        )

    def decoded(self, tokenizer: Tokenizer) -> str:
        """``tokenizer.decode(self.ids)``, reading only the ids since the last clean cut: the
        window from ``start`` is decoded and its head, the text of the ids before ``read`` read
        alone, is cut off (vLLM's incremental detokenizer). The head gives the new ids the
        context that a decoder's rules need (a SentencePiece decoder strips the first token's
        space); a cut is made only where the text ends in a whole character, never inside a
        multi-byte one that decodes to U+FFFD until its last byte arrives. A window whose text
        does not begin with its head takes the whole decode instead: a byte-fallback decoder
        turns a run of byte tokens that is not UTF-8 into one U+FFFD each, earlier bytes
        included. Decoding every id at every token cost O(n) a token: 219 µs at 2,048 ids on
        the 2-core CPU, against ~4 µs for a window."""
        window = tokenizer.decode(self.ids[self.start :])
        if window.startswith(self.head):
            full = self.stable + window[len(self.head) :]
        else:
            full = tokenizer.decode(self.ids)
        if full != self.stable and not full.endswith("\ufffd"):  # a clean cut: move the window on
            self.stable, self.start, self.read = full, self.read, len(self.ids)
            self.head = tokenizer.decode(self.ids[self.start : self.read])
        return full

    def push(self, token: int, tokenizer: Tokenizer, ends: set[int], stop: Sequence[str], max_new: int, lazy: bool = False) -> str:  # fmt: skip # noqa: E501
        """Take the next sampled id; return the text it releases ("" when none yet, or the row
        has already ended), setting ``finish_reason`` when the row ends. ``lazy`` (no stop
        strings, nobody streaming): decode once, when the row ends, not at every token."""
        if self.finish_reason is not None:
            return ""
        self.take(token, ends, stop, max_new)
        if lazy and not stop and self.finish_reason is None:
            return ""
        return self.release(tokenizer, stop, max_new)

    def take(self, token: int, ends: set[int], stop: Sequence[str], max_new: int) -> None:
        """``push``'s share that needs no text: the id, and the ends that ids decide (an end id;
        ``max_new`` ids when there are no stop strings: with them a stop string completed by
        the last id outranks the length, so ``release`` decides)."""
        if token in ends:
            self.finish_reason, self.end_id = "eos", token
        else:
            self.ids.append(token)
            if not stop and len(self.ids) == max_new:
                self.finish_reason = "length"

    def release(self, tokenizer: Tokenizer, stop: Sequence[str], max_new: int) -> str:
        """``push``'s share that reads the text, after ``take``: the piece the ids so far release,
        ending the row at a stop string (or, with stop strings, at ``max_new`` ids)."""
        full = self.decoded(tokenizer)
        if self.finish_reason is None:
            # a stop string first seen now ends in the unseen text: earlier steps searched the rest
            seen = len(self.text)
            hits = [i for i in (full.find(s, max(0, seen - len(s) + 1)) for s in stop) if i >= 0]
            if hits:
                self.finish_reason = "stop"
                full = full[: max(min(hits), seen)]  # emitted text is never taken back
            elif len(self.ids) == max_new:
                self.finish_reason = "length"
        end = len(full) if self.finish_reason else len(full) - _held_back(full, stop)
        piece = full[len(self.text) : end] if end > len(self.text) else ""
        self.text += piece
        return piece


class _Stream:
    """The rows of one call, left-padded to the longest prompt, sharing one KV cache and
    decoding in lockstep."""

    def __init__(self, engine: Engine, rows: list[Row], max_new_tokens: int) -> None:
        self.engine, self.rows = engine, rows
        pad_id = getattr(engine.tokenizer, "pad_id", 0)  # any id would do: the mask hides pad slots
        prompts = [r.prompt for r in rows]  # next_input: (distinct prompts, width)
        self.next_input, pad, inverse = distinct_left_padded(prompts, pad_id, engine.device)
        self.inverse = torch.tensor(inverse, device=engine.device) if len(pad) < len(rows) else None
        # The last sampled token is never fed back, hence the - 1.
        slots = engine.cache_slots(self.next_input.size(1) + max_new_tokens - 1)
        self.cache = engine.cache_type(slots, pad, engine.device)
        self.left = max_new_tokens  # forwards still allowed: each samples one more token per row

    @property
    def done(self) -> bool:
        return all(r.finish_reason is not None for r in self.rows)

    @torch.inference_mode()
    def step(self, temperature: float, top_k: int | None, top_p: float | None, k: int = 1) -> list[list[int]]:
        """Up to ``k`` forwards (the prefill on the first call), each sampling one id per row and
        feeding it to the next on the device; the ids are read back once, (rows, k'): in between
        the host queues work without waiting for the device."""
        model = self.engine.model
        was_training = model.training  # eval() walks every module: toggle only when needed
        if was_training:
            model.eval()
        drawn = []
        try:
            for _ in range(min(k, self.left)):
                forward = self.engine.decode if self.cache.k or self.cache.states else model  # prefill: eager
                with self.engine.mode():
                    logits = forward(self.next_input, cache=self.cache)[:, -1]  # (B, V)
                if self.inverse is not None:  # after the prefill of the distinct prompts: one row each
                    logits = logits[self.inverse]
                    self.cache.select(self.inverse)
                    self.inverse = None
                if self.engine.n_valid < logits.size(-1):  # ids beyond the tokenizer's vocabulary
                    logits[:, self.engine.n_valid :] = float("-inf")
                next_ids = sample_next(logits, temperature, top_k, top_p, [r.generator for r in self.rows])
                self.next_input = next_ids[:, None]  # (B, 1)
                drawn.append(next_ids)
                self.left -= 1
        finally:
            if was_training:
                model.train()
        return torch.stack(drawn, 1).tolist()


def _held_back(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters may still change or turn into a stop string."""
    n = len(text) - len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character decodes to U+FFFD
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n


def _compiled_step(model: nn.Module, options: dict | None = None) -> Callable[..., Tensor]:
    """``model(idx, cache=cache)`` under ``torch.compile(fullgraph=True)``, without the guards on
    the model. Dynamo checks ~1,600 of them per call (every module attribute and parameter):
    0.3–0.5 ms of a 3 ms gpt2-mini int8 step on the 2-core CPU, against 0.07 ms for the guards
    on the step's inputs (the token ids, the cache's buffers, pads and position), which stay.
    Safe because the step is a function of its own, with a code object of its own (dynamo keeps
    compiled graphs per code object), bound to this one model, whose structure, dtype and
    device the engine does not change; weights updated in place are read at each call."""

    def step(idx: Tensor, cache: KVCache) -> Tensor:
        return model(idx, cache=cache)

    step.__code__ = step.__code__.replace()  # a copy: no other engine's graphs live on it

    def inputs_only(guards: list) -> list[bool]:
        return [not (g.name == "model" or g.name.startswith(("model.", "model["))) for g in guards]

    return torch.compile(step, fullgraph=True, options={"guard_filter_fn": inputs_only, **(options or {})})


# Engine(compile_options=TUNED): the weights become constants (inductor's freezing: folded, and the
# q, k, v products of one input fused into one), each GEMM's kernel is picked by timing, and the
# fused kernels' launch settings are tuned (gpt-fast's coordinate descent). A step then reads
# weights as they were when it compiled: no training-time rollouts.
TUNED = {"freezing": True, "max_autotune": True, "coordinate_descent_tuning": True}
LOOKAHEAD = 8  # Engine.lookahead on CUDA
GRAPH_SLOTS = 128  # graphed caches round up to a multiple of this: one graph serves many lengths
GRAPH_WARMUP = 3  # eager steps before a capture (PyTorch's CUDA graphs notes: allocator, cuBLAS, autotuning)


def cuda_graph(
    fn: Callable[[], Tensor], warmup: int, device=None, pool=None
) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """``fn`` run ``warmup`` times on a side stream (it compiles, autotunes and fills the caching
    allocator there), then captured in a CUDA graph: the graph and the output tensor its replays
    write. Every tensor ``fn`` reads must stay at its address for the replays. ``pool``: a memory
    pool shared with other graphs, for graphs never replayed at once whose outputs are kept
    alive (so no later capture takes their memory) and copied out after each replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


@dataclass
class _Graphed:
    """One batch size and cache length: the static cache, input ids and logits a CUDA graph
    replays on (``graph`` None off CUDA), and the stream's cache that holds them now."""

    cache: StaticKVCache
    idx: Tensor  # (B, 1)
    logits: Tensor | None = None  # (B, 1, V), written by each replay
    graph: torch.cuda.CUDAGraph | None = None
    owner: weakref.ref | None = None


class GraphedDecode:
    """The one-token decode ``step(idx, cache=StaticKVCache)`` captured once per (batch size,
    cache length) in a CUDA graph and replayed per token (gpt-fast, SGLang): one launch instead of
    ~10 kernels per layer, each costing more host time than a batch-1 GEMV takes on the GPU.

    A graph replays fixed addresses, so it owns its inputs: a static cache and ids. A stream's
    ``StaticKVCache`` is *bound* on its first decode step: its buffers, position and pads are
    copied in and the stream's cache then points at the graph's tensors. A stream bound while
    another still lives takes the slot over: the other gets private copies back (``evict``) and is
    copied in again if it steps again. Off CUDA there are no graphs and the step runs eagerly (or
    compiled) on the same static cache, through the same binding: the CPU tests check that path."""

    def __init__(self, step: Callable[..., Tensor]):
        self.step = step
        self.graphed: dict[tuple[int, int], _Graphed] = {}

    def __call__(self, idx: Tensor, cache: KVCache) -> Tensor:
        if not isinstance(cache, StaticKVCache):
            raise TypeError("GraphedDecode needs a StaticKVCache: its step must have no Python-side state")
        g = self.graphed.get((idx.size(0), cache.max_len)) or self.capture(idx, cache)
        owner = g.owner() if g.owner else None
        if owner is not cache:
            if owner is not None:
                self.evict(owner)
            self.bind(g, cache)
        g.idx.copy_(idx)
        if g.graph is None:
            return self.step(g.idx, g.cache)
        g.graph.replay()
        return g.logits

    def capture(self, idx: Tensor, cache: StaticKVCache) -> _Graphed:
        B = idx.size(0)
        static = type(cache)(cache.max_len, device=cache.device)
        static.pad = torch.zeros(B, dtype=torch.long, device=cache.device)  # (B,): any stream's pads fit
        static.k = {layer: torch.zeros_like(t) for layer, t in cache.k.items()}
        static.v = {layer: torch.zeros_like(t) for layer, t in cache.v.items()}
        g = self.graphed[B, cache.max_len] = _Graphed(static, torch.zeros_like(idx))
        if idx.is_cuda:  # CUDA-only: a graph records kernel launches on a CUDA stream; a CPU has neither
            # warm-up from slot 0 (bind overwrites all); the capture runs nothing: pos is not advanced
            step = lambda: self.step(g.idx, static)  # noqa: E731
            g.graph, g.logits = cuda_graph(step, min(GRAPH_WARMUP, cache.max_len), idx.device)
        return g

    @staticmethod
    def bind(g: _Graphed, cache: StaticKVCache) -> None:
        static = g.cache
        for mine, theirs in ((static.k, cache.k), (static.v, cache.v)):
            for layer, buffer in mine.items():
                buffer.copy_(theirs[layer])
        static.pos.copy_(cache.pos)
        static.pad.copy_(cache.pad)  # (1,) zeros when the stream has no pads: broadcast
        cache.k, cache.v, cache.pos, cache.pad = dict(static.k), dict(static.v), static.pos, static.pad
        g.owner = weakref.ref(cache)

    @staticmethod
    def evict(cache: StaticKVCache) -> None:
        cache.k = {layer: t.clone() for layer, t in cache.k.items()}
        cache.v = {layer: t.clone() for layer, t in cache.v.items()}
        cache.pos, cache.pad = cache.pos.clone(), cache.pad.clone()


class Engine:
    """Generate text from a ``GPT`` (or anything called as ``model(idx, cache=...)`` with a
    ``cfg.max_seq_len``) and its tokenizer. ``device`` None keeps the model where it is.
    ``compile`` runs the one-token decode step under ``torch.compile(model, fullgraph=True)``
    with a ``StaticKVCache`` (the prefill stays eager; the first call compiles, seconds).
    ``graphs`` replays that step (compiled or not) from a CUDA graph (``GraphedDecode``); on a CPU
    it runs the same static-cache path without graphs. ``compile_options``: inductor's options for
    that compile (``TUNED``: weights frozen into the graph and every GEMM's kernel picked by
    timing, for a benchmark or a server whose weights never change). ``kernels="triton"`` decodes
    with ember's own fused step instead (``ember.infer.fused``: five launches a GPT-2 block, on
    the static cache; with ``graphs`` replayed from a CUDA graph). ``batch_invariant``: every
    product in ember.kernels.invariant's fixed order and attention by the serving cache's paged
    kernel (``InvariantKVCache``), so its greedy tokens are those ``Scheduler(batch_invariant=True)``
    serves, bit for bit, in any batch; needs Triton (a CPU runs it under the interpreter: tests)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        device: str | torch.device | None = None,
        compile: bool = False,
        graphs: bool = False,
        compile_options: dict | None = None,
        kernels: str = "torch",
        batch_invariant: bool = False,
    ):
        if not getattr(model.cfg, "causal", True):
            raise EmberError(
                "this model is bidirectional (model.causal=false, a masked LM): it fills in masked tokens "
                "and cannot generate left to right or keep a KV cache; score it with `ember eval RUN`"
            )
        if getattr(model.cfg, "head", "lm") != "lm":
            raise EmberError(
                "this model is a reward model (model.head=score): it scores replies and has no next-token "
                "logits to generate with; use it as grpo.reward_model, or generate with its SFT run"
            )
        if (compile or graphs or batch_invariant) and "mamba" in layer_mixers(model.cfg):
            raise EmberError(
                "compile, CUDA graphs and batch invariance decode with a static KV cache, which has no place "
                "for a Mamba layer's recurrent state; generate from this model without them"
            )
        if device is not None:
            model = model.to(device)
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        vocab_size = model.cfg.vocab_size
        self.n_valid = min(getattr(tokenizer, "vocab_size", vocab_size), vocab_size)
        self.end_turn_id = tokenizer.hf.token_to_id(END_TURN) if hasattr(tokenizer, "hf") else None
        self.graphs = graphs
        # generate() samples this many tokens between reads of the device (gpt-fast reads none):
        # on a GPU the host queues the next steps while the device runs, and a row that ends
        # inside them wastes at most lookahead - 1 steps; a CPU has nothing to overlap
        self.lookahead = LOOKAHEAD if self.device.type == "cuda" else 1
        if kernels not in ("torch", "triton"):
            raise EmberError(f"kernels={kernels!r}: choose torch (PyTorch's ops) or triton (ember's own)")
        if kernels == "triton" and compile:
            raise EmberError("kernels=triton decodes with ember's own step, never compiled: drop compile")
        self.cache_type = StaticKVCache if compile or graphs or kernels == "triton" else KVCache
        self.mode = contextlib.nullcontext  # what each forward runs under
        if batch_invariant:
            self.mode = invariant_mode(model, self.device, compile, kernels)
            self.cache_type = InvariantKVCache
        step = _compiled_step(model, compile_options) if compile else model
        if kernels == "triton":
            from ember.infer.fused import FusedDecode  # (imports Triton: only when asked for)

            step = FusedDecode(model)
        self.decode = GraphedDecode(step) if graphs else step

    def cache_slots(self, needed: int) -> int:
        """A stream's cache length: what it needs, or with ``graphs`` the next multiple of
        GRAPH_SLOTS (at most max_seq_len), so one captured graph serves prompts of many lengths."""
        if not self.graphs:
            return needed
        return max(needed, min(-(-needed // GRAPH_SLOTS) * GRAPH_SLOTS, self.model.cfg.max_seq_len))

    @classmethod
    def from_run(cls, run_dir: str | Path, device: str | torch.device = "cpu", ckpt: str = "last") -> Engine:
        """A run directory's model at ``ckpt`` (default: the final weights), by ``load_run``."""
        return cls(*load_run(run_dir, ckpt, device))

    def _encode(
        self, prompts: Sequence[str], max_new_tokens: int, truncate: bool
    ) -> list[tuple[list[int], int]]:
        """(prompt ids that fit, count dropped from the front) per prompt, or an EmberError."""
        if isinstance(prompts, str):
            raise EmberError("prompts must be a list of strings; wrap a single prompt as [prompt]")
        if not prompts:
            raise EmberError("no prompts given")
        max_seq_len = self.model.cfg.max_seq_len
        if max_new_tokens >= max_seq_len:
            raise EmberError(
                f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's "
                f"max_seq_len={max_seq_len}; use at most {max_seq_len - 1}"
            )
        room = max_seq_len - max_new_tokens  # prompt tokens that fit
        encoded = []
        for i, prompt in enumerate(prompts):
            ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)  # text or ids
            if not ids:
                raise EmberError(f"prompt {i + 1} is empty; give at least one character of text to continue")
            if len(ids) > room and not truncate:
                fits = len(ids) < max_seq_len
                lower = f"lower --max-new-tokens to {max_seq_len - len(ids)} or less, or " if fits else ""
                raise EmberError(
                    f"prompt {i + 1} is {len(ids)} tokens; with --max-new-tokens {max_new_tokens} that is "
                    f"{len(ids) + max_new_tokens}, beyond the model's max_seq_len={max_seq_len}; "
                    f"{lower}pass --truncate to keep the last {room} prompt tokens"
                )
            dropped = max(0, len(ids) - room)
            encoded.append((ids[dropped:], dropped))
        return encoded

    def _start(
        self, prompts: Sequence[str], sampling: Sampling, truncate: bool, lazy: bool = False
    ) -> tuple[list[Row], Iterator[tuple[int, str]]]:
        """Check the seeds, encode the prompts, set up the rows and their stream; returns the
        rows and the (not yet started) iterator of their text pieces."""
        sampling.check_seed(len(prompts))
        encoded = self._encode(prompts, sampling.max_new_tokens, truncate)
        rows = [Row(i, ids, dropped, self.generator(sampling, i)) for i, (ids, dropped) in enumerate(encoded)]
        return rows, self._decode(_Stream(self, rows, sampling.max_new_tokens), sampling, lazy)

    def _decode(self, stream: _Stream, sampling: Sampling, lazy: bool) -> Iterator[tuple[int, str]]:
        """Step the stream; yield (row, text piece) whenever a row's text grows."""
        s, ends = sampling, self.ends(sampling.ignore_eos)
        k = self.lookahead if lazy else 1  # a stream's reader waits for each token
        while not stream.done:
            for row, tokens in zip(stream.rows, stream.step(s.temperature, s.top_k, s.top_p, k), strict=True):
                for token in tokens:  # a row that has ended takes no more
                    if piece := row.push(token, self.tokenizer, ends, s.stop, s.max_new_tokens, lazy):
                        yield row.row, piece

    def generator(self, sampling: Sampling, i: int) -> torch.Generator | None:
        """Row i's own sampler, seeded ``seed + i``; None when greedy."""
        if sampling.temperature > 0:
            return torch.Generator(device=self.device).manual_seed(sampling.seed + i)
        return None

    def ends(self, ignore_eos: bool = False) -> set[int]:
        """The ids that end a row: ``<|eos|>`` and ``<|end_turn|>`` (none with ``ignore_eos``)."""
        return set() if ignore_eos else {self.tokenizer.eos_id, self.end_turn_id} - {None}

    def stream(
        self, prompts: Sequence[str], sampling: Sampling | None = None, truncate: bool = False
    ) -> Iterator[tuple[int, str]]:
        """Yield (row, text piece) as tokens are produced; a row's pieces join to its
        ``generate`` text. Arguments as in ``generate``; bad ones raise here, before any step."""
        return self._start(prompts, sampling or Sampling(), truncate)[1]

    def generate(
        self, prompts: Sequence[str | list[int]], sampling: Sampling | None = None, truncate: bool = False
    ) -> list[Completion]:
        """Continue each prompt (text, or token ids such as ``chat.render``'s) as ``sampling`` says
        (default ``Sampling()``): up to ``max_new_tokens`` tokens, ending early at ``<|eos|>`` or
        ``<|end_turn|>`` or at a ``stop`` string (excluded from the text); row i samples with
        seed + i. A prompt that does not fit with ``max_new_tokens`` raises unless ``truncate``,
        which keeps its last tokens."""
        rows, pieces = self._start(prompts, sampling or Sampling(), truncate, lazy=True)  # text at the end
        for _ in pieces:
            pass
        return [row.completion() for row in rows]
