"""The model a run starts from: its tokenizer, its resolved config, a finished run's weights
(``train.init_from``), fake quantization (``train.qat``) and adapters (``train.lora_rank``).

    tokenizer, file, known = start_tokenizer(cfg, chat=True)   # the data's, or a chat run's
    init_from(model, "runs/base", model_cfg, tokenizer_sha)     # fine-tuning: checked, then loaded

Before the layout is applied, the model may start from a finished run's float weights
(``train.init_from``: fine-tuning; checked against this run's model config and tokenizer, and
skipped on resume, where the checkpoint's weights win). A task on conversations (SFT, DPO, GRPO,
reward models) reads no shards, so its tokenizer is the source run's; one without the chat
tokens (an imported GPT-2 or Llama tokenizer) gets them appended, and the embedding and head
grow to match, each new row the mean of the old ones (``chat_tokenizer``, ``grow_vocab``). Its
block linears (and the output head, at int8) may fake-quantize their weights in every forward
(``train.qat``: ``QATLinear``, same parameters and names), so compile traces the rounding and
DDP/FSDP, checkpoints and the exported float weights are those of a plain run; ``ember
quantize`` with the same scheme then stores what training saw.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch

from ember.data.chat import add_chat_tokens
from ember.data.manifest import TOKENIZER, load_tokenizer, read_manifest
from ember.data.tokenizer import Tokenizer, file_sha256
from ember.errors import ConfigError
from ember.model.gpt import grow_vocab
from ember.model.lora import apply_lora, lora_summary
from ember.model.quant import QuantSpec, apply_qat
from ember.parallel.dist import print0
from ember.run import load_run_tokenizer, load_weights, read_spec, run_tokenizer


def start_tokenizer(cfg, chat: bool) -> tuple[Tokenizer, Path | None, int | None]:
    """The run's tokenizer, the file it is copied from (None: saved from memory) and, when the
    chat tokens were appended to it, its size before: the data dir's, or with ``chat`` (a task
    on conversations) and ``train.init_from`` the starting run's."""
    if chat and cfg.train.init_from:
        return chat_tokenizer(cfg.train.init_from)
    tokenizer = load_tokenizer(cfg.data.dir, read_manifest(cfg.data.dir))
    return tokenizer, Path(cfg.data.dir) / TOKENIZER, None


def resolve_model_config(model_cfg, tokenizer, grown: bool = False):
    """Fill ``vocab_size`` from the tokenizer (rounded up to ``vocab_multiple``) and check it;
    ``grown``: the chat tokens were appended, so a size below the tokenizer's is taken afresh."""
    if grown and 0 < model_cfg.vocab_size < tokenizer.vocab_size:
        model_cfg = replace(model_cfg, vocab_size=0)  # from the grown tokenizer, rounded up
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


def chat_tokenizer(run: str) -> tuple[Tokenizer, Path | None, int | None]:
    """The tokenizer of fine-tuning on conversations (SFT, DPO) from ``run``: the source run's
    (these tasks read no shards, so the data dir has no say), with the chat tokens appended if
    it lacks them (an imported foreign tokenizer). Returns it, the file to copy into the run
    (None when it grew: it is saved from memory) and, when it grew, its size before."""
    tokenizer, path = load_run_tokenizer(run, "train.init_from")
    known = tokenizer.vocab_size
    added = add_chat_tokens(tokenizer)
    if not added:
        return tokenizer, path, None
    ids = f"{known}..{tokenizer.vocab_size - 1}"
    print0(f"ember: {path} lacks the chat tokens: added {', '.join(added)} as ids {ids}")
    return tokenizer, None, known


def init_from(model, run: str, model_cfg, tokenizer_sha: str | None, known: int | None = None) -> None:
    """Load run directory ``run``'s final float weights (``model/``) into ``model`` (fine-tuning);
    an EmberError, before anything is written, if they cannot stand for this run's model: another
    model config, another tokenizer, or quantized weights (their rounding is not trainable).
    ``tokenizer_sha`` None: the tokenizer is the source's own (SFT), nothing to compare. ``known``:
    the source tokenizer's size when chat tokens were appended to it; the embedding and head then
    grow to this run's vocabulary, rows from ``known`` on the mean of the rows before."""
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


def apply_lora_cfg(model, train_cfg) -> set[str]:
    """``train.lora_rank``: adapters on the targeted block linears, everything else frozen (the
    base in NF4 with ``train.qlora``); returns the adapters' state dict names, which are all a
    checkpoint then holds."""
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


def apply_qat_cfg(model, train_cfg) -> None:
    """``train.qat``: every nn.Linear in the blocks fake-quantizes its weight in the forward pass,
    and the output head at int8 as ``ember quantize`` stores it (``QATLinear``: same parameters
    and names, so optimizer, checkpoints and the exported float weights are unchanged, and
    ``ember quantize`` of the same scheme stores what training saw)."""

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


# train.precision → torchao's float8 recipe: tensorwise scales (one per tensor: the fastest) or
# rowwise (one per row of each operand: closer to bf16, a little slower)
FP8_RECIPES = {"fp8": "tensorwise", "fp8-rowwise": "rowwise"}


def check_fp8(train_cfg, device: torch.device, layout: tuple[str, ...] = (), capability=None) -> None:
    """Refuse ``train.precision=fp8`` where it cannot run, before any work. Float8 training
    multiplies in float8 on tensor cores (``torch._scaled_mm``), which exist only on CUDA GPUs
    of compute capability 8.9 or newer (L4, 4090, H100, H200, B200): a CPU has no float8
    GEMM, so this path can be refused on one but never run there. ``layout``: the parts of the
    layout in use that float8 linears do not compose with here (TP, PP, FSDP)."""
    where = f"train.precision={train_cfg.precision}"
    if train_cfg.precision not in FP8_RECIPES:
        if train_cfg.fp8_linears != "blocks":
            raise ConfigError(f"train.fp8_linears={train_cfg.fp8_linears} picks the linears that train.precision=fp8 converts; this run trains in {train_cfg.precision}: set train.precision=fp8 or drop train.fp8_linears")  # fmt: skip # noqa: E501
        return
    if device.type != "cuda":
        raise ConfigError(f"{where} needs a CUDA GPU of compute capability 8.9 or newer; this run is on {device.type}: use train.precision=bf16")  # fmt: skip # noqa: E501
    major, minor = capability or torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(f"{where} needs float8 tensor cores (compute capability 8.9 or newer: L4, H100, H200); this GPU has {major}.{minor}: use train.precision=bf16")  # fmt: skip # noqa: E501
    clash = [*layout, *(["train.qat"] if train_cfg.qat != "none" else [])]
    clash += ["LoRA"] if train_cfg.lora_rank else []
    if train_cfg.fp8_linears == "all" and train_cfg.kernels == "triton":
        clash += ["train.kernels=triton's fused head and loss (train.fp8_linears=all converts the head)"]
    if clash:
        raise ConfigError(f"{where} converts the block linears to torchao's Float8Linear: not with {', '.join(clash)} yet")  # fmt: skip # noqa: E501
    if train_cfg.micro_batch * train_cfg.seq_len % 16:  # the weight gradient's inner dimension: the tokens
        raise ConfigError(f"{where}: float8 matrix products want every dimension a multiple of 16, the weight gradient's too, which sums over a micro-batch's {train_cfg.micro_batch} × {train_cfg.seq_len} tokens: make train.seq_len (or train.micro_batch) a multiple of 16")  # fmt: skip # noqa: E501
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError(f"{where} needs torchao's float8 training: pip install 'ember[quant]'") from None


def fp8_filter(module: torch.nn.Module, fqn: str, linears: str = "blocks") -> bool:
    """The linears float8 training converts (``train.fp8_linears``), those whose widths are both
    multiples of 16 (float8 GEMMs' alignment): every block linear (``blocks``, torchtitan's
    default: the head stays in bf16); the MLPs' alone (``mlp``: the widest products, whose GEMM
    time outweighs their casts first); or the blocks' and the head (``all``: the step's largest
    product, whose input is narrow but whose output gradient, B·T × vocab, costs a cast of its
    own). A head tied to the embedding stays tied: ``Float8Linear`` keeps the module's weight."""
    if not isinstance(module, torch.nn.Linear) or module.in_features % 16 or module.out_features % 16:
        return False
    if fqn == "output":
        return linears == "all"
    return fqn.startswith("layers.") and (linears != "mlp" or ".mlp." in fqn)


def apply_fp8(model, train_cfg) -> None:
    """``train.precision=fp8``: torchao's ``Float8Linear`` on the linears ``fp8_filter`` picks
    (same parameters and names: checkpoints and exported weights are a plain run's), with dynamic
    tensorwise or rowwise scales; the rest of the step runs under bf16 autocast. CUDA only
    (``check_fp8``); the tests check the refusal and ``fp8_filter`` on the CPU."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(FP8_RECIPES[train_cfg.precision])
    chosen = partial(fp8_filter, linears=train_cfg.fp8_linears)
    convert_to_float8_training(model, config=config, module_filter_fn=chosen)
