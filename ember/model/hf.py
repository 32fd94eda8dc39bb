"""Weights between ember's ``GPT`` and HF transformers' ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` /
``BertForMaskedLM``.

    hf = to_hf(model)     # an HF model with the same logits (fp32, CPU)
    back = from_hf(hf)    # and back to a GPT

Three layouts map; anything else raises ``ConfigError`` naming the option:

- GPT-2: learned positions, LayerNorm, GELU MLP, biases, multi-head attention,
  tied or untied head. HF's GPT-2 keeps its linear layers in ``Conv1D``, whose
  weight is (in, out), the transpose of ``nn.Linear``'s, and fuses q, k, v in
  ``c_attn`` as [q | k | v] along the output dimension.
- Llama: RoPE, RMSNorm, SwiGLU, no qk_norm; GQA, biases (HF's ``attention_bias``
  and ``mlp_bias`` together), tied or untied head. ember's RoPE already uses HF's
  rotate-half convention, so ``q_proj``/``k_proj`` are plain copies; Meta's
  original checkpoints pair dimensions (2i, 2i+1) and would need HF's row
  permutation, which is not needed here.
- BERT (``model.causal=false``): learned positions, post-norm LayerNorm blocks, a norm on the
  embeddings, exact GELU, the MLM head (``model.head=mlm``), biases. HF's token-type embeddings
  hold one vector per type; ember has none: on import, type 0's row (the one HF adds when given
  no ``token_type_ids``) is added to every position embedding; on export the table is zeros.

Dropout is carried over as far as HF has it (Llama has attention dropout only).
transformers is an optional dependency (the ``dev`` extra), imported inside the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ember.config import ModelConfig
from ember.errors import ConfigError
from ember.model.gpt import GPT, mlp_hidden_size

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# (HF key, ember keys concatenated along dim 0, transpose)
Mapping = list[tuple[str, tuple[str, ...], bool]]
HF_CLASSES = {  # (causal LM, reward model) per layout
    "gpt2": ("GPT2LMHeadModel", "GPT2ForSequenceClassification"),
    "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "bert": ("BertForMaskedLM", None),
}
TOKEN_TYPES = "bert.embeddings.token_type_embeddings.weight"  # folded into positions (module docstring)


def layout_of(cfg: ModelConfig) -> str:
    """'gpt2' or 'llama', or a ConfigError saying what HF cannot represent."""
    if cfg.qk_norm:
        raise ConfigError("model.qk_norm has no counterpart in HF GPT-2 or Llama; export needs qk_norm=false")
    if cfg.logit_softcap:
        raise ConfigError(
            "model.logit_softcap has no counterpart in HF GPT-2 or Llama; export needs logit_softcap=0"
        )
    if not cfg.causal:
        return _bert_layout(cfg)
    if cfg.norm_position != "pre" or cfg.gelu != "tanh":
        raise ConfigError(
            f"model.norm_position={cfg.norm_position}, model.gelu={cfg.gelu}: a causal model exports as HF "
            "GPT-2 or Llama, which need norm_position=pre and gelu=tanh"
        )
    if cfg.pos == "learned":
        wrong = [
            f"model.{key}={value}"
            for key, value, want in (
                ("norm", cfg.norm, "layernorm"),
                ("mlp", cfg.mlp, "gelu"),
                ("bias", cfg.bias, True),
                ("n_kv_head", cfg.n_kv_head or cfg.n_head, cfg.n_head),
            )
            if value != want
        ]
        if wrong:
            raise ConfigError(
                f"learned positions export as HF GPT-2, which has no {', '.join(wrong)}; "
                "GPT-2 needs norm=layernorm, mlp=gelu, bias=true and n_kv_head=n_head"
            )
        return "gpt2"
    wrong = [
        f"model.{k}={v}"
        for k, v, want in (("norm", cfg.norm, "rmsnorm"), ("mlp", cfg.mlp, "swiglu"))
        if v != want
    ]
    if wrong:
        raise ConfigError(
            f"RoPE exports as HF Llama, which has no {', '.join(wrong)}; "
            "Llama needs norm=rmsnorm and mlp=swiglu"
        )
    return "llama"


def _bert_layout(cfg: ModelConfig) -> str:
    want = (("pos", "learned"), ("norm", "layernorm"), ("norm_position", "post"), ("mlp", "gelu"),
            ("gelu", "erf"), ("bias", True), ("head", "mlm"), ("n_kv_head", cfg.n_head))  # fmt: skip
    have = {**vars(cfg), "n_kv_head": cfg.n_kv_head or cfg.n_head}
    if wrong := [f"model.{key}={have[key]}" for key, value in want if have[key] != value]:
        raise ConfigError(
            f"a bidirectional model (model.causal=false) exports as HF BERT, which has no {', '.join(wrong)}; "  # noqa: E501
            "BERT needs " + ", ".join(f"{key}={value}" for key, value in want)
        )
    return "bert"


def _bert_mapping(cfg: ModelConfig) -> Mapping:
    m: Mapping = [
        ("bert.embeddings.word_embeddings.weight", ("tok_embeddings.weight",), False),
        ("bert.embeddings.position_embeddings.weight", ("pos.wpe.weight",), False),
        ("cls.predictions.bias", ("output.bias",), False),
    ]
    pairs = [
        ("bert.embeddings.LayerNorm", "embed_norm"),
        ("cls.predictions.transform.dense", "transform.dense"),
        ("cls.predictions.transform.LayerNorm", "transform.norm"),
    ]
    for i in range(cfg.n_layer):
        hf, ours = f"bert.encoder.layer.{i}", f"layers.{i}"
        pairs += [
            (f"{hf}.attention.self.query", f"{ours}.attention.wq"),
            (f"{hf}.attention.self.key", f"{ours}.attention.wk"),
            (f"{hf}.attention.self.value", f"{ours}.attention.wv"),
            (f"{hf}.attention.output.dense", f"{ours}.attention.wo"),
            (f"{hf}.attention.output.LayerNorm", f"{ours}.attention_norm"),
            (f"{hf}.intermediate.dense", f"{ours}.mlp.w1"),
            (f"{hf}.output.dense", f"{ours}.mlp.w2"),
            (f"{hf}.output.LayerNorm", f"{ours}.mlp_norm"),
        ]
    return m + [(f"{a}.{p}", (f"{b}.{p}",), False) for a, b in pairs for p in ("weight", "bias")]


def _gpt2_mapping(cfg: ModelConfig) -> Mapping:
    m: Mapping = [
        ("transformer.wte.weight", ("tok_embeddings.weight",), False),
        ("transformer.wpe.weight", ("pos.wpe.weight",), False),
        ("transformer.ln_f.weight", ("norm.weight",), False),
        ("transformer.ln_f.bias", ("norm.bias",), False),
    ]
    for i in range(cfg.n_layer):
        hf, ours = f"transformer.h.{i}", f"layers.{i}"
        qkv = tuple(f"{ours}.attention.{w}" for w in ("wq", "wk", "wv"))
        m += [
            (f"{hf}.ln_1.weight", (f"{ours}.attention_norm.weight",), False),
            (f"{hf}.ln_1.bias", (f"{ours}.attention_norm.bias",), False),
            (f"{hf}.attn.c_attn.weight", tuple(f"{k}.weight" for k in qkv), True),
            (f"{hf}.attn.c_attn.bias", tuple(f"{k}.bias" for k in qkv), False),
            (f"{hf}.attn.c_proj.weight", (f"{ours}.attention.wo.weight",), True),
            (f"{hf}.attn.c_proj.bias", (f"{ours}.attention.wo.bias",), False),
            (f"{hf}.ln_2.weight", (f"{ours}.mlp_norm.weight",), False),
            (f"{hf}.ln_2.bias", (f"{ours}.mlp_norm.bias",), False),
            (f"{hf}.mlp.c_fc.weight", (f"{ours}.mlp.w1.weight",), True),
            (f"{hf}.mlp.c_fc.bias", (f"{ours}.mlp.w1.bias",), False),
            (f"{hf}.mlp.c_proj.weight", (f"{ours}.mlp.w2.weight",), True),
            (f"{hf}.mlp.c_proj.bias", (f"{ours}.mlp.w2.bias",), False),
        ]
    return m


def _llama_mapping(cfg: ModelConfig) -> Mapping:
    m: Mapping = [
        ("model.embed_tokens.weight", ("tok_embeddings.weight",), False),
        ("model.norm.weight", ("norm.weight",), False),
    ]
    linears = [
        ("self_attn.q_proj", "attention.wq"),
        ("self_attn.k_proj", "attention.wk"),
        ("self_attn.v_proj", "attention.wv"),
        ("self_attn.o_proj", "attention.wo"),
        ("mlp.gate_proj", "mlp.w1"),
        ("mlp.up_proj", "mlp.w3"),
        ("mlp.down_proj", "mlp.w2"),
    ]
    params = ("weight", "bias") if cfg.bias else ("weight",)
    for i in range(cfg.n_layer):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        m += [
            (f"{hf}.input_layernorm.weight", (f"{ours}.attention_norm.weight",), False),
            (f"{hf}.post_attention_layernorm.weight", (f"{ours}.mlp_norm.weight",), False),
        ]
        m += [(f"{hf}.{a}.{p}", (f"{ours}.{b}.{p}",), False) for a, b in linears for p in params]
    return m


def _mapping(cfg: ModelConfig, layout: str) -> Mapping:
    """The layout's table and the head: HF's ``score`` for a reward model, ``lm_head`` when untied."""
    m = {"gpt2": _gpt2_mapping, "llama": _llama_mapping, "bert": _bert_mapping}[layout](cfg)
    if cfg.head == "score":
        return [*m, ("score.weight", ("output.weight",), False)]
    head = "cls.predictions.decoder.weight" if layout == "bert" else "lm_head.weight"
    return m if cfg.tie_embeddings else [*m, (head, ("output.weight",), False)]


def _hf_config(cfg: ModelConfig, layout: str) -> Any:
    import transformers

    common = dict(
        vocab_size=cfg.vocab_size,
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
    )
    if layout == "bert":
        return transformers.BertConfig(
            **common,
            pad_token_id=None,  # no padding row: every embedding row trains, as in ember
            hidden_size=cfg.d_model,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            intermediate_size=mlp_hidden_size(cfg),
            hidden_act="gelu",  # HF's "gelu" is the exact erf form
            hidden_dropout_prob=cfg.dropout,
            attention_probs_dropout_prob=cfg.dropout,
            max_position_embeddings=cfg.max_seq_len,
            type_vocab_size=1,
            layer_norm_eps=cfg.norm_eps,
        )
    if layout == "gpt2":
        return transformers.GPT2Config(
            **common,
            n_positions=cfg.max_seq_len,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_inner=cfg.mlp_hidden or None,  # None = 4 * n_embd, as in ember
            activation_function="gelu_new",
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            layer_norm_epsilon=cfg.norm_eps,
        )
    return transformers.LlamaConfig(
        **common,
        hidden_size=cfg.d_model,
        intermediate_size=mlp_hidden_size(cfg),
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head or cfg.n_head,
        head_dim=cfg.d_model // cfg.n_head,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,  # transformers 5 moves it into rope_parameters
        attention_bias=cfg.bias,
        mlp_bias=cfg.bias,
        attention_dropout=cfg.dropout,
    )


def _rope(config: Any) -> tuple[str, float]:
    """(rope type, theta) from a transformers 4 (rope_theta, rope_scaling) or 5 (rope_parameters) config."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope_type, float(theta)


def _check_mapping(mapping: Mapping, names: set[str], side: str, pick: int) -> None:
    covered = {name for entry in mapping for name in ([entry[0]] if pick == 0 else entry[1])}
    if missing := names - covered:  # a bug in the tables above, not a user error
        raise RuntimeError(f"the {side} weights {sorted(missing)} have no mapping")


def to_hf(model: GPT) -> PreTrainedModel:
    """An HF ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` (fp32, CPU, same train/eval mode)
    holding copies of ``model``'s weights; for a reward model (``model.head=score``) the
    ``...ForSequenceClassification`` with one label, whose ``score`` is our head."""
    import transformers

    cfg = model.cfg
    layout = layout_of(cfg)
    mapping = _mapping(cfg, layout)
    config = _hf_config(cfg, layout)
    if cfg.head == "score":
        config.num_labels = 1
    hf = getattr(transformers, HF_CLASSES[layout][cfg.head == "score"])(config)
    _check_mapping(mapping, {name for name, _ in hf.named_parameters()} - {TOKEN_TYPES}, "HF", pick=0)
    ours, theirs = model.state_dict(), hf.state_dict()
    with torch.no_grad():
        if layout == "bert":
            theirs[TOKEN_TYPES].zero_()
        for hf_key, keys, transpose in mapping:
            weight = torch.cat([ours[k] for k in keys]) if len(keys) > 1 else ours[keys[0]]
            theirs[hf_key].copy_(weight.t() if transpose else weight)
    return hf.train(model.training)


def _config_from_gpt2(config: Any) -> ModelConfig:
    unsupported = {
        "activation_function": (config.activation_function, ("gelu_new", "gelu_pytorch_tanh")),
        "scale_attn_weights": (config.scale_attn_weights, (True,)),
        "scale_attn_by_inverse_layer_idx": (config.scale_attn_by_inverse_layer_idx, (False,)),
        "add_cross_attention": (getattr(config, "add_cross_attention", False), (False,)),
    }
    for key, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ConfigError(
                f"GPT-2 config {key}={value!r} has no ember equivalent (ember needs {allowed[0]!r})"
            )
    return ModelConfig(
        vocab_size=config.vocab_size,
        n_layer=config.n_layer,
        n_head=config.n_head,
        d_model=config.n_embd,
        max_seq_len=config.n_positions,
        mlp="gelu",
        mlp_hidden=config.n_inner or 0,
        norm="layernorm",
        norm_eps=config.layer_norm_epsilon,
        pos="learned",
        tie_embeddings=config.tie_word_embeddings,
        bias=True,
        dropout=config.resid_pdrop,
        init_std=config.initializer_range,
    )


def _config_from_llama(config: Any) -> ModelConfig:
    rope_type, theta = _rope(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    problems = {
        "hidden_act": (config.hidden_act, "silu"),
        "rope_type": (rope_type, "default"),
        "head_dim": (head_dim, config.hidden_size // config.num_attention_heads),
        "mlp_bias": (getattr(config, "mlp_bias", False), config.attention_bias),
    }
    for key, (value, want) in problems.items():
        if value != want:
            raise ConfigError(f"Llama config {key}={value!r} has no ember equivalent (ember needs {want!r})")
    return ModelConfig(
        vocab_size=config.vocab_size,
        n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads,
        n_kv_head=config.num_key_value_heads or 0,
        d_model=config.hidden_size,
        max_seq_len=config.max_position_embeddings,
        mlp="swiglu",
        mlp_hidden=config.intermediate_size,
        norm="rmsnorm",
        norm_eps=config.rms_norm_eps,
        pos="rope",
        rope_theta=theta,
        tie_embeddings=config.tie_word_embeddings,
        bias=config.attention_bias,
        dropout=float(config.attention_dropout),
        init_std=config.initializer_range,
    )


def _config_from_bert(config: Any) -> ModelConfig:
    problems = {
        "hidden_act": (config.hidden_act, "gelu"),
        "position_embedding_type": (getattr(config, "position_embedding_type", "absolute"), "absolute"),
        "is_decoder": (getattr(config, "is_decoder", False), False),
    }
    for key, (value, want) in problems.items():
        if value != want:
            raise ConfigError(f"BERT config {key}={value!r} has no ember equivalent (ember needs {want!r})")
    return ModelConfig(
        vocab_size=config.vocab_size,
        n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads,
        d_model=config.hidden_size,
        max_seq_len=config.max_position_embeddings,
        causal=False,
        mlp="gelu",
        gelu="erf",
        mlp_hidden=config.intermediate_size,
        norm="layernorm",
        norm_position="post",
        norm_eps=config.layer_norm_eps,
        pos="learned",
        tie_embeddings=config.tie_word_embeddings,
        bias=True,
        dropout=config.hidden_dropout_prob,
        init_std=config.initializer_range,
        head="mlm",
    )


def from_hf(hf_model: PreTrainedModel) -> GPT:
    """A ``GPT`` (CPU, the HF model's dtype cast to fp32) with the weights of an HF
    GPT-2 or Llama causal LM, or of a ``BertForMaskedLM``."""
    config = hf_model.config
    readers = {"gpt2": _config_from_gpt2, "llama": _config_from_llama, "bert": _config_from_bert}
    if config.model_type not in readers or (config.model_type == "bert" and not hasattr(hf_model, "cls")):
        raise ConfigError(
            f"cannot import an HF {type(hf_model).__name__} ({config.model_type!r}); ember reads GPT-2 and "
            "Llama causal LMs and BertForMaskedLM"
        )
    cfg = readers[config.model_type](config)
    mapping = _mapping(cfg, config.model_type)
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    model.init_buffers()
    _check_mapping(mapping, {name for name, _ in model.named_parameters()}, "ember", pick=1)
    ours, theirs = model.state_dict(), hf_model.state_dict()
    with torch.no_grad():
        for hf_key, keys, transpose in mapping:
            weight = theirs[hf_key].t() if transpose else theirs[hf_key]
            for key, part in zip(keys, weight.split([ours[k].size(0) for k in keys]), strict=True):
                ours[key].copy_(part)
        if config.model_type == "bert":  # type 0 everywhere: a constant vector, added to each position's
            ours["pos.wpe.weight"] += theirs[TOKEN_TYPES][0].to(ours["pos.wpe.weight"].dtype)
    return model.train(hf_model.training)
