"""Group relative policy optimisation: ``train.task=grpo`` (Shao et al. 2024, DeepSeekMath §4).

    ember train cpu-quick train.task=grpo grpo.data=add-3 train.init_from=runs/add3-sft

A step samples G = ``grpo.group`` completions of each of P prompts with ember's engine from the
very module that trains (eval mode, inference_mode, its KV cache; no copy of the weights), scores
them with the task's verifier (or ``grpo.reward_model``, ember/train/tasks/rm.py), and trains
with group-relative advantages, PPO's clipped ratio ρ_t = π/π_old and a KL penalty::

    A_i = (r_i − mean(r)) / (std(r) + 1e-4)    grpo.scale_rewards=true (GRPO; std with Bessel's correction)
    A_i =  r_i − mean(r)                       false (Dr. GRPO, Liu et al. 2025)
    ℓ_t = −min(ρ_t A, clip(ρ_t, 1 − ε, 1 + ε) A) + β k3_t
    k3_t = e^{q_t} − q_t − 1,   q_t = log π_ref(y_t | ·) − log π(y_t | ·)      (Schulman 2020)

``grpo.kl_correction=true`` (TRL's default) multiplies k3 by ρ, so its gradient is the reverse
KL's (DeepSeek-V3.2 §3.1); ``grpo.loss=token`` is TRL's ``bnpo``, ``sequence`` the paper's. The
numbers equal TRL's ``GRPOTrainer`` loss on the same inputs (tests/test_grpo.py). docs/grpo.md
has the derivation, π_old and μ = ``grpo.iterations``, the timings, the metrics and figures.

Design choices:

- **Exact resume.** Prompts come in a seeded epoch order with the cursor in the checkpoint
  (``SFTLoader``'s), and row i of rollout k's global batch samples from a generator seeded by
  ``(run.seed, k)`` + i, whichever rank holds it, so a rollout is a function of the step and the
  weights: a resumed run samples what the uninterrupted one did (tested bitwise on CPU), and two
  DDP ranks what one process does (tested to 1e-5). A checkpoint taken between the μ steps of
  one rollout carries that rollout's batch.
- **Parallel.** Under DDP a group never straddles ranks, so its advantages need no collective.
  FSDP is refused: decoding on sharded weights would need every rank to run the same number of
  forwards, which early-finishing rows do not.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from ember.data.chat import render
from ember.data.tasks import TASKS
from ember.errors import ConfigError, EmberError
from ember.infer.engine import Engine
from ember.infer.sampling import Sampling
from ember.parallel.dist import all_reduce, print0
from ember.train.tasks.dpo import frozen_copy, reference_policy, token_logps
from ember.train.tasks.rm import load_reward_model, score_sequences
from ember.train.tasks.sft import IGNORE, SFTLoader, SFTTask, data_task

LOSSES = ("token", "sequence")


def group_advantages(rewards: Tensor, group: int, scale: bool = True) -> Tensor:
    """(n,) rewards of n / ``group`` consecutive groups -> (n,) advantages (module docstring)."""
    grouped = rewards.view(-1, group)
    advantages = grouped - grouped.mean(1, keepdim=True)
    if scale:
        advantages = advantages / (grouped.std(1, keepdim=True) + 1e-4)
    return advantages.reshape(-1)


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor,
    ref_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    epsilon: float = 0.2,
    beta: float = 0.0,
    loss: str = "token",
    kl_correction: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped GRPO loss from per-token log-probabilities (rows, T) of the policy, of the
    policy that sampled and of the reference (None when ``beta`` is 0), per-row ``advantages``
    and the completion ``mask``; with the mean KL term (k3, times ρ with ``kl_correction``) and
    the share of tokens the clip holds (ρ outside [1 − ε, 1 + ε] on the side the advantage
    pushes) as metrics."""
    ratio = torch.exp(logps - old_logps)
    A = advantages[:, None]
    per_token = -torch.min(ratio * A, ratio.clamp(1 - epsilon, 1 + epsilon) * A)
    m = mask.to(per_token.dtype)
    tokens = m.sum().clamp(min=1)
    metrics = {}
    if beta:
        q = ref_logps - logps
        kl = torch.exp(q) - q - 1
        if kl_correction:
            kl = kl * ratio
        per_token = per_token + beta * kl
        metrics["kl"] = (kl.detach() * m).sum() / tokens
    if loss == "token":
        total = (per_token * m).sum() / tokens
    elif loss == "sequence":
        total = ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    else:
        raise EmberError(f"grpo.loss={loss!r}: choose one of {', '.join(LOSSES)}")
    clipped = ((ratio < 1 - epsilon) & (A < 0)) | ((ratio > 1 + epsilon) & (A > 0))
    metrics["clip_fraction"] = (clipped.detach().to(m.dtype) * m).sum() / tokens
    return total, metrics


def _rollout_seed(seed: int, rollout: int) -> int:
    """The sampling seed of row 0 of rollout ``rollout``; global row i samples with it + i."""
    digest = hashlib.sha256(f"grpo:{seed}:{rollout}".encode()).digest()
    return int.from_bytes(digest[:6], "big") << 16  # < 2**64, and room for 65,536 rows


def check_groups(rows: int, dp: int, group: int) -> None:
    """Each of the ``dp`` data-parallel ranks samples whole groups of ``group`` completions:
    checked before torchrun starts the ranks (``check_layout``) and by the loader."""
    if rows % dp or (rows // dp) % group:
        raise ConfigError(
            f"{rows} completions per step (train.batch_tokens / train.seq_len) do not split into groups "
            f"of grpo.group={group} on {dp} rank(s); make it a multiple of {group * dp}"
        )


class Rollouts(SFTLoader):
    """The trainer's loader for ``train.task=grpo``: batches of (x, y, advantages, old_logps,
    ref_logps), this rank's rows, sampled from ``model`` (the training module itself) on the
    task's train problems. ``metrics`` holds the last rollout's numbers for the step's record."""

    def __init__(self, grpo_cfg, tokenizer, model, reference: Callable | None, rows: int,
                 micro_batch: int, seed: int, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu"):  # fmt: skip
        self.task = data_task(grpo_cfg.data, "grpo.data") if grpo_cfg.data else None
        if self.task is None:
            raise EmberError(
                f"train.task=grpo needs grpo.data, an embedded task whose verifier gives the rewards "
                f"(got {grpo_cfg.data!r}; tasks: {', '.join(TASKS)})"
            )
        check_groups(rows, world_size, grpo_cfg.group)
        problems = self.task.generate("train", grpo_cfg.examples)
        super().__init__(problems, 0, rows, seed, False, rank, world_size, device)
        self.cfg, self.tokenizer, self.model, self.reference = grpo_cfg, tokenizer, model, reference
        self.micro_batch = micro_batch
        self.engine = Engine(model, tokenizer)
        self.sampling = Sampling(
            grpo_cfg.max_new_tokens, grpo_cfg.temperature, grpo_cfg.top_k or None, grpo_cfg.top_p
        )
        self.reward_model = None  # grpo.reward_model: σ(its score) is the reward (ember/train/tasks/rm.py)
        if grpo_cfg.reward_model:
            self.reward_model = load_reward_model(grpo_cfg.reward_model, tokenizer, torch.device(device))
        self.rollouts, self.used = 0, 0  # rollouts drawn; steps taken on the last one
        self.batch: tuple[Tensor, ...] | None = None
        self.metrics: dict[str, float] = {}

    def next_batch(self) -> tuple[Tensor, ...]:
        if self.batch is None or self.used == self.cfg.iterations:
            self.batch, self.used = self._rollout(), 0
        elif self.used == 1:
            self.metrics.update(gen_s=0.0, ref_s=0.0)  # the same rollout, at no cost
        self.used += 1
        return self.batch

    def _rollout(self) -> tuple[Tensor, ...]:
        cfg, G = self.cfg, self.cfg.group
        prompts = self.rows // G
        problems = [self._take() for _ in range(prompts)]  # every rank takes them all, keeps its own
        share = prompts // self.world_size
        problems = problems[self.rank * share : (self.rank + 1) * share]
        start = time.perf_counter()
        ids = [render(self.tokenizer, p.messages()[:-1], add_generation_prompt=True)[0] for p in problems]
        first = self.rank * share * G  # this rank's first row of the step's global batch
        sampling = replace(self.sampling, seed=_rollout_seed(self.seed, self.rollouts) + first)
        completions = self.engine.generate([p for p in ids for _ in range(G)], sampling)
        self.rollouts += 1
        scores = [self.task.score(problems[i // G], c.text) for i, c in enumerate(completions)]
        closed = [c.end_id is not None for c in completions]
        earned = scores
        if self.reward_model is not None:
            replies = [ids[i // G] + c.token_ids for i, c in enumerate(completions)]
            earned = torch.sigmoid(score_sequences(self.reward_model, replies)).tolist()
        rewards = torch.tensor([s + cfg.format_reward * e for s, e in zip(earned, closed, strict=True)])
        sequences = [
            ids[i // G] + c.token_ids + ([c.end_id] if c.end_id is not None else [])
            for i, c in enumerate(completions)
        ]
        width = max(map(len, sequences))
        tokens = torch.zeros(len(sequences), width, dtype=torch.long)
        trained = torch.zeros(len(sequences), width, dtype=torch.bool)
        for r, sequence in enumerate(sequences):
            tokens[r, : len(sequence)] = torch.tensor(sequence)
            trained[r, len(ids[r // G]) : len(sequence)] = True
        x = tokens[:, :-1].to(self.device)
        y = torch.where(trained[:, 1:], tokens[:, 1:], IGNORE).to(self.device)
        advantages = group_advantages(rewards, G, cfg.scale_rewards).to(self.device)
        generated = time.perf_counter()

        old = ref = torch.zeros(y.shape, device=self.device)  # unused: ρ from π detached, β = 0
        if cfg.iterations > 1:
            old = self._logps(
                lambda xs, ys: token_logps(self.model, xs, ys, cfg.temperature, cfg.shared_prefix), x, y
            )
        if cfg.beta:
            ref = self._logps(self.reference, x, y)
        grouped = rewards.view(-1, G)
        lengths = (y != IGNORE).sum(1).float().cpu()
        numbers = torch.tensor(
            [
                rewards.mean(),
                grouped.std(1).mean(),
                sum(s == 1.0 for s in scores) / len(scores),
                lengths.mean(),
                sum(c.finish_reason == "length" for c in completions) / len(completions),
                (grouped.std(1) == 0).float().mean(),
                generated - start,
                time.perf_counter() - generated,
            ],
            dtype=torch.float64,
            device=self.device,
        )
        all_reduce(numbers, "avg")
        names = ("reward", "reward_std", "accuracy", "completion_length", "length_capped")
        names += ("zero_std_groups", "gen_s", "ref_s")
        self.metrics = dict(zip(names, numbers.tolist(), strict=True))
        return x, y, advantages, old, ref

    @torch.no_grad()
    def _logps(self, logps: Callable, x: Tensor, y: Tensor) -> Tensor:
        """``logps(x, y)`` in eval mode, a micro-batch at a time (the memory of one)."""
        was_training = self.model.training
        self.model.eval()
        try:
            chunks = [
                logps(x[i : i + self.micro_batch], y[i : i + self.micro_batch])
                for i in range(0, x.size(0), self.micro_batch)
            ]
        finally:
            self.model.train(was_training)
        return torch.cat(chunks)

    def state_dict(self) -> dict:
        state = {**super().state_dict(), "rollouts": self.rollouts, "used": self.used}
        if self.batch is not None and self.used < self.cfg.iterations:  # a rollout not used up
            state["batch"] = [t.tolist() for t in self.batch]  # JSON floats round-trip exactly
            state["metrics"] = self.metrics
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.rollouts, self.used = int(state.get("rollouts", 0)), int(state.get("used", 0))
        if "batch" in state:
            dtypes = (torch.long, torch.long, torch.float32, torch.float32, torch.float32)
            self.batch = tuple(
                torch.tensor(t, dtype=d, device=self.device)
                for t, d in zip(state["batch"], dtypes, strict=True)
            )
            self.metrics = dict(state["metrics"])


class GRPOTask(SFTTask):
    """The trainer's task for ``train.task=grpo``: ``grpo_loss`` on a micro-batch of rollouts, and
    SFT's task accuracy on held-out problems at each evaluation."""

    name = "grpo"
    reference_on_resume = True
    shards_params = False

    def __init__(self, grpo_cfg, tokenizer):
        super().__init__(False, tokenizer, grpo_cfg.data, grpo_cfg.eval_problems)
        self.cfg = grpo_cfg

    @classmethod
    def check_layout(cls, cfg, world_size: int, dp: int) -> None:
        check_groups(cfg.train.batch_tokens // cfg.train.seq_len, dp, cfg.grpo.group)

    @classmethod
    def prepare(cls, trainer, model) -> None:
        keep = trainer.adapters is None and trainer.cfg.grpo.beta  # a KL term to the starting weights
        trainer.frozen = frozen_copy(model) if keep else None

    @classmethod
    def build(cls, trainer, model):
        cfg, env, t, g = trainer.cfg, trainer.env, trainer.cfg.train, trainer.cfg.grpo
        task = cls(g, trainer.tokenizer)
        reference = reference_policy(trainer, model, g.temperature, g.shared_prefix) if g.beta else None
        where = (env.dp_rank, env.dp_size, env.device)
        loader = Rollouts(g, trainer.tokenizer, model, reference, trainer.global_rows, t.micro_batch,
                          cfg.run.seed, *where)  # fmt: skip
        print0(
            f"grpo: {trainer.global_rows // g.group} prompts × {g.group} completions per step, from "
            f"{len(loader.examples):,} {g.data} train problems"
        )
        return task, loader, None

    def loss(self, model, batch) -> tuple[Tensor, dict]:
        x, y, advantages, old_logps, ref_logps = batch
        c = self.cfg
        logps = token_logps(model, x, y, c.temperature, c.shared_prefix)
        if c.iterations == 1:
            old_logps = logps.detach()  # the sampling policy is this one: ρ = 1, the policy gradient
        mask = y != IGNORE
        return grpo_loss(
            logps, old_logps, ref_logps, advantages, mask, c.epsilon, c.beta, c.loss, c.kl_correction
        )
