"""Weights between ember's ``GPT`` and HF transformers' ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` /
``MixtralForCausalLM`` / ``MambaForCausalLM`` / ``BertForMaskedLM``.

    hf = to_hf(model)     # an HF model with the same logits (fp32, CPU)
    back = from_hf(hf)    # and back to a GPT

Five layouts map; anything else raises ``ConfigError`` naming the option:

- GPT-2: learned positions, LayerNorm, GELU MLP, biases, multi-head attention,
  tied or untied head. HF's GPT-2 keeps its linear layers in ``Conv1D``, whose
  weight is (in, out), the transpose of ``nn.Linear``'s, and fuses q, k, v in
  ``c_attn`` as [q | k | v] along the output dimension.
- Llama: RoPE, RMSNorm, SwiGLU, no qk_norm; GQA, biases (HF's ``attention_bias``
  and ``mlp_bias`` together), tied or untied head. ember's RoPE already uses HF's
  rotate-half convention, so ``q_proj``/``k_proj`` are plain copies; Meta's
  original checkpoints pair dimensions (2i, 2i+1) and would need HF's row
  permutation, which is not needed here.
- Mixtral: Llama's attention with ``model.mlp=moe`` (no bias, no shared expert). transformers 5
  stores the experts fused: ``mlp.experts.gate_up_proj`` (E, 2*hidden, C) is ember's
  ``cat(w1, w3)`` along the rows (dim 1 of a stacked weight), ``down_proj`` is ``w2``, the
  router ``mlp.gate`` is ``mlp.router``. Its routing (softmax over all experts, top-k,
  renormalised) is ember's (ember/model/moe.py).
- Mamba (``model.mixer=mamba``, no MLP, no positions, RMSNorm): ember's ``Mamba`` names its
  parameters as HF's ``MambaMixer``, so each is a plain copy; dt_rank = ceil(d_model / 16) on both
  sides. A hybrid of attention and Mamba layers has no HF class here and is refused.
- BERT (``model.causal=false``): learned positions, post-norm LayerNorm blocks, a norm on the
  embeddings, exact GELU, the MLM head (``model.head=mlm``), biases. HF's token-type embeddings
  hold one vector per type; ember has none: on import, type 0's row (the one HF adds when given
  no ``token_type_ids``) is added to every position embedding; on export the table is zeros.

Dropout is carried over as far as HF has it (Llama has attention dropout only).
transformers is an optional dependency (the ``dev`` extra), imported inside the functions.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ember.config import ModelConfig
from ember.errors import ConfigError
from ember.model.gpt import GPT, layer_mixers, mlp_hidden_size
from ember.model.mamba import dt_rank
from ember.model.moe import expert_hidden_size

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# (HF key, ember keys concatenated along dim 0, transpose)
Mapping = list[tuple[str, tuple[str, ...], bool]]
HF_CLASSES = {  # (causal LM, reward model) per layout
    "gpt2": ("GPT2LMHeadModel", "GPT2ForSequenceClassification"),
    "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "mixtral": ("MixtralForCausalLM", "MixtralForSequenceClassification"),
    "mamba": ("MambaForCausalLM", None),
    "bert": ("BertForMaskedLM", None),
}
MAMBA_MIXER = ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj")  # linears (and the conv), same names
MAMBA_MAX_SEQ_LEN = 2048  # an imported Mamba's max_seq_len: HF has none; Mamba-130m trained at 2048
TOKEN_TYPES = "bert.embeddings.token_type_embeddings.weight"  # folded into positions (module docstring)


def layout_of(cfg: ModelConfig) -> str:
    """'gpt2', 'llama', 'mixtral', 'mamba' or 'bert', or a ConfigError saying what HF cannot represent."""
    mixers = set(layer_mixers(cfg))
    if "mamba" in mixers:
        return _mamba_layout(cfg, mixers)
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
    if cfg.mlp == "moe":
        wrong = [
            f"model.{k}={v}"
            for k, v, want in (
                ("norm", cfg.norm, "rmsnorm"),
                ("bias", cfg.bias, False),
                ("shared_expert", cfg.shared_expert, False),
            )  # fmt: skip
            if v != want
        ]
        if wrong:
            raise ConfigError(
                f"model.mlp=moe exports as HF Mixtral, which has no {', '.join(wrong)}; "
                "Mixtral needs norm=rmsnorm, bias=false and shared_expert=false"
            )
        return "mixtral"
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


def _mamba_layout(cfg: ModelConfig, mixers: set[str]) -> str:
    if mixers != {"mamba"}:
        raise ConfigError(
            f"model.pattern={cfg.pattern!r} mixes attention and Mamba layers, which no HF class ember "
            "exports to holds; export a pure Mamba model (model.mixer=mamba, no pattern)"
        )
    wants = (("norm", cfg.norm, "rmsnorm"), ("mlp", cfg.mlp, "none"), ("pos", cfg.pos, "none"),
             ("head", cfg.head, "lm"), ("logit_softcap", cfg.logit_softcap, 0.0))  # fmt: skip
    wrong = [f"model.{key}={value}" for key, value, want in wants if value != want]
    if wrong:
        raise ConfigError(
            f"Mamba exports as HF MambaForCausalLM, which has no {', '.join(wrong)}; "
            "it needs norm=rmsnorm, mlp=none, pos=none, head=lm and no logit_softcap"
        )
    return "mamba"


def _mamba_mapping(cfg: ModelConfig) -> Mapping:
    m: Mapping = [
        ("backbone.embeddings.weight", ("tok_embeddings.weight",), False),
        ("backbone.norm_f.weight", ("norm.weight",), False),
    ]
    for i in range(cfg.n_layer):
        hf, ours = f"backbone.layers.{i}", f"layers.{i}"
        names = [f"{lin}.weight" for lin in MAMBA_MIXER] + ["conv1d.bias", "dt_proj.bias", "A_log", "D"]
        names += ["in_proj.bias", "out_proj.bias"] if cfg.bias else []
        m += [(f"{hf}.norm.weight", (f"{ours}.attention_norm.weight",), False)]
        m += [(f"{hf}.mixer.{n}", (f"{ours}.attention.{n}",), False) for n in names]
    return m


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


def _mixtral_mapping(cfg: ModelConfig) -> Mapping:
    """Llama's table with the experts in place of the MLP."""
    m = [entry for entry in _llama_mapping(cfg) if ".mlp." not in entry[0]]
    for i in range(cfg.n_layer):
        hf, ours = f"model.layers.{i}.mlp", f"layers.{i}.mlp"
        m += [
            (f"{hf}.gate.weight", (f"{ours}.router.weight",), False),
            (f"{hf}.experts.gate_up_proj", (f"{ours}.experts.w1", f"{ours}.experts.w3"), False),
            (f"{hf}.experts.down_proj", (f"{ours}.experts.w2",), False),
        ]
    return m


def _rows(weight: torch.Tensor) -> int:
    """The dimension along which a mapping concatenates: the output rows of a weight (dim 0 of a
    matrix or bias, dim 1 of experts stacked as (E, out, in))."""
    return max(weight.dim() - 2, 0)


def _mapping(cfg: ModelConfig, layout: str) -> Mapping:
    """The layout's table and the head: HF's ``score`` for a reward model, ``lm_head`` when untied."""
    mappings = {
        "gpt2": _gpt2_mapping,
        "llama": _llama_mapping,
        "mixtral": _mixtral_mapping,
        "mamba": _mamba_mapping,
        "bert": _bert_mapping,
    }
    m = mappings[layout](cfg)
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
    if layout == "mamba":
        return transformers.MambaConfig(
            **common,
            hidden_size=cfg.d_model,
            state_size=cfg.d_state,
            num_hidden_layers=cfg.n_layer,
            layer_norm_epsilon=cfg.norm_eps,
            conv_kernel=cfg.d_conv,
            expand=cfg.expand,
            time_step_rank=dt_rank(cfg.d_model),
            use_bias=cfg.bias,
            use_conv_bias=True,
            hidden_act="silu",
            pad_token_id=None,
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
    llama = {  # what Llama and Mixtral share: the decoder's shape, RoPE, SiLU, RMSNorm
        **common,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head or cfg.n_head,
        "head_dim": cfg.d_model // cfg.n_head,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "attention_dropout": cfg.dropout,
    }
    if layout == "mixtral":
        return transformers.MixtralConfig(
            **llama,
            intermediate_size=expert_hidden_size(cfg),
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.top_k,
            router_aux_loss_coef=cfg.moe_aux,
            sliding_window=None,
        )
    return transformers.LlamaConfig(
        **llama,
        intermediate_size=mlp_hidden_size(cfg),
        rope_theta=cfg.rope_theta,  # transformers 5 moves it into rope_parameters
        attention_bias=cfg.bias,
        mlp_bias=cfg.bias,
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
            parts = [ours[k] for k in keys]
            weight = torch.cat(parts, dim=_rows(parts[0])) if len(keys) > 1 else parts[0]
            theirs[hf_key].copy_(weight.t() if transpose else weight)
    return hf.train(model.training)


def _check_mappable(family: str, fields: dict[str, tuple[Any, tuple]]) -> None:
    """A ConfigError for the first field of a transformers config that ember has no equivalent
    of (``fields``: name -> (its value, the values ember maps))."""
    for key, (value, allowed) in fields.items():
        if value not in allowed:
            raise ConfigError(f"{family} config {key}={value!r} has no ember equivalent (ember needs {allowed[0]!r})")  # fmt: skip # noqa: E501


def _config_from_gpt2(config: Any) -> ModelConfig:
    _check_mappable("GPT-2", {
        "activation_function": (config.activation_function, ("gelu_new", "gelu_pytorch_tanh")),
        "scale_attn_weights": (config.scale_attn_weights, (True,)),
        "scale_attn_by_inverse_layer_idx": (config.scale_attn_by_inverse_layer_idx, (False,)),
        "add_cross_attention": (getattr(config, "add_cross_attention", False), (False,)),
    })  # fmt: skip
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
    _check_mappable("Llama", {
        "hidden_act": (config.hidden_act, ("silu",)),
        "rope_type": (rope_type, ("default",)),
        "head_dim": (head_dim, (config.hidden_size // config.num_attention_heads,)),
        "mlp_bias": (getattr(config, "mlp_bias", False), (getattr(config, "attention_bias", False),)),
    })  # fmt: skip
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
        bias=getattr(config, "attention_bias", False),  # Mixtral has none
        dropout=float(config.attention_dropout),
        init_std=config.initializer_range,
    )


def _config_from_mixtral(config: Any) -> ModelConfig:
    wants = {"sliding_window": None, "router_jitter_noise": 0.0}
    _check_mappable("Mixtral", {key: (getattr(config, key, want), (want, 0)) for key, want in wants.items()})
    return replace(
        _config_from_llama(config),
        mlp="moe",
        n_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        moe_aux=config.router_aux_loss_coef,
    )


def _config_from_mamba(config: Any) -> ModelConfig:
    _check_mappable("Mamba", {
        "hidden_act": (config.hidden_act, ("silu",)),
        "intermediate_size": (config.intermediate_size, (int(config.expand) * config.hidden_size,)),
        "time_step_rank": (config.time_step_rank, (dt_rank(config.hidden_size),)),
        "use_conv_bias": (config.use_conv_bias, (True,)),
    })  # fmt: skip
    return ModelConfig(
        vocab_size=config.vocab_size,
        n_layer=config.num_hidden_layers,
        n_head=1,  # no attention layers
        d_model=config.hidden_size,
        max_seq_len=MAMBA_MAX_SEQ_LEN,
        mixer="mamba",
        d_state=config.state_size,
        d_conv=config.conv_kernel,
        expand=int(config.expand),
        mlp="none",
        norm="rmsnorm",
        norm_eps=config.layer_norm_epsilon,
        pos="none",
        tie_embeddings=config.tie_word_embeddings,
        bias=config.use_bias,
        init_std=config.initializer_range,
    )


def _config_from_bert(config: Any) -> ModelConfig:
    _check_mappable("BERT", {
        "hidden_act": (config.hidden_act, ("gelu",)),
        "position_embedding_type": (getattr(config, "position_embedding_type", "absolute"), ("absolute",)),
        "is_decoder": (getattr(config, "is_decoder", False), (False,)),
    })  # fmt: skip
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


IMPORTS = {
    "gpt2": _config_from_gpt2,
    "llama": _config_from_llama,
    "mixtral": _config_from_mixtral,
    "mamba": _config_from_mamba,
    "bert": _config_from_bert,
}


def from_hf(hf_model: PreTrainedModel) -> GPT:
    """A ``GPT`` (CPU, the HF model's dtype cast to fp32) with the weights of an HF
    GPT-2, Llama, Mixtral or Mamba causal LM, or of a ``BertForMaskedLM``."""
    config = hf_model.config
    if config.model_type not in IMPORTS or (config.model_type == "bert" and not hasattr(hf_model, "cls")):
        raise ConfigError(
            f"cannot import an HF {type(hf_model).__name__} ({config.model_type!r}); ember reads GPT-2, "
            "Llama, Mixtral and Mamba causal LMs and BertForMaskedLM"
        )
    cfg = IMPORTS[config.model_type](config)
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
            rows = _rows(weight)
            for key, part in zip(keys, weight.split([ours[k].size(rows) for k in keys], rows), strict=True):
                ours[key].copy_(part)
        if config.model_type == "bert":  # type 0 everywhere: a constant vector, added to each position's
            ours["pos.wpe.weight"] += theirs[TOKEN_TYPES][0].to(ours["pos.wpe.weight"].dtype)
    return model.train(hf_model.training)
