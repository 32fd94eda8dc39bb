"""Initialisation from outside: build on meta, swap modules, ``to_empty``, ``init_weights``.

The test doubles stand for what transformations swap in: a LoRA wrapper (B = 0), an MoE FFN
with stacked expert weights, a packed int8 linear. Every tensor is poisoned after ``to_empty``
(NaN, or an integer type's minimum, which no init here writes), so memory that nothing
initialised is found every time, not only when the allocator hands back garbage.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ember.config import ModelConfig, load_config
from ember.model.gpt import GPT, init_module
from ember.parallel.parallelize import apply_activation_checkpointing, apply_compile

LLAMA = {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}
LAYOUTS = {
    "gpt2": {},
    "gpt2-untied": {"tie_embeddings": False},
    "llama": LLAMA,
    "llama-gqa-qknorm-untied": {**LLAMA, "n_kv_head": 2, "qk_norm": True, "tie_embeddings": False},
    "relu2-rope-bias": {"mlp": "relu2", "pos": "rope"},
}
STD = 0.02


def tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=64, n_layer=2, n_head=4, d_model=32, max_seq_len=16, init_std=STD)
    return ModelConfig(**{**base, **overrides})


# ---------------------------------------------------------------------------
# Test doubles: what a transformation swaps in
# ---------------------------------------------------------------------------


class LoRALinear(nn.Module):
    """base(x) + B A x (Hu et al. 2021), A and B linears as in peft. B = 0: it starts as its
    base. An init that walks every nn.Linear would draw B too."""

    def __init__(self, base: nn.Module, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        init_module(self.base, std, generator)  # the std its place asks for, residual scale included
        nn.init.normal_(self.lora_a.weight, std=1.0 / self.lora_a.out_features, generator=generator)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class StackedMoE(nn.Module):
    """An FFN of E GELU experts with stacked weights, w1 (E, hidden, C) and w2 (E, C, hidden),
    mixed densely by a softmax router. Its w2 writes to the residual stream."""

    def __init__(self, cfg: ModelConfig, n_experts: int = 4, hidden: int = 48) -> None:
        super().__init__()
        self.router = nn.Linear(cfg.d_model, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, cfg.d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, cfg.d_model, hidden))
        self.n_layer = cfg.n_layer

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        init_module(self.router, std, generator)
        nn.init.normal_(self.w1, std=std, generator=generator)
        nn.init.normal_(self.w2, std=std / math.sqrt(2 * self.n_layer), generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.router(x).softmax(-1)  # (B, T, E)
        h = F.gelu(torch.einsum("btc,ehc->bteh", x, self.w1))  # (B, T, E, hidden)
        return torch.einsum("bteh,ech,bte->btc", h, self.w2, gate)


class PackedInt8Linear(nn.Module):
    """x W^T with W as int8 in [-127, 127], four to an int32 word, and one scale per row."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.register_buffer("packed", torch.empty(out_features, in_features // 4, dtype=torch.int32))
        self.register_buffer("scale", torch.empty(out_features))

    def dequantize(self) -> torch.Tensor:
        return self.packed.view(torch.int8).float() * self.scale[:, None]  # (out, in)

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        w = torch.empty(self.packed.size(0), 4 * self.packed.size(1), device=self.packed.device)
        w.normal_(0.0, std, generator=generator)
        self.scale.copy_(w.abs().amax(dim=1) / 127)
        self.packed.copy_((w / self.scale[:, None]).round().to(torch.int8).view(torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.dequantize().T


def swap_in(model: GPT) -> None:
    """On the meta device: LoRA on every wq, wo and on the MLP's w2, int8 wk and an int8 head
    when untied, an MoE in place of layer 0's MLP."""
    cfg = model.cfg
    with torch.device("meta"):
        for name, block in model.layers.items():
            attention = block.attention
            attention.wq, attention.wo = LoRALinear(attention.wq), LoRALinear(attention.wo)
            attention.wk = PackedInt8Linear(attention.wk.in_features, attention.wk.out_features)
            if name == "0":
                block.mlp = StackedMoE(cfg)
            else:
                block.mlp.w2 = LoRALinear(block.mlp.w2)
        if not cfg.tie_embeddings:
            model.output = PackedInt8Linear(cfg.d_model, cfg.vocab_size)


def poison(model: nn.Module) -> None:
    for t in [*model.parameters(), *model.buffers()]:
        t.data.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min)


def unwritten(model: nn.Module) -> list[str]:
    """The tensors that still hold poison somewhere."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [
        name
        for name, t in named
        if (t.isnan() if t.is_floating_point() else t == torch.iinfo(t.dtype).min).any()
    ]


def pooled_std(tensors) -> float:
    return torch.cat([t.flatten() for t in tensors]).std().item()


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_swapped_modules_initialise_themselves(layout):
    n_layer = 4
    cfg = tiny(**LAYOUTS[layout], n_layer=n_layer, d_model=128)
    with torch.device("meta"):
        model = GPT(cfg)
    swap_in(model)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    model.to_empty(device="cpu")
    poison(model)
    assert len(unwritten(model)) == len([*model.parameters(), *model.buffers()])  # the detector sees
    model.init_weights(seed=0)
    assert unwritten(model) == []

    blocks = list(model.layers.values())
    loras = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(loras) == 2 * n_layer + n_layer - 1
    assert all((m.lora_b.weight == 0).all() for m in loras)
    assert all((m.lora_a.weight != 0).all() for m in loras)

    # the residual scale reaches the wrapped output projections and the MoE's stacked w2
    resid = STD / math.sqrt(2 * n_layer)
    assert pooled_std(b.attention.wo.base.weight for b in blocks) == pytest.approx(resid, rel=0.02)
    assert pooled_std(b.mlp.w2.base.weight for b in blocks[1:]) == pytest.approx(resid, rel=0.02)
    assert pooled_std([blocks[0].mlp.w2]) == pytest.approx(resid, rel=0.02)
    assert pooled_std(b.attention.wq.base.weight for b in blocks) == pytest.approx(STD, rel=0.02)
    assert pooled_std([blocks[0].mlp.w1]) == pytest.approx(STD, rel=0.02)
    assert pooled_std(b.attention.wk.dequantize() for b in blocks) == pytest.approx(STD, rel=0.02)
    assert pooled_std(b.mlp.w1.weight for b in blocks[1:]) == pytest.approx(STD, rel=0.02)

    # B = 0: taking the wrappers off leaves the function as it was, bit for bit
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(idx)
    assert torch.isfinite(logits).all()
    for block in blocks:
        block.attention.wq, block.attention.wo = block.attention.wq.base, block.attention.wo.base
        if isinstance(block.mlp.w2, LoRALinear):
            block.mlp.w2 = block.mlp.w2.base
    assert torch.equal(model(idx), logits)


def reference_init(model: GPT, seed: int) -> None:
    """The init written as one walk by module type and name: N(0, init_std) for linears and
    embeddings, wo and w2 at init_std / sqrt(2 n_layer), zero biases, unit norms, the tied
    head drawn as the embedding."""
    generator = torch.Generator().manual_seed(seed)
    std = model.cfg.init_std
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
            elif isinstance(module, nn.Linear) and module.weight is not model.tok_embeddings.weight:
                scale = math.sqrt(2 * model.cfg.n_layer) if name.endswith((".wo", ".w2")) else 1
                nn.init.normal_(module.weight, std=std / scale, generator=generator)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std, generator=generator)
    model.init_buffers()


def preset_model(name: str) -> ModelConfig:
    cfg = load_config(name).model
    cfg = dataclasses.replace(cfg, vocab_size=cfg.vocab_size or 512)
    if cfg.d_model > 128:  # gpt2-small and llama-small shapes, shrunk
        kv = 2 if cfg.n_kv_head else 0
        cfg = dataclasses.replace(
            cfg, vocab_size=320, n_layer=3, n_head=4, n_kv_head=kv, d_model=96, max_seq_len=64
        )
    return cfg


@pytest.mark.parametrize("layout", [*LAYOUTS, "tiny", "cpu-quick", "gpt2-small", "llama-small"])
def test_plain_model_matches_reference_init(layout):
    # Bitwise: the modules draw in construction order from one generator, so a seed still
    # gives the weights it gave before init moved into the modules.
    cfg = tiny(**LAYOUTS[layout]) if layout in LAYOUTS else preset_model(layout)
    model = GPT.build(cfg, seed=3)
    with torch.device("meta"):
        reference = GPT(cfg)
    reference.to_empty(device="cpu")
    poison(reference)
    reference_init(reference, seed=3)
    assert unwritten(reference) == []
    ours = {**model.state_dict(), **dict(model.named_buffers())}  # the RoPE tables too
    theirs = {**reference.state_dict(), **dict(reference.named_buffers())}
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_wrapped_blocks_initialise_through_the_wrapper():
    # activation checkpointing and compile wrap each block; init goes through the wrappers
    cfg = tiny(**LLAMA)
    with torch.device("meta"):
        model = GPT(cfg)
    apply_activation_checkpointing(model)
    apply_compile(model)
    model.to_empty(device="cpu")
    poison(model)
    model.init_weights(seed=0)
    assert unwritten(model) == []
    plain = GPT.build(cfg, seed=0)
    for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_containers_are_gone_through_and_unknown_tensors_are_an_error():
    class Gain(nn.Module):  # holds a tensor, says nothing of its init
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.empty(dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.gain

    cfg = tiny()
    with torch.device("meta"):
        model = GPT(cfg)
        model.layers["0"].mlp.w1 = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 128))
    model.to_empty(device="cpu")
    poison(model)
    model.init_weights(seed=0)
    assert unwritten(model) == []
    assert model.layers["0"].mlp.w1[2].weight.std().item() == pytest.approx(STD, rel=0.1)

    with torch.device("meta"):
        model.layers["1"].mlp.w1 = nn.Sequential(nn.Linear(32, 128), Gain(128))
    model.to_empty(device="cpu")
    with pytest.raises(TypeError, match="Gain holds tensors but defines no init_weights"):
        model.init_weights(seed=0)
