"""Typed run configuration: dataclasses, YAML files with ``base:`` chains, presets
and ``key=value`` overrides.

One ``Config`` describes a whole run, in five sections (``run``, ``data``,
``model``, ``train``, ``parallel``), each a small dataclass whose fields carry a
one-line help text (``ember config keys`` lists them)::

    cfg = load_config("tiny", overrides=["data.vocab_size=256", "run.seed=3"])
    print(config_to_yaml(cfg))

Resolution order, later wins: dataclass defaults, then the ``base:`` chain of the
YAML file (the deepest base first), then the file itself, then the command-line
overrides in the order given.

Design choices:

- Parsing and merging is OmegaConf's structured-config machinery: a typed merge
  (``"12"`` into an ``int`` field becomes 12, a list replaces a list), the
  ``key.sub=value`` dotlist syntax with YAML-parsed values, and unknown-key and
  type checks against the dataclasses come for free, so none of it is written
  by hand here. What OmegaConf does not know is where a value came from, so
  each YAML file is also composed with PyYAML's node API to map every dotted key
  to its line; OmegaConf's exceptions are caught and re-raised as a one-line
  ``ConfigError`` that names the key, the file and line (or the command-line
  override), and the nearest valid key (``difflib``).
- OmegaConf is lax in two places where a typo should fail instead: it turns
  ``true`` into the string ``"True"`` for a ``str`` field (YAML 1.1 reads
  ``yes``/``no``/``on``/``off`` as booleans), and it lets a nested list or
  mapping into a ``list[str]``. ``_check_layer`` rejects both before merging.
- Does OmegaConf still earn its place next to the PyYAML walk? It is the project's chosen
  config library (DESIGN.md's dependencies), it does the typed merge, dotlist parsing and
  unknown-key checks we would otherwise write and test ourselves, and the glue above is two
  small functions. A hand-written merge was tried (issue 9) and came out ~45 lines shorter
  at the price of owning interpolation and type coercion; that trade belongs with the
  dependency list, so OmegaConf stays until the map changes.
- Each field declares its rules once: ``opt(default, help, choices=... | ge=/gt=/le=/lt=...)``.
  One generic pass (``_Section.__post_init__``) checks every field against them, so a
  dataclass built in code is checked like one loaded from YAML, and ``ember config keys``
  prints the same declarations. Only rules across fields are written out.
  ``OmegaConf.to_object`` builds the dataclasses and lets those errors through
  unwrapped; ``load_config`` adds where the bad value came from.
- A config is data: YAML is loaded with a safe loader, nothing is ever
  ``exec``'d or ``eval``'d.
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
import os
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from ember.errors import ConfigError

PRESETS_DIR = Path(__file__).resolve().parents[1] / "configs"


# Choice lists that code outside this module also reads; every other choice list is
# declared once, on its field.
TOKENIZER_KINDS = ("bpe", "char")
SAMPLING_MODES = ("random", "epoch")

_COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def opt(
    default: Any,
    help_text: str,
    *,
    choices: Sequence[str | int] = (),
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A config field: its default, one line of help, and the values it accepts
    (``choices``, or bounds ``ge``/``gt`` below and ``le``/``lt`` above). Declared
    here once, they are checked by ``_Section.__post_init__`` and listed by
    ``ember config keys``. A list default is copied per instance, a class default
    (a section) is built per instance."""
    bounds = [(op, b) for op, b in ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if b is not None]
    meta = {"help": help_text, "choices": tuple(choices), "bounds": bounds}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    if isinstance(default, type):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


def _allowed(meta: Mapping[str, Any]) -> str:
    """What a field accepts, in words: "one of 'a', 'b'", ">= 1", "in [0, 1)"; "" if anything."""
    if meta.get("choices"):
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    bounds = meta.get("bounds", [])
    if len(bounds) == 2:
        (lo_op, lo), (hi_op, hi) = bounds
        return f"in {'[' if lo_op == '>=' else '('}{lo}, {hi}{']' if hi_op == '<=' else ')'}"
    return " ".join(f"{op} {b}" for op, b in bounds)


class _InvalidValue(ConfigError):
    """A value that parsed but is out of range; carries the key so the loader can
    add the file and line it came from."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise _InvalidValue(key, message)


class _Section:
    """Base of the config sections (``class DataConfig(_Section, key="data")``):
    on construction every field is checked against its declared choices and bounds.
    A section with rules across fields adds them after ``super().__post_init__()``."""

    section: ClassVar[str]

    def __init_subclass__(cls, key: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.section = key

    def __post_init__(self) -> None:
        for f in dataclasses.fields(typing.cast(Any, self)):
            value, meta, key = getattr(self, f.name), f.metadata, f"{self.section}.{f.name}"
            choices, bounds = meta.get("choices"), meta.get("bounds", [])
            ok = value in choices if choices else all(_COMPARE[op](value, b) for op, b in bounds)
            _require(ok, key, f"{key} must be {_allowed(meta)}; got {value!r}")


# ---------------------------------------------------------------------------
# The sections
# ---------------------------------------------------------------------------


@dataclass
class RunConfig(_Section, key="run"):
    name: str = opt("ember", "run name; the run lives in <out_dir>/<name>/")
    out_dir: str = opt("runs", "folder that holds all run directories")
    seed: int = opt(1337, "global seed: data order, init and sampling derive from it", ge=0)


@dataclass
class DataConfig(_Section, key="data"):
    sources: list[str] = opt(
        ["embedded:python"], "corpus sources: embedded:<name>, files, globs or .jsonl/.parquet paths"
    )
    dir: str = opt("data/python", "where the tokenizer, shards and manifest are written")
    tokenizer: str = opt("bpe", "tokenizer kind: byte-level BPE or characters", choices=TOKENIZER_KINDS)
    vocab_size: int = opt(4096, "tokenizer vocabulary size, special tokens included", ge=1)
    val_fraction: float = opt(
        0.05, "share of each source's bytes held out for validation (by content hash, per source)", ge=0, lt=1
    )
    test_sources: list[str] = opt(
        [], "sources held out by origin as the test split (never trained on); [] = a hashed share"
    )
    test_bytes: int = opt(
        1_000_000, "about this many bytes of test_sources are sampled into test (0 = all)", ge=0
    )
    test_fraction: float = opt(
        0.02, "without test_sources: share of each source's bytes held out as the test split", ge=0, lt=1
    )
    tokenizer_train_bytes: int = opt(
        20_000_000, "at most this many bytes of text are used to train the tokenizer", gt=0
    )
    jsonl_field: str = opt("text", "field holding the document text in .jsonl sources")
    parquet_column: str = opt("text", "column holding the document text in .parquet sources")
    min_chars: int = opt(1, "documents shorter than this many characters are dropped", ge=0)
    max_nontext_fraction: float = opt(
        0.3, "documents with a larger fraction of non-text characters are dropped", ge=0, le=1
    )
    dedup: bool = opt(True, "drop exact duplicate documents (by content hash)")
    shard_tokens: int = opt(100_000_000, "maximum number of tokens per shard file", gt=0)
    sampling: str = opt(
        "random", "random windows, or a seeded permutation of windows per epoch", choices=SAMPLING_MODES
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(len(self.sources) > 0, "data.sources", "data.sources is empty; give at least one source")
        _require(
            self.val_fraction + self.test_fraction < 1.0,
            "data.test_fraction",
            f"data.val_fraction + data.test_fraction must be < 1; got {self.val_fraction} + "
            f"{self.test_fraction}",
        )


@dataclass
class ModelConfig(_Section, key="model"):
    """The decoder's shape and options (see ember/model/gpt.py)."""

    vocab_size: int = opt(0, "vocabulary size; 0 = the tokenizer's, rounded up to vocab_multiple", ge=0)
    vocab_multiple: int = opt(64, "round a tokenizer-derived vocab_size up to a multiple of this", ge=1)
    n_layer: int = opt(6, "number of transformer blocks", ge=1)
    n_head: int = opt(6, "attention (query) heads per block", ge=1)
    n_kv_head: int = opt(0, "key/value heads (GQA/MQA); 0 = n_head (plain multi-head attention)", ge=0)
    d_model: int = opt(384, "residual stream width", ge=1)
    max_seq_len: int = opt(256, "longest sequence the positions support", ge=1)
    mlp: str = opt(
        "gelu", "MLP: GPT-2's (gelu), Llama's (swiglu) or ReLU squared", choices=("gelu", "swiglu", "relu2")
    )
    mlp_hidden: int = opt(
        0, "MLP hidden width; 0 = 4*d_model (gelu, relu2) or 8/3*d_model rounded to 64 (swiglu)", ge=0
    )
    norm: str = opt("layernorm", "normalization layer", choices=("layernorm", "rmsnorm"))
    norm_eps: float = opt(1e-5, "epsilon of the norms", ge=0)
    pos: str = opt("learned", "positions: learned absolute embeddings or RoPE", choices=("learned", "rope"))
    rope_theta: float = opt(10000.0, "RoPE base frequency", gt=0)
    tie_embeddings: bool = opt(True, "share the token embedding with the output head")
    bias: bool = opt(True, "biases in linear layers and norms (GPT-2 style)")
    dropout: float = opt(0.0, "dropout on attention weights and residual branches", ge=0, lt=1)
    qk_norm: bool = opt(False, "normalize queries and keys per head before attention")
    init_std: float = opt(
        0.02, "std of the normal init; residual projections are scaled by 1/sqrt(2*n_layer)", ge=0
    )
    logit_softcap: float = opt(0.0, "cap logits smoothly at +-this value, cap*tanh(z/cap) (0 = off)", ge=0)
    head: str = opt(
        "lm",
        "lm: next-token logits over the vocabulary; score: one scalar per position, never tied "
        "(a reward model, train.task=rm)",
        choices=("lm", "score"),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(
            self.d_model % self.n_head == 0,
            "model.n_head",
            f"model.n_head={self.n_head} does not divide model.d_model={self.d_model}; "
            "choose a head count that divides the width",
        )
        kv = self.n_kv_head or self.n_head
        _require(
            kv <= self.n_head and self.n_head % kv == 0,
            "model.n_kv_head",
            f"model.n_kv_head={kv} does not divide model.n_head={self.n_head}; "
            "each key/value head must serve a whole group of query heads",
        )
        _require(
            self.pos != "rope" or (self.d_model // self.n_head) % 2 == 0,
            "model.pos",
            f"RoPE needs an even head dimension; d_model/n_head = {self.d_model // self.n_head}",
        )


@dataclass
class TrainConfig(_Section, key="train"):
    """Batch, budget, optimizer, schedule, precision, evaluation and checkpoint settings."""

    seq_len: int = opt(256, "tokens per training sequence (<= model.max_seq_len)", ge=1)
    batch_tokens: int = opt(
        16384, "global batch in tokens per optimizer step, across ranks and accumulation", ge=1
    )
    micro_batch: int = opt(16, "sequences per rank per forward/backward", ge=1)
    max_steps: int = opt(0, "stop after this many optimizer steps (0 = no limit)", ge=0)
    max_tokens: int = opt(0, "stop after this many training tokens (0 = no limit)", ge=0)
    max_time: float = opt(0.0, "stop after this many wall-clock seconds (0 = no limit)", ge=0)
    lr: float = opt(1e-3, "peak learning rate", ge=0)
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of lr", ge=0, le=1)
    warmup_steps: int = opt(50, "linear warmup steps", ge=0)
    schedule: str = opt(
        "cosine", "lr after warmup; wsd = stable, then decay", choices=("cosine", "linear", "wsd", "constant")
    )
    decay_fraction: float = opt(0.2, "wsd: fraction of the budget spent decaying", gt=0, le=1)
    weight_decay: float = opt(0.1, "AdamW decay on matrices (not norms, biases, embeddings)", ge=0)
    optimizer: str = opt(
        "adamw", "AdamW, or Muon on block matrices and AdamW on the rest", choices=("adamw", "muon")
    )
    muon_lr: float = opt(0.02, "Muon peak learning rate (block matrices)", ge=0)
    muon_momentum: float = opt(0.95, "Muon momentum (Nesterov)", ge=0, lt=1)
    muon_weight_decay: float = opt(0.0, "Muon decoupled weight decay on block matrices", ge=0)
    embed_lr: float = opt(0.0, "peak lr of the embeddings (and a tied head); 0 = train.lr", ge=0)
    head_lr: float = opt(0.0, "peak lr of an untied output head; 0 = train.lr", ge=0)
    beta1: float = opt(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = opt(0.95, "AdamW beta2", ge=0, lt=1)
    eps: float = opt(1e-8, "AdamW epsilon", ge=0)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0 = off)", ge=0)
    z_loss: float = opt(0.0, "weight of the z-loss on log-sum-exp of logits (PaLM)", ge=0)
    precision: str = opt(
        "fp32", "fp32, or bf16/fp16 autocast (fp16 with a GradScaler)", choices=("fp32", "bf16", "fp16")
    )
    compile: bool = opt(False, "torch.compile each block")
    activation_checkpointing: bool = opt(False, "recompute block activations in backward")
    deterministic: bool = opt(False, "deterministic algorithms, cuBLAS workspace, seeds")
    device: str = opt("auto", "auto = cuda if present", choices=("auto", "cpu", "cuda"))
    eval_every: int = opt(100, "evaluate every this many steps (0 = only at the end)", ge=0)
    eval_windows: int = opt(256, "at most this many validation windows per evaluation", ge=1)
    log_every: int = opt(10, "print a log line every this many steps", ge=1)
    log_dynamics: int = opt(
        0,
        "every this many steps log weight/update RMS, activation RMS/kurtosis, attention entropy (0: off)",
        ge=0,
    )
    ckpt_every: int = opt(0, "save a checkpoint every this many steps (0 = only at the end)", ge=0)
    keep_last: int = opt(2, "checkpoints kept, newest first", ge=2)
    keep_best: bool = opt(
        True,
        "export the weights with the best val loss to model-best/; their checkpoint is also kept "
        "if ckpt_every saved that step",
    )
    resume: str = opt("never", "'never', 'auto' (newest committed checkpoint) or a step folder")
    resume_allow_changes: bool = opt(
        False,
        "on resume, accept changes to the run's config (budgets, eval/ckpt cadence, lr, schedule); "
        "never to the model, run.seed, train.batch_tokens/seq_len/optimizer, data.dir/sampling, tokenizer",
    )
    nonfinite: str = opt(
        "stop",
        "on NaN/Inf loss or grads: stop (naming the module) or skip the step",
        choices=("stop", "skip"),
    )
    tensorboard: bool = opt(False, "also log to TensorBoard (needs the track extra)")
    qat: str = opt(
        "none",
        "quantization-aware training: the block linears see their weights fake-quantized as "
        "`ember quantize --scheme` of the same name stores them",
        choices=("none", "int8-weight", "int4-weight"),
    )
    qat_group_size: int = opt(
        32, "input features per scale and zero point (int4-weight only)", choices=(32, 64, 128)
    )
    init_from: str = opt(
        "", "a run directory whose final float weights (RUN/model/) start this run (fine-tuning); '' = none"
    )
    lora_rank: int = opt(
        0, "LoRA: adapters of this rank on the block linears, the rest frozen (0 = off)", ge=0
    )
    lora_alpha: float = opt(16.0, "LoRA: the update is scaled by lora_alpha / lora_rank", gt=0)
    lora_dropout: float = opt(0.0, "LoRA: dropout on the adapters' input", ge=0, lt=1)
    lora_targets: list[str] = opt(
        ["wq", "wk", "wv", "wo", "w1", "w2", "w3"], "LoRA: the block linears adapted (attention and MLP)"
    )
    lora_plus: float = opt(
        1.0, "LoRA+: the adapters' B matrices train at train.lr times this (Hayou et al. 2024: 16)", gt=0
    )
    qlora: bool = opt(False, "LoRA over a frozen base stored in NF4 (QLoRA)")
    lora_chat_tokens: bool = opt(
        True,
        "LoRA with train.task=sft: the embedding rows of the chat tokens (<|system|>, <|user|>, "
        "<|assistant|>, <|end_turn|>) train too, as a base model never saw them",
    )
    task: str = opt(
        "lm",
        "lm: next-token prediction on the shards; sft: supervised fine-tuning (see sft.*); "
        "dpo: direct preference optimisation (see dpo.*); grpo: reinforcement learning on a task's "
        "verifier (see grpo.*); rm: a reward model on dpo.*'s pairs (model.head=score)",
        choices=("lm", "sft", "dpo", "grpo", "rm"),
    )


@dataclass
class SFTConfig(_Section, key="sft"):
    """Supervised fine-tuning (``train.task=sft``): what the conversations are and how rows hold them."""

    data: str = opt(
        "",
        "conversations: an embedded task's name (its train split, e.g. add-2) or a JSONL file of "
        "{messages} or {prompt, completion} rows",
    )
    examples: int = opt(20000, "problems drawn from an embedded task's train split", ge=1)
    packing: bool = opt(True, "pack several conversations per row (no attention between them)")
    eval_problems: int = opt(
        100,
        "with an embedded task: test problems answered (greedy) at each evaluation (rm: made into "
        "held-out pairs, which it ranks); 0 = none",
        ge=0,
    )


@dataclass
class DPOConfig(_Section, key="dpo"):
    """Direct preference optimisation (``train.task=dpo``): the pairs, the loss and its β. A reward
    model (``train.task=rm``) trains on the same pairs (data, examples, rejected, eval_problems)."""

    data: str = opt(
        "",
        "preference pairs: a JSONL file of {prompt, chosen, rejected} rows, or an embedded task's name "
        "(its train split: the answer chosen, a corrupted one rejected)",
    )
    examples: int = opt(20000, "pairs made from an embedded task's train split", ge=1)
    rejected: str = opt(
        "corrupt",
        "with a task, the rejected reply: corrupt (a seeded near miss) or model (the starting model's own "
        "greedy answer where it is wrong, a near miss where it is right)",
        choices=("corrupt", "model"),
    )
    beta: float = opt(0.1, "β: the strength of the KL leash to the reference (larger: closer)", gt=0)
    loss: str = opt(
        "sigmoid",
        "sigmoid (DPO), robust (with label_smoothing: flipped labels expected) or ipo",
        choices=("sigmoid", "robust", "ipo"),
    )
    label_smoothing: float = opt(0.0, "robust: the share of pairs assumed mislabelled", ge=0, lt=0.5)
    sft_weight: float = opt(
        0.0, "add this times the chosen replies' negative log-likelihood per token (0 = plain DPO)", ge=0
    )
    eval_problems: int = opt(
        100, "with an embedded task: test problems answered (greedy) at each evaluation; 0 = none", ge=0
    )


@dataclass
class GRPOConfig(_Section, key="grpo"):
    """Group relative policy optimisation (``train.task=grpo``): prompts, sampling and the clipped
    loss. A step trains on train.batch_tokens / train.seq_len completions, grpo.group per prompt."""

    data: str = opt("", "an embedded task's name: prompts from its train split, rewards from its verifier")
    examples: int = opt(20000, "prompts drawn from the task's train split", ge=1)
    group: int = opt(8, "G: completions sampled per prompt, whose rewards are compared", ge=2)
    max_new_tokens: int = opt(16, "tokens sampled per completion at most", ge=1)
    temperature: float = opt(1.0, "sampling temperature (the log-probabilities divide by it too)", gt=0)
    top_k: int = opt(0, "sample among the k likeliest tokens (0 = all)", ge=0)
    top_p: float = opt(1.0, "nucleus sampling mass (1 = all)", gt=0, le=1)
    epsilon: float = opt(0.2, "ε: the importance ratio is clipped to [1 − ε, 1 + ε]", gt=0, lt=1)
    beta: float = opt(
        0.04, "β: weight of the k3 KL penalty to the reference (0 = none, and no reference forward)", ge=0
    )
    kl_correction: bool = opt(
        True,
        "multiply the k3 term by the ratio, for an unbiased reverse-KL gradient (TRL's default); "
        "false: DeepSeekMath's bare k3",
    )
    scale_rewards: bool = opt(
        True, "divide advantages by the group's reward std (GRPO); false: Dr. GRPO's mean-centred rewards"
    )
    loss: str = opt(
        "token",
        "token: mean over the micro-batch's completion tokens (TRL bnpo, DAPO); sequence: mean of each "
        "completion's token mean (the GRPO paper, TRL grpo)",
        choices=("token", "sequence"),
    )
    iterations: int = opt(1, "μ: optimizer steps on each rollout batch (>1: the clip matters)", ge=1)
    shared_prefix: bool = opt(
        True,
        "run each group's prompt once in the log-probability forwards (and the update's backward), "
        "its G completions continuing from it; false: every row its whole sequence (the plain path)",
    )
    format_reward: float = opt(0.0, "added to the reward of a completion that closes its turn", ge=0)
    eval_problems: int = opt(100, "test problems answered (greedy) at each evaluation; 0 = none", ge=0)
    reward_model: str = opt(
        "",
        "a reward model's run directory (train.task=rm): σ(its score) is the reward instead of the "
        "verifier's (accuracy is still the verifier's)",
    )


@dataclass
class ParallelConfig(_Section, key="parallel"):
    """How ranks share the work (launch with `ember train CONFIG --nproc N` or torchrun)."""

    data: str = opt("ddp", "data parallelism across ranks: DDP or FSDP2", choices=("ddp", "fsdp"))
    tp: int = opt(
        1, "tensor parallel: ranks that split each block's matrices (the rest is data parallel)", ge=1
    )
    sequence_parallel: bool = opt(
        False, "with parallel.tp: split the residual stream by position between the matrices (RoPE models)"
    )
    loss_parallel: bool = opt(
        False, "with parallel.tp: cross-entropy on the vocabulary-split logits, never gathered whole"
    )
    dp_replicate: int = opt(
        1, "HSDP (parallel.data=fsdp): shard within groups, replicate across this many of them", ge=1
    )
    dp_shard: int = opt(
        -1, "FSDP2 (parallel.data=fsdp): ranks each parameter is split over; -1 = what the rest leave", ge=-1
    )
    pp: int = opt(1, "pipeline parallel: stages, each a contiguous range of blocks on its own ranks", ge=1)
    pp_schedule: str = opt(
        "1f1b", "with parallel.pp: the order of micro-batches", choices=("gpipe", "1f1b", "interleaved-1f1b")
    )
    pp_microbatches: int = opt(
        0, "with parallel.pp: micro-batches per step; 0 = rows per rank / train.micro_batch", ge=0
    )
    pp_virtual_stages: int = opt(
        0, "with parallel.pp: stages per rank; 0 = 2 for interleaved-1f1b, else 1", ge=0
    )
    backend: str = opt("auto", "auto = nccl on CUDA, gloo on CPU", choices=("auto", "nccl", "gloo"))
    timeout_s: int = opt(
        600, "every collective's limit in seconds; past it the rank stops and names the culprit", ge=1
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        message = "parallel.dp_shard must be -1 (fill) or at least 1; got 0"
        _require(self.dp_shard != 0, "parallel.dp_shard", message)


@dataclass
class ServeConfig(_Section, key="serve"):
    """`ember serve RUN`: the paged KV cache and the continuous-batching scheduler."""

    block_size: int = opt(8, "tokens per KV-cache block (8: half the waste of 16, no slower on CPU)", ge=1)
    kv_memory: float = opt(
        268435456, "KV-cache pool: bytes (> 1), or a fraction of the memory free at start (<= 1)", gt=0
    )
    max_batch_tokens: int = opt(512, "tokens one step feeds at most (prefill chunks and decodes)", ge=1)
    max_seqs: int = opt(64, "sequences running at once at most", ge=1)
    max_waiting: int = opt(256, "requests allowed to wait; more get HTTP 429", ge=1)
    prefix_caching: bool = opt(True, "share the KV blocks of common prompt prefixes between requests")
    device: str = opt("cpu", "where the model runs (cpu, cuda, cuda:1, ...)")
    threads: int = opt(
        0, "torch threads of the engine on a CPU; 0 = every core but one, which the HTTP loop needs", ge=0
    )


@dataclass
class Config:
    run: RunConfig = opt(RunConfig, "run name, output folder and seed")
    data: DataConfig = opt(DataConfig, "corpus, tokenizer and shards")
    model: ModelConfig = opt(ModelConfig, "model architecture")
    train: TrainConfig = opt(TrainConfig, "training loop")
    sft: SFTConfig = opt(SFTConfig, "supervised fine-tuning data (train.task=sft)")
    dpo: DPOConfig = opt(DPOConfig, "preference optimisation (train.task=dpo)")
    grpo: GRPOConfig = opt(GRPOConfig, "reinforcement learning on verifiable rewards (train.task=grpo)")
    parallel: ParallelConfig = opt(ParallelConfig, "parallel layout")
    serve: ServeConfig = opt(ServeConfig, "the server (ember serve)")

    def __post_init__(self) -> None:
        _require(
            (self.train.task == "rm") == (self.model.head == "score"),
            "model.head",
            f"train.task={self.train.task} with model.head={self.model.head}: a reward model "
            "(train.task=rm) needs model.head=score, and every other task model.head=lm",
        )
        _require(
            self.train.seq_len <= self.model.max_seq_len,
            "train.seq_len",
            f"train.seq_len={self.train.seq_len} is beyond model.max_seq_len={self.model.max_seq_len}; "
            "lower train.seq_len or raise model.max_seq_len",
        )


# ---------------------------------------------------------------------------
# The schema, walked: keys, types, help
# ---------------------------------------------------------------------------


def _fields(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field[Any]]]:
    """(dotted key, resolved type, field) for every field, sections included, in order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        yield key, tp, f
        if dataclasses.is_dataclass(tp):
            yield from _fields(typing.cast(type, tp), key + ".")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if dataclasses.is_dataclass(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


def _domain(tp: Any, meta: Mapping[str, Any]) -> str:
    if meta.get("choices"):
        return " | ".join(repr(c) for c in meta["choices"])
    return f"{_type_name(tp)} {_allowed(meta)}".rstrip()


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _schema() -> dict[str, Any]:
    """Dotted key -> type, for sections and leaves."""
    return {key: tp for key, tp, _ in _fields(Config)}


def config_keys() -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default repr, help) for every leaf field, in file order; the
    type says what the field accepts: ``'bpe' | 'char'``, ``int >= 1``, ``float in [0, 1)``."""
    return [
        (key, _domain(tp, f.metadata), repr(_default(f)), f.metadata.get("help", ""))
        for key, tp, f in _fields(Config)
        if not dataclasses.is_dataclass(tp)
    ]


def _suggest(key: str, candidates: Sequence[str]) -> str | None:
    """Nearest valid key: by the full dotted key, else by its last part (a key
    put in the wrong section)."""
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if close:
        return close[0]
    by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(by_leaf), n=1, cutoff=0.8)
    return by_leaf[close[0]] if close else None


# ---------------------------------------------------------------------------
# YAML with line numbers
# ---------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads YAML 1.2 floats (``1e-3`` is a float, not a string)
    and no timestamps, like OmegaConf's own loader, so a value means the same in a
    file and in a command-line override."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()
}


@dataclass
class _Layer:
    """One source of values: a parsed mapping plus where each key came from."""

    data: dict[str, Any]
    where: Callable[[str], str]
    raw: dict[str, str] = field(default_factory=dict)  # dotted key -> text of a plain scalar


def _display(path: Path) -> str:
    if not path.is_absolute():
        return str(path)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _line_map(node: yaml.Node, prefix: str, lines: dict[str, int], raw: dict[str, str], source: str) -> None:
    """Record the 1-based line of every dotted key (and list item) under ``node``,
    and the source text of every plain scalar (so a str field set to ``007``
    keeps its zeros)."""
    if isinstance(node, yaml.ScalarNode) and node.style is None:
        raw[prefix.rstrip(".")] = node.value
    elif isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise ConfigError(
                    f"{source} line {key_node.start_mark.line + 1}: a config key must be a plain name"
                )
            key = f"{prefix}{key_node.value}"
            line = key_node.start_mark.line + 1
            if key_node.value in seen:
                raise ConfigError(
                    f"duplicate key {key} ({source} line {line}; first set on line {seen[key_node.value]})"
                )
            seen[key_node.value] = line
            lines[key] = line
            _line_map(value_node, key + ".", lines, raw, source)
    elif isinstance(node, yaml.SequenceNode):
        base = prefix.rstrip(".")
        for i, item in enumerate(node.value):
            lines[f"{base}[{i}]"] = item.start_mark.line + 1
            _line_map(item, f"{base}[{i}].", lines, raw, source)


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int], dict[str, str]]:
    source = _display(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {source}: {e}") from None
    try:
        node = yaml.compose(text, Loader=_Loader)
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{source} line {mark.line + 1}" if mark is not None else source
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"YAML syntax error in {where}: {problem}") from None
    if data is None:
        return {}, {}, {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source} must hold a mapping of sections (run:, data:, ...) at the top level; "
            f"got a {type(data).__name__}"
        )
    lines: dict[str, int] = {}
    raw: dict[str, str] = {}
    _line_map(node, "", lines, raw, source)
    return data, lines, raw


def _file_where(source: str, lines: dict[str, int]) -> Callable[[str], str]:
    def where(key: str) -> str:
        probe = key
        while probe and probe not in lines:  # a list item or a key of a bad section
            shorter = re.sub(r"(\.[^.\[\]]*|\[\d+\])$", "", probe)
            probe = "" if shorter == probe else shorter
        return f"{source} line {lines[probe]}" if probe else source

    return where


# ---------------------------------------------------------------------------
# Finding files: presets and base chains
# ---------------------------------------------------------------------------


def _preset_dirs() -> list[Path]:
    local = Path.cwd() / "configs"
    return [local] if local.resolve() == PRESETS_DIR else [local, PRESETS_DIR]


def available_presets() -> list[str]:
    """Names accepted by ``load_config`` in place of a path."""
    return sorted({p.stem for d in _preset_dirs() if d.is_dir() for p in d.glob("*.yaml")})


def _is_name(spec: str) -> bool:
    return "/" not in spec and os.sep not in spec and not spec.endswith((".yaml", ".yml"))


def _find_preset(name: str) -> Path | None:
    for d in _preset_dirs():
        candidate = d / f"{name}.yaml"
        if candidate.is_file():
            return candidate
    return None


def _missing(spec: str, context: str = "") -> ConfigError:
    presets = ", ".join(available_presets()) or "(none found)"
    return ConfigError(f"config file {spec!r} not found{context}; available presets: {presets}")


def _resolve_path(spec: str | os.PathLike[str]) -> Path:
    path = Path(spec)
    if path.is_file():
        return path
    if _is_name(str(spec)) and (preset := _find_preset(str(spec))) is not None:
        return preset
    raise _missing(str(spec))


def _resolve_base(spec: str, parent: Path, where: str) -> Path:
    candidates = [parent.parent / spec]
    if _is_name(spec):
        candidates.append(parent.parent / f"{spec}.yaml")
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if _is_name(spec) and (preset := _find_preset(spec)) is not None:
        return preset
    raise _missing(spec, f" (base of {where})")


def _file_layers(path: Path, chain: tuple[Path, ...] = ()) -> list[_Layer]:
    """The layers of ``path``: its base chain first, then the file itself."""
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(_display(p) for p in (*chain, resolved))
        raise ConfigError(f"base cycle: {cycle}; remove one of the base: keys")
    data, lines, raw = _read_yaml(path)
    source = _display(path)
    where = _file_where(source, lines)
    layers: list[_Layer] = []
    if "base" in data:
        base = data.pop("base")
        if not isinstance(base, str) or not base:
            raise ConfigError(f"base expects a file name or preset name, got {base!r} ({where('base')})")
        layers = _file_layers(_resolve_base(base, path, where("base")), (*chain, resolved))
    layers.append(_Layer(data, where, raw))
    return layers


def _override_layer(override: str) -> _Layer:
    where = f"command-line override `{override}`"
    key, eq, _ = override.partition("=")
    if not eq or not key.strip():
        raise ConfigError(f"{where} is not key=value (for example data.vocab_size=512)")
    if "[" in key:
        raise ConfigError(f"{where}: set the whole list instead of one item, e.g. data.sources=[a,b]")
    try:
        data = OmegaConf.to_container(OmegaConf.from_dotlist([override]), resolve=False)
        raw: dict[str, str] = {}
        _line_map(yaml.compose(override.partition("=")[2], Loader=_Loader), key.strip() + ".", {}, raw, where)
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        raise ConfigError(f"cannot parse {where}: {str(e).splitlines()[0]}") from None
    assert isinstance(data, dict)
    return _Layer(typing.cast(dict[str, Any], data), lambda _key: where, raw)


# ---------------------------------------------------------------------------
# Merging, with errors that point at the source
# ---------------------------------------------------------------------------


def _show(value: Any) -> str:
    return "null" if value is None else repr(value)


def _type_at(schema: dict[str, Any], key: str) -> Any:
    """The expected type of ``key``; ``a.b[3]`` is an item of list ``a.b``."""
    if key in schema:
        return schema[key]
    m = re.fullmatch(r"(.*)\[\d+\]", key)
    if m and (args := typing.get_args(_type_at(schema, m.group(1)))):
        return args[0]
    return None


def _check_layer(data: dict[str, Any], schema: dict[str, Any], layer: _Layer, prefix: str = "") -> None:
    """What OmegaConf lets through but should fail: a scalar where a section goes,
    a YAML boolean in a str field, a container inside a list of scalars. A number
    given to a str field keeps its source text (``007``, ``1e3``); an empty
    section (``model:``) becomes ``{}``. Unknown keys are left to OmegaConf."""
    where = layer.where
    for name, value in data.items():
        if not isinstance(name, str):
            raise ConfigError(f"config key {prefix}{name!r} must be a name, not a {type(name).__name__}")
        key = f"{prefix}{name}"
        tp = schema.get(key)
        if tp is None:
            continue
        if dataclasses.is_dataclass(tp):
            if value is None:
                data[name] = {}
            elif isinstance(value, dict):
                _check_layer(value, schema, layer, key + ".")
            else:
                raise ConfigError(
                    f"{key} is a section and expects a mapping of keys, got {_show(value)} ({where(key)})"
                )
        elif tp is str and isinstance(value, bool):
            raise ConfigError(
                f"{key} expects str, got {_show(value)} ({where(key)}); quote it to mean a string"
            )
        elif tp is str and isinstance(value, (int, float)) and key in layer.raw:
            data[name] = layer.raw[key]
        elif typing.get_origin(tp) is list and isinstance(value, list):
            item_tp = typing.get_args(tp)[0]
            for i, item in enumerate(value):
                item_key = f"{key}[{i}]"
                if isinstance(item, (list, dict)) or (item_tp is str and isinstance(item, bool)):
                    raise ConfigError(
                        f"{item_key} expects {_type_name(item_tp)}, got {_show(item)} ({where(item_key)})"
                    )
                if item_tp is str and isinstance(item, (int, float)) and item_key in layer.raw:
                    value[i] = layer.raw[item_key]


def _explain(err: OmegaConfBaseException, layer: _Layer, schema: dict[str, Any]) -> ConfigError:
    key = err.full_key or ""
    where = layer.where(key)
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
        suggestion = _suggest(key, list(schema))
        if suggestion is not None:
            hint = f"did you mean {suggestion}?"
        else:
            section = key.rsplit(".", 1)[0] if "." in key else ""
            siblings = [k for k in schema if k.rsplit(".", 1)[0] == section and "." in k] if section else []
            if section and not siblings:
                hint = f"section {section} has no keys yet"
            else:
                valid = siblings or [k for k in schema if "." not in k]
                hint = "valid keys: " + ", ".join(valid)
        return ConfigError(f"unknown config key {key} ({where}); {hint}")
    if isinstance(err, ValidationError) and key:
        tp = _type_at(schema, key)
        expected = _type_name(tp) if tp is not None else "another type"
        return ConfigError(f"{key} expects {expected}, got {_show(err.value)} ({where})")
    message = str(err).splitlines()[0]
    return ConfigError(f"{key}: {message} ({where})" if key else f"{message} ({where})")


def _flat_keys(data: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for name, value in data.items():
        key = f"{prefix}{name}"
        yield key
        if isinstance(value, dict):
            yield from _flat_keys(value, key + ".")


def _build(layers: Sequence[_Layer]) -> Config:
    schema = _schema()
    merged = OmegaConf.structured(Config)
    origin: dict[str, str] = {}
    for layer in layers:
        _check_layer(layer.data, schema, layer)
        try:
            merged = OmegaConf.merge(merged, layer.data)
        except OmegaConfBaseException as e:
            raise _explain(e, layer, schema) from None
        origin.update({key: layer.where(key) for key in _flat_keys(layer.data)})
    try:
        cfg = OmegaConf.to_object(merged)
    except _InvalidValue as e:
        where = origin.get(e.key)
        raise ConfigError(f"{e} ({where})" if where else str(e)) from None
    except MissingMandatoryValue as e:
        raise ConfigError(
            f"{e.full_key} has no value (???); set it in a file or with {e.full_key}=..."
        ) from None
    except OmegaConfBaseException as e:  # interpolation errors: ${...} that does not resolve
        where = origin.get(e.full_key or "", "")
        message = str(e).splitlines()[0]
        raise ConfigError(f"{e.full_key}: {message}" + (f" ({where})" if where else "")) from None
    assert isinstance(cfg, Config)
    return cfg


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------


def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then ``path`` (a YAML file or a preset name such as ``"tiny"``)
    with its ``base:`` chain, then ``key.sub=value`` overrides in order."""
    if isinstance(overrides, str):
        overrides = [overrides]
    layers = _file_layers(_resolve_path(path)) if path is not None else []
    layers += [_override_layer(o) for o in overrides]
    return _build(layers)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict in field order, ready for YAML or JSON."""
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: Config) -> str:
    """The resolved config as YAML; ``load_config`` of it gives back an equal Config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True, default_flow_style=False)
