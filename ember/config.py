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
- Value checks live in each section's ``__post_init__``, so a dataclass built
  in code is checked the same way as one loaded from YAML.
  ``OmegaConf.to_object`` builds the dataclasses and lets those errors through
  unwrapped; ``load_config`` adds where the bad value came from.
- A config is data: YAML is loaded with a safe loader, nothing is ever
  ``exec``'d or ``eval``'d.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def _help(text: str) -> dict[str, str]:
    return {"help": text}


class _InvalidValue(ConfigError):
    """A value that parsed but is out of range; carries the key so the loader can
    add the file and line it came from."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise _InvalidValue(key, message)


def _one_of(value: str, key: str, allowed: Sequence[str]) -> None:
    choices = ", ".join(repr(a) for a in allowed)
    _require(value in allowed, key, f"{key} must be one of {choices}; got {value!r}")


# ---------------------------------------------------------------------------
# The sections
# ---------------------------------------------------------------------------


@dataclass
class RunConfig:
    name: str = field(default="ember", metadata=_help("run name; the run lives in <out_dir>/<name>/"))
    out_dir: str = field(default="runs", metadata=_help("folder that holds all run directories"))
    seed: int = field(
        default=1337, metadata=_help("global seed: data order, init and sampling derive from it")
    )


@dataclass
class DataConfig:
    sources: list[str] = field(
        default_factory=lambda: ["embedded:python"],
        metadata=_help("corpus sources: embedded:<name>, files, globs or .jsonl/.parquet paths"),
    )
    dir: str = field(
        default="data/python", metadata=_help("where the tokenizer, shards and manifest are written")
    )
    tokenizer: str = field(default="bpe", metadata=_help("tokenizer kind: 'bpe' (byte-level BPE) or 'char'"))
    vocab_size: int = field(
        default=4096, metadata=_help("tokenizer vocabulary size, special tokens included")
    )
    val_fraction: float = field(
        default=0.05,
        metadata=_help("share of each source's bytes held out for validation (by content hash, per source)"),
    )
    test_sources: list[str] = field(
        default_factory=list,
        metadata=_help(
            "sources held out by origin as the test split (never trained on); [] = a hashed share"
        ),
    )
    test_bytes: int = field(
        default=1_000_000,
        metadata=_help("about this many bytes of test_sources are sampled into test (0 = all)"),
    )
    test_fraction: float = field(
        default=0.02,
        metadata=_help("without test_sources: share of each source's bytes held out as the test split"),
    )
    tokenizer_train_bytes: int = field(
        default=20_000_000, metadata=_help("at most this many bytes of text are used to train the tokenizer")
    )
    jsonl_field: str = field(
        default="text", metadata=_help("field holding the document text in .jsonl sources")
    )
    parquet_column: str = field(
        default="text", metadata=_help("column holding the document text in .parquet sources")
    )
    min_chars: int = field(
        default=1, metadata=_help("documents shorter than this many characters are dropped")
    )
    max_nontext_fraction: float = field(
        default=0.3, metadata=_help("documents with a larger fraction of non-text characters are dropped")
    )
    dedup: bool = field(default=True, metadata=_help("drop exact duplicate documents (by content hash)"))
    shard_tokens: int = field(default=100_000_000, metadata=_help("maximum number of tokens per shard file"))
    sampling: str = field(
        default="random", metadata=_help("'random' windows, or 'epoch' for a seeded permutation per epoch")
    )

    def __post_init__(self) -> None:
        _require(len(self.sources) > 0, "data.sources", "data.sources is empty; give at least one source")
        _one_of(self.tokenizer, "data.tokenizer", ("bpe", "char"))
        _one_of(self.sampling, "data.sampling", ("random", "epoch"))
        _require(
            self.vocab_size >= 1, "data.vocab_size", f"data.vocab_size must be >= 1; got {self.vocab_size}"
        )
        _require(
            0.0 <= self.val_fraction < 1.0,
            "data.val_fraction",
            f"data.val_fraction must be in [0, 1); got {self.val_fraction}",
        )
        _require(
            0.0 <= self.test_fraction < 1.0 and self.val_fraction + self.test_fraction < 1.0,
            "data.test_fraction",
            f"data.test_fraction must be in [0, 1) with val_fraction + test_fraction < 1; "
            f"got {self.test_fraction} (val_fraction {self.val_fraction})",
        )
        _require(
            self.test_bytes >= 0, "data.test_bytes", f"data.test_bytes must be >= 0; got {self.test_bytes}"
        )
        _require(
            self.tokenizer_train_bytes > 0,
            "data.tokenizer_train_bytes",
            f"data.tokenizer_train_bytes must be > 0; got {self.tokenizer_train_bytes}",
        )
        _require(self.min_chars >= 0, "data.min_chars", f"data.min_chars must be >= 0; got {self.min_chars}")
        _require(
            0.0 <= self.max_nontext_fraction <= 1.0,
            "data.max_nontext_fraction",
            f"data.max_nontext_fraction must be in [0, 1]; got {self.max_nontext_fraction}",
        )
        _require(
            self.shard_tokens > 0,
            "data.shard_tokens",
            f"data.shard_tokens must be > 0; got {self.shard_tokens}",
        )


@dataclass
class ModelConfig:
    """The decoder's shape and options (see ember/model/gpt.py)."""

    vocab_size: int = field(
        default=0, metadata=_help("vocabulary size; 0 = the tokenizer's, rounded up to vocab_multiple")
    )
    vocab_multiple: int = field(
        default=64, metadata=_help("round a tokenizer-derived vocab_size up to a multiple of this")
    )
    n_layer: int = field(default=6, metadata=_help("number of transformer blocks"))
    n_head: int = field(default=6, metadata=_help("attention (query) heads per block"))
    n_kv_head: int = field(
        default=0, metadata=_help("key/value heads (GQA/MQA); 0 = n_head (plain multi-head attention)")
    )
    d_model: int = field(default=384, metadata=_help("residual stream width"))
    max_seq_len: int = field(default=256, metadata=_help("longest sequence the positions support"))
    mlp: str = field(
        default="gelu", metadata=_help("'gelu' (GPT-2 MLP), 'swiglu' (Llama MLP) or 'relu2' (ReLU squared)")
    )
    mlp_hidden: int = field(
        default=0,
        metadata=_help("MLP hidden width; 0 = 4*d_model (gelu, relu2) or 8/3*d_model rounded to 64 (swiglu)"),
    )
    norm: str = field(default="layernorm", metadata=_help("'layernorm' or 'rmsnorm'"))
    norm_eps: float = field(default=1e-5, metadata=_help("epsilon of the norms"))
    pos: str = field(default="learned", metadata=_help("'learned' absolute positions or 'rope'"))
    rope_theta: float = field(default=10000.0, metadata=_help("RoPE base frequency"))
    tie_embeddings: bool = field(
        default=True, metadata=_help("share the token embedding with the output head")
    )
    bias: bool = field(default=True, metadata=_help("biases in linear layers and norms (GPT-2 style)"))
    dropout: float = field(default=0.0, metadata=_help("dropout on attention weights and residual branches"))
    qk_norm: bool = field(
        default=False, metadata=_help("normalize queries and keys per head before attention")
    )
    init_std: float = field(
        default=0.02,
        metadata=_help("std of the normal init; residual projections are scaled by 1/sqrt(2*n_layer)"),
    )
    logit_softcap: float = field(
        default=0.0, metadata=_help("cap logits smoothly at +-this value, cap*tanh(z/cap) (0 = off)")
    )

    def __post_init__(self) -> None:
        _one_of(self.mlp, "model.mlp", ("gelu", "swiglu", "relu2"))
        _require(
            self.logit_softcap >= 0,
            "model.logit_softcap",
            f"model.logit_softcap must be >= 0 (0 = off); got {self.logit_softcap}",
        )
        _one_of(self.norm, "model.norm", ("layernorm", "rmsnorm"))
        _one_of(self.pos, "model.pos", ("learned", "rope"))
        for key in ("n_layer", "n_head", "d_model", "max_seq_len", "vocab_multiple"):
            value = getattr(self, key)
            _require(value >= 1, f"model.{key}", f"model.{key} must be >= 1; got {value}")
        for key in ("vocab_size", "n_kv_head", "mlp_hidden"):
            value = getattr(self, key)
            _require(value >= 0, f"model.{key}", f"model.{key} must be >= 0; got {value}")
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
        _require(
            0.0 <= self.dropout < 1.0, "model.dropout", f"model.dropout must be in [0, 1); got {self.dropout}"
        )


@dataclass
class TrainConfig:
    """Batch, budget, optimizer, schedule, precision, evaluation and checkpoint settings."""

    seq_len: int = field(default=256, metadata=_help("tokens per training sequence (<= model.max_seq_len)"))
    batch_tokens: int = field(
        default=16384,
        metadata=_help("global batch in tokens per optimizer step, across ranks and accumulation"),
    )
    micro_batch: int = field(default=16, metadata=_help("sequences per rank per forward/backward"))
    max_steps: int = field(default=0, metadata=_help("stop after this many optimizer steps (0 = no limit)"))
    max_tokens: int = field(default=0, metadata=_help("stop after this many training tokens (0 = no limit)"))
    max_time: float = field(
        default=0.0, metadata=_help("stop after this many wall-clock seconds (0 = no limit)")
    )
    lr: float = field(default=1e-3, metadata=_help("peak learning rate"))
    min_lr_ratio: float = field(default=0.1, metadata=_help("final learning rate as a fraction of lr"))
    warmup_steps: int = field(default=50, metadata=_help("linear warmup steps"))
    schedule: str = field(
        default="cosine",
        metadata=_help("after warmup: 'cosine', 'linear', 'wsd' (stable then decay) or 'constant'"),
    )
    decay_fraction: float = field(default=0.2, metadata=_help("wsd: fraction of the budget spent decaying"))
    weight_decay: float = field(
        default=0.1, metadata=_help("AdamW decay on matrices (not norms, biases, embeddings)")
    )
    optimizer: str = field(
        default="adamw", metadata=_help("'adamw', or 'muon' (Muon on block matrices, AdamW on the rest)")
    )
    muon_lr: float = field(default=0.02, metadata=_help("Muon peak learning rate (block matrices)"))
    muon_momentum: float = field(default=0.95, metadata=_help("Muon momentum (Nesterov)"))
    muon_weight_decay: float = field(
        default=0.0, metadata=_help("Muon decoupled weight decay on block matrices")
    )
    embed_lr: float = field(
        default=0.0, metadata=_help("peak lr of the embeddings (and a tied head); 0 = train.lr")
    )
    head_lr: float = field(default=0.0, metadata=_help("peak lr of an untied output head; 0 = train.lr"))
    beta1: float = field(default=0.9, metadata=_help("AdamW beta1"))
    beta2: float = field(default=0.95, metadata=_help("AdamW beta2"))
    eps: float = field(default=1e-8, metadata=_help("AdamW epsilon"))
    grad_clip: float = field(default=1.0, metadata=_help("clip the global gradient norm to this (0 = off)"))
    z_loss: float = field(default=0.0, metadata=_help("weight of the z-loss on log-sum-exp of logits (PaLM)"))
    precision: str = field(
        default="fp32", metadata=_help("'fp32', 'bf16' (autocast) or 'fp16' (autocast + GradScaler)")
    )
    compile: bool = field(default=False, metadata=_help("torch.compile each block"))
    activation_checkpointing: bool = field(
        default=False, metadata=_help("recompute block activations in backward")
    )
    deterministic: bool = field(
        default=False, metadata=_help("deterministic algorithms, cuBLAS workspace, seeds")
    )
    device: str = field(default="auto", metadata=_help("'auto' (cuda if present), 'cpu' or 'cuda'"))
    eval_every: int = field(
        default=100, metadata=_help("evaluate every this many steps (0 = only at the end)")
    )
    eval_windows: int = field(
        default=256, metadata=_help("at most this many validation windows per evaluation")
    )
    log_every: int = field(default=10, metadata=_help("print a log line every this many steps"))
    ckpt_every: int = field(
        default=0, metadata=_help("save a checkpoint every this many steps (0 = only at the end)")
    )
    keep_last: int = field(default=2, metadata=_help("checkpoints kept, newest first (>= 2)"))
    keep_best: bool = field(
        default=True,
        metadata=_help(
            "export the weights with the best val loss to model-best/; their checkpoint is also kept "
            "if ckpt_every saved that step"
        ),
    )
    resume: str = field(
        default="never", metadata=_help("'never', 'auto' (newest committed checkpoint) or a step folder")
    )
    resume_allow_changes: bool = field(
        default=False,
        metadata=_help(
            "on resume, accept changes to the run's config (budgets, eval/ckpt cadence, lr, schedule); "
            "never to the model, run.seed, train.batch_tokens/seq_len/optimizer, data.dir/sampling, tokenizer"
        ),
    )
    nonfinite: str = field(
        default="stop", metadata=_help("on NaN/Inf loss or grads: 'stop' (and name the module) or 'skip'")
    )
    tensorboard: bool = field(
        default=False, metadata=_help("also log to TensorBoard (needs the track extra)")
    )

    def __post_init__(self) -> None:
        _one_of(self.schedule, "train.schedule", ("cosine", "linear", "wsd", "constant"))
        _one_of(self.precision, "train.precision", ("fp32", "bf16", "fp16"))
        _one_of(self.device, "train.device", ("auto", "cpu", "cuda"))
        _one_of(self.nonfinite, "train.nonfinite", ("stop", "skip"))
        _one_of(self.optimizer, "train.optimizer", ("adamw", "muon"))
        for key in ("seq_len", "batch_tokens", "micro_batch", "log_every"):
            value = getattr(self, key)
            _require(value >= 1, f"train.{key}", f"train.{key} must be >= 1; got {value}")
        for key in (
            "max_steps",
            "max_tokens",
            "max_time",
            "warmup_steps",
            "eval_every",
            "ckpt_every",
            "grad_clip",
            "z_loss",
            "weight_decay",
            "lr",
            "muon_lr",
            "muon_weight_decay",
            "embed_lr",
            "head_lr",
        ):
            value = getattr(self, key)
            _require(value >= 0, f"train.{key}", f"train.{key} must be >= 0; got {value}")
        _require(
            0.0 <= self.muon_momentum < 1.0, "train.muon_momentum", "train.muon_momentum must be in [0, 1)"
        )
        _require(
            self.keep_last >= 2, "train.keep_last", f"train.keep_last must be >= 2; got {self.keep_last}"
        )
        _require(
            0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio", "train.min_lr_ratio must be in [0, 1]"
        )
        _require(
            0.0 < self.decay_fraction <= 1.0, "train.decay_fraction", "train.decay_fraction must be in (0, 1]"
        )


@dataclass
class ParallelConfig:
    """How ranks share the work (launch with `ember train CONFIG --nproc N` or torchrun)."""

    data: str = field(default="ddp", metadata=_help("data parallelism across ranks: 'ddp' or 'fsdp' (FSDP2)"))
    backend: str = field(
        default="auto", metadata=_help("'auto' (nccl on CUDA, gloo on CPU), 'nccl' or 'gloo'")
    )
    timeout_s: int = field(default=600, metadata=_help("collective timeout in seconds"))

    def __post_init__(self) -> None:
        _one_of(self.data, "parallel.data", ("ddp", "fsdp"))
        _one_of(self.backend, "parallel.backend", ("auto", "nccl", "gloo"))
        _require(self.timeout_s >= 1, "parallel.timeout_s", "parallel.timeout_s must be >= 1")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig, metadata=_help("run name, output folder and seed"))
    data: DataConfig = field(default_factory=DataConfig, metadata=_help("corpus, tokenizer and shards"))
    model: ModelConfig = field(default_factory=ModelConfig, metadata=_help("model architecture"))
    train: TrainConfig = field(default_factory=TrainConfig, metadata=_help("training loop"))
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata=_help("parallel layout"))

    def __post_init__(self) -> None:
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
    """(dotted key, type name, default repr, help) for every leaf field, in file order."""
    return [
        (key, _type_name(tp), repr(_default(f)), f.metadata.get("help", ""))
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
