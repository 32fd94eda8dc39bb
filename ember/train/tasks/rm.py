"""Reward models: ``train.task=rm`` with ``model.head=score`` (Bradley–Terry, as in Stiennon et al.
2020 and InstructGPT, Ouyang et al. 2022 §3.5).

    ember train cpu-quick run.name=count-rm train.task=rm model.head=score dpo.data=count \\
        dpo.rejected=model train.init_from=runs/count-sft400
    ember train cpu-quick train.task=grpo grpo.data=count grpo.reward_model=runs/count-rm ...

The policy's network with a one-row head: ``r(x, y)`` is that scalar at the last token of the
reply's content (the closing ``<|end_turn|>`` every reply ends with is left out: it tells
nothing). The loss is the preferences' negative log-likelihood, ``−log σ(r_w − r_l)`` (Bradley &
Terry 1952; TRL's ``RewardTrainer``), over DPO's pairs in DPO's ``PairLoader``; metrics take
TRL's names as DPO logs them, and ``pair_accuracy`` is measured on pairs made from held-out test
problems. As GRPO's reward, ``σ(r)`` replaces the verifier's score while the logged ``accuracy``
stays the verifier's, so a run shows whether optimising the learnt reward moves the true one.
Checked against transformers: ``LlamaForSequenceClassification`` and ``GPT2ForSequenceClassification``
(one label) holding the same weights give the same r for the same tokens (tests/test_reward.py).
docs/reward.md has the model, the loss, the data and a demonstration of the reward exploited.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ember.errors import EmberError
from ember.parallel.dist import print0
from ember.parallel.parallelize import unwrap
from ember.run import load_run
from ember.train.tasks.dpo import Pair, encode_pairs, pair_loader, preference_pairs, task_preferences
from ember.train.tasks.sft import IGNORE, SFTTask, data_task


def score_positions(y: Tensor) -> Tensor:
    """(rows, T) bool: in each row of targets ``y`` (a prompt, then a reply ending in its end of
    turn), the input position of the reply's last content token: that of the last trained target."""
    trained = y != IGNORE
    last = y.size(1) - 1 - trained.int().flip(1).argmax(1)
    return torch.zeros_like(trained).scatter_(1, last[:, None], True)


def scores(model, x: Tensor, y: Tensor) -> Tensor:
    """(rows,) r of each row of a pair batch (``score_positions``)."""
    return model(x, keep=score_positions(y))[:, 0].float()


@torch.no_grad()
def score_sequences(model, sequences: list[list[int]], batch: int = 64) -> Tensor:
    """(n,) r of each token sequence (a prompt and a reply's content, without its end of turn):
    the score at its last token, in eval mode, ``batch`` right-padded rows at a time."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    try:
        for i in range(0, len(sequences), batch):
            rows = sequences[i : i + batch]
            x = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
            keep = torch.zeros_like(x, dtype=torch.bool)
            for r, sequence in enumerate(rows):
                x[r, : len(sequence)] = torch.tensor(sequence)
                keep[r, len(sequence) - 1] = True
            out.append(model(x.to(device), keep=keep.to(device))[:, 0].float())
    finally:
        model.train(was_training)
    return torch.cat(out)


def bradley_terry_loss(chosen: Tensor, rejected: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """−log σ(r_w − r_l), the mean over pairs, and TRL's metrics (module docstring)."""
    margins = chosen - rejected
    metrics = {
        "rewards/chosen": chosen.detach().mean(),
        "rewards/rejected": rejected.detach().mean(),
        "rewards/margins": margins.detach().mean(),
        "rewards/accuracies": (margins.detach() > 0).float().mean(),
    }
    return -F.logsigmoid(margins).mean(), metrics


def pair_accuracy(model, pairs: list[Pair]) -> float:
    """The share of ``pairs`` whose chosen reply the model scores above the rejected one."""
    chosen = score_sequences(model, [prompt + c[:-1] for prompt, c, _ in pairs])
    rejected = score_sequences(model, [prompt + r[:-1] for prompt, _, r in pairs])
    return (chosen > rejected).float().mean().item()


class RMTask(SFTTask):
    """The trainer's task for ``train.task=rm``: the Bradley–Terry loss on a micro-batch of pairs,
    and ``pair_accuracy`` on the held-out ``pairs`` at each evaluation."""

    name = "rm"
    rows_per_example = 2  # a chosen and a rejected row

    def __init__(self, tokenizer, pairs: list[Pair]):
        super().__init__(False, tokenizer)
        self.pairs = pairs

    @classmethod
    def prepare(cls, trainer, model) -> None:
        pass  # (no chat-token rows: the pairs train the score head and what LoRA adapts)

    @classmethod
    def build(cls, trainer, model):
        pairs, answer = preference_pairs(trainer, None)  # the starting run's answers, loaded once
        task = cls(trainer.tokenizer, held_out_pairs(trainer, answer))
        return task, pair_loader(trainer, pairs), None

    def validate(self, trainer) -> dict:
        result = self.accuracy(unwrap(trainer.model))
        if result:
            n = len(self.pairs)
            print0(f"step {trainer.step:6d} | pair accuracy {result['pair_accuracy']:.1%} on {n} held-out pairs")  # fmt: skip # noqa: E501
        return result

    def accuracy(self, model) -> dict:
        return {"pair_accuracy": pair_accuracy(model, self.pairs)} if self.pairs else {}

    def loss(self, model, batch) -> tuple[Tensor, dict]:
        x, y = batch
        return bradley_terry_loss(*scores(model, x, y).chunk(2))


def held_out_pairs(trainer, answer) -> list[Pair]:
    """A reward model's held-out pairs: ``dpo.eval_problems`` of the task's test problems, made
    as its training pairs are (none with a JSONL file of pairs)."""
    d = trainer.cfg.dpo
    if data_task(d.data, "dpo.data") is None or not d.eval_problems:
        return []
    made = task_preferences(d.data, d.eval_problems, trainer.cfg.run.seed, answer if d.rejected == "model" else None, "test")  # fmt: skip # noqa: E501
    return encode_pairs(trainer.tokenizer, made, trainer.cfg.train.seq_len)


def load_reward_model(run: str | Path, tokenizer, device: torch.device):
    """``grpo.reward_model``'s model, frozen on ``device``; an EmberError unless it is a reward
    model (``model.head=score``) that reads this run's tokenizer."""
    model, theirs = load_run(run, "last", device)
    if model.cfg.head != "score":
        raise EmberError(
            f"grpo.reward_model={run} is not a reward model (its model.head is {model.cfg.head}); "
            "train one with `ember train ... train.task=rm model.head=score`"
        )
    if theirs.sha256 != tokenizer.sha256:
        raise EmberError(
            f"grpo.reward_model={run} reads another tokenizer than this run's; train the reward model "
            "from the same SFT run as the policy (train.init_from)"
        )
    return model.requires_grad_(False).eval()
