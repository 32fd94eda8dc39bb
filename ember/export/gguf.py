"""A run directory to and from one GGUF file, the format llama.cpp, Ollama and LM Studio load.

    export_gguf("runs/tiny", "out/tiny.gguf", "q8_0")  # ember export runs/tiny --to gguf FILE --type q8_0
    import_gguf("out/tiny.gguf", "runs/tiny-back")     # ember import gguf FILE --out runs/tiny-back

The file follows llama.cpp's conventions (its ``convert_hf_to_gguf.py``) so that llama.cpp and
transformers' ``from_pretrained(..., gguf_file=...)`` both read it: the ``gpt2`` architecture for
learned positions (``attn_qkv`` fused as [q | k | v], weights (out, in) as ``nn.Linear`` keeps
them) and ``llama`` for RoPE. The tensors are written with the ``gguf`` package, ours only the
names, the layout and what is checked.

Design choices:

- llama.cpp's ``llama`` graph applies RoPE to adjacent pairs (2i, 2i+1), Meta's layout; ember,
  like HF, rotates halves. ``convert_hf_to_gguf.py`` therefore interleaves the rows of each q/k
  head (``_permute``), and every reader (llama.cpp's graph, transformers' loader) undoes it. We
  do the same and undo it on import.
- ``--type``: f32; f16 for the 2-D weights; q8_0 or q4_0 (blocks of 32 along a row, one scale
  each, ``gguf.quants``) for the 2-D weights whose rows are a whole number of blocks, f16 for the
  others (a fallback in the spirit of llama.cpp's). Norms and biases stay f32, as llama.cpp's
  converter keeps 1-D tensors; GPT-2's position table too (our choice: it is small and added,
  not multiplied, so rounding it buys nothing).
- The tokenizer is a byte-level BPE (``tokenizer.ggml.model = "gpt2"``, the GPT-2 split regex,
  ``pre = "gpt-2"``): tokens, merges, types (ember's 16 specials are CONTROL), bos/eos/pad/unk
  ids, no added bos (ember never prepends one) and the chat template when the chat tokens exist.
  A char or SentencePiece tokenizer has no such form and is refused. The vocabulary is padded to
  the embedding's rows with ``[PADn]`` UNUSED tokens, as llama.cpp pads, and dropped on import.
- ``general.*`` holds the model card in brief (``ember/export/card.py``'s record): name,
  parameter count and size label, the data sources, and the test bits/byte when ``eval.json``
  has them.
- The file is written beside the target and renamed into place (ember/atomic.py); ``--force``
  replaces only a GGUF file.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ember.atomic import build_dir, check_target, staging_dir
from ember.config import ModelConfig, config_to_yaml
from ember.data.chat import END_TURN, HF_CHAT_TEMPLATE
from ember.data.tokenizer import SPECIAL_TOKENS, Tokenizer
from ember.errors import EmberError
from ember.export.card import run_record
from ember.export.hf import TOKENIZER, imported_config
from ember.model.gpt import GPT, mlp_hidden_size
from ember.model.hf import layout_of
from ember.run import export_weights, load_run

TARGETS = ("gguf",)
TYPES = ("f32", "f16", "q8_0", "q4_0")
BLOCK = 32  # q8_0 and q4_0 quantize blocks of 32 values along a row
CONTROL, NORMAL, UNUSED = 3, 1, 5  # llama.cpp's token types (gguf.TokenType)


def _gguf():
    try:
        import gguf
    except ImportError:
        raise EmberError(
            "GGUF export and import need the gguf package: pip install gguf (or ember[export])"
        ) from None
    return gguf


# ------------------------------------------------------------------ tensors


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of each head from rotate-half order (i, i + d/2) to adjacent pairs (2i, 2i+1)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _names(cfg: ModelConfig, layout: str, export: bool = False) -> list[tuple[str, tuple[str, ...]]]:
    """(GGUF name, ember keys concatenated along dim 0) for every tensor of the layout (to write
    when ``export``, to read otherwise)."""
    names = [("token_embd.weight", ("tok_embeddings.weight",)), ("output_norm.weight", ("norm.weight",))]
    gpt2 = layout == "gpt2"
    if gpt2:
        names += [("position_embd.weight", ("pos.wpe.weight",)), ("output_norm.bias", ("norm.bias",))]
    if not cfg.tie_embeddings:
        names.append(("output.weight", ("output.weight",)))
    elif gpt2 and export:  # llama.cpp's converter writes GPT-2's head even when tied: so do we
        names.append(("output.weight", ("tok_embeddings.weight",)))
    params = ("weight", "bias") if gpt2 else ("weight",)
    for i in range(cfg.n_layer):
        b, ours = f"blk.{i}", f"layers.{i}"
        pairs = [("attn_norm", "attention_norm"), ("ffn_norm", "mlp_norm"), ("attn_output", "attention.wo")]
        if gpt2:
            pairs += [("ffn_up", "mlp.w1"), ("ffn_down", "mlp.w2")]
            names += [(f"{b}.attn_qkv.{p}", tuple(f"{ours}.attention.{w}.{p}" for w in ("wq", "wk", "wv")))
                      for p in params]  # fmt: skip
        else:
            pairs += [("attn_q", "attention.wq"), ("attn_k", "attention.wk"), ("attn_v", "attention.wv"),
                      ("ffn_gate", "mlp.w1"), ("ffn_up", "mlp.w3"), ("ffn_down", "mlp.w2")]  # fmt: skip
        names += [(f"{b}.{g}.{p}", (f"{ours}.{e}.{p}",)) for g, e in pairs for p in params]
    return names


def _encode(gguf, name: str, w: np.ndarray, kind: str):
    """(data, raw dtype or None) of one tensor for ``--type kind``; see the module docstring."""
    if kind == "f32" or w.ndim != 2 or name.startswith("position_embd"):
        return w, None
    if kind in ("q8_0", "q4_0") and w.shape[1] % BLOCK == 0:
        qtype = gguf.GGMLQuantizationType[kind.upper()]
        return gguf.quants.quantize(w, qtype), qtype
    return w.astype(np.float16), None


# ------------------------------------------------------------------ tokenizer


def _bpe_parts(tokenizer: Tokenizer, where: str) -> tuple[list[str], list[str], set[str]]:
    """(tokens by id, merges as "a b", special tokens) of a byte-level BPE, or an EmberError."""
    spec = json.loads(tokenizer.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if (model.get("type"), pre.get("type"), pre.get("use_regex"), pre.get("add_prefix_space")) != (
        "BPE", "ByteLevel", True, False,
    ) or spec.get("normalizer"):  # fmt: skip
        raise EmberError(
            f"{where}: GGUF export writes a byte-level BPE tokenizer (GPT-2's split), and this run's is "
            f"{tokenizer.kind!r} with pre-tokenizer {pre.get('type')!r}; train with data.tokenizer=bpe"
        )
    vocab = dict(model["vocab"])
    vocab.update({t["content"]: t["id"] for t in spec.get("added_tokens", [])})
    tokens = [None] * tokenizer.vocab_size
    for tok, i in vocab.items():
        tokens[i] = tok
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges, {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}


def _bpe_tokenizer(tokens: list[str], merges: list[str], specials: list[str]) -> HFTokenizer:
    """The ``tokenizers`` object ember trains (ember/data/tokenizer.py), from a GGUF's fields."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return hf


# ------------------------------------------------------------------ export


def _metadata(w, gguf, run_dir: Path, model: GPT, kind: str) -> None:
    """The model card in brief, as ``general.*`` keys (card.py's record of the run)."""
    record, n = run_record(run_dir), model.num_params()
    w.add_name(record["config"]["run"]["name"])
    w.add_size_label(f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K")
    w.add_uint64("general.parameter_count", n)
    w.add_license("other")
    w.add_tags(["ember", "text-generation"])
    sources = record["sources"]
    for i, spec in enumerate(sources):
        w.add_string(f"general.dataset.{i}.name", spec)
    if sources:
        w.add_uint32("general.dataset.count", len(sources))
    text = f"A {n:,}-parameter {layout_of(model.cfg)} model trained with ember"
    text += f" on {', '.join(sources)}" if sources else " (data not recorded)"
    test = record["results"].get("test")
    if test and "bpb" in test:
        w.add_float32("general.test_bits_per_byte", float(test["bpb"]))
        text += f"; test split: {test['bpb']:.4f} bits/byte over {test['documents']:,} documents"
    w.add_description(text + f"; weights {kind}.")
    file_type = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}[kind]
    w.add_file_type(int(gguf.LlamaFileType[file_type]))
    if kind.startswith("q"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _hyper(w, cfg: ModelConfig, layout: str) -> None:
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(mlp_hidden_size(cfg))
    w.add_head_count(cfg.n_head)
    if layout == "gpt2":
        w.add_layer_norm_eps(cfg.norm_eps)
        return
    w.add_head_count_kv(cfg.n_kv_head or cfg.n_head)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(cfg.d_model // cfg.n_head)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)


def _check_layout(cfg: ModelConfig) -> str:
    layout = layout_of(cfg)  # ConfigError for what neither GPT-2 nor Llama holds
    if cfg.head != "lm":
        raise EmberError(f"model.head={cfg.head!r}: GGUF holds a causal LM; export a model with head=lm")
    if layout == "llama" and cfg.bias:
        raise EmberError(
            "model.bias=true: llama.cpp's and transformers' GGUF readers of the llama architecture "
            "take no attention/MLP biases; export a model with bias=false (or use --to hf)"
        )
    if layout == "gpt2" and mlp_hidden_size(cfg) != 4 * cfg.d_model:
        raise EmberError(
            f"model.mlp_hidden={cfg.mlp_hidden}: transformers' GGUF reader of gpt2 assumes an MLP of "
            "4 * d_model; export a GPT-2 layout with mlp_hidden=0 (or use --to hf)"
        )
    return layout


def export_gguf(
    run_dir: str | Path, out: str | Path, kind: str = "f32", ckpt: str = "last", force: bool = False
) -> Path:
    """Write ``run_dir``'s model (``ckpt``) and tokenizer as one GGUF file, weights as ``kind``."""
    if kind not in TYPES:
        raise EmberError(f"--type {kind!r}: unknown GGUF type; choose one of {', '.join(TYPES)}")
    gguf = _gguf()
    out = check_target(out, kind="gguf", sources=[run_dir], force=force)
    model, tokenizer = load_run(run_dir, ckpt)  # EmberError for a missing or damaged run
    cfg, run_dir = model.cfg, Path(run_dir)
    layout = _check_layout(cfg)
    tokens, merges, specials = _bpe_parts(tokenizer, str(run_dir / TOKENIZER))
    if len(tokens) > cfg.vocab_size:
        raise EmberError(f"{run_dir}: the tokenizer has {len(tokens)} tokens, the embedding {cfg.vocab_size}")
    types = [CONTROL if t in specials else NORMAL for t in tokens]
    pad = cfg.vocab_size - len(tokens)  # embedding rows no token reaches, named as llama.cpp names them
    tokens, types = tokens + [f"[PAD{len(tokens) + i}]" for i in range(pad)], types + [UNUSED] * pad
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    heads = {"attn_q": cfg.n_head, "attn_k": cfg.n_kv_head or cfg.n_head}
    stage = staging_dir(out)
    tmp = stage / "model.gguf"
    try:
        w = gguf.GGUFWriter(str(tmp), layout)
        _metadata(w, gguf, run_dir, model, kind)
        _hyper(w, cfg, layout)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        for role, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                          ("pad", w.add_pad_token_id), ("unk", w.add_unk_token_id)):  # fmt: skip
            if getattr(tokenizer, f"{role}_id") is not None:
                add(getattr(tokenizer, f"{role}_id"))
        w.add_add_bos_token(False)  # ember never prepends bos: say so, not leave it to a reader's default
        w.add_add_eos_token(False)
        if tokenizer.hf.token_to_id(END_TURN) is not None:
            w.add_chat_template(HF_CHAT_TEMPLATE)
        for name, keys in _names(cfg, layout, export=True):
            weight = torch.cat([state[k] for k in keys])
            if layout == "llama" and (n_head := heads.get(name.split(".")[-2])):
                weight = _permute(weight, n_head)
            data, raw = _encode(gguf, name, weight.numpy(), kind)
            w.add_tensor(name, data, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


# ------------------------------------------------------------------ import


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _float(value) -> float:
    """A float32 field as the decimal it was written from (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _model_config(reader, arch: str, tensors: dict, where: str) -> ModelConfig:
    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise EmberError(f"{where} has no {arch}.{key}; it is not a complete {arch} GGUF")
        return value

    head = tensors.get("output.weight")  # absent, or a copy of the embedding: a tied head
    tied = head is None or torch.equal(head, tensors["token_embd.weight"])
    d, n_head, ff = (
        int(need("embedding_length")),
        int(need("attention.head_count")),
        int(need("feed_forward_length")),
    )
    common = dict(
        vocab_size=tensors["token_embd.weight"].shape[0], n_layer=int(need("block_count")), n_head=n_head,
        d_model=d, max_seq_len=int(need("context_length")), tie_embeddings=tied,
    )  # fmt: skip
    if arch == "gpt2":
        eps = _float(need("attention.layer_norm_epsilon"))
        mlp_hidden = 0 if ff == 4 * d else ff  # 0: ember's default width, as a GPT-2 run has it
        return ModelConfig(**common, mlp="gelu", mlp_hidden=mlp_hidden, norm="layernorm", norm_eps=eps,
                           pos="learned", bias=True)  # fmt: skip
    rope_dim = int(_field(reader, "llama.rope.dimension_count", d // n_head))
    if rope_dim != d // n_head or any(k.endswith(".bias") for k in tensors):
        raise EmberError(f"{where}: partial RoPE or biased llama layers have no ember equivalent")
    return ModelConfig(
        **common, n_kv_head=int(_field(reader, "llama.attention.head_count_kv", n_head)), mlp="swiglu",
        mlp_hidden=ff, norm="rmsnorm", norm_eps=_float(need("attention.layer_norm_rms_epsilon")), pos="rope",
        rope_theta=_float(_field(reader, "llama.rope.freq_base", 10000.0)), bias=False,
    )  # fmt: skip


def _read_tokenizer(reader, where: str) -> Tokenizer:
    if _field(reader, "tokenizer.ggml.model") != "gpt2" or "tokenizer.ggml.merges" not in reader.fields:
        raise EmberError(
            f"{where}: tokenizer.ggml.model={_field(reader, 'tokenizer.ggml.model')!r}; ember imports a "
            "byte-level BPE vocabulary with merges ('gpt2'), not SentencePiece"
        )
    tokens, merges = (
        list(_field(reader, "tokenizer.ggml.tokens")),
        list(_field(reader, "tokenizer.ggml.merges")),
    )
    types = list(_field(reader, "tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
    while tokens and types[-1] == UNUSED:  # llama.cpp's padding to the embedding's rows
        tokens.pop(), types.pop()
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind == CONTROL]
    hf = _bpe_tokenizer(tokens, merges, specials)
    if tokens[: len(SPECIAL_TOKENS)] == SPECIAL_TOKENS:
        return Tokenizer(hf)  # ember's own layout
    keys = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}
    ids = {role: _field(reader, f"tokenizer.ggml.{key}_token_id") for role, key in keys.items()}
    return Tokenizer(hf, {r: None if i is None or i >= len(tokens) else tokens[i] for r, i in ids.items()})


def import_gguf(path: str | Path, out: str | Path, force: bool = False) -> Path:
    """Build a run directory at ``out`` from a gpt2 or llama GGUF file (weights dequantized to fp32)."""
    gguf = _gguf()
    path, out = Path(path), Path(out)
    if not path.is_file():
        why = "is a folder" if path.is_dir() else "not found"
        raise EmberError(
            f"{path} {why}; give the .gguf file written by `ember export --to gguf` or llama.cpp"
        )
    check_target(out, kind="run", sources=[path], force=force)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise EmberError(f"{path} is not a readable GGUF file ({str(e)[:200]})") from None
    arch = _field(reader, "general.architecture")
    if arch not in ("gpt2", "llama"):
        raise EmberError(f"{path}: general.architecture={arch!r}; ember imports gpt2 and llama")
    tensors = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        tensors[t.name] = torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy
    cfg = _model_config(reader, arch, tensors, str(path))
    tokenizer = _read_tokenizer(reader, str(path))
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    model.init_buffers()
    state, names = model.state_dict(), _names(cfg, "gpt2" if arch == "gpt2" else "llama")
    heads = {"attn_q": cfg.n_head, "attn_k": cfg.n_kv_head or cfg.n_head}
    if missing := sorted({n for n, _ in names} - set(tensors)):
        raise EmberError(f"{path} lacks the tensors {missing[:4]}; it is not a complete {arch} model")
    with torch.no_grad():
        for name, keys in names:
            weight = tensors[name].reshape(-1, *state[keys[0]].shape[1:])
            if arch == "llama" and (n_head := heads.get(name.split(".")[-2])):
                weight = _unpermute(weight, n_head)
            for key, part in zip(keys, weight.split([state[k].size(0) for k in keys]), strict=True):
                state[key].copy_(part)
    model.eval()
    config = imported_config(out, cfg, tokenizer)

    def fill(tmp: Path) -> None:
        (tmp / TOKENIZER).write_text(tokenizer.to_str(), encoding="utf-8")
        export_weights(model, tmp / "model", asdict(cfg), {TOKENIZER: tmp / TOKENIZER})
        tokenizer.save_specials(tmp / "model")
        tokenizer.save_specials(tmp)
        (tmp / "config.yaml").write_text(config_to_yaml(config), encoding="utf-8")

    return build_dir(out, fill, kind="run")
