"""Will this layout run? The one check of a config against a number of ranks, made before
torchrun starts any (``ember train --nproc N``, ``ember plan``, ``ember analyze ... --nproc``)
and again by each rank's trainer, so a layout that cannot run fails in one line, naming the
numbers, and never inside a collective.

    layout = check_layout(cfg, world_size=4)     # Layout(dp=2, rows=32, grad_accum=4) or a ConfigError

It checks the mesh (pipeline × data replicas × data shards × tensor parallel = the ranks), what
each kind of parallelism needs of the model (heads and widths that split, stages with layers),
what the task allows (``Task.check_layout``; only tasks that ``splits_model`` run under
tensor or pipeline parallel), and that the global batch splits into micro-batches on the
data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.errors import ConfigError
from ember.model.gpt import layer_mixers, mlp_hidden_size
from ember.parallel.pipeline import microbatches, virtual_stages
from ember.train.tasks import task_class


@dataclass(frozen=True)
class Layout:
    dp: int  # data-parallel ranks (the ranks over pipeline stages and tensor-parallel groups)
    rows: int  # sequences per global step
    grad_accum: int  # micro-steps of accumulation per rank


def compile_scope(t, device_type: str, world_size: int) -> str:
    """What ``train.compile`` compiles: ``model`` (the task's forward and loss as one graph),
    ``block`` (each block) or ``""`` (nothing). ``auto`` takes the whole model on one CUDA
    device when the task's loss traces to one graph and no block is recomputed: gpt2-small's
    step on an H200 ran 24% faster that way at half the peak memory, the fp32 logits fused
    into the loss (benchmarks/RESULTS.md, "One GPU, measured"). Elsewhere each block: ranks
    need it, and a CPU pays the longer compile of a whole graph for no such gain."""
    if not t.compile:
        return ""
    if t.compile_scope != "auto":
        return t.compile_scope
    whole = device_type == "cuda" and world_size == 1 and task_class(t.task).whole_graph
    return "model" if whole and not t.activation_checkpointing else "block"


def check_layout(cfg, world_size: int, model_cfg=None) -> Layout:
    """The layout of ``cfg`` on ``world_size`` ranks, or a ConfigError that says why it cannot
    run (``model_cfg``: the resolved model config, when the vocabulary is known)."""
    tp, t, replicas, shard, pp = (cfg.parallel.tp, cfg.train, cfg.parallel.dp_replicate,
                                  cfg.parallel.dp_shard, cfg.parallel.pp)  # fmt: skip
    if cfg.parallel.data != "fsdp" and (replicas > 1 or shard > 1):
        raise ConfigError(f"parallel.dp_replicate={replicas} and parallel.dp_shard={shard} shape FSDP2 (HSDP when both > 1): set parallel.data=fsdp")  # fmt: skip # noqa: E501
    if shard != -1 and pp * replicas * shard * tp != world_size:
        raise ConfigError(f"parallel.pp × dp_replicate × dp_shard × tp = {pp} × {replicas} × {shard} × {tp} = {pp * replicas * shard * tp}, but there are {world_size} ranks; set parallel.dp_shard=-1 to fill")  # fmt: skip # noqa: E501
    if world_size % (pp * replicas * tp):
        sizes = (("pp", pp), ("dp_replicate", replicas), ("tp", tp))
        what = " × ".join(f"parallel.{k}={v}" for k, v in sizes if v > 1)
        raise ConfigError(f"{what} needs a multiple of {pp * replicas * tp} ranks, not {world_size}")  # fmt: skip # noqa: E501
    if t.lora_rank and world_size > 1 and cfg.parallel.data == "fsdp":
        raise ConfigError("LoRA runs on one device or under DDP (parallel.data=ddp), not FSDP yet")
    task = task_class(t.task)
    if not task.shards_params and world_size > 1 and cfg.parallel.data == "fsdp":
        raise ConfigError(f"train.task={t.task} runs on one device or under DDP (parallel.data=ddp)")
    fsdp = world_size > 1 and cfg.parallel.data == "fsdp"
    if t.kernels == "triton" and (tp > 1 or pp > 1 or fsdp or t.qat != "none"):
        raise ConfigError("train.kernels=triton runs on one device or under DDP, without train.qat (its fused loss reads the head's plain weight); use train.kernels=torch")  # fmt: skip # noqa: E501
    if t.compiles_step and world_size > 1:
        raise ConfigError(f"train.compile_scope=model compiles the whole step on one device; on {world_size} ranks set train.compile_scope=block")  # fmt: skip # noqa: E501
    if t.compiles_step and not task.whole_graph:
        raise ConfigError(f"train.compile_scope=model wants a loss that traces to one graph; train.task={t.task}'s reads values on the host (a graph break each step): set train.compile_scope=block")  # fmt: skip # noqa: E501
    dp = world_size // (pp * tp)
    task.check_layout(cfg, world_size, dp)
    m = model_cfg or cfg.model
    if task.tokens and m.kind != "gpt":
        raise ConfigError(f"model.kind={m.kind} classifies images: set train.task=classify (configs/digits.yaml)")  # fmt: skip # noqa: E501
    if m.mlp == "moe" or cfg.parallel.ep > 1:
        _check_experts(cfg, world_size, m)
    if (pp > 1 or tp > 1) and "mamba" in layer_mixers(m):
        raise ConfigError(f"parallel.tp={tp} and parallel.pp={pp}: Mamba layers (model.mixer=mamba or an M in model.pattern) train on one device or data parallel (DDP/FSDP) only for now; set parallel.tp=1 and parallel.pp=1")  # fmt: skip # noqa: E501
    if pp > 1:
        _check_pipeline(cfg, world_size, m, task)
    if tp > 1:
        _check_tensor_parallel(cfg, world_size, m, task)
    rows, grad_accum = _check_batch(t, dp)
    if t.compile and t.compile_mode == "reduce-overhead" and grad_accum > 1:
        raise ConfigError(f"train.compile_mode=reduce-overhead replays CUDA graphs whose outputs, the gradients too, the next replay overwrites: with {grad_accum} micro-batches a step they would be lost; make a step one micro-batch, train.batch_tokens={t.micro_batch * t.seq_len * dp} ({t.micro_batch} rows{f' on each of {dp} ranks' if dp > 1 else ''}), or set train.compile_mode=default")  # fmt: skip # noqa: E501
    return Layout(dp, rows, grad_accum)


def _check_batch(train_cfg, dp: int) -> tuple[int, int]:
    """(global rows per step, micro-steps of accumulation) on ``dp`` data-parallel ranks."""
    T, mb = train_cfg.seq_len, train_cfg.micro_batch
    if train_cfg.batch_tokens % T:
        raise ConfigError(
            f"train.batch_tokens={train_cfg.batch_tokens} is not a multiple of train.seq_len={T}"
        )
    rows = train_cfg.batch_tokens // T
    if rows % (mb * dp):
        per_rank = rows // dp  # the largest micro-batch that would split a rank's rows, if they split
        fits = max((d for d in range(1, mb) if per_rank % d == 0), default=0) if rows % dp == 0 else 0
        raise ConfigError(
            f"train.batch_tokens={train_cfg.batch_tokens} gives {rows} sequences per step, which does not "
            f"split into micro-batches of {mb} on {dp} rank(s); make batch_tokens a multiple of "
            f"seq_len*micro_batch*ranks = {T * mb * dp}"
            + (f", or set train.micro_batch={fits} ({per_rank} rows a rank)" if fits else "")
        )
    return rows, rows // (mb * dp)


def _check_experts(cfg, world_size: int, m) -> None:
    """model.mlp=moe trains on one device, under DDP or FSDP2, and with its experts split over
    parallel.ep ranks; not under tensor or pipeline parallel, nor compiled (its expert loop reads
    the token counts on the host, a break in the graph)."""
    p, ep = cfg.parallel, cfg.parallel.ep
    if m.mlp != "moe":
        raise ConfigError(f"parallel.ep={ep} splits the experts of an MoE over ranks: set model.mlp=moe or parallel.ep=1")  # fmt: skip # noqa: E501
    for on, what in ((p.tp > 1, f"parallel.tp={p.tp}"), (p.pp > 1, f"parallel.pp={p.pp}"),
                     (cfg.train.compile, "train.compile=true"),  # the router losses are lm's and sft's:
                     (cfg.train.task not in ("lm", "sft"), f"train.task={cfg.train.task}")):  # fmt: skip
        if on:
            raise ConfigError(f"model.mlp=moe does not run with {what} yet; it runs on one device, under parallel.data=ddp or fsdp, and with parallel.ep")  # fmt: skip # noqa: E501
    if ep > 1 and (ep != world_size or p.dp_replicate > 1):
        raise ConfigError(f"parallel.ep={ep} splits the experts over all the data-parallel ranks: set parallel.ep to the number of ranks ({world_size}), with parallel.dp_replicate=1")  # fmt: skip # noqa: E501
    if m.n_experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide model.n_experts ({m.n_experts}): each rank holds n_experts / ep experts")  # fmt: skip # noqa: E501


def _check_tensor_parallel(cfg, world_size: int, m, task) -> None:
    tp, t, pp = cfg.parallel.tp, cfg.train, cfg.parallel.pp
    n_kv = m.n_kv_head or m.n_head
    split = (("model.n_head", m.n_head), ("model.n_kv_head", n_kv), ("the MLP width", mlp_hidden_size(m)))
    for what, n in split:
        if n % tp:
            raise ConfigError(f"parallel.tp={tp} must divide {what} ({n}): each rank takes a tp-th of them")
    if m.vocab_size and m.vocab_size % tp:
        raise ConfigError(f"parallel.tp={tp} must divide model.vocab_size ({m.vocab_size}): the embedding and head are split by rows")  # fmt: skip # noqa: E501
    if world_size // pp > tp and cfg.parallel.data == "ddp":
        raise ConfigError(
            f"parallel.tp={tp} on {world_size // pp} ranks per stage leaves {world_size // pp // tp} "
            "data-parallel groups, "
            "which shard with FSDP2 over the tensor-parallel DTensors: set parallel.data=fsdp"
        )
    if cfg.parallel.loss_parallel and (t.z_loss or m.logit_softcap):
        raise ConfigError("parallel.loss_parallel computes plain cross-entropy on split logits: set train.z_loss=0 and model.logit_softcap=0")  # fmt: skip # noqa: E501
    if cfg.parallel.sequence_parallel and m.pos != "rope":
        raise ConfigError("parallel.sequence_parallel needs model.pos=rope: learned positions are added to the whole sequence")  # fmt: skip # noqa: E501
    unsupported = (
        (not task.splits_model, f"train.task={t.task}"),
        (t.lora_rank, "LoRA"),
        (t.qat != "none", "QAT"),
    )
    for on, what in unsupported:
        if on:
            raise ConfigError(f"parallel.tp={tp} trains the language model only for now, not {what}")


def _check_pipeline(cfg, world_size: int, model_cfg, task) -> None:
    p, t = cfg.parallel, cfg.train
    pp, v = p.pp, virtual_stages(p)
    stages = pp * v
    if model_cfg.n_layer < stages:
        raise ConfigError(f"parallel.pp={pp} × {v} stage(s) per rank = {stages} stages, but the model has {model_cfg.n_layer} layers: each stage needs at least one")  # fmt: skip # noqa: E501
    if p.pp_schedule == "interleaved-1f1b" and v < 2:
        raise ConfigError("parallel.pp_schedule=interleaved-1f1b needs parallel.pp_virtual_stages >= 2 (or 0)")  # fmt: skip # noqa: E501
    if p.pp_schedule != "interleaved-1f1b" and v != 1:
        raise ConfigError(f"parallel.pp_virtual_stages={v} needs parallel.pp_schedule=interleaved-1f1b; {p.pp_schedule} runs one stage per rank")  # fmt: skip # noqa: E501
    if model_cfg.tie_embeddings:
        raise ConfigError("model.tie_embeddings=true shares the embedding with the head, which live on the first and the last pipeline stage: set model.tie_embeddings=false with parallel.pp")  # fmt: skip # noqa: E501
    unsupported = ((not task.splits_model, f"train.task={t.task}"), (t.lora_rank, "LoRA"),
                   (t.qat != "none", "QAT"), (t.precision == "fp16", "fp16 (its loss scaler)"),
                   (t.z_loss, "train.z_loss"), (p.loss_parallel, "parallel.loss_parallel"))  # fmt: skip
    for on, what in unsupported:
        if on:
            raise ConfigError(f"parallel.pp={pp} trains the language model with plain cross-entropy only for now, not {what}")  # fmt: skip # noqa: E501
    dp = world_size // (pp * p.tp * p.dp_replicate) * p.dp_replicate
    if dp > 1 and p.data == "ddp":
        raise ConfigError(f"parallel.pp={pp} on {world_size} ranks leaves {dp} data-parallel groups, which shard with FSDP2 (DDP's reducer expects one backward per step, a pipeline runs one per micro-batch): set parallel.data=fsdp")  # fmt: skip # noqa: E501
    rows = t.batch_tokens // t.seq_len // max(dp, 1)
    m = microbatches(cfg, max(dp, 1))
    if rows % m or rows < m:
        raise ConfigError(f"parallel.pp_microbatches={m}: each data-parallel rank's {rows} rows per step do not split into {m} equal micro-batches")  # fmt: skip # noqa: E501
    if p.pp_schedule == "1f1b" and m < pp:
        raise ConfigError(f"parallel.pp_schedule=1f1b needs at least as many micro-batches as stages: {m} < {pp}; raise train.batch_tokens or parallel.pp_microbatches")  # fmt: skip # noqa: E501
    if p.pp_schedule == "interleaved-1f1b" and m % max(1, m // pp):
        raise ConfigError(f"parallel.pp_schedule=interleaved-1f1b runs micro-batches in rounds of {pp}: {m} is not a multiple of {max(1, m // pp)}")  # fmt: skip # noqa: E501
