"""``ember plan CONFIG [--nproc N]``: will it fit? Bytes per rank, predicted from the config and
the layout before anything runs, and (``--measure``) set against a few real steps.

    plans = predict(cfg, model_cfg, world)  # one dict per rank: params, grads, optimizer, ...
    measured = measure(trainer, steps=3)    # the same components, from a live storage tracker
    print_plan(cfg, plans, measured, ...)   # the tables `ember plan` prints

A rank holds, in a step of training with AdamW (fp32 master weights, gradients and moments;
with ``train.precision`` bf16 or fp16 the trace runs under autocast, as the trainer does):

- **parameters**: its share of each tensor. Tensor parallel splits the block matrices (q, k, v
  and the MLP's up/gate by output rows, the attention output and the MLP's down by input
  columns) and the embedding and head by vocabulary rows by ``tp``; FSDP2 then cuts dim 0 of
  what is left into ``dp_shard`` chunks, each padded to the largest (its shards are equal-sized);
  a pipeline stage holds only its blocks, the first the embedding, the last the norm and head.
- **gradients**: the same shapes as the parameters.
- **optimizer**: AdamW's two moments (2 × the parameters) and a 4-byte step per tensor; Muon
  one momentum for the block matrices.
- **activations**: what autograd saves for the backward, found by tracing the rank's model (its
  stage, with its tensor-parallel widths) on fake tensors (``FakeTensorMode``: shapes and dtypes,
  no data, and the same attention kernel as the real device) at the micro-batch's shape, and
  summing the distinct storages the saved-tensor hook sees. With activation checkpointing a
  block keeps only its input, and the backward recomputes one block at a time. A pipeline stage
  holds several micro-batches' at once: M under GPipe, min(M, S - stage) under 1F1B, the warm-up
  count of torch's interleaved schedule under interleaved 1F1B.
- **peak**: the largest sum over the backward pass, layer by layer: activations still to be
  consumed, gradients already made (all of them from the start when gradients accumulate over
  micro-batches or micro-batches flow through a pipeline), two logits-sized buffers (the
  gradient of the loss and of the logits) when the backward starts, and under FSDP2 the
  gathered (unsharded) parameters of the root and of two blocks (the one computed and the one
  prefetched) with one block's unsharded gradient before its reduce-scatter.

The measurement (``StorageTracker``, a ``TorchDispatchMode``) records every storage an
operation creates and when it dies (a weak reference), on top of the parameters, gradients and
optimizer state present when it starts; at the largest total it splits the live bytes into
parameters, gradients, optimizer state and the rest (activations and temporaries). On CUDA the
caching allocator's peak is reported beside it (``allocator_peak``: with its rounding to
blocks). The prediction is a model of the same quantities, so the two are comparable term by
term (``tests/test_plan.py`` holds them within 10%). Bytes of the process itself (Python,
torch, communication buffers) are in neither: they are what ``peak_mem_mb`` adds on a CPU.

FLOPs per step are the trainer's (6N + attention, PaLM appendix B) times the tokens of a step;
the expected step time divides them by the device's peak at ``--mfu``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import weakref
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from ember.config import load_config
from ember.data.manifest import load_tokenizer
from ember.data.prepare import prepare
from ember.errors import EmberError
from ember.model.gpt import GPT, layer_mixers, mlp_hidden_size
from ember.model.mamba import dt_rank
from ember.parallel.dist import local, run_ranks
from ember.parallel.pipeline import microbatches, stage_layers, stage_model, virtual_stages
from ember.train.layout import check_layout
from ember.train.start import resolve_model_config
from ember.train.tasks import task_class
from ember.train.trainer import scratch_trainer

COLUMN = ("attention.wq", "attention.wk", "attention.wv", "mlp.w1", "mlp.w3")  # split by output rows
ROW = ("attention.wo", "mlp.w2")  # split by input columns


def coordinates(cfg, world_size: int, rank: int) -> dict:
    """Where ``rank`` sits in the mesh (rank = (pp_rank × dp + dp_rank) × tp + tp_rank)."""
    p = cfg.parallel
    pp, tp = p.pp, p.tp
    dp = world_size // (pp * tp)
    fsdp = p.data == "fsdp" and dp > 1
    shard = dp // p.dp_replicate if fsdp else 1
    return {"pp_rank": rank // (dp * tp), "dp": dp, "dp_rank": rank // tp % dp, "tp": tp, "shard": shard,
            "fsdp": fsdp}  # fmt: skip


def _local_shape(name: str, shape: tuple, tp: int, shard: int) -> tuple:
    """A parameter's shape on one rank: split by tensor parallel, then FSDP2's padded chunk."""
    shape = list(shape)
    module = name.rsplit(".", 1)[0]
    if tp > 1:
        if module.endswith(COLUMN) or module in ("tok_embeddings", "output"):
            shape[0] //= tp
        elif module.endswith(ROW) and name.endswith("weight"):
            shape[1] //= tp
    if shard > 1:
        shape[0] = math.ceil(shape[0] / shard)
    return tuple(shape)


def _stage_model(model: GPT, cfg, pp_rank: int) -> tuple[GPT, list[int]]:
    p = cfg.parallel
    if p.pp == 1:
        return model, [0]
    n_stages = p.pp * virtual_stages(p)
    ranges = stage_layers(model.cfg.n_layer, n_stages)
    ids = list(range(pp_rank, n_stages, p.pp))
    return stage_model(model, [i for s in ids for i in ranges[s]], 0 in ids, n_stages - 1 in ids), ids


def _narrow(model: GPT, tp: int) -> None:
    """Give each block the widths one tensor-parallel rank computes (the model reads its head
    count from the shapes); the embedding and head stay whole, as their outputs are gathered."""
    for block in model.layers.values():
        for name, module in list(block.named_modules()):
            if name.endswith(COLUMN + ROW):
                parent = block.get_submodule(name.rsplit(".", 1)[0])
                i, o = module.in_features, module.out_features
                i, o = (i, o // tp) if name.endswith(COLUMN) else (i // tp, o)
                setattr(parent, name.rsplit(".", 1)[1], torch.nn.Linear(i, o, bias=module.bias is not None))


def trace_activations(model_cfg, cfg, rows: int, pp_rank: int = 0) -> dict:
    """Bytes autograd saves in one forward of ``rows`` × seq_len on the rank's model: in total,
    per block, and what a checkpointed block keeps (its input)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    T = cfg.train.seq_len
    with FakeTensorMode():
        model, _ = _stage_model(GPT(model_cfg), cfg, pp_rank)
        if cfg.parallel.tp > 1:
            _narrow(model, cfg.parallel.tp)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        seen: dict[int, int] = {}
        per_block: dict[str, int] = {}
        where = ["other"]

        def pack(t):
            key = t.untyped_storage()._cdata
            if key not in params and key not in seen:
                seen[key] = t.untyped_storage().nbytes()
                per_block[where[0]] = per_block.get(where[0], 0) + seen[key]
            return t

        hooks = []
        for name, block in model.layers.items():
            hooks.append(block.register_forward_pre_hook(lambda m, a, name=name: where.__setitem__(0, name)))
            hooks.append(block.register_forward_hook(lambda m, a, o: where.__setitem__(0, "other")))
        if model.tok_embeddings is not None:
            x = torch.randint(0, model_cfg.vocab_size, (rows, T))
        else:
            x = torch.randn(rows, T, model_cfg.d_model, requires_grad=True)
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
        autocast = torch.autocast("cpu", dtype=half) if half else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:  # (as the trainer casts)
            out = model(x)
            if model.output is not None:
                F.cross_entropy(out.flatten(0, 1), torch.randint(0, model_cfg.vocab_size, (rows * T,)))
        for h in hooks:
            h.remove()
    blocks = [per_block.get(name, 0) for name in model.layers]
    return {"total": sum(seen.values()), "blocks": blocks, "other": per_block.get("other", 0),
            "block_input": rows * T * model_cfg.d_model * 4, "logits": rows * T * model_cfg.vocab_size * 4
            if model.output is not None else 0}  # fmt: skip


def _in_flight(cfg, stage: int, microbatches: int) -> int:
    """Micro-batches whose activations a pipeline rank holds at once."""
    p = cfg.parallel
    if p.pp == 1:
        return 1
    if p.pp_schedule == "gpipe":
        return microbatches
    if p.pp_schedule == "1f1b":
        return min(microbatches, p.pp - stage)
    v = virtual_stages(p)  # torch's interleaved warm-up: (v - 1) rounds, then 2 per later rank
    per_round = microbatches // max(1, microbatches // p.pp)
    warmup = (v - 1) * per_round + 2 * (p.pp - 1 - stage)
    return min(warmup + 1, microbatches * v)  # (counted in a stage's micro-batches)


def predict(cfg, model_cfg, world_size: int) -> list[dict]:
    """One dict per rank: bytes of parameters, gradients, optimizer state, activations (as run,
    without and with activation checkpointing) and the peak; see the module docstring."""
    t, pipelined = cfg.train, cfg.parallel.pp > 1
    if model_cfg.mlp == "moe":  # the rows each expert gets depend on the routing: no fake-tensor trace
        raise EmberError("ember plan does not predict model.mlp=moe yet (how many rows each expert multiplies depends on the routing); train it and run `ember analyze RUN memory`")  # fmt: skip # noqa: E501
    with torch.device("meta"):
        whole = GPT(model_cfg)

    def by_block(model, sizes):  # bytes by parameter name -> bytes by block, in the model's order
        return [sum(b for n, b in sizes.items() if n.startswith(f"layers.{i}.")) for i in model.layers]

    plans = []
    for rank in range(world_size):
        c = coordinates(cfg, world_size, rank)
        model, ids = _stage_model(whole, cfg, c["pp_rank"])
        shapes = {
            n: _local_shape(n, tuple(p.shape), c["tp"], c["shard"]) for n, p in model.named_parameters()
        }
        sizes = {n: math.prod(s) * 4 for n, s in shapes.items()}
        params = sum(sizes.values())
        if t.optimizer == "muon":
            hidden = [n for n in sizes if "layers" in n.split(".") and len(shapes[n]) == 2]  # one momentum
            rest = params - sum(sizes[n] for n in hidden)  # AdamW's
            optimizer = sum(sizes[n] for n in hidden) + 2 * rest + 4 * (len(sizes) - len(hidden))
        else:
            optimizer = 2 * params + 4 * len(sizes)
        rows_per_rank = t.batch_tokens // t.seq_len // c["dp"]
        m = microbatches(cfg, c["dp"]) if pipelined else rows_per_rank // t.micro_batch
        rows = rows_per_rank // m if pipelined else t.micro_batch
        act = trace_activations(model_cfg, cfg, rows, c["pp_rank"])
        flight = _in_flight(cfg, c["pp_rank"], m)
        ac_total = act["other"] + len(act["blocks"]) * act["block_input"] + max(act["blocks"], default=0)
        used = ac_total if t.activation_checkpointing else act["total"]
        unit = len(ids)  # interleaved: a micro-batch in flight holds one of the rank's stages, not all
        used, per_flight, per_flight_ac = used / unit, act["total"] / unit, ac_total / unit
        # the backward, step by step from the loss (the head, the blocks from the last, the
        # embedding), each step's bytes counted as the module docstring's **peak** says
        head = sum(b for n, b in sizes.items() if n.split(".")[0] in ("norm", "output"))
        order = [head, *by_block(model, sizes)[::-1]]
        order.append(params - sum(order))  # the embedding (and learned positions)
        gathered = block_grad = 0
        if c["fsdp"]:  # gathered parameters: the root's and two blocks' (computed, prefetched)
            full = {n: math.prod(_local_shape(n, tuple(p.shape), c["tp"], 1)) * 4 for n, p in model.named_parameters()}  # fmt: skip # noqa: E501
            full_blocks = by_block(model, full)
            gathered = sum(full.values()) - sum(full_blocks) + 2 * max(full_blocks, default=0)
            if t.precision != "fp32":  # FSDP2's mixed precision gathers 16-bit copies
                gathered //= 2
            block_grad = max(full_blocks, default=0)  # a block's whole gradient, before its reduce-scatter
        stream = rows * t.seq_len * model_cfg.d_model * 4  # one micro-batch of the residual stream
        # pipelined: receive buffers, one per micro-batch, for inputs (not first) and their gradients
        # (not last); and the last stage keeps its output until its backward
        buffers = m * stream * ((model.tok_embeddings is None) + (model.output is None)) if pipelined else 0
        kept = act["logits"] if pipelined else 0
        # a block's backward works on gradients of its MLP's hidden units (three for SwiGLU's two
        # branches and product, two otherwise) and of the stream coming in and going out
        hidden = rows * t.seq_len * mlp_hidden_size(model_cfg) // cfg.parallel.tp * 4
        if model_cfg.mlp == "moe":  # each token's top_k experts (and the shared one)
            hidden *= model_cfg.top_k + model_cfg.shared_expert
        working = (3 if model_cfg.mlp in ("swiglu", "moe") else 2) * hidden + 2 * stream
        blocks = [act["block_input"]] * len(act["blocks"]) if t.activation_checkpointing else act["blocks"]
        n = len(blocks)
        peak = (0, 0, 0)  # (total, gradients then, activations and temporaries then)
        for k in range(n + 2):  # k of the steps done
            saved = round((flight - 1) * used) + sum(blocks[: n - max(0, k - 1)])
            saved += act["other"] - (act["logits"] if k else 0)  # the loss's log-probabilities go first
            if t.activation_checkpointing and 0 < k <= n:
                saved += max(act["blocks"], default=0)  # the block being recomputed
            # gradients exist whole from the start once a micro-batch's backward has run before this one
            grads = params if m > 1 and (not pipelined or flight < m) else sum(order[:k])
            temps = (2 * act["logits"] + kept) if k == 0 else working if k <= n else 0
            extra = gathered + (block_grad if 1 < k <= n else 0) + buffers
            transient = saved + temps + extra  # activations and temporaries
            peak = max(peak, (params + optimizer + grads + transient, grads, transient))
        plans.append({
            "rank": rank, **c, "stages": ids, "microbatches": m, "rows": rows, "in_flight": flight,
            "params": params, "grads": params, "optimizer": optimizer,
            "activations": round(flight * per_flight), "activations_ac": round(flight * per_flight_ac),
            "peak": peak[0], "grads_at_peak": peak[1], "activations_at_peak": peak[2],
            "fsdp_gathered": gathered,
            "virtual_stages": virtual_stages(cfg.parallel) if pipelined else 1,
        })  # fmt: skip
    return plans


def fitting_micro_batch(cfg, model_cfg, world_size: int, budget: float) -> tuple[int, int] | None:
    """The largest micro-batch (a divisor of a rank's rows, so the global batch is unchanged, of
    whole examples: a DPO pair is two rows) whose predicted peak fits in ``budget`` bytes on every
    rank, and that peak; None when none fits. The peak grows with the rows, so a binary search
    over the divisors: a few traces."""
    dp = check_layout(cfg, world_size, model_cfg).dp
    per_rank = cfg.train.batch_tokens // cfg.train.seq_len // dp
    whole = task_class(cfg.train.task).rows_per_example
    sizes = [d for d in range(1, per_rank + 1) if per_rank % d == 0 and d % whole == 0]
    lo, hi, best = 0, len(sizes) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        trial = replace(cfg, train=replace(cfg.train, micro_batch=sizes[mid]))
        peak = max(r["peak"] for r in predict(trial, model_cfg, world_size))
        if peak <= budget:
            best, lo = (sizes[mid], peak), mid + 1
        else:
            hi = mid - 1
    return best


def step_flops(model_cfg, cfg) -> float:
    with torch.device("meta"):
        model = GPT(model_cfg)
    return model.flops_per_token(cfg.train.seq_len) * cfg.train.batch_tokens


# ---------------------------------------------------------------- measuring


def _storages(tensors) -> dict[int, int]:
    """Bytes by storage of ``tensors`` (None skipped; a DTensor's local shard)."""
    tensors = [local(t) for t in tensors if t is not None]
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors of the optimizer's state (its moments, its steps)."""
    return [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


class StorageTracker(TorchDispatchMode):
    """Live tensor bytes by storage: every storage an operation returns is counted until its
    last reference dies (weak reference); entering counts what exists already. At the largest
    total, ``at_peak`` splits it into parameters, gradients, optimizer state and the rest."""

    def __init__(self, model, optimizer, timeline: bool = False):
        super().__init__()
        self.model, self.optimizer = model, optimizer
        self.live: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.total = self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.timeline: list[dict] | None = [] if timeline else None  # the split after every operation

    def _add(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        if is_traceable_wrapper_subclass(t):  # a DTensor: its local tensor is what holds memory
            for attr in t.__tensor_flatten__()[0]:
                self._add(getattr(t, attr))
            return
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        self.live[key] = st.nbytes()
        self.total += st.nbytes()
        self.refs[key] = weakref.ref(st, lambda _, key=key: self._drop(key))

    def _drop(self, key: int) -> None:
        self.total -= self.live.pop(key, 0)
        self.refs.pop(key, None)

    def _split(self) -> dict[str, int]:
        params = _storages(self.params)
        grads = _storages(p.grad for p in self.params)
        optim = _storages(_optimizer_tensors(self.optimizer))
        split = {"params": 0, "grads": 0, "optimizer": 0, "activations": 0}
        for key, n in self.live.items():
            kind = "params" if key in params else "grads" if key in grads else "optimizer" if key in optim else "activations"  # fmt: skip # noqa: E501
            split[kind] += n
        return split

    def __enter__(self):
        # the parameters as they stand between steps (FSDP2: the shards; the gathered copies it
        # makes in the step count as activations, as ``predict`` counts them)
        self.params = list(self.model.parameters())
        grads = [p.grad for p in self.params]
        for t in [*self.params, *grads, *_optimizer_tensors(self.optimizer), *self.model.buffers()]:
            self._add(t)
        self.peak = self.total
        self.at_peak = self._split()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            self._add(t)
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = self._split()
        if self.timeline is not None:
            self.timeline.append(self._split())
        return out


def measure(trainer, steps: int = 4, tracked: int = 3, timeline: bool = False) -> dict:
    """Run ``steps`` training steps and track the last ``tracked`` (at most ``steps`` - 2, at
    least 2): the bytes of the parameters, gradients and optimizer state (this rank's), and of
    the tracked step with the lowest peak, that peak and the gradients and the rest (activations
    and temporaries) live at it. (A communication thread can free a collective's input a moment
    late, which only adds to a step's peak: the lowest of the steps is the schedule's own; on a
    loaded machine two steps were once both late, hence three where the steps allow.)"""
    tracked = max(2, min(tracked, steps - 2))

    def local_bytes(tensors) -> int:
        return sum(_storages(tensors).values())

    grads = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grads.append(local_bytes(p.grad for p in trainer.model.parameters()))
    )
    batches = trainer.loader.iterate(trainer.step)
    best = None
    cuda = trainer.env.device.type == "cuda"
    for _ in range(steps - tracked):
        trainer.advance(batches)
    for _ in range(min(steps, tracked)):
        gc.collect()  # garbage of earlier steps, freed at a moment of Python's choosing, goes first
        if cuda:  # the caching allocator's own count, beside the tracker's
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with StorageTracker(trainer.model, trainer.optimizer, timeline) as tracker:
            trainer.advance(batches)
        if best is None or tracker.peak < best.peak:
            best = tracker
            best.allocator = torch.cuda.max_memory_allocated() if cuda else None
    return {
        "params": local_bytes(trainer.model.parameters()),
        "grads": grads[-1],
        "optimizer": local_bytes(_optimizer_tensors(trainer.optimizer)),
        "peak": best.peak,
        "grads_at_peak": best.at_peak["grads"],
        "activations_at_peak": best.at_peak["activations"],
        **({"allocator_peak": best.allocator} if cuda else {}),
        **({"timeline": best.timeline} if timeline else {}),
    }


def estimated_params(model_cfg) -> int:
    """Parameters of ``model_cfg``'s decoder from its shape alone, nothing built: embeddings, the
    head if untied, learned positions, and per block the four attention and two or three MLP
    matrices (norms and biases, a sliver, left out)."""
    d, head_dim = model_cfg.d_model, model_cfg.d_model // model_cfg.n_head
    kv = (model_cfg.n_kv_head or model_cfg.n_head) * head_dim
    mlp = (3 if model_cfg.mlp in ("swiglu", "moe") else 2) * d * mlp_hidden_size(model_cfg)
    if model_cfg.mlp == "moe":  # each expert (and the shared one) a SwiGLU, and the router
        mlp = mlp * (model_cfg.n_experts + model_cfg.shared_expert) + d * model_cfg.n_experts
    mlp = 0 if model_cfg.mlp == "none" else mlp
    embeddings = model_cfg.vocab_size * d * (1 if model_cfg.tie_embeddings else 2)
    positions = model_cfg.max_seq_len * d if model_cfg.pos == "learned" else 0
    n_mamba = layer_mixers(model_cfg).count("mamba")
    d_in = model_cfg.expand * d  # a Mamba layer: in_proj, out_proj, x_proj, dt_proj, A_log, conv1d
    mamba = 3 * d * d_in + d_in * (2 * dt_rank(d) + 3 * model_cfg.d_state + model_cfg.d_conv)
    attention = (model_cfg.n_layer - n_mamba) * (2 * d * d + 2 * d * kv)
    return embeddings + positions + model_cfg.n_layer * mlp + n_mamba * mamba + attention


def machine_bytes() -> int:
    """This machine's memory: its RAM, or one GPU's if that is larger."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
    return max(ram, gpu)


def check_size(model_cfg, world_size: int, margin: float) -> None:
    """Refuses, before any model is built, a config whose weights, gradients and AdamW moments
    alone (16 bytes a parameter, spread over ``world_size`` ranks) exceed ``margin`` × the
    machine's memory: building it would take minutes and gigabytes before any answer."""
    n = estimated_params(model_cfg)
    need, have = 16 * n / world_size, machine_bytes()
    if need > margin * have:
        raise EmberError(
            f"model.n_layer={model_cfg.n_layer}, d_model={model_cfg.d_model}, vocab_size="
            f"{model_cfg.vocab_size}: about {n:.2g} parameters, {need / 2**30:,.0f} GiB per rank for "
            f"weights, gradients and AdamW state on {world_size} rank(s), over {margin:g} × this "
            f"machine's {have / 2**30:.0f} GiB; choose a smaller model or more ranks"
        )


def model_config_for(cfg):
    """The model config with ``vocab_size`` resolved as the trainer will: from the prepared
    tokenizer if data.dir holds one, else data.vocab_size rounded up to model.vocab_multiple."""
    if cfg.model.vocab_size:
        return cfg.model
    try:
        return resolve_model_config(cfg.model, load_tokenizer(cfg.data.dir))
    except (EmberError, OSError):
        m = cfg.model.vocab_multiple
        return replace(cfg.model, vocab_size=(cfg.data.vocab_size + m - 1) // m * m)


COMPONENTS = ("params", "grads", "optimizer", "grads_at_peak", "activations_at_peak", "peak")


def difference(predicted: int, measured: int, peak: int) -> float:
    """How far a prediction is off: relative to the measured value, or for a component under 5%
    of the peak, as a share of the peak (the peak can fall inside a block's backward, after some
    of its gradients exist: the prediction counts a block's gradients when its backward is done)."""
    if max(predicted, measured) < 0.05 * peak:
        return abs(predicted - measured) / peak
    return abs(predicted - measured) / max(measured, 1)


def measure_config(cfg, steps: int = 4, timeline: bool = False) -> list[dict] | None:
    """On every rank of the launch (or alone): train ``steps`` steps of ``cfg`` in a scratch run
    directory and measure the last; rank 0 gets every rank's figures (others: None)."""
    import torch.distributed as dist

    with scratch_trainer(cfg, max_steps=steps) as trainer:
        mine = measure(trainer, steps, timeline=timeline)
    if not dist.is_initialized():
        return [mine]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every if dist.get_rank() == 0 else None


def print_plan(cfg, predicted: list[dict], measured: list[dict] | None, flops: float, config: str,
               steps: int, peak_tflops: float = 0.0, mfu: float = 0.4, fits=None) -> None:  # fmt: skip
    """What ``ember plan CONFIG`` prints: the layout, the predicted bytes per rank, FLOPs per step
    (and the step time at ``mfu`` of ``peak_tflops``), the micro-batch that ``fits`` a memory,
    and against ``measured`` the ratios."""
    from rich.console import Console
    from rich.table import Table

    mib = lambda b: f"{b / 2**20:,.2f}"  # noqa: E731
    p, t, first = cfg.parallel, cfg.train, predicted[0]
    layout = [f"{k}={getattr(p, k)}" for k in ("pp", "dp_replicate", "tp") if getattr(p, k) > 1]
    layout += [f"dp={first['dp']} ({'FSDP2' if first['fsdp'] else 'replicas'})"] if first["dp"] > 1 else []
    if p.pp > 1:
        layout.append(f"{p.pp_schedule}, {first['microbatches']} micro-batches of {first['rows']} rows")
    print(f"{config} on {len(predicted)} rank(s): {', '.join(layout) or 'one process'}; "
          f"{t.precision}, {t.optimizer}, micro-batch {first['rows']} × {t.seq_len}")  # fmt: skip
    table = Table(title="predicted bytes per rank (MiB)")
    for col in ("rank", "stages", "params", "grads", "optimizer", "activations", "with AC", "peak"):
        table.add_column(col, justify="right")
    for r in predicted:
        sizes = [mib(r[k]) for k in ("params", "grads", "optimizer", "activations", "activations_ac", "peak")]
        table.add_row(str(r["rank"]), ",".join(map(str, r["stages"])), *sizes)
    Console().print(table)
    step_s = ""
    if peak_tflops:
        step_s = f"; at {mfu:.0%} MFU of {peak_tflops:g} TFLOP/s per rank: {flops / (mfu * peak_tflops * 1e12 * len(predicted)):.3g} s a step"  # fmt: skip # noqa: E501
    print(f"FLOPs per step: {flops:.3e} (6N + attention, × {t.batch_tokens:,} tokens){step_s}")
    if fits is not None:
        gib, found = fits
        line = f"train.micro_batch={found[0]}, predicted peak {mib(found[1])} MiB" if found else "none"
        print(f"largest micro-batch whose predicted peak fits in {gib:g} GiB: {line}")
    if measured is None:
        return
    table = Table(title=f"predicted vs measured (MiB), the lower of the last two of {steps} steps")
    for col in ("rank", "component", "predicted", "measured", "ratio"):
        table.add_column(col, justify="right")
    worst = 0.0
    for pred, meas in zip(predicted, measured, strict=True):
        for key in COMPONENTS:
            a, b = pred[key], meas[key]
            ratio = a / b if b else (1.0 if a == 0 else float("inf"))
            worst = max(worst, difference(a, b, meas["peak"]))
            table.add_row(str(pred["rank"]), key.replace("_", " "), mib(a), mib(b), f"{ratio:.3f}")
        if "allocator_peak" in meas:  # CUDA
            a, b = pred["peak"], meas["allocator_peak"]
            table.add_row(str(pred["rank"]), "peak (allocator)", mib(a), mib(b), f"{a / b:.3f}")
    Console().print(table)
    print(f"largest difference: {worst:.1%} (relative; under 5% of the peak, as a share of the peak)")


def plan_command(config: str, overrides: list[str], nproc: int, measure: bool, steps: int, as_json: bool,
                 peak_tflops: float | None, mfu: float, command: str | None = None,
                 memory_gib: float | None = None) -> None:  # fmt: skip
    """`ember plan`: predict for ``nproc`` ranks and, with ``measure``, run the steps (a torchrun
    launch for nproc > 1, whose rank 0 prints its figures as one JSON line that this reads back);
    the largest micro-batch that fits ``memory_gib`` (default: this GPU's memory, if any)."""
    cfg, ranked = load_config(config, overrides), "LOCAL_RANK" in os.environ
    if not ranked:  # a prediction may be for bigger machines; a measurement runs on this one
        check_size(model_config_for(cfg), nproc, 1 if measure else 64)
        if measure:
            prepare(cfg, command=command)  # the measured steps read the data, as training would
    model_cfg = model_config_for(cfg)  # (after prepare: the vocabulary may come from the tokenizer)
    if not ranked:
        check_layout(cfg, nproc, model_cfg)
    predicted = predict(cfg, model_cfg, int(os.environ.get("WORLD_SIZE", nproc)))
    measured = None
    if measure and nproc > 1 and not ranked:
        flags = ["--measure", f"--steps={steps}", "--json"]  # (the ranks read WORLD_SIZE)
        out = run_ranks(nproc, "plan", config, *overrides, *flags, what="the measured run")
        lines = [line for line in out.splitlines() if line.startswith('{"measured"')]
        if not lines:
            raise EmberError("the measured run printed no measurement:\n" + "\n".join(out.splitlines()[-8:]))
        measured = json.loads(lines[-1])["measured"]
    elif measure:
        measured = measure_config(cfg, steps)
        if measured is None or ranked:  # not rank 0; or rank 0 of a launch, read back by the launcher
            if measured is not None:
                print(json.dumps({"measured": measured}), flush=True)
            return
    flops = step_flops(model_cfg, cfg)
    if memory_gib is None and torch.cuda.is_available():
        memory_gib = torch.cuda.mem_get_info()[0] / 2**30  # free now: less the CUDA context
    fits = None
    if memory_gib is not None and cfg.parallel.pp > 1:
        print("ember: note: --memory: under parallel.pp the schedule sets the micro-batches")
    elif memory_gib is not None:
        fits = memory_gib, fitting_micro_batch(cfg, model_cfg, nproc, memory_gib * 2**30)
    if as_json:
        micro = None
        if fits:
            gib, found = fits
            micro = {"memory_gib": gib, "micro_batch": found[0] if found else None, "peak": found[1] if found else None}  # fmt: skip # noqa: E501
        print(json.dumps({"predicted": predicted, "measured": measured, "flops_per_step": flops,
                          "fits": micro}))  # fmt: skip
    else:
        print_plan(cfg, predicted, measured, flops, config, steps, peak_tflops, mfu, fits)
