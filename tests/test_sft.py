"""Supervised fine-tuning: the chat format, packing without cross-attention, the epoch order
and its exact resume."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from ember.cli import main
from ember.config import ModelConfig
from ember.data.chat import chat_ids, render
from ember.data.tasks import TASKS
from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.model.gpt import GPT
from ember.run import load_run, read_metrics
from ember.train.tasks.sft import IGNORE, PackedDocuments, SFTLoader, SFTTask
from ember.train.trainer import train

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


@pytest.mark.parametrize("packing", [True, False])
def test_the_loss_reads_the_trained_positions_only_and_equals_the_full_one(packing):
    """SFTTask.loss runs the head on the trained positions alone (``keep``); loss and gradients
    equal the masked cross-entropy over every position's logits."""
    model = _model("llama")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(8, 320, (3, 24), generator=g)
    y = torch.randint(8, 320, (3, 24), generator=g)
    y[torch.rand(3, 24, generator=g) < 0.7] = IGNORE
    doc = torch.arange(24).repeat(3, 1) // 9  # three conversations a row
    loss, info = SFTTask(packing).loss(model, (x, y, doc))
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(x, cache=PackedDocuments(doc)) if packing else model(x)
    full = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
    full.backward()
    assert info["trained_tokens"] == int((y != IGNORE).sum()) and torch.allclose(loss, full, atol=1e-6)
    for ours, theirs in zip(grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


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


# ---------------------------------------------------------------- through the trainer

SFT = [
    "train.task=sft",
    "sft.data=add-2",
    "sft.examples=300",
    "train.deterministic=true",
    "model.dropout=0.1",
]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}


@pytest.mark.parametrize("packing", ["true", "false"])
def test_sft_resumes_bit_for_bit_with_its_epoch_cursor(tiny_cfg, packing):
    args = [*SFT, f"sft.packing={packing}", "train.max_steps=8", "train.ckpt_every=4", "train.keep_last=3"]
    args += ["sft.examples=40"]  # 8 steps of 8 rows cross an epoch of 40 conversations
    cfg = tiny_cfg(*args)
    train(cfg)
    run = Path(cfg.run.out_dir) / cfg.run.name
    full = _losses(run)
    assert sorted(full) == list(range(1, 9)) and all(math.isfinite(v) for v in full.values())
    shutil.rmtree(run / "checkpoints" / "step-000008")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines if r["step"] <= 4))
    train(tiny_cfg(*args, "train.resume=auto"))
    assert _losses(run) == full  # bitwise equal floats: same batches, same RNG


def test_sft_learns_and_eval_task_scores_it(tiny_cfg, capsys):
    cfg = tiny_cfg(*SFT, "model.dropout=0.0", "train.max_steps=30", "train.lr=0.003", "train.report=true")
    train(cfg)
    run = Path(cfg.run.out_dir) / cfg.run.name
    losses = _losses(run)
    assert losses[30] < 0.7 * losses[1]  # the completion-only loss falls
    accuracy = {r["step"]: r["task_accuracy"] for r in read_metrics(run) if "task_accuracy" in r}
    assert sorted(accuracy) == [10, 20, 30] and all(0 <= a <= 1 for a in accuracy.values())
    assert (run / "plots" / "task_accuracy.png").is_file()  # accuracy against step in the report
    assert main(["eval", str(run), "--task", "add-2", "--n", "20"]) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "95% interval" in out
    record = json.loads((run / "eval.json").read_text())["results"]["task:add-2"]
    assert record["problems"] == 20 and 0.0 <= record["accuracy"] <= 1.0
    lo, hi = record["accuracy_ci95"]
    assert lo <= record["accuracy"] <= hi
    assert main(["eval", str(run), "--task", "add-2", "--n", "5", "--skip", "15"]) == 0  # the last 5 of 20
    skipped = json.loads((run / "eval.json").read_text())["results"]["task:add-2"]
    last5 = [p.prompt for p in TASKS["add-2"].generate("test", 20)[15:]]
    assert skipped["skipped"] == 15 and [e["prompt"] for e in skipped["examples"]] == last5
    assert main(["eval", str(run), "--task", "add-7"]) == 2
    assert main(["eval", str(run), "--task", "add-2-choice", "--n", "10"]) == 0
    choice = json.loads((run / "eval.json").read_text())["results"]["task:add-2-choice"]
    assert choice["problems"] == 10 and all(ex["output"].isdigit() for ex in choice["examples"])


def test_choose_picks_the_option_of_highest_likelihood():
    from ember.data.tasks import Problem
    from ember.infer.evaluate import choose

    tok = Tokenizer.train_bpe(TEXT, 300)
    model = _model("llama")
    problem = Problem("What is 12 + 30?", "42", "t", {"options": ["42", "43", "52", "24"]})
    prompt = render(tok, problem.messages()[:-1], add_generation_prompt=True)[0]
    end = chat_ids(tok)["end"]
    scores = []
    with torch.no_grad():
        for option in problem.meta["options"]:
            ids = prompt + tok.encode(option) + [end]
            logp = model(torch.tensor([ids[:-1]]))[0].log_softmax(-1)
            scores.append(sum(logp[t - 1, ids[t]].item() for t in range(len(prompt), len(ids))))
        assert choose(model, tok, problem) == problem.meta["options"][scores.index(max(scores))]


def test_sft_from_a_jsonl_file_and_bad_rows(tiny_cfg, tmp_path, capsys):
    path = tmp_path / "chats.jsonl"
    rows = [{"prompt": f"Say {w}", "completion": w} for w in ("yes", "no", "maybe", "def", "class")]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = tiny_cfg("train.task=sft", f"sft.data={path}", "train.max_steps=3", "train.eval_every=0")
    assert math.isfinite(train(cfg)["loss"])
    path.write_text(json.dumps(rows[0]) + "\n" + '{"prompt": "x"}\n')
    argv = [
        "train",
        "tiny",
        f"data.dir={cfg.data.dir}",
        "data.val_fraction=0.1",
        f"run.out_dir={tmp_path / 'bad'}",
    ]
    assert main([*argv, "train.task=sft", f"sft.data={path}", "train.max_steps=1"]) == 2
    assert f"{path}:2" in capsys.readouterr().err
    assert not (tmp_path / "bad" / "tiny" / "model").exists()


def test_the_exported_chat_template_gives_embers_ids(tiny_cfg, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_cfg(*SFT, "train.max_steps=1", "train.eval_every=0")
    train(cfg)
    run = Path(cfg.run.out_dir) / cfg.run.name
    assert main(["export", str(run), "--to", "hf", str(tmp_path / "hf")]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    _, tokenizer = load_run(run)
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is 12 + 30? héllo wörld 😀"},
        {"role": "assistant", "content": "42"},
    ]
    got = hf_tok.apply_chat_template(messages, tokenizer_kwargs={"split_special_tokens": False})
    got = got["input_ids"] if hasattr(got, "keys") else got
    assert got == render(tokenizer, messages)[0]
    prompt = hf_tok.apply_chat_template(
        messages[:-1], add_generation_prompt=True, tokenizer_kwargs={"split_special_tokens": False}
    )
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    assert prompt == render(tokenizer, messages[:-1], add_generation_prompt=True)[0]
