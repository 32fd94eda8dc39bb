"""GRPO (``train.task=grpo``): the loss on fixed log-probabilities against the formula written out
and against TRL's GRPOTrainer, group advantages, the rollouts' layout and seeding, and runs that
log their rewards and resume bit for bit, a rollout's batch carried across a checkpoint."""

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
from ember.run import read_metrics
from ember.train.tasks.dpo import shared_prefix_logits, token_logps
from ember.train.tasks.grpo import Rollouts, group_advantages, grpo_loss
from ember.train.tasks.sft import IGNORE
from ember.train.trainer import train

LLAMA = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2)


def _inputs(seed: int = 0, rows: int = 6, T: int = 7):
    g = torch.Generator().manual_seed(seed)
    logps = -3 * torch.rand(rows, T, generator=g)
    old = logps + 0.4 * torch.randn(rows, T, generator=g)  # ratios well outside [0.8, 1.2] too
    ref = logps + 0.3 * torch.randn(rows, T, generator=g)
    advantages = torch.randn(rows, generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])[:rows]
    mask = torch.arange(T)[None] < lengths[:, None]
    return logps, old, ref, advantages, mask


def _written_out(logps, old, ref, advantages, mask, eps, beta, loss, correction):
    """ℓ_t = −min(ρ A, clip(ρ) A) + β (e^q − q − 1) (× ρ with ``correction``), averaged as ``loss``
    says, in plain Python."""
    per_row, total, tokens = [], 0.0, 0
    for b in range(logps.size(0)):
        row = []
        for t in range(logps.size(1)):
            if not mask[b, t]:
                continue
            rho = math.exp(logps[b, t].item() - old[b, t].item())
            a = advantages[b].item()
            value = -min(rho * a, min(max(rho, 1 - eps), 1 + eps) * a)
            q = ref[b, t].item() - logps[b, t].item()
            row.append(value + beta * (math.exp(q) - q - 1) * (rho if correction else 1))
        per_row.append(sum(row) / len(row))
        total, tokens = total + sum(row), tokens + len(row)
    return total / tokens if loss == "token" else sum(per_row) / len(per_row)


@pytest.mark.parametrize("loss", ["token", "sequence"])
@pytest.mark.parametrize("beta,correction", [(0.0, True), (0.04, True), (0.04, False)])
def test_loss_equals_the_formula(loss, beta, correction):
    logps, old, ref, advantages, mask = _inputs()
    got, metrics = grpo_loss(logps, old, ref, advantages, mask, 0.2, beta, loss, correction)
    want = _written_out(logps, old, ref, advantages, mask, 0.2, beta, loss, correction)
    assert got.item() == pytest.approx(want, abs=1e-6)
    assert 0 < metrics["clip_fraction"] < 1
    assert ("kl" in metrics) == bool(beta) and (not beta or metrics["kl"] > 0)
    with pytest.raises(EmberError, match="grpo.loss"):
        grpo_loss(logps, old, ref, advantages, mask, 0.2, beta, "dapo")


@pytest.mark.parametrize("loss,trl_loss", [("token", "bnpo"), ("sequence", "grpo")])
@pytest.mark.parametrize("beta,correction", [(0.0, True), (0.04, True), (0.04, False)])
def test_loss_gradient_and_metrics_equal_trls(tmp_path, loss, trl_loss, beta, correction):
    """TRL's GRPOTrainer._compute_loss on the same per-token log-probabilities (its model forward
    replaced by them), old log-probabilities, reference, advantages and mask: the loss, its gradient
    with respect to the log-probabilities, the KL and the clipped share agree within 1e-6."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import transformers

    from ember.model.hf import to_hf

    tok = Tokenizer.train_bpe(["What is 12 + 30? 42. " * 50], 300)
    cfg = ModelConfig(vocab_size=320, n_layer=1, n_head=2, d_model=32, max_seq_len=64, **LLAMA)
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.hf, eos_token="<|eos|>", pad_token="<|pad|>"
    )
    args = trl.GRPOConfig(output_dir=str(tmp_path), beta=beta, epsilon=0.2, loss_type=trl_loss,
                          num_generations=2, per_device_train_batch_size=2, max_completion_length=7,
                          use_bias_correction_kl=correction, bf16=False, use_cpu=True,
                          report_to=[])  # fmt: skip
    data = datasets.Dataset.from_dict({"prompt": ["a", "b"]})
    to_hf(GPT.build(cfg, seed=0)).save_pretrained(tmp_path / "hf")  # a path: TRL loads its reference too
    trainer = trl.GRPOTrainer(model=str(tmp_path / "hf"), reward_funcs=lambda completions, **kw: [0.0] * len(completions),  # noqa: E501
                              args=args, train_dataset=data, processing_class=hf_tok)  # fmt: skip
    trainer.model.eval()  # "eval" metrics and no division by accumulation steps

    logps, old, ref, advantages, mask = _inputs()
    ours_leaf, theirs_leaf = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (theirs_leaf, torch.zeros_like(logps), None)
    zeros = torch.zeros(6, 9, dtype=torch.long)
    inputs = {"prompt_ids": zeros[:, :2], "prompt_mask": torch.ones_like(zeros[:, :2]),
              "completion_ids": zeros[:, 2:], "completion_mask": mask.long(),
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref}  # fmt: skip
    theirs = trainer._compute_loss(trainer.model, inputs)
    ours, metrics = grpo_loss(ours_leaf, old, ref, advantages, mask, 0.2, beta, loss, correction)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    ours.backward(), theirs.backward()
    assert torch.allclose(ours_leaf.grad, theirs_leaf.grad, atol=1e-6)
    logged = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    assert metrics["clip_fraction"].item() == pytest.approx(logged["clip_ratio/region_mean"], abs=1e-6)
    if beta:
        assert metrics["kl"].item() == pytest.approx(logged["kl"], abs=1e-6)


def test_group_advantages_written_out():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    got = group_advantages(rewards, 4)
    std = math.sqrt(sum((r - 0.5) ** 2 for r in (1, 0, 0, 1)) / 3)  # Bessel's correction, as TRL's
    want = [(r - 0.5) / (std + 1e-4) for r in (1, 0, 0, 1)] + [0.0] * 4  # a group all alike: no signal
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    assert group_advantages(rewards, 4, scale=False).tolist() == pytest.approx(
        [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    )
    assert group_advantages(rewards, 2).view(-1, 2).sum(1).abs().max() < 1e-6


def test_token_logps_are_the_full_forwards():
    cfg = ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, max_seq_len=16, **LLAMA)
    model = GPT.build(cfg, seed=0).eval()
    x = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    y = torch.where(
        torch.rand(3, 10, generator=torch.Generator().manual_seed(1)) < 0.5, x.roll(-1, 1), IGNORE
    )
    with torch.no_grad():
        full = torch.log_softmax(model(x) / 0.7, -1)
        got = token_logps(model, x, y, temperature=0.7)
    want = torch.where(y != IGNORE, full.gather(2, y.clamp(min=0)[..., None])[..., 0], 0.0)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("layout", ["llama", "gpt2"])
def test_shared_prefix_logps_and_gradients_equal_the_plain_forward(layout):
    """Three groups of 3 completions behind prompts of 4, 6 and 6 tokens (two groups of one
    length: prompts are told apart by their ids), completions of 1 to 4 trained tokens with
    untrained holes and right padding: the shared path's log-probabilities and every
    parameter's gradient equal the plain forward's, in training mode."""
    extra = LLAMA if layout == "llama" else {"n_kv_head": 1}
    cfg = ModelConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=16, **extra)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, 64, (9, 11), generator=g)
    y = torch.full_like(x, IGNORE)
    shapes = [(4, 1), (4, 4), (4, 3), (6, 2), (6, 4), (6, 1), (6, 3), (6, 3), (6, 4)]  # (prompt, trained)
    for r, (prompt, trained) in enumerate(shapes):
        x[r, :prompt] = x[r // 3 * 3, :prompt]  # a group's rows share their prompt
        y[r, prompt - 1 : prompt - 1 + trained] = torch.randint(0, 64, (trained,), generator=g)
    y[4, 6] = IGNORE  # an untrained hole inside a completion
    assert not torch.equal(x[3, :6], x[6, :6])
    assert shared_prefix_logits(GPT.build(cfg, seed=0), x, y != IGNORE).shape == ((y != IGNORE).sum(), 64)
    grads = []
    for share in (False, True):
        model = GPT.build(cfg, seed=0).train()
        logps = token_logps(model, x, y, temperature=0.7, share=share)
        (logps * torch.linspace(-1, 1, 11)).sum().backward()
        grads.append((logps.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (shared, shared_grads) = grads
    assert (plain != 0).sum() == (y != IGNORE).sum() and torch.allclose(shared, plain, atol=1e-5)
    for name, grad in plain_grads.items():
        assert torch.allclose(shared_grads[name], grad, atol=1e-5), name


def _grpo_cfg(**changes):
    from ember.config import GRPOConfig

    return GRPOConfig(
        **{"data": "add-2", "examples": 20, "group": 4, "max_new_tokens": 4, "beta": 0.0, **changes}
    )


def test_rollouts_train_the_completions_score_them_and_are_seeded(tiny_cfg):
    base_cfg = tiny_cfg("run.name=base", "train.max_steps=1", "train.eval_every=0")
    train(base_cfg)
    from ember.run import load_run

    model, tok = load_run(Path(base_cfg.run.out_dir) / "base")
    from ember.data.chat import add_chat_tokens

    assert not add_chat_tokens(tok)  # an ember tokenizer holds them already

    def rollout(seed):
        loader = Rollouts(_grpo_cfg(), tok, model.train(), None, rows=8, micro_batch=4, seed=seed)
        return loader, loader.next_batch()

    loader, (x, y, advantages, old, ref) = rollout(0)
    problems = TASKS["add-2"].generate("train", 20)
    order = loader._permutation(0)[:2]
    assert model.training  # sampling switched it to eval and back
    end = chat_ids(tok)["end"]
    for r in range(8):
        prompt = render(tok, problems[order[r // 4]].messages()[:-1], add_generation_prompt=True)[0]
        assert x[r, : len(prompt)].tolist() == prompt  # the prompt is given, not trained
        assert (y[r, : len(prompt) - 1] == IGNORE).all()
        completion = y[r][y[r] != IGNORE].tolist()
        assert 1 <= len(completion) <= 4 + 1 and (completion[-1] == end or len(completion) == 4)
    texts = [tok.decode([i for i in y[r].tolist() if i not in (IGNORE, end)]) for r in range(8)]
    scores = [TASKS["add-2"].score(problems[order[r // 4]], text) for r, text in enumerate(texts)]
    assert loader.metrics["accuracy"] == pytest.approx(sum(s == 1 for s in scores) / 8)
    assert torch.allclose(advantages, group_advantages(torch.tensor(scores), 4))
    assert (
        loader.metrics["gen_s"] > 0
        and loader.metrics["completion_length"] == (y != IGNORE).sum(1).float().mean()
    )
    assert torch.equal(rollout(0)[1][1], y)  # same seed, same samples
    loader.next_batch()  # μ = 1: every batch a new rollout, on the next prompts
    assert (loader.rollouts, loader.position) == (2, 4)
    assert not torch.equal(rollout(1)[1][0], x)  # another seed, another order


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}


@pytest.mark.parametrize("lora", [False, True], ids=["frozen-copy", "lora-adapters-off"])
def test_grpo_runs_log_rewards_and_resume_bitwise_mid_rollout(tiny_cfg, lora):
    """μ = 2 steps per rollout and a checkpoint at step 3, between the two steps of a rollout: the
    resumed run reads that rollout's batch from the checkpoint and samples the next ones as the
    uninterrupted run did (its RNG seeded by the rollout's index)."""
    base_cfg = tiny_cfg("run.name=base", "train.max_steps=40", "train.lr=0.01", "train.eval_every=0")
    train(base_cfg)
    base = Path(base_cfg.run.out_dir) / "base"
    args = ["run.name=grpo", "train.task=grpo", "grpo.data=pydoc", "grpo.examples=40", "grpo.group=4",
            "grpo.max_new_tokens=16", "grpo.beta=0.1", "grpo.iterations=2", f"train.init_from={base}",
            "train.max_steps=6", "train.ckpt_every=3", "train.keep_last=3", "train.eval_every=0",
            "train.lr=0.01", "model.dropout=0.0", "grpo.eval_problems=4", "train.batch_tokens=1024",
            *(["train.lora_rank=2"] if lora else [])]  # fmt: skip
    train(tiny_cfg(*args))
    run = base.parent / "grpo"
    records = [r for r in read_metrics(run) if "loss" in r]
    for key in (
        "reward",
        "reward_std",
        "accuracy",
        "kl",
        "clip_fraction",
        "completion_length",
        "zero_std_groups",
    ):
        assert all(math.isfinite(r[key]) for r in records), key
    assert records[0]["kl"] == pytest.approx(0, abs=1e-6)  # the policy starts as its reference
    assert [r["gen_s"] > 0 for r in records] == [True, False] * 3  # a rollout every second step
    assert records[1]["reward"] == records[0]["reward"]
    assert any(r["reward_std"] > 0 for r in records)  # pydoc's F1: 32 completions a rollout, some score
    first = records[0]  # the policy is its old self and its reference: only advantages move it
    assert (first["grad_norm"] > 0) == (first["reward_std"] > 0)
    if not lora:  # (rank-2 adapters at this learning rate move the ratios less than ε)
        assert any(r["clip_fraction"] > 0 for r in records[1::2])  # a rollout's second step moved off it
    assert any("task_accuracy" in r for r in read_metrics(run))
    full = _losses(run)
    meta = json.loads((run / "checkpoints" / "step-000003" / "meta.json").read_text())
    assert "batch" in meta["data_cursor"]  # the rollout half used
    shutil.rmtree(run / "checkpoints" / "step-000006")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines if r["step"] <= 3))
    train(tiny_cfg(*args, "train.resume=auto"))
    assert _losses(run) == full


def test_bad_grpo_setups_are_clear_errors(tiny_cfg, capsys, tmp_path):
    cfg = tiny_cfg("run.name=base", "train.max_steps=1", "train.eval_every=0")
    train(cfg)
    argv = ["train", "tiny", f"data.dir={cfg.data.dir}", "data.val_fraction=0.1", f"run.out_dir={tmp_path}",
            "train.task=grpo", "train.max_steps=1", f"train.init_from={Path(cfg.run.out_dir) / 'base'}"]  # fmt: skip # noqa: E501
    assert main([*argv, "grpo.data=chats.jsonl"]) == 2
    assert "verifier" in capsys.readouterr().err
    assert main([*argv, "grpo.data=add-2", "grpo.group=3"]) == 2  # 8 completions a step
    assert "groups of grpo.group=3" in capsys.readouterr().err
    assert main([*argv, "grpo.data=add-2", "grpo.temperature=0"]) == 2
    assert "grpo.temperature" in capsys.readouterr().err


@pytest.mark.slow
def test_two_ddp_ranks_sample_and_train_as_one_process(tiny_cfg, tmp_path):
    """Each rank samples its own groups with the seeds of their rows in the global batch, so two
    ranks draw the completions one process draws, and their losses agree to 1e-5."""
    import os
    import subprocess
    import sys

    base_cfg = tiny_cfg("run.name=base", "train.max_steps=40", "train.lr=0.01", "train.eval_every=0")
    train(base_cfg)
    base = Path(base_cfg.run.out_dir) / "base"
    args = ["train.task=grpo", "grpo.data=pydoc", "grpo.examples=40", "grpo.group=4", "grpo.max_new_tokens=8",
            "grpo.beta=0.1", f"train.init_from={base}", "train.max_steps=3", "train.eval_every=0",
            "train.lr=0.01", "train.deterministic=true", "grpo.eval_problems=0",
            "train.batch_tokens=512"]  # fmt: skip
    train(tiny_cfg("run.name=one", *args))
    cmd = [sys.executable, "-m", "ember", "train", "tiny", "--nproc", "2", f"data.dir={base_cfg.data.dir}",
           "data.val_fraction=0.1", f"run.out_dir={base.parent}", "run.name=two", "train.device=cpu",
           "train.report=false", *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, two = ([r for r in read_metrics(base.parent / n) if "loss" in r] for n in ("one", "two"))
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "reward", "completion_length", "kl"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), (a["step"], key)
    assert any(r["reward_std"] > 0 for r in one)
