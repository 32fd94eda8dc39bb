"""The numbers the loss and the evaluation report, against their formulas: the z-loss of PaLM,
and bits per byte against the UTF-8 bytes of the decoded text."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ember.config import ModelConfig
from ember.data.tokenizer import SPECIAL_TOKENS, Tokenizer
from ember.infer.evaluate import score
from ember.model.gpt import GPT
from ember.run import read_metrics
from ember.train.tasks.lm import LMTask
from ember.train.trainer import Trainer

# ---------------------------------------------------------------- z-loss


def z_loss_by_hand(logits: torch.Tensor, y: torch.Tensor, z: float) -> torch.Tensor:
    """PaLM (Chowdhery et al. 2022, §5): CE + z · log²Z, Z = Σ_v exp(logit_v), in fp64 and
    without logsumexp or cross_entropy."""
    logits = logits.double()
    log_z = logits.exp().sum(-1).log()  # (B, T); logits are O(1) here, no overflow
    picked = logits.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return (log_z - picked).mean() + z * (log_z**2).mean()


def test_z_loss_value_and_gradient_follow_the_formula():
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 11, generator=gen)).requires_grad_()
    y = torch.randint(0, 11, (2, 5), generator=gen)
    z = 1e-2
    loss, _ = LMTask(z, torch.ones(11, dtype=torch.int64)).loss(lambda x: logits, (None, y))
    want = z_loss_by_hand(logits.detach(), y, z)
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert (want - z_loss_by_hand(logits.detach(), y, 0.0)).item() > 0.05  # z matters at this size
    # d/dlogit_v [CE + z log²Z] = (softmax_v − [v = y] + 2 z log Z softmax_v) / (B·T)
    (grad,) = torch.autograd.grad(loss, logits)
    soft = logits.detach().double().softmax(-1)
    log_z = logits.detach().double().logsumexp(-1, keepdim=True)
    want_grad = (soft - F.one_hot(y, 11).double() + 2 * z * log_z * soft) / y.numel()
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-8)
    plain, _ = LMTask(0.0, torch.ones(11, dtype=torch.int64)).loss(lambda x: logits, (None, y))
    assert plain.item() == pytest.approx(z_loss_by_hand(logits.detach(), y, 0.0).item(), rel=1e-6)


def test_trainer_trains_on_the_z_loss_it_is_given(tiny_cfg):
    """train.z_loss reaches the loop: step 1's logged loss is CE + z log²Z of the first
    batch under the initial weights."""
    z = 0.1
    trainer = Trainer(tiny_cfg("train.max_steps=1", "train.eval_every=0", f"train.z_loss={z}"))
    x, y = trainer.loader.batch(0)
    with torch.no_grad():
        want = z_loss_by_hand(trainer.model(x), y, z).item()
        plain = z_loss_by_hand(trainer.model(x), y, 0.0).item()
    trainer.run()
    logged = [r["loss"] for r in read_metrics(trainer.run_dir) if "loss" in r]
    assert logged[0] == pytest.approx(want, rel=1e-5)
    assert want - plain > 1.0  # log V ≈ 6.2, so z log²Z ≈ 4: ignoring z_loss would show


# ---------------------------------------------------------------- bits per byte

DOCS = [
    "naïve café, déjà vu: 1 € = 100 cents.\n",
    "漢字とかな、そして 한국어 — and emoji 🙂🚀 too.\n",
    "def f(x):\n    return x ** 2  # ASCII only\n",
]


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_bits_per_byte_divides_by_the_utf8_bytes_of_the_decoded_text(kind):
    vocab = 300 if kind == "bpe" else len(set("".join(DOCS))) + len(SPECIAL_TOKENS)  # char: no <|unk|>
    tok = Tokenizer.train(kind, DOCS * 4, vocab)
    ids = [tok.eos_id]
    for doc in DOCS:
        ids += tok.encode(doc) + [tok.eos_id]
    tokens = np.asarray(ids, dtype=np.int64)
    targets = tokens[1:]  # the first token is context only
    text = tok.decode([int(i) for i in targets if i != tok.eos_id])
    assert text == "".join(DOCS)  # the round trip, so the bytes below are the documents'
    n_bytes = len(text.encode("utf-8"))
    assert n_bytes > len(text) + 20  # many multi-byte characters: bytes ≠ characters

    V = -(-tok.vocab_size // 64) * 64
    T = len(tokens) - 1  # one window holds the whole text, so the context is plain
    model = GPT.build(ModelConfig(vocab_size=V, n_layer=1, n_head=2, d_model=16, max_seq_len=T), seed=0)
    strata = [{"name": "all", "offset": 0, "documents": len(DOCS), "bytes": n_bytes, "tokens": len(tokens)}]
    r = score(model, tokens, torch.tensor(tok.token_byte_lengths(V)), strata, seq_len=T, eos_id=tok.eos_id)

    with torch.no_grad():
        logits = model(torch.from_numpy(tokens[None, :-1]))[0]  # (T, V)
        nats = F.cross_entropy(logits, torch.from_numpy(targets), reduction="none")
    text_nats = nats[torch.from_numpy(targets != tok.eos_id)].double().sum().item()
    assert r["bytes"] == n_bytes
    assert r["tokens"] == T and r["documents"] == len(DOCS)
    assert r["bpb"] == pytest.approx(text_nats / math.log(2) / n_bytes, rel=1e-6)
    assert r["loss"] == pytest.approx(nats.double().mean().item(), rel=1e-6)


def test_token_byte_lengths_sum_to_the_decoded_bytes_of_a_split(tiny_data):
    """The table the trainer's val_bpb uses, on the real tiny corpus: summed over the val
    split it gives the UTF-8 bytes of the split's decoded text, document by document."""
    from ember.data.loader import TokenDataset
    from ember.data.manifest import load_tokenizer, read_manifest

    tok = load_tokenizer(tiny_data, read_manifest(tiny_data))
    table = np.asarray(tok.token_byte_lengths())
    tokens = np.concatenate([np.asarray(s, dtype=np.int64) for s in TokenDataset(tiny_data, "val").shards])
    ends = np.flatnonzero(tokens == tok.eos_id)
    assert len(ends) >= 2
    total = 0
    for lo, hi in zip(np.r_[0, ends[:-1] + 1], ends, strict=True):
        doc = tokens[lo:hi]
        decoded = len(tok.decode(doc.tolist()).encode("utf-8"))
        assert table[doc].sum() == decoded
        total += decoded
    assert table[tokens].sum() == total
