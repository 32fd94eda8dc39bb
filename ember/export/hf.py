"""A run directory to and from an HF transformers folder (``save_pretrained`` layout).

    export_hf("runs/tiny", "out/tiny-hf")           # ember export runs/tiny --to hf out/tiny-hf
    import_hf("out/tiny-hf", "runs/tiny-back")       # ember import hf out/tiny-hf --out runs/tiny-back

The HF folder holds ``config.json`` (``GPT2LMHeadModel`` for learned positions, else
``LlamaForCausalLM``), ``model.safetensors``, ``generation_config.json`` (bos/eos/pad ids)
and a fast tokenizer (``tokenizer.json`` + ``tokenizer_config.json``), so
``AutoModelForCausalLM`` and ``AutoTokenizer`` load it with no ember installed. The weight
renaming lives in ember/model/hf.py; this module only reads and writes folders.

Design choices:

- ember's tokenizer encodes special-token strings in text as ordinary characters
  (``encode_special_tokens``); ``tokenizer_config.json`` says the same to transformers with
  ``split_special_tokens: true``, so both give the same ids on any string.
- An imported run is a run directory like a trained one: ``model/`` (weights,
  ``model_config.json``, ``tokenizer.json``), ``tokenizer.json`` and a ``config.yaml`` (the
  defaults with the imported model and ``train.seq_len = max_seq_len``) that ``ember eval
  --data`` and ``ember generate`` read. It has no checkpoints and no prepared data.
- The tokenizer must be an ember one (special tokens at ids 0..15, as ember's exports
  have); an HF directory without ``tokenizer.json`` is refused before anything is written.
- Both directions write into a staging folder beside the target and rename it into place
  at the end (ember/atomic.py): a failure leaves nothing half-written. A target that exists
  and is not empty is refused unless ``force``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path

from ember.atomic import build_dir
from ember.config import Config, config_to_yaml
from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.model.hf import from_hf, to_hf
from ember.train.checkpoint import export_weights, load_run

TARGETS = ("hf",)
TOKENIZER = "tokenizer.json"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise EmberError(
            "HF export and import need transformers: pip install transformers (or ember[dev])"
        ) from None
    transformers.utils.logging.disable_progress_bar()  # ember prints what was written itself
    return transformers


def _check_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise EmberError(f"{out} exists and is not a directory; choose another path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise EmberError(f"{out} exists and is not empty; choose another path or pass --force to replace it")


def export_hf(run_dir: str | Path, out: str | Path, ckpt: str = "last", force: bool = False) -> Path:
    """Write ``run_dir``'s model (``ckpt``: last, best or a step) and tokenizer as an HF folder."""
    transformers = _transformers()
    out = Path(out)
    _check_target(out, force)
    model, tokenizer = load_run(run_dir, ckpt)  # EmberError for a missing or damaged run
    hf = to_hf(model).eval()
    special = dict(
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id
    )
    for key, value in special.items():
        setattr(hf.config, key, value)
    hf.generation_config = transformers.GenerationConfig(**special)
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.hf,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        split_special_tokens=True,  # as ember encodes: "<|eos|>" in text is plain characters
        clean_up_tokenization_spaces=False,
        model_max_length=model.cfg.max_seq_len,
    )

    def fill(tmp: Path) -> None:
        hf.save_pretrained(tmp)
        hf_tokenizer.save_pretrained(tmp)
        # ember's own file: transformers adds a no-op post_processor; this keeps the round trip exact
        (tmp / TOKENIZER).write_text(tokenizer.to_str(), encoding="utf-8")

    return build_dir(out, fill)


def import_hf(hf_dir: str | Path, out: str | Path, force: bool = False) -> Path:
    """Build a run directory at ``out`` from a GPT-2 or Llama HF folder on disk."""
    transformers = _transformers()
    hf_dir, out = Path(hf_dir), Path(out)
    if not (hf_dir / "config.json").is_file():
        raise EmberError(f"{hf_dir} has no config.json; point at a folder written by save_pretrained")
    if not (hf_dir / TOKENIZER).is_file():
        raise EmberError(
            f"{hf_dir} has no {TOKENIZER}: ember imports a model with its fast tokenizer; "
            "save the tokenizer there too (tokenizer.save_pretrained)"
        )
    _check_target(out, force)
    try:
        tokenizer = Tokenizer.load(hf_dir / TOKENIZER)
    except EmberError as e:  # e.g. GPT-2's own tokenizer: its specials are not ember's
        raise EmberError(
            f"{hf_dir / TOKENIZER}: {e}; ember imports tokenizers with its special tokens at ids "
            "0..15, as `ember export --to hf` writes them"
        ) from None
    try:
        model_type = json.loads((hf_dir / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as e:  # ValueError: bad JSON or UTF-8
        raise EmberError(f"{hf_dir / 'config.json'} cannot be read ({e})") from None
    if model_type not in ("gpt2", "llama"):
        raise EmberError(
            f"{hf_dir / 'config.json'}: model_type={model_type!r} cannot be imported; ember reads gpt2, llama"
        )
    from safetensors import SafetensorError

    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    except (OSError, ValueError, SafetensorError) as e:  # no or damaged weights; transformers says which
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EmberError(f"cannot load the model in {hf_dir} ({message[:300]})") from None
    model = from_hf(hf)  # ConfigError naming the field ember cannot represent
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise EmberError(
            f"{hf_dir / TOKENIZER} has {tokenizer.vocab_size} tokens but the model only "
            f"{model.cfg.vocab_size}: the tokenizer does not match the weights"
        )
    cfg = Config()
    cfg = replace(
        cfg,
        run=replace(cfg.run, name=out.name, out_dir=str(out.parent)),
        # no prepared data: `ember eval --split` then says so instead of reading another corpus
        data=replace(
            cfg.data, dir=str(out / "data"), tokenizer=tokenizer.kind, vocab_size=tokenizer.vocab_size
        ),
        model=model.cfg,
        train=replace(cfg.train, seq_len=min(cfg.train.seq_len, model.cfg.max_seq_len)),
    )

    def fill(tmp: Path) -> None:
        export_weights(model, tmp / "model", asdict(model.cfg), {TOKENIZER: hf_dir / TOKENIZER})
        shutil.copyfile(hf_dir / TOKENIZER, tmp / TOKENIZER)
        (tmp / "config.yaml").write_text(config_to_yaml(cfg), encoding="utf-8")

    return build_dir(out, fill)
