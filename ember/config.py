"""Typed run configuration: dataclasses, YAML files with ``base:`` chains, presets and ``key=value``
overrides. One ``Config`` describes a whole run in sections (``run``, ``data``, ``model``, ``train``,
...), small dataclasses whose fields carry a one-line help text (``ember config keys`` lists them)::

    cfg = load_config("tiny", overrides=["data.vocab_size=256", "run.seed=3"])
    print(config_to_yaml(cfg))

Resolution order, later wins: dataclass defaults, the ``base:`` chain of the YAML file (the deepest
base first), the file itself, then the command-line overrides in the order given.

Design choices:

- Each field declares its rules once: ``opt(default, help, choices=... | ge=/gt=/le=/lt=...)``. One
  generic pass (``_Section.__post_init__``) checks every field against them, so a dataclass built in
  code is checked like one loaded from YAML, and ``ember config keys`` prints the same declarations.
  Only rules across fields are written out.
- No OmegaConf (its merge knew no line numbers): each file, and each override's value, is composed
  once into PyYAML nodes, which keep their line; ``_Merged.add`` walks them onto the defaults,
  checking each value's type as it lands, so an error names the file and line, or the override.
  ``${key}`` interpolation is filled in after the merge. Measured: 967 lines became 700; ``import
  ember.config`` 75 ms, was 155; ``load_config("tiny")`` 11 ms, was 90.
- A config is data: YAML is loaded with a safe loader, nothing is ever ``exec``'d or ``eval``'d.
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
import os
import re
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from ember.errors import ConfigError

PRESETS_DIR = Path(__file__).resolve().parents[1] / "configs"


# Choice lists that code outside this module reads too; the others are declared on their field.
TOKENIZER_KINDS = ("bpe", "char")
SAMPLING_MODES = ("random", "epoch")
MLPS = ("gelu", "swiglu", "relu2", "moe", "none")
NORMS = ("layernorm", "rmsnorm", "batchnorm", "none")

COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


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
    """A config field: its default, one line of help and the values it accepts (``choices`` or bounds).
    A list default is copied, a class default (a section) built, per instance."""
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
    """A value out of range; carries its key so that the loader can add where it came from."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise _InvalidValue(key, message)


class _Section:
    """Base of the sections (``class DataConfig(_Section, key="data")``): on construction every field is
    checked against its choices and bounds; rules across fields follow ``super().__post_init__()``."""

    section: ClassVar[str]

    def __init_subclass__(cls, key: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.section = key

    def __post_init__(self) -> None:
        for f in dataclasses.fields(typing.cast(Any, self)):
            value, meta, key = getattr(self, f.name), f.metadata, f"{self.section}.{f.name}"
            choices, bounds = meta.get("choices"), meta.get("bounds", [])
            ok = value in choices if choices else all(COMPARE[op](value, b) for op, b in bounds)
            _require(ok, key, f"{key} must be {_allowed(meta)}; got {value!r}")


# --- The sections ---
@dataclass
class RunConfig(_Section, key="run"):
    name: str = opt("ember", "run name; the run lives in <out_dir>/<name>/")
    out_dir: str = opt("runs", "folder that holds all run directories")
    seed: int = opt(1337, "global seed: data order, init and sampling derive from it", ge=0)


@dataclass
class DataConfig(_Section, key="data"):
    sources: list[str] = opt(["embedded:python"], "embedded:<name>, files, globs or .jsonl/.parquet paths")
    dir: str = opt("data/python", "where the tokenizer, shards and manifest are written")
    tokenizer: str = opt("bpe", "tokenizer kind: byte-level BPE or characters", choices=TOKENIZER_KINDS)
    vocab_size: int = opt(4096, "tokenizer vocabulary size, special tokens included", ge=1)
    val_fraction: float = opt(0.05, "share of each source's bytes hashed into validation", ge=0, lt=1)
    test_sources: list[str] = opt([], "sources held out by origin as the test split; [] = a hashed share")
    test_bytes: int = opt(1_000_000, "about this many bytes of test_sources go into test (0 = all)", ge=0)
    test_fraction: float = opt(0.02, "if no test_sources: share of each source's bytes for test", ge=0, lt=1)
    tokenizer_train_bytes: int = opt(20_000_000, "at most this many bytes of text train the tokenizer", gt=0)
    jsonl_field: str = opt("text", "field holding the document text in .jsonl sources")
    parquet_column: str = opt("text", "column holding the document text in .parquet sources")
    min_chars: int = opt(1, "documents shorter than this many characters are dropped", ge=0)
    max_nontext_fraction: float = opt(0.3, "drop documents above this share of non-text chars", ge=0, le=1)
    dedup: bool = opt(True, "drop exact duplicate documents (by content hash)")
    shard_tokens: int = opt(100_000_000, "maximum number of tokens per shard file", gt=0)
    sampling: str = opt("random", "random windows or a seeded permutation per epoch", choices=SAMPLING_MODES)
    augment: bool = opt(False, "images: random shifts (and flips of natural images) in training")

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(len(self.sources) > 0, "data.sources", "data.sources is empty; give at least one source")
        message = (f"data.val_fraction + data.test_fraction must be < 1; "
                   f"got {self.val_fraction} + {self.test_fraction}")  # fmt: skip
        _require(self.val_fraction + self.test_fraction < 1.0, "data.test_fraction", message)


@dataclass
class ModelConfig(_Section, key="model"):
    """The decoder's shape and options (see ember/model/gpt.py), or an image classifier's (kind)."""

    kind: str = opt("gpt", "gpt: the decoder; mlp, cnn, vit: image classifiers (train.task=classify)", choices=("gpt", "mlp", "cnn", "vit"))  # fmt: skip # noqa: E501
    init: str = opt("default", "classifiers' init: default, he (Kaiming), xavier (Glorot)", choices=("default", "he", "xavier"))  # fmt: skip # noqa: E501
    patch: int = opt(2, "vit: patch size in pixels (divides the image's height and width)", ge=1)
    classes: int = opt(0, "classifiers: number of classes; 0 = the data's", ge=0)
    image: list[int] = opt([], "classifiers: channels, height, width; [] = the data's")
    vocab_size: int = opt(0, "vocabulary size; 0: the tokenizer's, to a vocab_multiple", ge=0, le=2**24)
    vocab_multiple: int = opt(64, "round a tokenizer-derived vocab_size up to a multiple of this", ge=1)
    n_layer: int = opt(6, "number of transformer blocks", ge=1, le=1024)
    n_head: int = opt(6, "attention (query) heads per block", ge=1, le=1024)
    n_kv_head: int = opt(0, "key/value heads (GQA/MQA); 0 = n_head (plain multi-head attention)", ge=0)
    d_model: int = opt(384, "residual stream width", ge=1, le=2**17)
    max_seq_len: int = opt(256, "longest sequence the positions support", ge=1, le=2**24)
    mlp: str = opt("gelu", "gelu (GPT-2), swiglu (Llama), relu2, moe (experts), none", choices=MLPS)
    n_experts: int = opt(8, "moe: routed experts per layer, each a SwiGLU of mlp_hidden", ge=1, le=1024)
    top_k: int = opt(2, "moe: experts each token is routed to (<= n_experts)", ge=1)
    shared_expert: bool = opt(False, "moe: plus one expert that every token passes through")
    moe_aux: float = opt(0.01, "moe: weight of the load-balancing loss (Switch, Mixtral)", ge=0)
    moe_z: float = opt(0.001, "moe: weight of the router z-loss (ST-MoE)", ge=0)
    mixer: str = opt("attention", "every layer's sequence mixer", choices=("attention", "mamba"))
    pattern: str = opt("", "hybrid: a letter per layer, A attention, M Mamba, repeated to n_layer")
    d_state: int = opt(16, "mamba: state size per channel", ge=1)
    d_conv: int = opt(4, "mamba: width of the causal depthwise convolution", ge=1)
    expand: int = opt(2, "mamba: inner width = expand * d_model", ge=1)
    causal: bool = opt(True, "false: bidirectional attention (BERT-style, for train.task=mlm)")
    gelu: str = opt("tanh", "GELU of the gelu MLP and mlm head: tanh approximation (GPT-2) or erf (BERT)", choices=("tanh", "erf"))  # fmt: skip # noqa: E501
    mlp_hidden: int = opt(0, "MLP hidden width; 0 = 4*d_model, swiglu: 8/3*d_model rounded to 64", ge=0)
    norm: str = opt("layernorm", "normalization layer; batchnorm, none: mlp and cnn only", choices=NORMS)
    norm_position: str = opt("pre", "pre: x + f(norm(x)), a final norm; post (BERT): norm(x + f(x)), embeddings normed", choices=("pre", "post"))  # fmt: skip # noqa: E501
    norm_eps: float = opt(1e-5, "epsilon of the norms", ge=0)
    pos: str = opt("learned", "positions: learned, RoPE or none (Mamba)", choices=("learned", "rope", "none"))
    rope_theta: float = opt(10000.0, "RoPE base frequency", gt=0)
    tie_embeddings: bool = opt(True, "share the token embedding with the output head")
    bias: bool = opt(True, "biases in linear layers and norms (GPT-2 style)")
    dropout: float = opt(0.0, "dropout on attention weights and residual branches", ge=0, lt=1)
    qk_norm: bool = opt(False, "normalize queries and keys per head before attention")
    init_std: float = opt(0.02, "init std (normal); residual projections scaled by 1/sqrt(2*n_layer)", ge=0)
    logit_softcap: float = opt(0.0, "cap logits smoothly at +-this value, cap*tanh(z/cap) (0 = off)", ge=0)
    head: str = opt("lm", "lm: logits; mlm: BERT's dense-GELU-norm first, a bias; score: a reward", choices=("lm", "mlm", "score"))  # fmt: skip # noqa: E501

    def __post_init__(self) -> None:
        super().__post_init__()
        message = (f"model.n_head={self.n_head} does not divide model.d_model={self.d_model}; "
                   "choose a head count that divides the width")  # fmt: skip
        _require(self.d_model % self.n_head == 0, "model.n_head", message)
        kv = self.n_kv_head or self.n_head
        message = (f"model.n_kv_head={kv} does not divide model.n_head={self.n_head}; "
                   "each key/value head must serve a whole group of query heads")  # fmt: skip
        _require(kv <= self.n_head and self.n_head % kv == 0, "model.n_kv_head", message)
        message = f"model.top_k={self.top_k} is more than model.n_experts={self.n_experts}"
        _require(self.top_k <= self.n_experts, "model.top_k", message)
        message = f"model.pattern={self.pattern!r}: one letter per layer, A (attention) or M (Mamba)"
        _require(set(self.pattern) <= {"A", "M"}, "model.pattern", message)
        message = f"RoPE needs an even head dimension; d_model/n_head = {self.d_model // self.n_head}"
        _require(self.pos != "rope" or (self.d_model // self.n_head) % 2 == 0, "model.pos", message)
        norms = {"mlp": NORMS, "cnn": ("layernorm", "batchnorm", "none")}.get(self.kind, NORMS[:2])
        message = f"model.kind={self.kind} takes model.norm {', '.join(norms)}; got {self.norm}"
        _require(self.norm in norms, "model.norm", message)


@dataclass
class TrainConfig(_Section, key="train"):
    seq_len: int = opt(256, "tokens per training sequence (<= model.max_seq_len)", ge=1)
    batch_tokens: int = opt(16384, "global batch in tokens per step, across ranks and accumulation", ge=1)
    micro_batch: int = opt(16, "sequences per rank per forward/backward", ge=1)
    max_steps: int = opt(0, "stop after this many optimizer steps (0 = no limit)", ge=0)
    max_tokens: int = opt(0, "stop after this many training tokens (0 = no limit)", ge=0)
    max_time: float = opt(0.0, "stop after this many wall-clock seconds (0 = no limit)", ge=0)
    lr: float = opt(1e-3, "peak learning rate", ge=0)
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of lr", ge=0, le=1)
    warmup_steps: int = opt(50, "linear warmup steps", ge=0)
    schedule: str = opt("cosine", "wsd: stable, then decay", choices=("cosine", "linear", "wsd", "constant"))
    decay_fraction: float = opt(0.2, "wsd: fraction of the budget spent decaying", gt=0, le=1)
    weight_decay: float = opt(0.1, "AdamW decay on matrices (not norms, biases, embeddings)", ge=0)
    optimizer: str = opt("adamw", "muon = Muon on block matrices, AdamW elsewhere; sgd", choices=("adamw", "muon", "sgd"))  # fmt: skip # noqa: E501
    momentum: float = opt(0.9, "sgd: momentum", ge=0, lt=1)
    nesterov: bool = opt(False, "sgd: Nesterov momentum")
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
    precision: str = opt("fp32", "bf16/fp16 autocast, fp16 with GradScaler; fp8(-rowwise): torchao float8 block linears (CUDA sm89+)", choices=("fp32", "bf16", "fp16", "fp8", "fp8-rowwise"))  # fmt: skip # noqa: E501
    fp8_linears: str = opt("blocks", "the linears precision=fp8 converts: blocks; mlp (the MLPs' alone); all (blocks and the head)", choices=("blocks", "mlp", "all"))  # fmt: skip # noqa: E501
    compile: bool = opt(False, "torch.compile each block, or the whole step (compile_scope)")
    compile_scope: str = opt("auto", "block: each block; model: forward + loss in one graph (one device); auto: model on one CUDA device where the loss traces whole, else block", choices=("auto", "block", "model"))  # fmt: skip # noqa: E501
    compile_mode: str = opt("default", "reduce-overhead: CUDA graphs", choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"))  # fmt: skip # noqa: E501
    sdpa: str = opt("auto", "PyTorch's attention backend: flash, cudnn, efficient (CUDA), math", choices=("auto", "flash", "cudnn", "efficient", "math"))  # fmt: skip # noqa: E501
    kernels: str = opt("torch", "triton: ember.kernels (norm, RoPE, attn, CE)", choices=("torch", "triton"))
    activation_checkpointing: bool = opt(False, "recompute block activations in backward")
    deterministic: bool = opt(False, "deterministic algorithms, cuBLAS workspace, seeds")
    device: str = opt("auto", "auto = cuda if present", choices=("auto", "cpu", "cuda"))
    eval_every: int = opt(100, "evaluate every this many steps (0 = only at the end)", ge=0)
    eval_windows: int = opt(256, "at most this many validation windows per evaluation", ge=1)
    log_every: int = opt(10, "print a log line every this many steps", ge=1)
    log_dynamics: int = opt(0, "every N steps log weight/update/activation RMS, kurtosis... (0: off)", ge=0)
    ckpt_every: int = opt(0, "save a checkpoint every this many steps (0 = only at the end)", ge=0)
    keep_last: int = opt(2, "checkpoints kept, newest first", ge=2)
    keep_best: bool = opt(True, "export best-val-loss weights to model-best/, keep their checkpoint if any")
    report: bool = opt(True, "write report.md and plots/ when the run ends (or later: ember report RUN)")
    resume: str = opt("never", "'never', 'auto' (newest committed checkpoint) or a step folder")
    resume_allow_changes: bool = opt(False, "on resume, accept changes to the run's config (budgets, eval/ckpt cadence, lr, schedule); never to the model, run.seed, train.batch_tokens/seq_len/optimizer, data.dir/sampling, tokenizer")  # fmt: skip # noqa: E501
    nonfinite: str = opt("stop", "NaN/Inf loss/grads: stop (naming where) or skip", choices=("stop", "skip"))
    tensorboard: bool = opt(False, "also log to TensorBoard (needs the track extra)")
    qat: str = opt("none", "QAT: block linears' weights fake-quantized as `ember quantize --scheme` of that name stores them", choices=("none", "int8-weight", "int4-weight"))  # fmt: skip # noqa: E501
    qat_group_size: int = opt(32, "int4-weight: inputs per scale and zero point", choices=(32, 64, 128))
    init_from: str = opt("", "fine-tune from a run directory's final float weights (RUN/model/); '' = none")
    lora_rank: int = opt(0, "LoRA: adapters of this rank on block linears, the rest frozen (0 = off)", ge=0)
    lora_alpha: float = opt(16.0, "LoRA: the update is scaled by lora_alpha / lora_rank", gt=0)
    lora_dropout: float = opt(0.0, "LoRA: dropout on the adapters' input", ge=0, lt=1)
    lora_targets: list[str] = opt(["wq", "wk", "wv", "wo", "w1", "w2", "w3"], "LoRA: block linears adapted")
    lora_plus: float = opt(1.0, "LoRA+: B matrices train at lr times this (Hayou et al. 2024: 16)", gt=0)
    qlora: bool = opt(False, "LoRA over a frozen base stored in NF4 (QLoRA)")
    mlm_mask: float = opt(0.15, "mlm: tokens masked (80% [MASK], 10% random, 10% kept)", gt=0, lt=1)
    lora_chat_tokens: bool = opt(True, "LoRA + train.task=sft: also train the new chat tokens' embeddings")
    task: str = opt("lm", "lm: next-token prediction; sft: supervised fine-tuning; dpo: preference optimisation; grpo: RL on a task's verifier; rm: a reward model on dpo.*'s pairs; classify: images; or any in train/tasks/")  # fmt: skip # noqa: E501

    def __post_init__(self) -> None:
        super().__post_init__()
        message = "train.qlora=true adapts a frozen NF4 base with LoRA; give it train.lora_rank (e.g. 8)"
        _require(not self.qlora or self.lora_rank > 0, "train.qlora", message)
        key = "train.compile_scope" if self.compile_scope != "auto" else "train.compile_mode"
        unset = self.compile_scope == "auto" and self.compile_mode == "default"
        _require(self.compile or unset, key, f"{key} shapes torch.compile: set train.compile=true")

    @property
    def compiles_step(self) -> bool:
        """The task's forward and loss asked to compile as one graph (``auto``: layout.compile_scope)."""
        return self.compile and self.compile_scope == "model"


@dataclass
class SFTConfig(_Section, key="sft"):
    data: str = opt("", "an embedded task (its train split), or JSONL of {messages} / {prompt, completion}")
    examples: int = opt(20000, "problems drawn from an embedded task's train split", ge=1)
    packing: bool = opt(True, "pack several conversations per row (no attention between them)")
    eval_problems: int = opt(100, "a task's test problems answered per eval (rm: ranked); 0 = none", ge=0)


@dataclass
class DPOConfig(_Section, key="dpo"):
    """Direct preference optimisation (``train.task=dpo``): the pairs, the loss and its β. A reward
    model (``train.task=rm``) trains on the same pairs (data, examples, rejected, eval_problems)."""

    data: str = opt("", "JSONL of {prompt, chosen, rejected}, or an embedded task (see dpo.rejected)")
    examples: int = opt(20000, "pairs made from an embedded task's train split", ge=1)
    rejected: str = opt("corrupt", "corrupt (a seeded near miss) or model (the initial model's greedy answer if wrong, else near miss)", choices=("corrupt", "model"))  # fmt: skip # noqa: E501
    beta: float = opt(0.1, "β: the strength of the KL leash to the reference (larger: closer)", gt=0)
    loss: str = opt("sigmoid", "sigmoid (DPO), robust (label_smoothing flips), ipo", choices=("sigmoid", "robust", "ipo"))  # fmt: skip # noqa: E501
    label_smoothing: float = opt(0.0, "robust: the share of pairs assumed mislabelled", ge=0, lt=0.5)
    sft_weight: float = opt(0.0, "plus this times the chosen replies' NLL per token (0 = plain DPO)", ge=0)
    eval_problems: int = opt(100, "with a task: test problems answered greedily at each eval; 0 = none", ge=0)


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
    beta: float = opt(0.04, "β: weight of the k3 KL to the reference (0 = none, no reference forward)", ge=0)
    kl_correction: bool = opt(True, "k3 × the ratio: an unbiased reverse-KL gradient (TRL's default); false: DeepSeekMath's bare k3")  # fmt: skip # noqa: E501
    scale_rewards: bool = opt(True, "advantages / group reward std (GRPO); false: mean-centred (Dr. GRPO)")
    loss: str = opt("token", "token: mean over the micro-batch's completion tokens (TRL bnpo, DAPO); sequence: mean of each completion's token mean (the GRPO paper, TRL grpo)", choices=("token", "sequence"))  # fmt: skip # noqa: E501
    iterations: int = opt(1, "μ: optimizer steps on each rollout batch (>1: the clip matters)", ge=1)
    shared_prefix: bool = opt(True, "each group's prompt once in the log-prob passes; false: every row whole")
    format_reward: float = opt(0.0, "added to the reward of a completion that closes its turn", ge=0)
    eval_problems: int = opt(100, "test problems answered (greedy) at each evaluation; 0 = none", ge=0)
    reward_model: str = opt("", "a reward model's run: σ(score) is the reward; accuracy stays the verifier's")


@dataclass
class ParallelConfig(_Section, key="parallel"):
    """How ranks share the work (launch with `ember train CONFIG --nproc N` or torchrun)."""

    data: str = opt("ddp", "data parallelism across ranks: DDP or FSDP2", choices=("ddp", "fsdp"))
    tp: int = opt(1, "tensor parallel: ranks splitting each block's matrices (the rest: data parallel)", ge=1)
    sequence_parallel: bool = opt(False, "with tp: residual stream split by position between matrices (RoPE)")
    loss_parallel: bool = opt(False, "with tp: cross-entropy on the vocab-split logits, never gathered whole")
    dp_replicate: int = opt(1, "HSDP (data=fsdp): shard in groups, replicate across this many of them", ge=1)
    dp_shard: int = opt(-1, "FSDP2: ranks each parameter is split over; -1 = what the rest leave", ge=-1)
    pp: int = opt(1, "pipeline parallel: stages, each a contiguous range of blocks on its own ranks", ge=1)
    pp_schedule: str = opt("1f1b", "order of pp micro-batches", choices=("gpipe", "1f1b", "interleaved-1f1b"))
    pp_microbatches: int = opt(0, "pp micro-batches per step; 0 = rows per rank / train.micro_batch", ge=0)
    pp_virtual_stages: int = opt(0, "with pp: stages per rank; 0 = 2 for interleaved-1f1b, else 1", ge=0)
    backend: str = opt("auto", "auto = nccl on CUDA, gloo on CPU", choices=("auto", "nccl", "gloo"))
    timeout_s: int = opt(600, "seconds per collective; past them the rank stops and names the culprit", ge=1)
    ep: int = opt(1, "expert parallel: ranks the experts of each MoE layer are split over", ge=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        message = "parallel.dp_shard must be -1 (fill) or at least 1; got 0"
        _require(self.dp_shard != 0, "parallel.dp_shard", message)


@dataclass
class ServeConfig(_Section, key="serve"):
    """`ember serve RUN`: the paged KV cache and the continuous-batching scheduler."""

    block_size: int = opt(8, "tokens per KV-cache block (8: half the waste of 16, no slower on CPU)", ge=1)
    kv_memory: float = opt(268435456, "KV-cache bytes (> 1) or fraction of free memory at start (<= 1)", gt=0)
    max_batch_tokens: int = opt(512, "tokens one step feeds at most (prefill chunks and decodes)", ge=1)
    max_seqs: int = opt(64, "sequences running at once at most", ge=1)
    max_waiting: int = opt(256, "requests allowed to wait; more get HTTP 429", ge=1)
    prefix_caching: bool = opt(True, "share the KV blocks of common prompt prefixes between requests")
    device: str = opt("cpu", "where the model runs (cpu, cuda, cuda:1, ...)")
    threads: int = opt(0, "engine's torch threads on a CPU; 0 = every core but one (for the HTTP loop)", ge=0)
    paged_attention: str = opt("auto", "auto: triton on CUDA, gather elsewhere (and for Mamba layers); gather: copy a row's blocks, then SDPA; flex: FlexAttention reads the pool in place; triton: ember's paged-attention kernel reads it through the block tables", choices=("auto", "gather", "flex", "triton"))  # fmt: skip # noqa: E501
    batch_invariant: bool = opt(False, "a request's tokens the same bits in any batch: products in one fixed order (ember.kernels.invariant); needs paged_attention=triton (auto picks it); slower")  # fmt: skip # noqa: E501
    async_steps: bool = opt(False, "plan and launch each step before the last one's ids are read back, so the host's work runs under the device's (vLLM's async scheduling); an id that ends a sequence costs one token of work past its end")  # fmt: skip # noqa: E501
    decode_buckets: list[int] = opt([1, 2, 4, 8, 16, 32, 64], "decode-only steps padded to these batch sizes, others to a multiple of a quarter of a power of two of tokens; CUDA graphs on a GPU (flex and triton; [] = off)")  # fmt: skip # noqa: E501


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
        message = (f"train.task={self.train.task} with model.head={self.model.head}: a reward model "
                   "(train.task=rm) needs model.head=score, and every other task model.head=lm")  # fmt: skip
        _require((self.train.task == "rm") == (self.model.head == "score"), "model.head", message)
        seq_len, max_seq_len = self.train.seq_len, self.model.max_seq_len
        message = (f"train.seq_len={seq_len} is beyond model.max_seq_len={max_seq_len}; "
                   "lower train.seq_len or raise model.max_seq_len")  # fmt: skip
        _require(self.train.seq_len <= self.model.max_seq_len, "train.seq_len", message)
        mlm, m = self.train.task == "mlm", self.model
        message = (f"train.task={self.train.task} with model.causal={m.causal}, model.head={m.head}: train.task=mlm needs causal=false (it reads both sides "  # fmt: skip # noqa: E501
                   "of a mask); other tasks need causal=true (bidirectional attention sees the token it predicts) and no mlm head")  # fmt: skip # noqa: E501
        _require(mlm != m.causal and (mlm or m.head != "mlm"), "model.causal", message)
        serve = self.serve
        message = (f"serve.batch_invariant needs serve.paged_attention=triton, not {serve.paged_attention}: "
                   "that kernel's sums run in one order whatever the batch; gather's and flex's do not")
        ok = not serve.batch_invariant or serve.paged_attention in ("triton", "auto")
        _require(ok, "serve.batch_invariant", message)


# --- The schema, walked: keys, types, help ---
def _fields(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field[Any]]]:
    """(dotted key, resolved type, field) for every field, sections included, in order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, tp = prefix + f.name, hints[f.name]
        yield key, tp, f
        if dataclasses.is_dataclass(tp):
            yield from _fields(typing.cast(type, tp), key + ".")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return "section" if dataclasses.is_dataclass(tp) else tp.__name__


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def config_keys() -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default repr, help) for every leaf field, in file order; the
    type says what the field accepts: ``'bpe' | 'char'``, ``int >= 1``, ``float in [0, 1)``."""
    keys = []
    for key, tp, f in _fields(Config):
        if not dataclasses.is_dataclass(tp):
            choices = f.metadata["choices"]
            domain = " | ".join(map(repr, choices)) if choices else f"{_type_name(tp)} {_allowed(f.metadata)}"
            keys.append((key, domain.rstrip(), repr(_default(f)), f.metadata["help"]))
    return keys


# --- YAML, composed once: every node keeps its line and its source text ---
class _Layer:
    """One source of values: the YAML node of a file, or of ``{a: {b: value}}`` built
    around an override ``a.b=value``; ``where`` names a node's file and line."""

    def __init__(self, text: str, source: str, in_file: bool) -> None:
        self.loader, self.source, self.in_file = yaml.SafeLoader(text), source, in_file
        try:
            self.node: Any = self.loader.get_single_node()
        except yaml.YAMLError as e:
            raise self._error(e) from None
        finally:
            self.loader.dispose()

    def _error(self, e: yaml.YAMLError) -> ConfigError:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{self.source} line {mark.line + 1}" if mark and self.in_file else self.source
        return ConfigError(f"YAML syntax error in {where}: {getattr(e, 'problem', None) or e}")

    def where(self, node: yaml.Node) -> str:
        return f"{self.source} line {node.start_mark.line + 1}" if self.in_file else self.source

    def value(self, node: yaml.Node) -> Any:
        try:
            return self.loader.construct_object(node, deep=True)
        except yaml.YAMLError as e:  # an unknown or unsafe tag
            raise self._error(e) from None


class _Template(str):
    """A value with ``${key}`` references, filled in once every layer is merged."""


_REF = re.compile(r"\$\{([^${}]*)\}")
_WORDS = dict.fromkeys(("yes", "y", "on", "true"), True) | dict.fromkeys(("no", "n", "off", "false"), False)


def _show(value: Any) -> str:
    return "null" if value is None else repr(value)


def _check(key: str, tp: Any, value: Any, where: str, raw: str | None = None) -> Any:
    """``value`` as a field of type ``tp`` takes it, converted as OmegaConf's typed merge did
    (``'64'`` -> 64; ``1``, ``'yes'`` -> True; a number in a str keeps its source text ``raw``)."""
    try:
        if typing.get_origin(tp) is list and isinstance(value, list):
            return [_check(f"{key}[{i}]", typing.get_args(tp)[0], v, where) for i, v in enumerate(value)]
        if tp is bool and type(value) in (bool, int, str):
            word = _WORDS.get(value.lower()) if isinstance(value, str) else None
            return word if word is not None else int(value) != 0
        if tp is int and type(value) in (int, str):
            return int(value)
        if tp is float and type(value) in (float, int, str):
            return float(value)
        if tp is str and not isinstance(value, (bool, bytes, list, dict, type(None))):
            return raw if raw is not None and not isinstance(value, str) else str(value)
    except ValueError:
        pass
    hint = "; quote it to mean a string" if tp is str and isinstance(value, bool) else ""
    raise ConfigError(f"{key} expects {_type_name(tp)}, got {_show(value)} ({where}){hint}")


def _unknown(key: str, schema: Mapping[str, Any], where: str) -> ConfigError:
    """Suggests the nearest valid key, by the dotted key or its last part (a key in the wrong section)."""
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in schema}
    close = difflib.get_close_matches(key, list(schema), n=1, cutoff=0.6)
    close_leaf = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(by_leaf), n=1, cutoff=0.8)
    if close or close_leaf:
        suggestion = close[0] if close else by_leaf[close_leaf[0]]
        return ConfigError(f"unknown config key {key} ({where}); did you mean {suggestion}?")
    siblings = ", ".join(k for k in schema if k.rpartition(".")[0] == key.rpartition(".")[0])
    return ConfigError(f"unknown config key {key} ({where}); valid keys: {siblings}")


# --- Merging: the layers onto the defaults, each value checked as it lands ---
class _Merged:
    """Every leaf's value by dotted key, the defaults' until a layer sets it, and where
    each set value came from (so a bound broken in ``__post_init__`` names it too)."""

    def __init__(self) -> None:
        fields = list(_fields(Config))
        self.schema = {key: tp for key, tp, _ in fields}
        self.values = {key: _default(f) for key, tp, f in fields if not dataclasses.is_dataclass(tp)}
        self.origin: dict[str, str] = {}

    def add(self, layer: _Layer, node: yaml.MappingNode, prefix: str = "") -> None:
        """A section merges key by key; a leaf (a list too) is replaced."""
        own = {key_node for key_node, _ in node.value}
        layer.loader.flatten_mapping(node)  # `<<: *anchor` keys go first, so the mapping's own win
        seen: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            name, where = layer.value(key_node), layer.where(key_node)
            if not isinstance(name, str):
                kind = type(name).__name__
                raise ConfigError(f"config key {prefix}{name!r} must be a plain name, not a {kind} ({where})")
            key, first = prefix + name, seen.setdefault(name, key_node)
            if first is not key_node and first in own:
                line = first.start_mark.line + 1
                raise ConfigError(f"duplicate key {key} ({where}; first set on line {line})")
            if key == "base" and layer.in_file:
                continue  # read by _file_layers
            if key not in self.schema:
                raise _unknown(key, self.schema, where)
            tp = self.schema[key]
            if not dataclasses.is_dataclass(tp):
                self.values[key], self.origin[key] = self._value(layer, key, tp, value_node, where), where
            elif isinstance(value_node, yaml.MappingNode):
                self.add(layer, value_node, key + ".")
            elif (value := layer.value(value_node)) is not None:  # `model:` alone is an empty section
                raise ConfigError(
                    f"{key} is a section and expects a mapping of keys, got {_show(value)} ({where})"
                )

    def _value(self, layer: _Layer, key: str, tp: Any, node: yaml.Node, where: str) -> Any:
        if isinstance(node, yaml.SequenceNode) and typing.get_origin(tp) is list:  # items name their lines
            item_tp, items = typing.get_args(tp)[0], enumerate(node.value)
            return [self._value(layer, f"{key}[{i}]", item_tp, n, layer.where(n)) for i, n in items]
        value = layer.value(node)
        if isinstance(value, str) and "${" in value:
            return _Template(value)
        raw = node.value if isinstance(node, yaml.ScalarNode) and node.style is None else None
        return _check(key, tp, value, where, raw)

    def resolve(self, key: str, stack: tuple[str, ...] = ()) -> Any:
        """``key``'s value with its ``${other.key}`` filled in; a lone reference keeps its type."""
        value = self.values[key]
        if not any(isinstance(v, _Template) for v in (value if isinstance(value, list) else [value])):
            return value
        where = self.origin[key]
        if key in stack:
            raise ConfigError(f"{key}: interpolation cycle {' -> '.join((*stack, key))} ({where})")

        def lookup(m: re.Match[str]) -> Any:
            ref = m[1].strip()
            if ref not in self.values:
                raise ConfigError(f"{key}: interpolation {m[0]} names no config key ({where})")
            return self.resolve(ref, (*stack, key))

        def fill(v: Any) -> Any:
            if not isinstance(v, _Template):
                return v
            whole = _REF.fullmatch(v)
            return lookup(whole) if whole else _REF.sub(lambda m: str(lookup(m)), v)

        filled = [fill(v) for v in value] if isinstance(value, list) else fill(value)
        self.values[key] = _check(key, self.schema[key], filled, where)
        return self.values[key]

    def build(self, cls: Any = Config, prefix: str = "") -> Any:
        """The dataclasses, each checking its declared choices and bounds as it is built."""
        kwargs = {}
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            tp = self.schema[key]
            kwargs[f.name] = self.build(tp, key + ".") if dataclasses.is_dataclass(tp) else self.resolve(key)
        return cls(**kwargs)


# --- Finding files: presets and base chains ---
def _display(path: Path) -> str:
    cwd = Path.cwd()
    return str(path.relative_to(cwd) if path.is_absolute() and path.is_relative_to(cwd) else path)


def _preset_dirs() -> list[Path]:
    local = Path.cwd() / "configs"
    return [local] if local.resolve() == PRESETS_DIR else [local, PRESETS_DIR]


def available_presets() -> list[str]:
    """Names accepted by ``load_config`` in place of a path."""
    return sorted({p.stem for d in _preset_dirs() if d.is_dir() for p in d.glob("*.yaml")})


def _find(spec: str, parent: Path | None = None, where: str = "") -> Path:
    """The file ``spec`` names: a path (for a base, next to ``parent``; a name there may omit
    ``.yaml``), else a preset name, looked up in ./configs first."""
    named = "/" not in spec and os.sep not in spec and not spec.endswith((".yaml", ".yml"))
    candidates = [parent.parent / spec if parent else Path(spec)]
    if named:
        candidates += [parent.parent / f"{spec}.yaml"] if parent else []
        candidates += [d / f"{spec}.yaml" for d in _preset_dirs()]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    presets = ", ".join(available_presets()) or "(none found)"
    context = f" (base of {where})" if where else ""
    raise ConfigError(f"config file {spec!r} not found{context}; available presets: {presets}")


def _file_layers(path: Path, chain: tuple[Path, ...] = ()) -> list[_Layer]:
    """The layers of ``path``: its base chain first, then the file itself."""
    resolved, source = path.resolve(), _display(path)
    if resolved in chain:
        cycle = " -> ".join(_display(p) for p in (*chain, resolved))
        raise ConfigError(f"base cycle: {cycle}; remove one of the base: keys")
    try:
        layer = _Layer(path.read_text(encoding="utf-8"), source, in_file=True)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {source}: {e}") from None
    if layer.node is not None and not isinstance(layer.node, yaml.MappingNode):
        if (data := layer.value(layer.node)) is not None:  # (a file of just `null` is empty)
            raise ConfigError(
                f"{source} must hold a mapping of sections (run:, data:, ...) at the top level; "
                f"got a {type(data).__name__}"
            )
        layer.node = None
    layers: list[_Layer] = []
    for key_node, value_node in layer.node.value if layer.node is not None else []:
        if key_node.value == "base":
            base, where = layer.value(value_node), layer.where(key_node)
            if not isinstance(base, str) or not base:
                raise ConfigError(f"base expects a file name or preset name, got {base!r} ({where})")
            layers = _file_layers(_find(base, path, where), (*chain, resolved))
    return [*layers, layer]


def _override_layer(override: str) -> _Layer:
    source = f"command-line override `{override}`"
    key, eq, text = override.partition("=")
    if not eq or not key.strip():
        raise ConfigError(f"{source} is not key=value (for example data.vocab_size=512)")
    if "[" in key:
        raise ConfigError(f"{source}: set the whole list instead of one item, e.g. data.sources=[a,b]")
    layer, tag = _Layer(text, source, in_file=False), "tag:yaml.org,2002:"
    node = layer.node if layer.node is not None else yaml.ScalarNode(tag + "null", "")
    for part in reversed(key.split(".")):
        node = yaml.MappingNode(tag + "map", [(yaml.ScalarNode(tag + "str", part), node)])
    layer.node = node
    return layer


# --- Public entry points ---
def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then ``path`` (a YAML file or a preset name such as ``"tiny"``)
    with its ``base:`` chain, then ``key.sub=value`` overrides in order."""
    if isinstance(overrides, str):
        overrides = [overrides]
    layers = _file_layers(_find(os.fspath(path))) if path is not None else []
    merged = _Merged()
    for layer in layers + [_override_layer(o) for o in overrides]:
        if layer.node is not None:
            merged.add(layer, layer.node)
    try:
        return merged.build()
    except _InvalidValue as e:
        where = merged.origin.get(e.key)
        raise ConfigError(f"{e} ({where})" if where else str(e)) from None


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict in field order, ready for YAML or JSON."""
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: Config) -> str:
    """The resolved config as YAML; ``load_config`` of it gives back an equal Config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True, default_flow_style=False)
