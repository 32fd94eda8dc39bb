"""Per-sample gradients by ``torch.func``: ``vmap(grad(loss))`` over ``functional_call`` on the
model equals one backward per sample, for each layout (tied weights included: the tied
table's gradient holds both of its uses). This is the path analysis tools take, so the model
must stay free of what breaks it (in-place updates of inputs, ``.item()``, data-dependent
Python branches)."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from ember.config import ModelConfig
from ember.model.gpt import GPT

BASE = dict(vocab_size=48, n_layer=2, n_head=4, d_model=32, max_seq_len=16, init_std=0.2)
LAYOUTS = {
    "gpt2-tied": {},
    "llama-gqa-untied": {
        "pos": "rope",
        "norm": "rmsnorm",
        "mlp": "swiglu",
        "bias": False,
        "n_kv_head": 2,
        "qk_norm": True,
        "tie_embeddings": False,
    },
}


# torch has no batching rule for the CPU flash-attention kernel yet and loops over the batch instead
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vmap_per_sample_grads_equal_a_loop(layout):
    model = GPT.build(ModelConfig(**BASE, **LAYOUTS[layout]), seed=0)
    gen = torch.Generator().manual_seed(0)
    B, T = 4, 12
    idx = torch.randint(0, BASE["vocab_size"], (B, T + 1), generator=gen)
    x, y = idx[:, :-1], idx[:, 1:]
    params = {name: p.detach() for name, p in model.named_parameters()}  # a tied weight once
    buffers = dict(model.named_buffers())

    def loss_one(params, x, y):  # x, y: (T,)
        logits = functional_call(model, (params, buffers), (x.unsqueeze(0),))  # (1, T, V)
        return F.cross_entropy(logits[0], y)

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)  # name -> (B, *shape)

    for i in range(B):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[i : i + 1])[0], y[i]).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(per_sample[name][i], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the samples' gradients differ (a batch-mean gradient in every slot would fail above), and
    # their mean is the gradient of the batch's mean loss
    emb = per_sample["tok_embeddings.weight"]
    assert not torch.allclose(emb[0], emb[1])
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(per_sample[name].mean(0), p.grad, rtol=1e-4, atol=1e-6, msg=name)
