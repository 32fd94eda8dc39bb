"""DPO (``train.task=dpo``): the loss and metrics against TRL's DPOTrainer on the same model and
batch, the formulas written out, the pair loader, preference data, and runs that resume bit for
bit with the reference as a frozen copy or as the model with its LoRA adapters off."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ember.cli import main
from ember.config import ModelConfig
from ember.data.tasks import TASKS
from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.model.gpt import GPT
from ember.run import read_metrics
from ember.train.tasks.dpo import (
    PairLoader,
    corrupt,
    dpo_loss,
    encode_pairs,
    load_preferences,
    sequence_logps,
    task_preferences,
)
from ember.train.tasks.sft import IGNORE
from ember.train.trainer import train

LLAMA = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train_bpe(["What is 12 + 30? 42. Sort 3 1 2: 1 2 3. " * 50], 300)


def _model(seed: int) -> GPT:
    cfg = ModelConfig(vocab_size=320, n_layer=2, n_head=4, d_model=64, max_seq_len=64, **LLAMA)
    return GPT.build(cfg, seed=seed).eval()


def _batch(tok, n_pairs: int = 4, seq_len: int = 40):
    pairs = encode_pairs(tok, task_preferences("add-2", 2 * n_pairs, seed=0), seq_len)
    return PairLoader(pairs, seq_len, 2 * n_pairs, 2 * n_pairs, seed=0).next_batch()


@pytest.mark.parametrize(
    "loss,smoothing,sft",
    [("sigmoid", 0.0, 0.0), ("robust", 0.1, 0.0), ("ipo", 0.0, 0.0), ("sigmoid", 0.0, 0.5)],
)
def test_loss_and_metrics_equal_trls(tok, tmp_path, loss, smoothing, sft):
    """TRL's DPOTrainer computes the loss of the same batch with the exported policy and reference
    (fp32: DPOConfig's default bf16 autocast off); every number agrees within 1e-5."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import transformers

    from ember.model.hf import to_hf

    policy, reference = _model(0), _model(1)
    x, y = _batch(tok)
    with torch.no_grad():
        logps, lengths = sequence_logps(policy, x, y)
        ours, metrics = dpo_loss(
            logps, sequence_logps(reference, x, y)[0], lengths, 0.1, loss, smoothing, sft
        )
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.hf, eos_token="<|eos|>", pad_token="<|pad|>"
    )
    data = datasets.Dataset.from_dict({"prompt": ["a"] * 2, "chosen": ["b"] * 2, "rejected": ["c"] * 2})
    args = trl.DPOConfig(output_dir=str(tmp_path), beta=0.1, loss_type=[loss, "sft"] if sft else [loss],
                         loss_weights=[1.0, sft] if sft else None, label_smoothing=smoothing,
                         bf16=False, use_cpu=True, report_to=[], per_device_train_batch_size=2)  # fmt: skip
    trainer = trl.DPOTrainer(model=to_hf(policy).eval(), ref_model=to_hf(reference).eval(), args=args,
                             train_dataset=data, processing_class=hf_tok)  # fmt: skip
    # TRL's inputs: the whole sequences, the replies' tokens marked, padding masked out
    completion = torch.cat([torch.zeros(len(y), 1, dtype=torch.bool), y != IGNORE], 1)
    ids = torch.cat([x, y[:, -1:].clamp(min=0)], 1)
    lengths_ids = completion.int().cumsum(1).argmax(1) + 1
    attention = (torch.arange(ids.size(1))[None] < lengths_ids[:, None]).long()
    inputs = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion.long()}
    trainer.model.eval()
    with torch.no_grad():
        theirs = trainer._compute_loss(trainer.model, inputs, False)
    assert abs(ours.item() - theirs.item()) < 1e-5
    logged = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    for key, value in metrics.items():
        assert value.item() == pytest.approx(logged[key], abs=1e-5), key
    assert 0 < metrics["rewards/accuracies"] <= 1 and metrics["rewards/margins"].abs() > 1e-3


def test_the_losses_written_out():
    g = torch.Generator().manual_seed(0)
    logps, ref = -10 * torch.rand(8, generator=g), -10 * torch.rand(8, generator=g)
    lengths = torch.tensor([3, 4, 5, 6, 2, 3, 7, 4])
    beta, eps = 0.2, 0.1
    h = (logps[:4] - ref[:4]) - (logps[4:] - ref[4:])
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    sigmoid = sum(-math.log(sig(beta * v)) for v in h.tolist()) / 4
    robust = sum((-(1 - eps) * math.log(sig(beta * v)) + eps * math.log(sig(-beta * v))) / (1 - 2 * eps)
                 for v in h.tolist()) / 4  # fmt: skip
    per_token = (logps - ref) / lengths
    ipo = sum((c - r - 1 / (2 * beta)) ** 2 for c, r in zip(per_token[:4], per_token[4:], strict=True)) / 4
    for kind, want in (("sigmoid", sigmoid), ("robust", robust), ("ipo", ipo)):
        got, metrics = dpo_loss(logps, ref, lengths, beta, kind, eps)
        assert got.item() == pytest.approx(float(want), rel=1e-6), kind
    assert metrics["rewards/margins"].item() == pytest.approx(beta * h.mean().item(), rel=1e-6)
    assert metrics["rewards/accuracies"].item() == (h > 0).float().mean().item()
    with_nll, _ = dpo_loss(logps, ref, lengths, beta, "sigmoid", 0.0, 0.5)  # + 0.5 × chosen NLL per token
    assert with_nll.item() == pytest.approx(sigmoid - 0.5 * logps[:4].sum().item() / 18, rel=1e-6)
    with pytest.raises(EmberError, match="dpo.loss"):
        dpo_loss(logps, ref, lengths, beta, "kto")


def test_sequence_logps_sums_the_replies_tokens(tok):
    model = _model(0)
    x, y = _batch(tok)
    with torch.no_grad():
        logps, lengths = sequence_logps(model, x, y)
        full = F.log_softmax(model(x), -1)
    for r in range(len(y)):
        keep = y[r] != IGNORE
        want = full[r, keep].gather(1, y[r, keep][:, None]).sum()
        assert torch.allclose(logps[r], want, atol=1e-5) and lengths[r] == keep.sum()


def test_micro_batches_hold_whole_pairs_chosen_first(tok):
    pairs = encode_pairs(tok, task_preferences("add-2", 12, seed=0), 40)
    loader = PairLoader(pairs, 40, rows=8, micro_batch=4, seed=3)
    x, y = loader.next_batch()
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(3 * 1_000_003)).tolist()
    for p in range(4):  # pair p sits in micro-batch p // 2: chosen at row 4b + k, rejected at 4b + 2 + k
        block, k = divmod(p, 2)
        prompt, chosen, rejected = pairs[order[p]]
        for row, reply in ((4 * block + k, chosen), (4 * block + 2 + k, rejected)):
            assert x[row, : len(prompt)].tolist() == prompt
            assert y[row][y[row] != IGNORE].tolist() == reply
    with pytest.raises(EmberError, match="even"):
        PairLoader(pairs, 40, rows=6, micro_batch=3, seed=0)


def test_task_pairs_are_scored_wrong_and_corruptions_differ():
    import random

    pairs = task_preferences("sort", 50, seed=0)
    problems = {p.prompt: p for p in TASKS["sort"].generate("train", 50)}
    assert len(pairs) == 50
    for prompt, chosen, rejected in pairs:
        problem = problems[prompt[0]["content"]]
        assert chosen == problem.answer and TASKS["sort"].score(problem, rejected) == 0.0
    rng = random.Random(0)
    assert {abs(int(corrupt("57", rng)) - 57) for _ in range(50)} <= {1, 10, 100}
    assert corrupt("abc", rng) in {"bac", "acb"}


def test_jsonl_pairs_in_both_forms_and_bad_rows(tmp_path):
    path = tmp_path / "prefs.jsonl"
    rows = [
        {"prompt": "Say yes", "chosen": "yes", "rejected": "no"},
        {"prompt": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}],
         "chosen": [{"role": "assistant", "content": "Hello!"}],
         "rejected": {"role": "assistant", "content": "Go"}},
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pairs = load_preferences(path)
    assert pairs[0] == ([{"role": "user", "content": "Say yes"}], "yes", "no")
    assert pairs[1][0][0]["role"] == "system" and pairs[1][1:] == ("Hello!", "Go")
    for bad, message in [
        ('{"prompt": "x", "chosen": "y"}', "expected"),
        (
            '{"prompt": [{"role": "assistant", "content": "x"}], "chosen": "y", "rejected": "z"}',
            "end with a user",
        ),
        (
            '{"prompt": "x", "chosen": [{"role": "user", "content": "y"}], "rejected": "z"}',
            "assistant message",
        ),
        ("not json", "not JSON"),
    ]:
        path.write_text(json.dumps(rows[0]) + "\n" + bad + "\n")
        with pytest.raises(EmberError, match=message) as e:
            load_preferences(path)
        assert f"{path}:2" in str(e.value)


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}


@pytest.mark.parametrize("lora", [False, True], ids=["frozen-copy", "lora-adapters-off"])
def test_dpo_runs_start_at_log2_log_trls_metrics_and_resume_bitwise(tiny_cfg, lora):
    base_cfg = tiny_cfg("run.name=base", "train.max_steps=2", "train.eval_every=0", "train.report=true")
    train(base_cfg)
    base = Path(base_cfg.run.out_dir) / "base"
    args = ["run.name=dpo", "train.task=dpo", "dpo.data=add-2", "dpo.examples=40", f"train.init_from={base}",
            "train.max_steps=6", "train.ckpt_every=3", "train.keep_last=3", "train.eval_every=0",
            "train.lr=0.01", "model.dropout=0.0", *(["train.lora_rank=2"] if lora else [])]  # fmt: skip
    train(tiny_cfg(*args, "train.report=true"))
    run = base.parent / "dpo"
    records = [r for r in read_metrics(run) if "loss" in r]
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as its reference
    assert records[0]["rewards/margins"] == pytest.approx(0, abs=1e-6)
    last = records[-1]
    assert last["rewards/margins"] > 0 and last["loss"] < math.log(2)  # it learns the preference
    assert (run / "plots" / "dpo_margins.png").is_file() and (run / "plots" / "dpo_accuracies.png").is_file()
    assert not (base / "plots" / "dpo_margins.png").exists()  # drawn for runs that log it only
    full = _losses(run)
    shutil.rmtree(run / "checkpoints" / "step-000006")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines if r["step"] <= 3))
    train(tiny_cfg(*args, "train.resume=auto"))
    assert _losses(run) == full  # bitwise: same pairs, same reference


def test_bad_dpo_data_is_a_clear_error(tiny_cfg, capsys, tmp_path):
    cfg = tiny_cfg()
    argv = ["train", "tiny", f"data.dir={cfg.data.dir}", "data.val_fraction=0.1", f"run.out_dir={tmp_path}",
            "train.task=dpo", "train.max_steps=1"]  # fmt: skip
    assert main([*argv, "dpo.data=add-9"]) == 2
    assert "dpo.data='add-9'" in capsys.readouterr().err
    assert main([*argv, "dpo.data=add-2", "train.micro_batch=3", "train.batch_tokens=192"]) == 2
    assert "even" in capsys.readouterr().err


def test_model_replies_are_rejected_where_wrong_and_near_misses_where_right():
    problems = TASKS["add-2"].generate("train", 6)

    def answer(task, ps):  # a model that is right on even problems, says "7" on odd ones
        assert task is TASKS["add-2"] and [p.prompt for p in ps] == [p.prompt for p in problems]
        return [p.answer if i % 2 == 0 else "7" for i, p in enumerate(ps)]

    pairs = task_preferences("add-2", 6, seed=0, answer=answer)
    for i, (prompt, chosen, rejected) in enumerate(pairs):
        assert prompt[0]["content"] == problems[i].prompt and chosen == problems[i].answer
        if i % 2:
            assert rejected == "7"
        else:
            assert rejected != chosen and abs(int(rejected) - int(chosen)) in (1, 10, 100)


def test_dpo_with_the_models_own_replies_runs(tiny_cfg, capsys):
    base_cfg = tiny_cfg("run.name=base", "train.max_steps=1", "train.eval_every=0")
    train(base_cfg)
    base = Path(base_cfg.run.out_dir) / "base"
    args = ["run.name=own", "train.task=dpo", "dpo.data=add-2", "dpo.examples=8", "dpo.rejected=model",
            f"train.init_from={base}", "train.max_steps=1", "train.eval_every=0",
            "train.seq_len=64"]  # fmt: skip
    assert math.isfinite(train(tiny_cfg(*args))["loss"])
    assert "the starting model answers 8 add-2 problems" in capsys.readouterr().out
