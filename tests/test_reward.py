"""Reward models (train.task=rm, model.head=score): the score equals transformers' sequence
classification on the same weights, the Bradley–Terry loss and metrics equal TRL's RewardTrainer,
training ranks held-out pairs and resumes bitwise, and GRPO takes σ(score) as its reward."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ember.cli import main
from ember.config import ModelConfig
from ember.data.chat import chat_ids
from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.infer.engine import Engine
from ember.model.gpt import GPT
from ember.model.hf import to_hf
from ember.run import load_run, read_metrics
from ember.train.tasks.dpo import pair_rows
from ember.train.tasks.grpo import Rollouts, group_advantages
from ember.train.tasks.rm import RMTask, pair_accuracy, score_sequences, scores
from ember.train.tasks.sft import IGNORE
from ember.train.trainer import train

LAYOUTS = {
    "llama": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=1),
    "gpt2": dict(tie_embeddings=True),  # a tied source: the score head is never tied
}


def _pairs(g: torch.Generator, n: int = 4, end: int = 3) -> list:
    """n pairs of random ids: (prompt, chosen + [end], rejected + [end]), lengths all different."""

    def ids(k):
        return torch.randint(4, 320, (k,), generator=g).tolist()

    return [(ids(3 + i), ids(1 + i) + [end], ids(4 - i % 3) + [end]) for i in range(n)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scores_equal_transformers_sequence_classification(layout):
    """r at a sequence's last token equals HF's ...ForSequenceClassification (one label) on the
    same weights, a row alone; and a padded pair batch scores each reply at its last content token."""
    cfg = ModelConfig(vocab_size=320, n_layer=2, n_head=2, d_model=32, max_seq_len=64, head="score",
                      init_std=0.2, **LAYOUTS[layout])  # fmt: skip
    model = GPT.build(cfg, seed=0).eval()
    assert model.output.weight.shape == (1, 32) and model.output.weight is not model.tok_embeddings.weight
    hf = to_hf(model).eval()
    assert type(hf).__name__.endswith("ForSequenceClassification")
    pairs = _pairs(torch.Generator().manual_seed(0))
    sequences = [p + r[:-1] for p, *replies in pairs for r in replies]
    ours = score_sequences(model, sequences, batch=3)  # ragged batches, right-padded
    with torch.no_grad():
        theirs = torch.stack([hf(torch.tensor([s])).logits[0, 0] for s in sequences])
    assert theirs.abs().max() > 0.1 and torch.allclose(ours, theirs, atol=1e-5)
    x, y = pair_rows(pairs, seq_len=16)
    with torch.no_grad():
        batch = scores(model, x, y)  # rows [chosen..., rejected...]
    assert torch.allclose(batch, torch.cat([ours[0::2], ours[1::2]]), atol=1e-5)


def test_loss_and_metrics_equal_trls_reward_trainer(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import transformers

    tok = Tokenizer.train_bpe(["What is 12 + 30? 42. " * 50], 300)
    cfg = ModelConfig(vocab_size=320, n_layer=1, n_head=2, d_model=32, max_seq_len=64, head="score",
                      init_std=0.5, **LAYOUTS["llama"])  # fmt: skip
    model = GPT.build(cfg, seed=1).eval()
    pairs = _pairs(torch.Generator().manual_seed(1), n=6)
    x, y = pair_rows(pairs, seq_len=16)
    ours, metrics = RMTask(tok, []).loss(model, (x, y))

    hf = to_hf(model).eval()
    hf.config.pad_token_id = tok.pad_id
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.hf, eos_token="<|eos|>", pad_token="<|pad|>"
    )
    args = trl.RewardConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to=[])
    data = datasets.Dataset.from_dict({"chosen": ["a"], "rejected": ["b"]})
    trainer = trl.RewardTrainer(model=hf, args=args, train_dataset=data, processing_class=hf_tok)
    trainer.model.eval()  # "eval" metrics
    rows = [p + c[:-1] for p, c, _ in pairs] + [p + r[:-1] for p, _, r in pairs]
    ids = torch.full((len(rows), max(map(len, rows))), tok.pad_id)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    theirs = trainer.compute_loss(
        trainer.model, {"input_ids": ids, "attention_mask": (ids != tok.pad_id).long()}
    )
    logged = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    assert 0.1 < metrics["rewards/accuracies"] < 0.9  # the pairs are not all ranked one way
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)
    assert metrics["rewards/accuracies"].item() == pytest.approx(logged["accuracy"], abs=1e-6)
    assert metrics["rewards/margins"].item() == pytest.approx(logged["margin"], abs=1e-5)
    margins = scores(model, x, y).detach().view(2, -1)
    assert ours.item() == pytest.approx(-torch.nn.functional.logsigmoid(margins[0] - margins[1]).mean().item(), abs=1e-6)  # fmt: skip # noqa: E501


def _rm_args(base: Path, *more: str) -> list[str]:
    return ["run.name=rm", "train.task=rm", "model.head=score", "dpo.data=add-2", "dpo.examples=200",
            "dpo.eval_problems=60", f"train.init_from={base}", "train.seq_len=32", "train.batch_tokens=512",
            "train.micro_batch=8", "train.lr=0.01", "model.dropout=0.0", *more]  # fmt: skip


def test_reward_model_trains_ranks_held_out_pairs_and_resumes_bitwise(tiny_cfg):
    base_cfg = tiny_cfg("run.name=base", "train.max_steps=2", "train.eval_every=0")
    train(base_cfg)
    base = Path(base_cfg.run.out_dir) / "base"
    args = _rm_args(
        base, "train.max_steps=8", "train.ckpt_every=4", "train.keep_last=3", "train.eval_every=4"
    )
    summary = train(tiny_cfg(*args, "train.report=true"))
    run = base.parent / "rm"
    records = [r for r in read_metrics(run) if "loss" in r]
    for r in records:  # the loss is −log σ of the margin, whatever the pairs
        assert set(r) >= {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"}
    assert records[-1]["loss"] < records[0]["loss"]
    model, tok = load_run(run)
    assert model.cfg.head == "score"
    from ember.train.tasks.dpo import encode_pairs, task_preferences

    held_out = encode_pairs(tok, task_preferences("add-2", 60, 1337, split="test"), 32)
    assert summary["pair_accuracy"] == pair_accuracy(model, held_out) and len(held_out) == 60
    assert [r["step"] for r in read_metrics(run) if "pair_accuracy" in r] == [4, 8]
    assert (run / "plots" / "pair_accuracy.png").is_file() and (run / "plots" / "dpo_margins.png").is_file()
    full = {r["step"]: r["loss"] for r in records}
    shutil.rmtree(run / "checkpoints" / "step-000008")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines if r["step"] <= 4))
    train(tiny_cfg(*args, "train.resume=auto"))
    assert {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r} == full


def test_reward_model_learns_an_easy_preference(tiny_cfg, tmp_path):
    """Pairs whose chosen reply is "yes" and rejected "no": 30 steps rank every held-in pair."""
    base_cfg = tiny_cfg("run.name=base", "train.max_steps=1", "train.eval_every=0")
    train(base_cfg)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}", "chosen": "yes", "rejected": "no"}) + "\n"
                            for i in range(40)))  # fmt: skip
    base = Path(base_cfg.run.out_dir) / "base"
    train(tiny_cfg(*_rm_args(base, f"dpo.data={data}", "train.max_steps=30", "train.eval_every=0")))
    records = [r for r in read_metrics(base.parent / "rm") if "loss" in r]
    assert records[0]["rewards/accuracies"] < 1.0 or records[0]["loss"] > 0.5
    assert records[-1]["rewards/accuracies"] == 1.0 and records[-1]["loss"] < 0.1


def test_grpo_rewards_are_sigma_of_the_reward_models_score(tiny_cfg):
    base_cfg = tiny_cfg("run.name=base", "train.max_steps=1", "train.eval_every=0")
    train(base_cfg)
    base = Path(base_cfg.run.out_dir) / "base"
    train(tiny_cfg(*_rm_args(base, "train.max_steps=2", "train.eval_every=0", "model.init_std=0.5")))
    from ember.config import GRPOConfig

    policy, tok = load_run(base)
    cfg = GRPOConfig(data="add-2", examples=20, group=4, max_new_tokens=4, beta=0.0,
                     reward_model=str(base.parent / "rm"), temperature=1.5)  # fmt: skip
    loader = Rollouts(cfg, tok, policy.train(), None, rows=8, micro_batch=4, seed=0)
    x, y, advantages, _, _ = loader.next_batch()
    rm, _ = load_run(base.parent / "rm")
    end = chat_ids(tok)["end"]
    sequences = []
    for r in range(8):
        trained = (y[r] != IGNORE).nonzero()[:, 0]
        reply = y[r, trained].tolist()
        sequences.append(x[r, : int(trained[0]) + 1].tolist() + reply[: -1 if reply[-1] == end else None])
    rewards = torch.sigmoid(score_sequences(rm, sequences))
    assert rewards.std() > 1e-4  # the replies differ, and so do their scores
    assert loader.metrics["reward"] == pytest.approx(rewards.mean().item(), abs=1e-6)
    assert torch.allclose(advantages, group_advantages(rewards, 4), atol=1e-5)
    assert 0.0 <= loader.metrics["accuracy"] <= 1.0  # still the verifier's


def test_reward_model_setups_are_clear_errors(tiny_cfg, capsys, tmp_path):
    base_cfg = tiny_cfg("run.name=base", "train.max_steps=1", "train.eval_every=0")
    train(base_cfg)
    base = Path(base_cfg.run.out_dir) / "base"
    argv = ["train", "tiny", f"data.dir={base_cfg.data.dir}", "data.val_fraction=0.1",
            f"run.out_dir={tmp_path}", "train.max_steps=1", f"train.init_from={base}"]  # fmt: skip
    assert main([*argv, "train.task=rm", "dpo.data=add-2"]) == 2  # no score head
    assert "model.head=score" in capsys.readouterr().err
    assert main([*argv, "train.task=sft", "sft.data=add-2", "model.head=score"]) == 2
    assert "model.head=score" in capsys.readouterr().err
    assert main([*argv, "train.task=grpo", "grpo.data=add-2", f"grpo.reward_model={base}"]) == 2
    assert "is not a reward model" in capsys.readouterr().err
    train(tiny_cfg(*_rm_args(base, "train.max_steps=1", "train.eval_every=0", "train.lr=0")))
    rm, lm = load_run(base.parent / "rm")[0].state_dict(), load_run(base)[0].state_dict()
    assert rm.keys() == lm.keys() and all(torch.equal(rm[k], lm[k]) for k in rm if k != "output.weight")
    assert rm["output.weight"].shape == (1, 64)  # every weight but the head from train.init_from
    assert main(["eval", str(base.parent / "rm"), "--task", "add-2", "--n", "2"]) == 2
    assert "reward model" in capsys.readouterr().err
    with pytest.raises(EmberError, match="reward model"):
        Engine(*load_run(base.parent / "rm"))
