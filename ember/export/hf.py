"""A run directory to and from an HF transformers folder (``save_pretrained`` layout).

    export_hf("runs/tiny", "out/tiny-hf")           # ember export runs/tiny --to hf out/tiny-hf
    import_hf("out/tiny-hf", "runs/tiny-back")       # ember import hf out/tiny-hf --out runs/tiny-back

The HF folder holds ``config.json`` (``GPT2LMHeadModel`` for learned positions,
``MixtralForCausalLM`` for ``model.mlp=moe``, ``MambaForCausalLM`` for a pure Mamba model, else
``LlamaForCausalLM``; ``BertForMaskedLM`` for a masked LM), ``model.safetensors``,
``generation_config.json`` (bos/eos/pad ids) and a fast tokenizer (``tokenizer.json`` +
``tokenizer_config.json``), so ``AutoModelForCausalLM`` (``AutoModelForMaskedLM``) and
``AutoTokenizer`` load it with no ember installed. The weight
renaming lives in ember/model/hf.py; this module only reads and writes folders.

Design choices:

- ember's tokenizer encodes special-token strings in text as ordinary characters
  (``encode_special_tokens``); ``tokenizer_config.json`` says the same to transformers with
  ``split_special_tokens: true``, so both give the same ids on any string.
- An imported run is a run directory like a trained one: ``model/`` (weights,
  ``model_config.json``, ``tokenizer.json``), ``tokenizer.json`` and a ``config.yaml`` (the
  defaults with the imported model and ``train.seq_len = max_seq_len``) that ``ember eval
  --data`` and ``ember generate`` read. It has no checkpoints and no prepared data.
- The tokenizer is ember's own (special tokens at ids 0..15, as ember's exports have; a
  folder naming ``<|eos|>`` is read that way, and re-imports byte for byte) or a foreign
  fast tokenizer such as GPT-2's byte-level BPE (``<|endoftext|>`` as bos/eos, no pad) or a
  Llama-style one (``<unk>``, ``<s>``, ``</s>``; Metaspace and byte fallback). A foreign
  tokenizer's bos/eos/pad/unk tokens are read from the folder, first found wins:
  ``tokenizer_config.json`` and ``special_tokens_map.json`` (``eos_token``: a string or
  ``{"content": ...}``), then ``generation_config.json`` and ``config.json`` (``eos_token_id``;
  the first of a list), then well-known names in the vocabulary (``<|endoftext|>``,
  ``<s>``/``</s>``, ``<unk>``, ``<pad>``). They are stored as ``specials.json`` beside each
  copy of ``tokenizer.json`` (ember/data/tokenizer.py), which is copied unchanged. No eos,
  no ``tokenizer.json``, or a vocabulary larger than the embedding is refused before
  anything is written. Imported text is encoded as transformers does with
  ``add_special_tokens=False``, except that a special-token string inside the text stays
  ordinary characters (see above). Exporting an imported run names its own special tokens
  (pad = eos where it had none), so stock → ember → HF keeps the ids and the logits.
- Both directions write into a staging folder beside the target and rename it into place
  at the end (ember/atomic.py): a failure leaves nothing half-written. A target that exists
  and is not empty is refused unless ``force`` and it is ember's own output of that kind
  (``check_target``); the source folder, a folder holding it or one inside it, never.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path

from safetensors import SafetensorError
from tokenizers import Tokenizer as HFTokenizer

from ember.atomic import build_dir, check_target
from ember.config import Config, config_to_yaml
from ember.data.chat import END_TURN, HF_CHAT_TEMPLATE
from ember.data.masking import mask_id
from ember.data.tokenizer import ROLES, SPECIAL_TOKENS, Tokenizer
from ember.errors import EmberError
from ember.export.card import model_card
from ember.model.hf import IMPORTS, from_hf, to_hf
from ember.run import export_weights, load_run

TARGETS = ("hf",)
TOKENIZER = "tokenizer.json"
# Where a foreign tokenizer's special tokens are named, in order: token strings, then ids.
TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")
ID_FILES = ("generation_config.json", "config.json")
KNOWN_NAMES = {
    "bos": ("<|endoftext|>", "<s>", "<|begin_of_text|>"),
    "eos": ("<|endoftext|>", "</s>", "<|end_of_text|>"),
    "pad": ("<pad>", "<|pad|>"),
    "unk": ("<unk>",),
}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise EmberError(
            "HF export and import need transformers: pip install transformers (or ember[dev])"
        ) from None
    transformers.utils.logging.disable_progress_bar()  # ember prints what was written itself
    return transformers


def export_hf(run_dir: str | Path, out: str | Path, ckpt: str = "last", force: bool = False) -> Path:
    """Write ``run_dir``'s model (``ckpt``: last, best or a step) and tokenizer as an HF folder."""
    transformers = _transformers()
    out = check_target(out, kind="hf", sources=[run_dir], force=force)
    model, tokenizer = load_run(run_dir, ckpt)  # EmberError for a missing or damaged run
    hf = to_hf(model).eval()
    special = dict(
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id
    )
    hf.config.update(special)
    hf.generation_config = transformers.GenerationConfig(**special)
    tokens = {f"{role}_token": tok for role, tok in tokenizer.special_tokens().items() if tok is not None}
    if not model.cfg.causal:  # BertForMaskedLM: the fill-mask pipeline reads the tokenizer's mask token
        tokens["mask_token"] = tokenizer.id_to_token(mask_id(tokenizer))
    if tokenizer.hf.token_to_id(END_TURN) is not None:  # an ember tokenizer: the chat format's tokens
        tokens["chat_template"] = HF_CHAT_TEMPLATE
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.hf,
        **tokens,
        split_special_tokens=True,  # as ember encodes: "<|eos|>" in text is plain characters
        clean_up_tokenization_spaces=False,
        model_max_length=model.cfg.max_seq_len,
    )

    def fill(tmp: Path) -> None:
        hf.save_pretrained(tmp)
        hf_tokenizer.save_pretrained(tmp)
        # ember's own file: transformers adds a no-op post_processor; this keeps the round trip exact
        (tmp / TOKENIZER).write_text(tokenizer.to_str(), encoding="utf-8")
        card = model_card(Path(run_dir), model, type(hf).__name__, Path(out).name)
        (tmp / "README.md").write_text(card, encoding="utf-8")

    return build_dir(out, fill, kind="hf")


def import_hf(hf_dir: str | Path, out: str | Path, force: bool = False) -> Path:
    """Build a run directory at ``out`` from a GPT-2, Llama, Mixtral, Mamba or BertForMaskedLM HF folder."""
    transformers = _transformers()
    hf_dir, out = Path(hf_dir), Path(out)
    if not (hf_dir / "config.json").is_file():
        raise EmberError(f"{hf_dir} has no config.json; point at a folder written by save_pretrained")
    if not (hf_dir / TOKENIZER).is_file():
        raise EmberError(
            f"{hf_dir} has no {TOKENIZER}: ember imports a model with its fast tokenizer; "
            "save the tokenizer there too (tokenizer.save_pretrained)"
        )
    check_target(out, kind="run", sources=[hf_dir], force=force)
    tokenizer = _read_tokenizer(hf_dir)
    try:
        model_type = json.loads((hf_dir / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as e:  # ValueError: bad JSON or UTF-8
        raise EmberError(f"{hf_dir / 'config.json'} cannot be read ({e})") from None
    if model_type not in IMPORTS:
        raise EmberError(
            f"{hf_dir / 'config.json'}: model_type={model_type!r} cannot be imported; "
            f"ember reads {', '.join(IMPORTS)}"
        )
    auto = transformers.AutoModelForMaskedLM if model_type == "bert" else transformers.AutoModelForCausalLM
    try:
        hf = auto.from_pretrained(hf_dir).eval()
    except (OSError, ValueError, SafetensorError) as e:  # no or damaged weights; transformers says which
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EmberError(f"cannot load the model in {hf_dir} ({message[:300]})") from None
    except RuntimeError as e:  # transformers: shapes in config.json that the weights do not have
        if "mismatched" not in str(e):
            raise
        raise EmberError(
            f"{hf_dir / 'config.json'} does not match the weights: a size in it (vocab_size, hidden_size, "
            "heads, layers) differs from the saved tensors'; restore the config the weights were saved with"
        ) from None
    model = from_hf(hf)  # ConfigError naming the field ember cannot represent
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise EmberError(
            f"{hf_dir / TOKENIZER} has {tokenizer.vocab_size} tokens but the model only "
            f"{model.cfg.vocab_size}: the tokenizer does not match the weights"
        )
    cfg = imported_config(out, model.cfg, tokenizer)

    def fill(tmp: Path) -> None:
        export_weights(model, tmp / "model", asdict(model.cfg), {TOKENIZER: hf_dir / TOKENIZER})
        shutil.copyfile(hf_dir / TOKENIZER, tmp / TOKENIZER)
        tokenizer.save_specials(tmp / "model")  # nothing for an ember tokenizer
        tokenizer.save_specials(tmp)
        (tmp / "config.yaml").write_text(config_to_yaml(cfg), encoding="utf-8")

    return build_dir(out, fill, kind="run")


def imported_config(out: Path, model_cfg, tokenizer: Tokenizer) -> Config:
    """The ``config.yaml`` of a run imported into ``out``: the defaults, the imported model, and
    ``data.dir = out/data``, which does not exist, so ``ember eval --split`` says there is no
    prepared data instead of reading another corpus."""
    cfg = Config()
    return replace(
        cfg,
        run=replace(cfg.run, name=out.name, out_dir=str(out.parent)),
        data=replace(
            cfg.data, dir=str(out / "data"), tokenizer=tokenizer.kind, vocab_size=tokenizer.vocab_size
        ),
        model=model_cfg,
        train=replace(
            cfg.train,
            seq_len=min(cfg.train.seq_len, model_cfg.max_seq_len),
            task="lm" if model_cfg.causal else "mlm",  # an encoder (BertForMaskedLM) trains as MLM
        ),
    )


# ------------------------------------------------------------------ a foreign tokenizer's specials


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON or UTF-8
        raise EmberError(f"{path} cannot be read ({e}); save the folder again with save_pretrained") from None
    return data if isinstance(data, dict) else {}


def _special_token(hf_dir: Path, hf_tok, role: str) -> str | None:
    """The token string of ``role`` (bos, eos, pad, unk) that the folder names, or None."""
    for name in TOKEN_FILES:
        value = _json(hf_dir / name).get(f"{role}_token")
        if isinstance(value, dict):  # an AddedToken as older transformers saved it
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str) or hf_tok.token_to_id(value) is None:
            raise EmberError(
                f"{hf_dir / name}: {role}_token={value!r} is not in {hf_dir / TOKENIZER}; "
                "the tokenizer files do not belong together: save the tokenizer again"
            )
        return value
    for name in ID_FILES:
        value = _json(hf_dir / name).get(f"{role}_token_id")
        if isinstance(value, list):  # several eos ids (e.g. end of text, end of turn): the first
            value = value[0] if value else None
        if value is None:
            continue
        token = hf_tok.id_to_token(value) if isinstance(value, int) and value >= 0 else None
        if token is None:
            raise EmberError(
                f"{hf_dir / name}: {role}_token_id={value!r} is not an id of {hf_dir / TOKENIZER} "
                f"({hf_tok.get_vocab_size()} tokens); fix the id or save the tokenizer again"
            )
        return token
    return next((t for t in KNOWN_NAMES[role] if hf_tok.token_to_id(t) is not None), None)


def _read_tokenizer(hf_dir: Path) -> Tokenizer:
    """The folder's tokenizer: ember's own layout, or a foreign one with its specials."""
    try:
        return Tokenizer.load(hf_dir / TOKENIZER)  # ember's own layout loads as is
    except EmberError as e:
        ember_error = e
    try:
        hf_tok = HFTokenizer.from_file(str(hf_dir / TOKENIZER))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise EmberError(f"{hf_dir / TOKENIZER} is not a valid tokenizer.json ({e})") from None
    named = [_json(hf_dir / name).get("eos_token") for name in TOKEN_FILES]
    eos = SPECIAL_TOKENS[1]
    if any(hf_tok.token_to_id(t) == i for i, t in enumerate(SPECIAL_TOKENS[:4])) or (
        eos in named and hf_tok.token_to_id(eos) is None
    ):  # a damaged ember tokenizer (some specials where ember puts them, or <|eos|> named but absent)
        raise EmberError(
            f"{hf_dir / TOKENIZER}: {ember_error}; ember's own tokenizers have their special tokens "
            "at ids 0..15, as `ember export --to hf` writes them"
        )
    specials = {role: _special_token(hf_dir, hf_tok, role) for role in ROLES}
    try:
        return Tokenizer(hf_tok, specials)
    except EmberError as e:
        raise EmberError(
            f"{hf_dir / TOKENIZER}: {e}; name it as eos_token in {hf_dir / TOKEN_FILES[0]}"
        ) from None
