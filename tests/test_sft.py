"""Supervised fine-tuning: the chat format, packing without cross-attention, the epoch order
and its exact resume."""

import pytest
import torch

from ember.config import ModelConfig
from ember.data.chat import chat_ids, render
from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.model.gpt import GPT
from ember.train.sft import IGNORE, PackedDocuments, SFTLoader, SFTTask

TEXT = ["What is 12 + 30? 42. Sort 3 1 2: 1 2 3. def main():\n    return 1\n" * 40]
LAYOUTS = {
    "llama": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2),
    "gpt2": dict(pos="learned", norm="layernorm", mlp="gelu", bias=True),
}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train_bpe(TEXT, 300)


def _model(layout: str, vocab_size: int = 320) -> GPT:
    cfg = ModelConfig(
        vocab_size=vocab_size, n_layer=2, n_head=4, d_model=64, max_seq_len=64, **LAYOUTS[layout]
    )
    return GPT.build(cfg, seed=0).eval()


def test_render_marks_the_assistant_content_and_its_end_of_turn(tok):
    special = chat_ids(tok)
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "42"},
    ]
    ids, trained = render(tok, messages)
    answer = tok.encode("42")
    assert ids[-len(answer) - 2 :] == [special["assistant"], *answer, special["end"]]
    assert trained == [False] * (len(ids) - len(answer) - 1) + [True] * (len(answer) + 1)
    prompt, _ = render(tok, messages[:-1], add_generation_prompt=True)
    assert ids[: len(prompt)] == prompt  # the generation prompt is the conversation's own prefix
    with pytest.raises(EmberError, match="role 'robot'"):
        render(tok, [{"role": "robot", "content": "hi"}])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_conversations_get_the_logits_they_get_alone(layout):
    model = _model(layout)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(8, 320, (n,), generator=g) for n in (7, 12, 5)]
    row = torch.cat([*docs, torch.zeros(6, dtype=torch.long)])[None]  # three conversations, then padding
    doc = torch.cat([torch.full((len(d),), i) for i, d in enumerate([*docs, torch.zeros(6)])])[None]
    with torch.no_grad():
        packed = model(row, cache=PackedDocuments(doc))[0]
        start = 0
        for d in docs:
            alone = model(d[None])[0]
            torch.testing.assert_close(packed[start : start + len(d)], alone, rtol=0, atol=1e-5)
            start += len(d)
        crossed = model(row)[0, len(docs[0]) : len(docs[0]) + len(docs[1])]  # no mask: attention crosses
    assert (crossed - model(docs[1][None])[0]).abs().max() > 1e-3


def _examples(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 12, (1,), generator=g))
        ids = torch.randint(8, 320, (length,), generator=g).tolist()
        out.append((ids, [False] * (length // 2) + [True] * (length - length // 2)))
    return out


@pytest.mark.parametrize("packing", [True, False])
def test_the_loader_resumes_bit_for_bit_across_epochs(packing):
    examples = _examples(23)
    a = SFTLoader(examples, seq_len=16, rows=4, seed=3, packing=packing)
    for _ in range(5):
        a.next_batch()
    b = SFTLoader(examples, seq_len=16, rows=4, seed=3, packing=packing)
    b.load_state_dict(a.state_dict())
    for _ in range(12):  # past at least one epoch boundary
        for u, v in zip(a.next_batch(), b.next_batch(), strict=True):
            assert torch.equal(u, v)
    assert a.epoch >= 1


def test_an_epoch_visits_every_conversation_once_in_a_seeded_order():
    examples = _examples(10)
    loader = SFTLoader(examples, seq_len=16, rows=1, seed=0, packing=False)
    firsts = [tuple(loader.next_batch()[0][0, :3].tolist()) for _ in range(20)]
    expect = sorted(tuple(ids[:3]) for ids, _ in examples)
    assert sorted(firsts[:10]) == expect and sorted(firsts[10:]) == expect
    assert firsts[:10] != firsts[10:]  # each epoch its own permutation
    other = SFTLoader(examples, seq_len=16, rows=1, seed=1, packing=False)
    assert [tuple(other.next_batch()[0][0, :3].tolist()) for _ in range(10)] != firsts[:10]


def test_targets_are_the_trained_tokens_shifted_and_packing_fills_rows():
    examples = _examples(30)
    x, y, doc = SFTLoader(examples, seq_len=32, rows=2, seed=0, packing=True).next_batch()
    assert x.shape == y.shape == doc.shape == (2, 32)
    assert doc[:, -1].min() >= 2  # several conversations per row
    for r in range(2):
        kept = y[r] != IGNORE
        assert torch.equal(y[r, :-1][kept[:-1]], x[r, 1:][kept[:-1]])  # y is x shifted where trained
    model = _model("llama")
    loss, metrics = SFTTask(packing=True).loss(model, (x, y, doc))
    assert torch.isfinite(loss) and metrics["trained_tokens"] == int((y != IGNORE).sum()) > 0
