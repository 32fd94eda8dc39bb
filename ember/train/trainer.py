"""``ember train``: one loop for a CPU, a GPU, or many ranks under torchrun.

    result = train(load_config("tiny", ["train.max_steps=20"]))

The loop (``Trainer.run``) reads top to bottom: budget check, learning rates, batch, the
step (``train_step``: micro-batches with loss scaled by accumulation, backward, unscale +
clip, non-finite guard agreed across ranks, optimizer step), log (``_log``), evaluate,
checkpoint. What is trained is a *task* (``LMTask`` here: next-token prediction), which
supplies ``loss`` and ``evaluate``; post-training plugs into the same loop as tasks and loaders
of its own: SFT (ember/train/sft.py), DPO (dpo.py) and GRPO (grpo.py, whose "loader" samples the
step's completions from the training model itself). The optimizer (``train.optimizer``:
AdamW, or Muon on the block matrices) comes from ``ember.train.optim`` with one parameter group
per role; each group has its own peak learning rate (``group["peak_lr"]``) and the schedule
scales each peak alike. The logged ``lr`` is the schedule at ``train.lr``.

Before the layout is applied, the model may start from a finished run's float weights
(``train.init_from``: fine-tuning; checked against this run's model config and tokenizer, and
skipped on resume, where the checkpoint's weights win). Supervised fine-tuning reads no
shards, so its tokenizer is the source run's; one without the chat tokens (an imported GPT-2 or
Llama tokenizer) gets them appended, and the embedding and head grow to match, each new row the
mean of the old ones (``_chat_tokenizer``, ``grow_vocab``). Its block linears (and the output
head, at int8) may fake-quantize their weights in every forward (``train.qat``: ``QATLinear``,
same parameters and names), so
compile traces the rounding and DDP/FSDP, checkpoints and the exported float weights are those
of a plain run; ``ember quantize`` with the same scheme then stores what training saw.

Numbers you can trust:

- the global batch at step ``s`` is a pure function of ``(run.seed, s)`` (see
  ``ember.data.loader``), the schedule is a pure function of step and budget progress, and
  checkpoints hold model, optimizer (Muon momenta included), scaler, RNG, step, tokens and
  elapsed time (the peak learning rates come from the config on resume): resuming
  reproduces the uninterrupted run bitwise on CPU in fp32 deterministic mode; and a run resumes
  only as itself (``_resume_folder``, ``_check_resumed_config``: one history per directory);
- the weights are initialised identically on every rank (seeded, on the CPU, before the
  layout is applied), so DDP and FSDP2 runs match a single process at the same global batch.
  Building on the meta device and initialising sharded parameters in place, which very
  large models need, comes with the scaling work.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch.profiler import record_function

import ember
from ember.config import config_to_yaml
from ember.data.chat import add_chat_tokens, chat_ids
from ember.data.loader import TokenDataset, TrainLoader, ValLoader
from ember.data.manifest import TOKENIZER, load_tokenizer, read_manifest
from ember.data.tokenizer import SPECIALS_FILE, Tokenizer, file_sha256
from ember.errors import ConfigError, DataError, EmberError
from ember.model.gpt import GPT, grow_vocab
from ember.parallel.dist import Watchdog, all_reduce, barrier, destroy_distributed, init_distributed, print0
from ember.parallel.parallelize import check_layout, parallelize, unwrap
from ember.train.checkpoint import (
    export_weights,
    latest_checkpoint,
    load_checkpoint,
    load_run,
    load_weights,
    run_tokenizer,
    save_checkpoint,
)
from ember.train.dpo import DPOTask, PairLoader, encode_pairs, load_pairs, task_preferences, token_logps
from ember.train.grpo import GRPOTask, Rollouts
from ember.train.metrics import MetricsLog, ProgressBar, peak_flops, peak_memory_mb
from ember.train.optim import build_optimizer, lr_at
from ember.train.reward import RMTask
from ember.train.sft import SFTLoader, SFTTask, data_task, encode_conversations, load_conversations

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


# On resume the config must equal the run's, but for where the run lives, computes and logs
# (RESUME_FREE). RESUME_FIXED keys and the tokenizer shape the weights, the optimizer state and every
# batch: no opt-in accepts a change to them. Other changes (budgets and so the schedule's length,
# eval and checkpoint cadence, learning rates) need train.resume_allow_changes=true.
RESUME_FREE = ("run.name", "run.out_dir", "train.resume", "train.device", "train.log_every", "parallel.")
RESUME_FREE += ("train.log_dynamics",)
RESUME_FREE += ("train.init_from",)  # it only starts a run: a resumed one loads its checkpoint
RESUME_FIXED = ("model.", "run.seed", "train.batch_tokens", "train.seq_len", "train.optimizer", "data.dir")
RESUME_FIXED += ("data.sampling", "tokenizer")
# tasks on conversations: no shards read, the source run's tokenizer
CHAT_TASKS = ("sft", "dpo", "grpo", "rm")


class NonFiniteError(EmberError):
    """Loss or gradients became NaN/Inf."""


# ---------------------------------------------------------------- the task


class LMTask:
    """Next-token prediction: cross-entropy on shifted windows, optional z-loss (PaLM §5).
    ``token_bytes[i]`` is the number of UTF-8 bytes token ``i`` stands for, so bits per byte
    counts the bytes of the evaluated text exactly, whatever the tokenizer."""

    def __init__(self, z_loss: float, token_bytes: torch.Tensor):
        self.z_loss = z_loss
        self.token_bytes = token_bytes

    def loss(self, model, batch) -> tuple[torch.Tensor, dict]:
        x, y = batch
        logits = model(x).float()  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        if self.z_loss:
            loss = loss + self.z_loss * torch.logsumexp(logits, dim=-1).pow(2).mean()
        return loss, {}

    @torch.no_grad()
    def evaluate(self, model, val_loader, autocast) -> dict:
        token_bytes = self.token_bytes
        device = token_bytes.device
        sums = torch.zeros(4, dtype=torch.float64, device=device)  # nats, tokens, nats on text, bytes
        was_training = model.training
        model.eval()
        for x, y in val_loader:
            with autocast:
                logits = model(x)
            if logits is None:  # a pipeline rank without the last stage
                continue
            logits = logits.float()
            if hasattr(logits, "full_tensor"):  # split by vocabulary (parallel.loss_parallel): gathered
                logits = logits.full_tensor()
            nats_per_token = F.cross_entropy(logits.flatten(0, 1), y.reshape(-1), reduction="none")
            text = token_bytes[y.reshape(-1)] > 0  # <|eos|> and friends stand for no bytes of text
            nats = nats_per_token.sum()
            sums += torch.stack(
                [
                    nats.double(),
                    torch.tensor(y.numel(), device=device, dtype=torch.float64),
                    nats_per_token[text].sum().double(),
                    token_bytes[y].sum().double(),
                ]
            )
        model.train(was_training)
        all_reduce(sums)
        nats, tokens, text_nats, nbytes = sums.tolist()
        loss = nats / max(tokens, 1)
        return {
            "val_loss": loss,
            "val_ppl": math.exp(min(loss, 50)),
            # bits per UTF-8 byte of the text, so tokenizers compare fairly (special tokens excluded)
            "val_bpb": text_nats / math.log(2) / max(nbytes, 1),
        }


# ---------------------------------------------------------------- helpers


def _set_deterministic(on: bool) -> None:
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def _git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parents[2],
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _env_record(env) -> dict:
    return {
        "ember": ember.__version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device": str(env.device),
        "device_name": torch.cuda.get_device_name(env.device)
        if env.device.type == "cuda"
        else platform.processor(),
        "world_size": env.world_size,
        "cpu_threads": torch.get_num_threads(),
        "git_sha": _git_sha(),
        "command": " ".join(sys.argv),
    }


def resolve_model_config(model_cfg, tokenizer):
    """Fill ``vocab_size`` from the tokenizer (rounded up to ``vocab_multiple``) and check it."""
    vocab = model_cfg.vocab_size
    if vocab == 0:
        m = model_cfg.vocab_multiple
        vocab = (tokenizer.vocab_size + m - 1) // m * m
    if vocab < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab} is smaller than the tokenizer's {tokenizer.vocab_size}; "
            "set model.vocab_size=0 to take it from the tokenizer"
        )
    return replace(model_cfg, vocab_size=vocab)


def clip_grad_norm(params, max_norm: float, pipeline=None) -> torch.Tensor:
    """``clip_grad_norm_`` that also takes a mix of DTensor and plain gradients, or DTensors on
    different meshes (tensor parallel splits the blocks' matrices and leaves norms whole; FSDP2
    over it puts the two on a 2-D and a 1-D mesh): each norm as a plain number (a DTensor's is
    reduced over its mesh), the total, then every gradient scaled in place. Gradients of one
    kind (one device, DDP, FSDP2 alone) on a GPU take torch's own batched path; on a CPU each
    matrix's norm is taken row by row, then over its rows in float64: torch's CPU norm sums a
    whole tensor's squares in one float32 accumulator, which on an embedding's gradient of 0.5 M
    elements came out 1.1e-4 low (``ember analyze CONFIG determinism --nproc 2
    parallel.data=fsdp`` found it: FSDP2's half-size shards lost less) and on 40 M entries of
    0.1, 2% (pytorch/pytorch#169237); by rows, 1e-7. Under pipeline parallel (``pipeline``: the
    rank's PipelineGPT) the norm sums every stage's gradients."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    on_cpu = bool(grads) and grads[0].device.type == "cpu"
    if pipeline is not None:
        from ember.parallel.pipeline import pipeline_grad_norm

        total = pipeline_grad_norm(params, pipeline.group)
    elif not on_cpu and len({(type(g), getattr(g, "device_mesh", None)) for g in grads}) <= 1:
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)  # one kind: torch's own
        return total.full_tensor() if hasattr(total, "full_tensor") else total
    else:
        rows = [torch.linalg.vector_norm(g, dim=-1) if on_cpu and g.dim() > 1 else g for g in grads]
        norms = [r.double().norm(2.0) if on_cpu else r.norm(2.0) for r in rows]
        norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
        total = torch.stack(norms).norm(2.0).float() if norms else torch.zeros(())
    if max_norm < math.inf:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device) if not hasattr(g, "device_mesh") else coef.item())
    return total


def _batch_layout(train_cfg, world_size: int) -> tuple[int, int]:
    """(global rows per step, micro-steps of accumulation), or a ConfigError that says why not."""
    T, mb = train_cfg.seq_len, train_cfg.micro_batch
    if train_cfg.batch_tokens % T:
        raise ConfigError(
            f"train.batch_tokens={train_cfg.batch_tokens} is not a multiple of train.seq_len={T}"
        )
    rows = train_cfg.batch_tokens // T
    if rows % (mb * world_size):
        raise ConfigError(
            f"train.batch_tokens={train_cfg.batch_tokens} gives {rows} sequences per step, which does not "
            f"split into micro-batches of {mb} on {world_size} rank(s); make batch_tokens a multiple of "
            f"seq_len*micro_batch*ranks = {T * mb * world_size}"
        )
    return rows, rows // (mb * world_size)


def _find_nonfinite_module(model, task, batch, autocast) -> str:
    """Re-run the micro-batch, forward and backward, with every module output, gradient at a
    module output and parameter gradient checked in the order they are computed
    (``ember.analysis.replay.Recorder``); say where the first non-finite one is."""
    from ember.analysis.replay import Recorder

    model.zero_grad(set_to_none=True)  # the failed step's gradients would be seen again
    rec = Recorder(unwrap(model), keep=False)
    try:
        with autocast:  # as in training, so an overflow reproduces
            loss, _ = task.loss(model, batch)
        if rec.first is None:
            loss.backward()
    finally:
        rec.close()
        model.zero_grad(set_to_none=True)
    first = rec.first
    if first is None:
        return "none in the forward or the backward pass (the loss itself?)"
    if first["phase"] == "forward":
        return first["name"]
    return f"none in the forward pass; in the backward, the {first['phase'].replace('backward', 'gradient at the output')} of {first['name']}"  # fmt: skip # noqa: E501


def _chat_tokenizer(run: str) -> tuple[Tokenizer, Path | None, int | None]:
    """The tokenizer of fine-tuning on conversations (SFT, DPO) from ``run``: the source run's
    (these tasks read no shards, so the data dir has no say), with the chat tokens appended if
    it lacks them (an imported foreign tokenizer). Returns it, the file to copy into the run
    (None when it grew: it is saved from memory) and, when it grew, its size before."""
    path = run_tokenizer(run)
    if path is None:
        raise ConfigError(
            f"train.init_from={run}: no {TOKENIZER} in {Path(run) / 'model'} or {run}; give a run "
            "directory that `ember train` or `ember import` wrote"
        )
    tokenizer = Tokenizer.load(path)
    known = tokenizer.vocab_size
    added = add_chat_tokens(tokenizer)
    if not added:
        return tokenizer, path, None
    ids = f"{known}..{tokenizer.vocab_size - 1}"
    print0(f"ember: {path} lacks the chat tokens: added {', '.join(added)} as ids {ids}")
    return tokenizer, None, known


def _init_from(model, run: str, model_cfg, tokenizer_sha: str | None, known: int | None = None) -> None:
    """Load run directory ``run``'s final float weights (``model/``) into ``model`` (fine-tuning);
    an EmberError, before anything is written, if they cannot stand for this run's model: another
    model config, another tokenizer, or quantized weights (their rounding is not trainable).
    ``tokenizer_sha`` None: the tokenizer is the source's own (SFT), nothing to compare. ``known``:
    the source tokenizer's size when chat tokens were appended to it; the embedding and head then
    grow to this run's vocabulary, rows from ``known`` on the mean of the rows before."""
    from ember.export.quantize import read_spec

    src = Path(run)
    folder = src / "model"
    if not (folder / "model_config.json").is_file():
        raise ConfigError(
            f"train.init_from={run}: no final weights there ({folder / 'model_config.json'} not found); "
            "give a run directory that `ember train` finished"
        )
    spec = read_spec(folder)
    if spec is not None:
        raise ConfigError(
            f"train.init_from={run} is quantized ({spec.label}); fine-tune from the float run it was "
            "quantized from (train.qat trains towards the same rounding)"
        )
    try:
        theirs = json.loads((folder / "model_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"train.init_from={run}: cannot read {folder}/model_config.json ({e})") from None
    ours = asdict(model_cfg)
    differ = [k for k in ours if k in theirs and theirs[k] != ours[k]] + [k for k in theirs if k not in ours]
    score_from_lm = model_cfg.head == "score" and theirs.get("head", "lm") == "lm"  # a reward model's start
    free = {"dropout"} | ({"vocab_size"} if known is not None else set())  # weights' shapes unchanged
    free |= {"head", "init_std"} if score_from_lm else set()  # (init_std: the new head's)
    differ = [k for k in differ if k not in free]  # (vocab_size: it grew with the tokenizer)
    if differ:
        listing = ", ".join(f"model.{k}={theirs.get(k)!r} there but {ours.get(k)!r} here" for k in differ)
        raise ConfigError(
            f"train.init_from={run}: its model differs from this run's: {listing}; set those keys to the "
            f"source's values (or use {src / 'config.yaml'} as the config)"
        )
    tokenizer = run_tokenizer(src)
    if tokenizer_sha is not None and (tokenizer is None or file_sha256(tokenizer) != tokenizer_sha):
        found = f"{tokenizer} differs from" if tokenizer else f"no {TOKENIZER} in {folder} or {src} to match"
        raise ConfigError(
            f"train.init_from={run}: {found} the data dir's tokenizer; prepare the data with the "
            "source run's tokenizer, or fine-tune on the data dir it was trained on"
        )
    if known is not None:
        print0(
            f"ember: the embedding and head grow from {theirs['vocab_size']} to {model_cfg.vocab_size} rows; "
            f"rows {known}.. start as the mean of rows 0..{known - 1}"
        )
    if score_from_lm:
        print0(f"ember: every weight from {run} but its vocabulary head; the score head starts at init")

    def adapt(state: dict) -> dict:
        if known is not None:
            state = grow_vocab(state, model_cfg.vocab_size, known)
        if score_from_lm:  # the score head keeps its initialisation
            state = {**state, "output.weight": model.output.weight.detach().clone()}
        return state

    load_weights(model, folder, adapt=adapt)


def _apply_lora(model, train_cfg) -> set[str]:
    """``train.lora_rank``: adapters on the targeted block linears, everything else frozen (the
    base in NF4 with ``train.qlora``); returns the adapters' state dict names, which are all a
    checkpoint then holds."""
    from ember.model.lora import apply_lora, lora_summary

    if not train_cfg.init_from:
        print0("ember: note: LoRA without train.init_from adapts a freshly initialised model")
    apply_lora(
        model,
        train_cfg.lora_rank,
        train_cfg.lora_alpha,
        train_cfg.lora_dropout,
        tuple(train_cfg.lora_targets),
        nf4=train_cfg.qlora,
    )
    print0(lora_summary(model) + (" (base in NF4)" if train_cfg.qlora else ""))
    return {name for name, p in model.named_parameters() if p.requires_grad}


def _train_rows(model, ids: list[int]) -> set[str]:
    """Let only the rows ``ids`` of the embedding and of an untied head train: each table's
    gradient is masked to those rows, and as such tables take the embedding role (no weight
    decay, ``param_role``) AdamW leaves the other rows exactly as they were. The fine-tuning of
    new special tokens that PEFT offers as ``trainable_token_indices``; returns the tables'
    state dict names."""
    names = {"tok_embeddings.weight"}
    if model.output.weight is not model.tok_embeddings.weight:
        names.add("output.weight")
    for name in names:
        weight = model.get_parameter(name)
        mask = torch.zeros(weight.size(0), 1, dtype=weight.dtype, device=weight.device)
        mask[ids] = 1
        weight.requires_grad_(True)
        weight.register_hook(lambda grad, mask=mask: grad * mask.to(grad.device, grad.dtype))  # after .to()
        weight.row_mask = mask  # read by param_role
    count = len(ids) * model.tok_embeddings.weight.size(1) * len(names)
    tables = " and ".join(sorted(names))
    print0(f"and {len(ids)} rows of the {tables} (the chat tokens): {count:,} parameters")
    return names


def _apply_qat(model, train_cfg) -> None:
    """``train.qat``: every nn.Linear in the blocks fake-quantizes its weight in the forward pass,
    and the output head at int8 as ``ember quantize`` stores it (``QATLinear``: same parameters
    and names, so optimizer, checkpoints and the exported float weights are unchanged, and
    ``ember quantize`` of the same scheme stores what training saw)."""
    from ember.export.quantize import QuantSpec, apply_qat

    spec = QuantSpec(train_cfg.qat, train_cfg.qat_group_size)
    if spec.scheme == "int4-weight":
        widths = sorted({m.in_features for m in model.layers.modules() if isinstance(m, torch.nn.Linear)})
        bad = [k for k in widths if k % spec.group_size]
        if bad:
            raise ConfigError(
                f"train.qat_group_size={spec.group_size} does not divide the block linears' input widths "
                f"{bad}; choose a group size that divides {widths}"
            )
    apply_qat(model, spec)


# ---------------------------------------------------------------- the trainer


class Trainer:
    def __init__(self, cfg, run_dir: Path | None = None):
        self.cfg = cfg
        t = cfg.train
        if not (t.max_steps or t.max_tokens or t.max_time):
            raise ConfigError("no training budget: set train.max_steps, train.max_tokens or train.max_time")
        self.env = env = init_distributed(cfg.parallel, t.device)
        self.watch = Watchdog(env, cfg.parallel.timeout_s)  # a failed collective says who and why
        if t.precision != "fp32" and env.device.type == "cpu":
            print0(f"ember: note: {t.precision} autocast on a CPU is slow; fp32 is the CPU default")
        _set_deterministic(t.deterministic)

        chat_from = t.init_from if t.task in CHAT_TASKS else ""
        manifest = None if chat_from else read_manifest(cfg.data.dir)
        if chat_from:
            self.tokenizer, self.tokenizer_file, known = _chat_tokenizer(chat_from)
        else:
            self.tokenizer, known = load_tokenizer(cfg.data.dir, manifest), None
            self.tokenizer_file = Path(cfg.data.dir) / TOKENIZER
        # the run's tokenizer: copied from tokenizer_file, or saved from memory when it grew
        file = self.tokenizer_file
        self.tokenizer_sha = file_sha256(file) if file else self.tokenizer.sha256
        model_cfg = cfg.model
        if known is not None and 0 < model_cfg.vocab_size < self.tokenizer.vocab_size:
            model_cfg = replace(model_cfg, vocab_size=0)  # from the grown tokenizer, rounded up
        self.model_cfg = resolve_model_config(model_cfg, self.tokenizer)
        check_layout(cfg, env.world_size, self.model_cfg)
        if t.log_dynamics and (env.distributed and (cfg.parallel.data == "fsdp" or env.tp > 1 or env.pp > 1) or t.compile):  # fmt: skip # noqa: E501
            raise ConfigError("train.log_dynamics reads whole weights and eager attention: one device or DDP, without train.compile")  # fmt: skip # noqa: E501
        self.global_rows, self.grad_accum = _batch_layout(t, env.dp_size)
        self.run_dir = Path(run_dir) if run_dir else Path(cfg.run.out_dir) / cfg.run.name
        self.resume_from = self._resume_folder()
        if self.resume_from is not None:
            self._check_resumed_config()

        torch.manual_seed(cfg.run.seed)
        model = GPT.build(self.model_cfg, device="cpu")  # meta → to_empty → init_weights (seeded above)
        # on resume the checkpoint's weights win; a LoRA checkpoint holds only the adapters, so
        # its frozen base is loaded again from init_from, and DPO's reference copy comes from it
        if t.init_from and (self.resume_from is None or t.lora_rank or t.task in ("dpo", "grpo")):
            _init_from(model, t.init_from, self.model_cfg, None if chat_from else self.tokenizer_sha, known)
        if t.qat != "none":  # before parallelize: compile then traces the fake quantization too
            _apply_qat(model, t)
        self.adapters: set[str] | None = None  # with LoRA: the state dict entries that train
        if t.lora_rank:
            self.adapters = _apply_lora(model, t)
            if t.task == "sft" and t.lora_chat_tokens:  # (DPO's reference would move with them)
                self.adapters |= _train_rows(model, list(chat_ids(self.tokenizer).values()))
        self.n_params = model.num_params()
        self.flops_per_token = model.flops_per_token(t.seq_len)
        self.peak_flops = peak_flops(env.device)
        model.to(env.device)
        self.frozen = None  # DPO's reference without LoRA: the starting weights, frozen
        self.step_metrics: dict[str, torch.Tensor] = {}  # the task's own, per step (DPO's rewards, ...)
        if t.task in ("dpo", "grpo"):
            if env.world_size > 1 and cfg.parallel.data == "fsdp":
                raise ConfigError(f"train.task={t.task} runs on one device or under DDP (parallel.data=ddp)")
            if self.adapters is None and (t.task == "dpo" or cfg.grpo.beta):
                self.frozen = copy.deepcopy(model).requires_grad_(False).eval()
        self.model = parallelize(model, env, cfg)
        self.loss_parallel = contextlib.nullcontext
        if env.tp > 1 and cfg.parallel.loss_parallel:  # forward and backward of the loss on split logits
            from torch.distributed.tensor.parallel import loss_parallel

            self.loss_parallel = loss_parallel
        self.optimizer = build_optimizer(self.model, t, env.device)
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=t.precision == "fp16")
        dtype = AUTOCAST.get(t.precision)
        fsdp_casts = env.distributed and cfg.parallel.data == "fsdp"  # its MixedPrecisionPolicy does it
        self.autocast = (
            torch.autocast(env.device.type, dtype=dtype)
            if dtype and not fsdp_casts
            else contextlib.nullcontext()
        )
        token_bytes = torch.tensor(self.tokenizer.token_byte_lengths(self.model_cfg.vocab_size))
        if t.task == "sft":
            self.task = SFTTask(cfg.sft.packing, self.tokenizer, cfg.sft.data, cfg.sft.eval_problems)
            examples = encode_conversations(self.tokenizer, load_conversations(cfg.sft), t.seq_len)
            print0(f"sft: {len(examples):,} conversations from {cfg.sft.data}")
            self.loader = SFTLoader(
                examples,
                t.seq_len,
                self.global_rows,
                cfg.run.seed,
                cfg.sft.packing,
                env.dp_rank,
                env.dp_size,
                env.device,
            )
            self.val_loader = None  # task accuracy on held-out problems: `ember eval RUN --task NAME`
        elif t.task in ("dpo", "rm"):
            policy = [model] if t.task == "dpo" else []  # rm: the starting run's, loaded once, answers

            def answer(task, problems):
                if not policy and not t.init_from:
                    raise ConfigError("train.task=rm with dpo.rejected=model needs train.init_from: the run whose wrong answers are rejected")  # fmt: skip # noqa: E501
                policy[:] = policy or [load_run(t.init_from)[0]]
                return self._answers(policy[0], task, problems)

            pairs = encode_pairs(self.tokenizer, load_pairs(cfg.dpo, cfg.run.seed, answer), t.seq_len)
            if t.task == "dpo":
                self.task = DPOTask(cfg.dpo, self.tokenizer, self._reference(model))
            else:
                self.task = RMTask(self.tokenizer, self._held_out_pairs(answer))
            print0(f"{t.task}: {len(pairs):,} preference pairs from {cfg.dpo.data}")
            where = (env.dp_rank, env.dp_size, env.device)
            self.loader = PairLoader(pairs, t.seq_len, self.global_rows, t.micro_batch, cfg.run.seed, *where)
            self.val_loader = None
        elif t.task == "grpo":
            g = cfg.grpo
            self.task = GRPOTask(g, self.tokenizer)
            reference = self._reference(model, g.temperature, g.shared_prefix) if g.beta else None
            where = (env.dp_rank, env.dp_size, env.device)
            self.loader = Rollouts(g, self.tokenizer, model, reference, self.global_rows, t.micro_batch,
                                   cfg.run.seed, *where)  # fmt: skip
            print0(
                f"grpo: {self.global_rows // g.group} prompts × {g.group} completions per step, from "
                f"{len(self.loader.examples):,} {g.data} train problems"
            )
            self.val_loader = None
        else:
            self.task = LMTask(t.z_loss, token_bytes.to(env.device))
            train_set = TokenDataset(cfg.data.dir, "train")
            self.loader = TrainLoader(
                train_set,
                t.seq_len,
                self.global_rows,
                cfg.run.seed,
                env.dp_rank,
                env.dp_size,
                mode=cfg.data.sampling,
                device=env.device,
            )
            self.val_loader = self._val_loader(manifest)

        self.step, self.tokens, self.elapsed_before = 0, 0, 0.0
        self.best_val, self.best_step, self.skipped = math.inf, -1, 0
        if self.resume_from is not None:
            # the config's peaks win, and this layout's kernels (TP cannot take a 1-process run's foreach)
            keys = ("peak_lr", "foreach", "fused")
            mine = [{k: g[k] for k in keys if k in g} for g in self.optimizer.param_groups]
            meta = load_checkpoint(self.resume_from, self.model, self.optimizer, only=self.adapters)
            for group, kept in zip(self.optimizer.param_groups, mine, strict=True):
                group.update(kept)
            self.step, self.tokens = meta["step"], meta["tokens"]
            self.elapsed_before = meta["elapsed"]
            self.best_val, self.best_step = meta.get("best_val", math.inf), meta.get("best_step", -1)
            self.skipped = meta.get("skipped", 0)
            if meta.get("scaler"):
                self.scaler.load_state_dict(meta["scaler"])
            if meta.get("data_cursor"):  # SFT's epoch order (LM batches are a function of the step)
                self.loader.load_state_dict(meta["data_cursor"])
            print0(f"resumed from {self.resume_from} (step {self.step}, {self.tokens:,} tokens)")
        # a finished run resumed again: nothing to train, and nothing in its directory changes
        self.done = self.progress(self.elapsed_before) >= 1.0 and (self.run_dir / "summary.json").is_file()
        if not self.done:
            self._prepare_run_dir()
        resumed_at = self.step if self.resume_from is not None else None
        self.metrics = MetricsLog(self.run_dir, env.is_main and not self.done, t.tensorboard, resumed_at)
        self.dynamics, self.dyn_metrics = None, {}
        if t.log_dynamics:
            from ember.analysis.dynamics import Dynamics

            self.dynamics = Dynamics(unwrap(self.model))

    def _val_loader(self, manifest: dict) -> ValLoader | None:
        """Fixed validation windows, the same count on every rank (FSDP forwards are collective);
        None, with a note, when the val split is empty or shorter than one window."""
        t, env = self.cfg.train, self.env
        if not manifest["splits"]["val"]["shards"]:
            print0("ember: note: the data has no validation split (data.val_fraction=0): no evaluation")
            return None
        val_set = TokenDataset(self.cfg.data.dir, "val")
        try:
            probe = ValLoader(val_set, t.seq_len, t.micro_batch, max_windows=t.eval_windows)
        except DataError as e:
            print0(f"ember: note: no evaluation: {e}")
            return None
        usable = probe.n_windows_total // env.dp_size * env.dp_size
        if not usable:
            print0("ember: note: fewer validation windows than ranks: no evaluation")
            return None
        return ValLoader(
            val_set,
            t.seq_len,
            t.micro_batch,
            max_windows=usable,
            rank=env.dp_rank,
            world_size=env.dp_size,
            device=env.device,
        )

    # ------------------------------------------------------------ run directory

    def _resume_folder(self) -> Path | None:
        """The checkpoint to resume from, or None to start afresh; a ConfigError where either
        would mix two histories in one run directory."""
        resume, run_dir = self.cfg.train.resume, self.run_dir
        ckpts = run_dir / "checkpoints"
        newest = latest_checkpoint(ckpts)
        if resume == "never" and newest is not None:
            raise ConfigError(
                f"{run_dir} already holds checkpoints; resume it with train.resume=auto, "
                "or pick another run.name (nothing was overwritten)"
            )
        if resume in ("never", "auto"):
            metrics = run_dir / "metrics.jsonl"
            if newest is None and metrics.is_file() and metrics.stat().st_size:
                raise ConfigError(
                    f"{run_dir} holds the metrics of an earlier run but no committed checkpoint to resume "
                    "from (train.ckpt_every=0 saves one only at the end); delete that folder to start over, "
                    "or pick another run.name (nothing was overwritten)"
                )
            return newest
        folder = Path(resume) if Path(resume).is_dir() else ckpts / resume
        if not folder.is_dir():
            raise ConfigError(
                f"train.resume={resume!r}: no such checkpoint folder (use 'auto' or step-NNNNNN)"
            )
        if (
            newest is not None
            and newest.name > folder.name
            and newest.parent.resolve() == folder.parent.resolve()
        ):
            raise ConfigError(
                f"train.resume={resume!r} is older than {newest.name}; resuming from it would mix two "
                "histories. Move the newer step folders out of checkpoints/ first, or use train.resume=auto"
            )
        return folder

    def _check_resumed_config(self) -> None:
        """Compare the config with the one the checkpoint's run was last started with (its newest
        config-resume-*.yaml, else config.yaml), and the tokenizer with the run's copy."""
        run = self.resume_from.parent.parent
        saved = max(run.glob("config-resume-step-*.yaml"), default=run / "config.yaml")
        if not saved.is_file():
            return  # a checkpoint folder outside its run: nothing to compare with
        old = yaml.safe_load(saved.read_text())
        new = yaml.safe_load(config_to_yaml(replace(self.cfg, model=self.model_cfg)))
        changed = {
            f"{section}.{k}": (old[section][k], v)
            for section, values in new.items()
            for k, v in values.items()
            if k in old.get(section, {}) and old[section][k] != v
        }
        changed = {k: change for k, change in changed.items() if not k.startswith(RESUME_FREE)}
        sha = self.tokenizer_sha
        if (run / TOKENIZER).is_file() and (run_sha := file_sha256(run / TOKENIZER)) != sha:
            changed["tokenizer sha256"] = (run_sha[:12], sha[:12])
        fixed = [k for k in changed if k.startswith(RESUME_FIXED)]
        if changed and (fixed or not self.cfg.train.resume_allow_changes):
            listing = ", ".join(f"{k} {a!r} → {b!r}" for k, (a, b) in changed.items())
            fix = "pass train.resume_allow_changes=true to resume with these"
            if fixed:
                fix = f"{', '.join(fixed)} cannot change on resume: put them back, or start another run.name"
            raise ConfigError(f"resuming {run} with a config that differs from {saved}: {listing}. {fix}")

    def _held_out_pairs(self, answer) -> list:
        """A reward model's held-out pairs: ``dpo.eval_problems`` of the task's test problems, made
        as its training pairs are (none with a JSONL file of pairs)."""
        d = self.cfg.dpo
        if data_task(d.data, "dpo.data") is None or not d.eval_problems:
            return []
        made = task_preferences(d.data, d.eval_problems, self.cfg.run.seed, answer if d.rejected == "model" else None, "test")  # fmt: skip # noqa: E501
        return encode_pairs(self.tokenizer, made, self.cfg.train.seq_len)

    def _answers(self, model, task, problems) -> list[str]:
        """The starting model's greedy replies to ``problems`` (``dpo.rejected=model``): before any
        step, and on resume before the checkpoint loads, so the same pairs either way. Special
        tokens it emitted are left out (a reply is text, where they would be plain characters)."""
        from ember.data.tasks import reply_of
        from ember.infer.engine import Engine
        from ember.infer.evaluate import answer_problems

        print0(
            f"dpo: the starting model answers {len(problems):,} {task.name} problems (greedy) for the pairs"
        )
        was_training = model.training
        try:
            engine = Engine(model.eval(), self.tokenizer)
            longest = max(len(self.tokenizer.encode(p.answer)) for p in problems) + 8  # a wrong reply as long
            outputs = answer_problems(engine, task, problems, max_new_tokens=longest, batch=64)
            replies = [reply_of(text) for _, text, _ in outputs]
            for added in self.tokenizer.hf.get_added_tokens_decoder().values():  # text cannot hold
                replies = [r.replace(added.content, "") for r in replies]  # the control tokens it emitted
            return replies
        finally:
            model.train(was_training)

    def _reference(self, model, temperature: float = 1.0, share: bool = False):
        """The reference policy of DPO and GRPO: ``(x, y) ->`` per-token log-probabilities of the
        trained targets (``token_logps``, with ``share`` its shared prefixes), from the model with
        its adapters off (LoRA: no second copy) or from the frozen starting weights; in eval mode
        (no dropout) either way."""
        if self.frozen is not None:
            return lambda x, y: token_logps(self.frozen, x, y, temperature, share)
        from ember.model.lora import adapters_disabled

        def reference(x, y):
            was_training = model.training
            model.eval()
            try:
                with adapters_disabled(model):
                    return token_logps(model, x, y, temperature, share)
            finally:
                model.train(was_training)

        return reference

    def _prepare_run_dir(self) -> None:
        if not self.env.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg = replace(self.cfg, model=self.model_cfg)
        name = "config.yaml" if self.resume_from is None else f"config-resume-{self.resume_from.name}.yaml"
        (self.run_dir / name).write_text(config_to_yaml(cfg))  # the first leg's config.yaml is kept
        (self.run_dir / "env.json").write_text(json.dumps(_env_record(self.env), indent=2) + "\n")
        if self.tokenizer_file is None:  # grown by the chat tokens
            self.tokenizer.save(self.run_dir / TOKENIZER)
        else:
            shutil.copyfile(self.tokenizer_file, self.run_dir / TOKENIZER)
            self.tokenizer.save_specials(self.run_dir)  # a foreign tokenizer's; none for ember's

    # ------------------------------------------------------------ budget

    def progress(self, elapsed: float, steps_done: int = 0) -> float:
        """Fraction of the budget spent, counting ``steps_done`` more steps: a step's lr is set by
        where the budget stands when that step ends, so the last step of a step or token budget
        runs at the final learning rate."""
        t = self.cfg.train
        fractions = [
            (self.step + steps_done) / t.max_steps if t.max_steps else 0.0,
            (self.tokens + steps_done * t.batch_tokens) / t.max_tokens if t.max_tokens else 0.0,
            elapsed / t.max_time if t.max_time else 0.0,
        ]
        return max(fractions)

    # ------------------------------------------------------------ the loop

    def run(self) -> dict:
        t, env = self.cfg.train, self.env
        if self.done:  # a larger budget needs train.resume_allow_changes=true
            print0(f"{self.run_dir} spent its budget at step {self.step}: nothing to do")
            return json.loads((self.run_dir / "summary.json").read_text())
        print0(
            f"training {self.n_params / 1e6:.2f}M parameters on {env.world_size} × {env.device.type}, "
            f"{t.batch_tokens:,} tokens/step ({self.grad_accum} micro-steps of {t.micro_batch}×{t.seq_len} "
            f"per rank) → {self.run_dir}"
        )
        bar = ProgressBar(env.is_main)
        start = time.perf_counter()
        last = {}
        progress = self.progress(self.elapsed_before)
        batches = self.loader.iterate(self.step)  # background prefetch + pinned copies on CUDA
        comm = {"ddp": "DDP's gradient all-reduce", "fsdp": "FSDP's all-gathers and reduce-scatters"}
        if self.env.pp > 1:
            comm = dict.fromkeys(comm, f"the pipeline's sends and receives ({self.cfg.parallel.pp_schedule})")
        try:
            while progress < 1.0:
                self.watch.at(self.step + 1)
                t0 = time.perf_counter()
                lr = self.set_lr(self.progress(self._elapsed(start), steps_done=1))
                with record_function("ember/data"):
                    _, *batch = next(batches)  # (x, y), or (x, y, doc) for packed SFT
                t1 = time.perf_counter()
                self.watch.phase(f"the forward and backward ({comm[self.cfg.parallel.data]})")
                observe = self.dynamics is not None and (self.step + 1) % t.log_dynamics == 0
                if observe:
                    self.dynamics.begin()
                loss, grad_norm, fwd_bwd_s = self.train_step(batch)
                if observe:
                    self.dyn_metrics = self.dynamics.end()
                t3 = time.perf_counter()
                self.step += 1
                self.tokens += t.batch_tokens
                elapsed = self._elapsed(start)
                progress = self.progress(elapsed)
                last = self._log(bar, lr, loss, grad_norm, (t0, t1, t1 + fwd_bwd_s, t3), elapsed, progress)
                final = progress >= 1.0
                if (t.eval_every and self.step % t.eval_every == 0) or final:
                    self.watch.phase("evaluation")
                    last.update(self._evaluate())
                if (t.ckpt_every and self.step % t.ckpt_every == 0) or final:
                    self.watch.phase("the checkpoint save")
                    self._checkpoint(elapsed)
        except Exception as e:
            explained = self.watch.explain(e)
            if explained is None:
                raise
            raise explained from None
        finally:
            self.watch.stop()
            bar.close()
            self.loader.close()
            self.metrics.close()
        self._finish(last)
        return last

    def set_lr(self, progress_after: float) -> float:
        """The learning rates of the coming step, the budget at ``progress_after`` when it ends:
        each group's own peak, one schedule; returns the schedule at ``train.lr``."""
        t = self.cfg.train
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, progress_after, t, peak=group["peak_lr"])
        return lr_at(self.step, progress_after, t)

    def advance(self, batches) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One step outside ``run`` (``ember plan --measure``, ``ember analyze``): the schedule's
        learning rates, the next batch of ``batches`` (``loader.iterate``), ``train_step``."""
        self.set_lr(self.progress(0.0, steps_done=1))
        with record_function("ember/data"):
            _, *batch = next(batches)
        out = self.train_step(batch)
        self.step += 1
        self.tokens += self.cfg.train.batch_tokens
        return out

    def train_step(self, batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step on this rank's rows (x, y, ...: (rows, seq_len)): micro-batches with the
        loss scaled by accumulation, backward, unscale + clip, the non-finite guard agreed across
        ranks, step. Returns the loss (mean over ranks), the gradient norm and the seconds spent
        in forward + backward."""
        t = self.cfg.train
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=self.env.device)
        self.step_metrics = {}
        pipeline = getattr(self.model, "schedule", None) is not None
        if pipeline:  # the schedule runs every micro-batch's forward and backward
            with self.autocast:
                loss_sum = self.model.train_step(*batch)
            loss_sum *= self.env.pp  # only the last stage's ranks hold it: the average below is right
        for micro in range(0 if pipeline else self.grad_accum):
            rows = slice(micro * t.micro_batch, (micro + 1) * t.micro_batch)
            with self._sync_grads(micro == self.grad_accum - 1), self.loss_parallel():
                with self.autocast, record_function("ember/forward"):  # (labels for a profiler, if one runs)
                    loss, info = self.task.loss(self.model, tuple(b[rows] for b in batch))
                    loss = loss / self.grad_accum
                with record_function("ember/backward"):
                    self.scaler.scale(loss).backward()
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # (a replicated DTensor)
            loss_sum += loss.detach()
            for key, value in info.items():
                if isinstance(value, torch.Tensor):
                    share = value.detach().float() / self.grad_accum
                    self.step_metrics[key] = self.step_metrics.get(key, 0) + share
        self.watch.phase("the loss and metrics all-reduces")
        for value in self.step_metrics.values():
            all_reduce(value, "avg")
        fwd_bwd_s = time.perf_counter() - start

        with record_function("ember/optimizer"):
            self.scaler.unscale_(self.optimizer)
            max_norm = t.grad_clip or math.inf
            grad_norm = clip_grad_norm(self.model.parameters(), max_norm, self.model if pipeline else None)
            all_reduce(loss_sum, "avg")
            bad = ~torch.isfinite(loss_sum)
            if not self.scaler.is_enabled():  # under fp16 the scaler skips inf-gradient steps itself
                bad |= ~torch.isfinite(grad_norm)
            if all_reduce(bad.float(), "max").item():
                self._on_nonfinite(tuple(b[: t.micro_batch] for b in batch))
            else:
                self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm, fwd_bwd_s

    def _log(self, bar, lr: float, loss, grad_norm, times: tuple, elapsed: float, progress: float) -> dict:
        """The finished step's record, written to metrics.jsonl and shown on the progress bar, and
        a line every ``train.log_every`` steps. ``times``: when the step began, its batch came,
        forward + backward ended, and it ended."""
        t, env = self.cfg.train, self.env
        t0, t1, t2, t3 = times
        dt = t3 - t0
        last = {
            "skipped": self.skipped,
            "step": self.step,
            "tokens": self.tokens,
            "loss": loss.item(),
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": t.batch_tokens / dt,
            "step_s": dt,
            "data_s": t1 - t0,
            "fwd_bwd_s": t2 - t1,
            "opt_s": t3 - t2,
            "elapsed_s": elapsed,
            "peak_mem_mb": peak_memory_mb(env.device),
        }
        if self.peak_flops:
            last["mfu"] = self.flops_per_token * t.batch_tokens / dt / (self.peak_flops * env.world_size)
        last.update({key: value.item() for key, value in self.step_metrics.items()})
        last.update(getattr(self.loader, "metrics", {}))  # GRPO's rollout: rewards, lengths, times
        last.update(self.dyn_metrics)  # train.log_dynamics, on the steps it observes
        self.dyn_metrics = {}
        self.metrics.write(last)
        bar.update(progress, f"step {self.step} loss {last['loss']:.3f}")
        if self.step % t.log_every == 0 or self.step == 1:
            eta = elapsed / max(progress, 1e-9) * (1 - progress)
            print0(
                f"step {self.step:6d} | loss {last['loss']:.4f} | lr {lr:.2e} "
                f"| grad {last['grad_norm']:.2f} | "
                f"{last['tokens_per_s']:,.0f} tok/s | {100 * progress:5.1f}% | eta {eta:6.0f}s"
            )
        return last

    def _elapsed(self, start: float) -> float:
        """Seconds of training so far, including earlier legs; the slowest rank's clock, so
        all ranks agree when a time budget is spent."""
        elapsed = torch.tensor(self.elapsed_before + time.perf_counter() - start, device=self.env.device)
        return all_reduce(elapsed, "max").item()

    def _sync_grads(self, sync: bool):
        """Skip the gradient all-reduce on all but the last micro-step of accumulation."""
        if not sync and hasattr(self.model, "no_sync"):  # DDP
            return self.model.no_sync()
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def _on_nonfinite(self, batch: tuple) -> None:
        """Skip the update (the step still counts: the data moves on), or stop naming the culprit."""
        if self.cfg.train.nonfinite == "skip":
            self.skipped += 1
            print0(
                f"step {self.step + 1}: non-finite loss or gradient norm; "
                f"update skipped ({self.skipped} so far)"
            )
            return
        module = "not located under pipeline parallel"
        if getattr(self.model, "schedule", None) is None:
            module = _find_nonfinite_module(self.model, self.task, batch, self.autocast)
        raise NonFiniteError(
            f"step {self.step + 1}: loss or gradient norm is not finite; first non-finite output: {module}. "
            "Lower train.lr, set train.grad_clip, or pass train.nonfinite=skip. With the statistics of what "
            f"came before it: `ember analyze {self.run_dir} nonfinite --step {self.step + 1}`"
        )

    def _evaluate(self) -> dict:
        if isinstance(self.task, SFTTask):
            result = self.task.accuracy(unwrap(self.model))
            if "task_accuracy" in result:
                n = len(self.task.problems)
                print0(
                    f"step {self.step:6d} | {self.task.task.name} accuracy {result['task_accuracy']:.1%} "
                    f"on {n} test problems"
                )
            elif result:
                n = len(self.task.pairs)
                print0(f"step {self.step:6d} | pair accuracy {result['pair_accuracy']:.1%} on {n} held-out pairs")  # fmt: skip # noqa: E501
            if result:
                self.metrics.write({"step": self.step, "tokens": self.tokens, **result})
            return result
        if self.val_loader is None:
            return {}
        result = self.task.evaluate(self.model, self.val_loader, self.autocast)
        print0(
            f"step {self.step:6d} | val loss {result['val_loss']:.4f} | ppl {result['val_ppl']:.2f} | "
            f"bpb {result['val_bpb']:.4f}"
        )
        self.metrics.write({"step": self.step, "tokens": self.tokens, **result})
        if result["val_loss"] < self.best_val:
            self.best_val, self.best_step = result["val_loss"], self.step
            if self.cfg.train.keep_best:
                self._export("model-best")
        return result

    def _checkpoint(self, elapsed: float) -> None:
        meta = {
            "tokens": self.tokens,
            "elapsed": elapsed,
            "best_val": self.best_val,
            "best_step": self.best_step,
            "skipped": self.skipped,
            "world_size": self.env.world_size,
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "data_cursor": self.loader.state_dict() if hasattr(self.loader, "state_dict") else None,
        }
        keep = (self.best_step,) if self.cfg.train.keep_best and self.best_step >= 0 else ()
        save_checkpoint(
            self.run_dir / "checkpoints",
            self.step,
            self.model,
            self.optimizer,
            meta,
            keep_last=self.cfg.train.keep_last,
            keep_steps=keep,
            only=self.adapters,
        )

    def _write_report(self) -> None:
        from ember.report.report import write_report

        try:
            print0(f"report: {write_report([self.run_dir])}")
        except EmberError as e:  # e.g. matplotlib not installed: the run itself is complete
            print0(f"ember: note: no report written ({e})")

    def _export(self, name: str) -> None:
        model = self.model
        if self.adapters is not None:  # a plain model for every later verb: the adapters merged in
            from ember.export.peft import save_peft
            from ember.model.lora import merge_lora

            # the chat tokens' rows go as PEFT's trainable tokens; a grown vocabulary does not fit
            # the source run's model, which adapter/ is for
            rows = list(chat_ids(self.tokenizer).values()) if "tok_embeddings.weight" in self.adapters else []
            grown = self.tokenizer_file is None  # _chat_tokenizer added the chat tokens
            if name == "model" and self.env.is_main and not grown:
                try:
                    src = str(self.cfg.train.init_from)
                    save_peft(unwrap(self.model), self.run_dir / "adapter", src, token_rows=rows)
                except EmberError as e:  # a layout transformers has no class for
                    print0(f"ember: note: no PEFT adapter/ written ({e})")
            model = merge_lora(copy.deepcopy(unwrap(self.model)))
        export_weights(
            model,
            self.run_dir / name,
            asdict(self.model_cfg),
            {
                file: self.run_dir / file  # as _prepare_run_dir wrote them
                for file in (TOKENIZER, SPECIALS_FILE)
                if file == TOKENIZER or self.tokenizer.specials is not None
            },
        )

    def _finish(self, last: dict) -> None:
        self._export("model")
        if self.env.is_main:
            summary = {
                **last,
                "best_val_loss": self.best_val if math.isfinite(self.best_val) else None,
                "best_step": self.best_step,
                "skipped_steps": self.skipped,
                "n_params": self.n_params,
            }
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self._write_report()
        print0(f"done: step {self.step}, {self.tokens:,} tokens; weights in {self.run_dir / 'model'}")


@contextlib.contextmanager
def scratch_trainer(cfg, **train_changes):
    """A Trainer for ``cfg`` in a temporary run directory, no evaluation or checkpoints (and
    ``train_changes``), closed after: what ``ember plan --measure`` and ``ember analyze`` run
    their steps on. Stepping it is the caller's: ``set_lr``, a batch, ``train_step``."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ember-scratch-") as tmp:
        t = replace(cfg.train, **{"eval_every": 0, "ckpt_every": 0, **train_changes})
        trainer = Trainer(replace(cfg, run=replace(cfg.run, out_dir=tmp, name="scratch"), train=t))
        try:
            yield trainer
        finally:
            trainer.loader.close()
            trainer.watch.stop()
            trainer.metrics.close()


def train(cfg, run_dir: Path | None = None) -> dict:
    """Build a Trainer for ``cfg``, run it, and leave the process group."""
    try:
        result = Trainer(cfg, run_dir).run()
        barrier()  # every rank is past its last collective before any tears the process group down
        return result
    finally:
        destroy_distributed()
