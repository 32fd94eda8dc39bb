"""Weight decay by parameter kind: decay on the matrices of linear layers only; none on norms,
biases, embeddings or a head tied to the embedding. Checked both in the groups and in what
one optimizer step does: with zero gradients an AdamW or Muon step is pure decoupled decay,
W ← W (1 − lr·wd), so a parameter shrinks by exactly that factor or not at all."""

import pytest
import torch
from torch import nn

from ember.config import ModelConfig, TrainConfig
from ember.model.gpt import GPT
from ember.train.optim import build_optimizer

BASE = dict(vocab_size=64, n_layer=2, n_head=4, d_model=32, max_seq_len=16)
LAYOUTS = {
    "gpt2-tied": {},  # LayerNorm with bias, learned positions, biases, GELU, tied head
    "gpt2-untied": {"tie_embeddings": False},
    "llama-tied": {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "qk_norm": True},
    "llama-untied": {
        "pos": "rope",
        "norm": "rmsnorm",
        "mlp": "swiglu",
        "bias": False,
        "tie_embeddings": False,
    },
}
LR, WD = 0.1, 0.5  # shrink factor 0.95


def expected_decay(model: nn.Module) -> dict[str, bool]:
    """Parameter name → decays, from the module types alone: the weight of a Linear decays
    unless it is an embedding table (a tied head); everything else does not."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decays = {}
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            is_matrix = isinstance(module, nn.Linear) and p_name == "weight"
            decays[name] = is_matrix and id(p) not in embeddings
    kinds = {type(m) for m in model.modules()}
    assert kinds & {nn.LayerNorm, nn.RMSNorm} and nn.Embedding in kinds  # the test covers them
    return {name: decays[name] for name, _ in model.named_parameters()}  # a tied weight once


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_only_linear_matrices_decay(layout, optimizer):
    model = GPT.build(ModelConfig(**BASE, **LAYOUTS[layout]), seed=0)
    want = expected_decay(model)
    assert any(want.values()) and not all(want.values())
    if LAYOUTS[layout].get("bias", True):
        assert any(n.endswith(".bias") for n in want)  # biases are there to be left alone
    if LAYOUTS[layout].get("tie_embeddings", True):
        assert model.output.weight is model.tok_embeddings.weight
    else:
        assert want["output.weight"]  # an untied head is a matrix like any other

    cfg = TrainConfig(optimizer=optimizer, lr=LR, weight_decay=WD, muon_lr=LR, muon_weight_decay=WD)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    names = dict(model.named_parameters())
    assert len(group_of) == len(names)  # every parameter once
    for name, p in names.items():
        assert (group_of[id(p)]["weight_decay"] > 0) == want[name], name

    before = {n: p.detach().clone() for n, p in names.items()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in names.items():
        if want[name]:
            torch.testing.assert_close(p.detach(), before[name] * (1 - LR * WD), rtol=1e-6, atol=0)
        else:
            assert torch.equal(p.detach(), before[name]), f"{name} changed: it must not decay"
