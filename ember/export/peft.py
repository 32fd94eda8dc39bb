"""PEFT's adapter format for ember's LoRA adapters (``ember/model/lora.py``), written here, in
``export/``, because the model package does no file I/O (DESIGN rule 1).

    save_peft(model, "runs/sft/adapter")    # adapter_config.json + adapter_model.safetensors

``PeftModel.from_pretrained(to_hf(base), "runs/sft/adapter")`` then gives the adapted model's
logits (tests/test_lora.py, within 1e-5). Module names follow ember/model/hf.py's mapping. GPT-2
keeps q, k and v in one ``Conv1D`` (``c_attn``, output [q | k | v]) while ember adapts them
apart; one adapter of rank k·r on ``c_attn`` is exactly the k adapters of rank r: A stacked,
B block-diagonal, with PEFT's ``rank_pattern``/``alpha_pattern`` keeping the scale α/r.

Embedding rows trained beside the adapters (the chat tokens, ``train.lora_chat_tokens``) are
PEFT's ``trainable_token_indices``: their values, stored as ``token_adapter.trainable_tokens_delta``
(the rows themselves, which PEFT copies over the base's), on the input embedding and, when the
head is not tied to it, on the head too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from ember.errors import EmberError
from ember.model.hf import layout_of
from ember.model.lora import LoRALinear, lora_layers

HF_NAMES = {  # ember linear -> its HF module under the block, per layout (ember/model/hf.py's mapping)
    "llama": {
        "attention.wq": "self_attn.q_proj",
        "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "mlp.w1": "mlp.gate_proj",
        "mlp.w3": "mlp.up_proj",
        "mlp.w2": "mlp.down_proj",
    },
    "gpt2": {  # Conv1D layers; q, k, v share c_attn (fused in save_peft)
        "attention.wq": "attn.c_attn",
        "attention.wk": "attn.c_attn",
        "attention.wv": "attn.c_attn",
        "attention.wo": "attn.c_proj",
        "mlp.w1": "mlp.c_fc",
        "mlp.w2": "mlp.c_proj",
    },
}
HF_NAMES["mixtral"] = {k: v for k, v in HF_NAMES["llama"].items() if k.startswith("attention.")}
HF_BLOCKS = {"llama": "model.layers", "gpt2": "transformer.h", "mixtral": "model.layers"}
HF_EMBEDDINGS = {"llama": "model.embed_tokens", "gpt2": "transformer.wte", "mixtral": "model.embed_tokens"}


def _peft_tensors(model: nn.Module, layout: str) -> dict[str, tuple[Tensor, Tensor]]:
    """{HF module path: (A, B)} for PEFT: one pair per adapter, except GPT-2's q, k, v, which
    become one pair on c_attn: A stacked (k·r × in), B block-diagonal (3d × k·r), for the k of
    q, k, v that have adapters; an output block without one gets zero rows of B."""
    pairs: dict[str, tuple[Tensor, Tensor]] = {}
    fused: dict[str, list[tuple[int, LoRALinear]]] = {}
    for name, layer in lora_layers(model):
        block, _, rest = name.removeprefix("layers.").partition(".")  # "3", "attention.wq"
        if rest not in HF_NAMES[layout]:
            raise EmberError(f"PEFT has no {layout} module for the adapter on {name}")
        hf = f"{HF_BLOCKS[layout]}.{block}.{HF_NAMES[layout][rest]}"
        if hf.endswith("c_attn"):
            qkv = ("attention.wq", "attention.wk", "attention.wv").index(rest)
            fused.setdefault(hf, []).append((qkv, layer))
            continue
        pairs[hf] = (layer.lora_A.detach().float(), layer.lora_B.detach().float())
    for hf, parts in fused.items():
        parts.sort(key=lambda part: part[0])
        d, r = parts[0][1].out_features, parts[0][1].rank  # GPT-2: q, k, v all d × d
        A = torch.cat([layer.lora_A.detach().float() for _, layer in parts])  # (k·r, in)
        B = A.new_zeros(3 * d, len(parts) * r)  # (3d, k·r), rows [q | k | v] as in c_attn
        for j, (i, layer) in enumerate(parts):
            B[i * d : (i + 1) * d, j * r : (j + 1) * r] = layer.lora_B.detach().float()
        pairs[hf] = (A, B)
    return pairs


def save_peft(
    model: nn.Module, out_dir: str | Path, base_model_name_or_path: str = "", token_rows: Sequence[int] = ()
) -> Path:
    """Write the adapters in PEFT's format (adapter_config.json + adapter_model.safetensors) for
    the HF layout ``to_hf`` exports the model as (see the module docstring for GPT-2's c_attn),
    with the embedding (and untied head) rows ``token_rows`` as trainable tokens."""
    layout = layout_of(model.cfg)  # a ConfigError for what HF cannot represent
    layers = [layer for _, layer in lora_layers(model)]
    if not layers:
        raise EmberError("the model has no LoRA adapters to save; apply_lora first")
    first = layers[0]
    if any((layer.rank, layer.alpha) != (first.rank, first.alpha) for layer in layers):
        raise EmberError("save_peft writes one rank and alpha for every adapter; these adapters differ")
    pairs = _peft_tensors(model, layout)
    tensors = {}
    for hf, (A, B) in pairs.items():
        tensors[f"base_model.model.{hf}.lora_A.weight"] = A.contiguous()
        tensors[f"base_model.model.{hf}.lora_B.weight"] = B.contiguous()
    # Suffixes PEFT matches module names against; GPT-2 needs the parent to tell attn.c_proj from mlp's.
    keep = 2 if layout == "gpt2" else 1
    targets = sorted({".".join(hf.split(".")[-keep:]) for hf in pairs})
    rows = sorted(token_rows)
    token_indices: list[int] | dict[str, list[int]] | None = rows or None
    if rows:
        tables = {HF_EMBEDDINGS[layout]: model.tok_embeddings.weight}
        if model.output.weight is not model.tok_embeddings.weight:  # a tied head follows the embedding
            tables["lm_head"] = model.output.weight
            token_indices = {name.split(".")[-1]: rows for name in tables}
        for name, weight in tables.items():
            delta = weight.detach()[rows].float().contiguous()
            tensors[f"base_model.model.{name}.token_adapter.trainable_tokens_delta"] = delta
    fused = [A.size(0) for hf, (A, _) in pairs.items() if hf.endswith("c_attn")]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": first.dropout.p if isinstance(first.dropout, nn.Dropout) else 0.0,
        "target_modules": targets,
        # GPT-2's c_attn: rank k·r and alpha k·α, so that PEFT's scale alpha / r stays α / r
        "rank_pattern": {"c_attn": fused[0]} if fused else {},
        "alpha_pattern": {"c_attn": first.alpha * fused[0] / first.rank} if fused else {},
        "bias": "none",
        "trainable_token_indices": token_indices,
        "fan_in_fan_out": layout == "gpt2",  # Conv1D stores its weight (in, out)
        "inference_mode": True,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out
