"""Direct preference optimisation: ``train.task=dpo`` (Rafailov et al. 2023).

    ember train cpu-quick train.task=dpo dpo.data=add-2 train.init_from=runs/add2-sft

**The loss.** Fine-tuning against a reward r with a KL leash to a reference policy,
``max E[r(x, y)] − β KL(π ‖ π_ref)``, has the optimum ``π*(y|x) ∝ π_ref(y|x) exp(r(x, y)/β)``,
so ``r = β log π*/π_ref + β log Z(x)``. Put that r into the Bradley–Terry probability that the
chosen answer y_w beats the rejected y_l, ``σ(r(x, y_w) − r(x, y_l))``: Z(x) cancels, and the
policy itself is trained by the negative log-likelihood of the preferences::

    h = (log π(y_w|x) − log π_ref(y_w|x)) − (log π(y_l|x) − log π_ref(y_l|x))
    sigmoid: −log σ(β h)                      (dpo.loss=sigmoid, the paper's)
    robust:  with dpo.label_smoothing ε, a share ε of the labels assumed flipped (Chowdhury et
             al. 2024): (−(1−ε) log σ(β h) + ε log σ(−β h)) / (1 − 2ε)
    ipo:     (h̄ − 1/(2β))², h̄ with each log-ratio averaged over its completion's tokens
             (Azar et al. 2023; the per-token average as TRL takes it)
    plus, with dpo.sft_weight α, α times the chosen replies' negative log-likelihood per token
    (TRL's loss_type=[..., "sft"]; the NLL term of Pang et al. 2024), which keeps DPO from
    lowering the chosen replies' likelihood along with the rejected ones'

``log π(y|x)`` sums the log-probabilities of the completion's tokens (its content and closing
``<|end_turn|>``), given the prompt rendered in the chat format. The loss is the mean over the
pairs; the numbers equal TRL's ``DPOTrainer`` on the same model and batch (tests/test_dpo.py).

**The reference.** With LoRA (``train.lora_rank``) it is the same model with its adapters off
(``adapters_disabled``): no second copy. Otherwise a frozen copy of the starting weights,
kept on the device. Either way its log-probabilities are computed in the step, under no_grad,
so a resumed run computes what the uninterrupted one did.

**Metrics** (TRL's names, per step, means over the pairs): ``rewards/chosen`` = β (log π − log
π_ref) of y_w, ``rewards/rejected`` the same of y_l, ``rewards/margins`` their difference,
``rewards/accuracies`` the share of pairs whose chosen reward is the larger, ``logps/chosen``
and ``logps/rejected`` (summed over the completion).

**Data** (``dpo.data``): a JSONL file of ``{"prompt", "chosen", "rejected"}`` rows, each a
string or chat messages (the prompt a list of messages ending in a user turn, chosen and
rejected an assistant message or a list of one), or an embedded task: chosen is a problem's
reference answer and rejected a seeded corruption of it that the task's verifier scores 0
(off by one, ten or a hundred, or two neighbours swapped). Rows are two per pair, chosen then
rejected, no packing; each micro-batch holds whole pairs (its first half chosen, its second
half rejected), in a seeded epoch order with the cursor in the checkpoint (``PairLoader``).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ember.data.chat import chat_ids, check_messages, render
from ember.data.tasks import jsonl_rows, reply_of
from ember.errors import ConfigError, EmberError
from ember.infer.engine import Engine, KVCache, distinct_left_padded
from ember.infer.evaluate import answer_problems
from ember.model.gpt import GPT
from ember.model.lora import adapters_disabled
from ember.parallel.dist import print0
from ember.run import load_run
from ember.train.tasks.sft import IGNORE, SFTLoader, SFTTask, data_task

LOSSES = ("sigmoid", "robust", "ipo")
Preference = tuple[list[dict], str, str]  # prompt messages, chosen reply, rejected reply
Pair = tuple[list[int], list[int], list[int]]  # prompt ids, chosen ids, rejected ids (each + end of turn)


# ---------------------------------------------------------------- data


def _reply(value, where: str, key: str) -> str:
    if isinstance(value, str):
        if not value.strip():
            raise EmberError(f"{where}: '{key}' is empty; a pair compares two replies that say something")
        return value
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        check_messages(value, f"{where}: {key}")
        if value[0]["role"] == "assistant":
            return _reply(value[0]["content"], where, key)
    raise EmberError(f"{where}: '{key}' must be a string or one assistant message")


def load_preferences(path: str | Path) -> list[Preference]:
    """Pairs from a JSONL file (see the module docstring); an EmberError names the line."""
    pairs = []
    for where, row in jsonl_rows(path, "preference pairs"):
        if not isinstance(row, dict) or not {"prompt", "chosen", "rejected"} <= set(row):
            raise EmberError(f'{where}: expected {{"prompt": ..., "chosen": ..., "rejected": ...}}')
        prompt = row["prompt"]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        check_messages(prompt, f"{where}: prompt")
        if prompt[-1]["role"] != "user":
            raise EmberError(f"{where}: the prompt must end with a user message, which the replies answer")
        prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
        chosen, rejected = _reply(row["chosen"], where, "chosen"), _reply(row["rejected"], where, "rejected")
        if chosen == rejected:
            raise EmberError(f"{where}: 'chosen' and 'rejected' are the same reply; the pair teaches nothing")
        pairs.append((prompt, chosen, rejected))
    if not pairs:
        raise EmberError(f"{path} holds no preference pairs; write one JSON object per line")
    return pairs


def corrupt(answer: str, rng: random.Random) -> str:
    """A near miss of ``answer``: a number off by 1, 10 or 100; otherwise two neighbouring items
    (words, or characters of one word) swapped, or the last character dropped."""
    if answer.lstrip("-").isdigit():
        value = int(answer)
        return str(value + rng.choice([d for d in (-100, -10, -1, 1, 10, 100) if value + d >= 0]))
    items, sep = (answer.split(" "), " ") if " " in answer else (list(answer), "")
    if len(items) > 1 and len(set(items)) > 1:
        i = rng.choice([j for j in range(len(items) - 1) if items[j] != items[j + 1]])
        items[i], items[i + 1] = items[i + 1], items[i]
        return sep.join(items)
    return answer[:-1] if len(answer) > 1 else answer + answer


def task_preferences(
    spec: str, n: int, seed: int, answer: Callable | None = None, split: str = "train"
) -> list[Preference]:
    """``n`` pairs from an embedded task's ``split``: its answer chosen, a corruption that the
    verifier scores 0 rejected (problems with no such corruption are skipped); with ``answer``
    (``(task, problems) -> replies``: a model's), that reply where the verifier scores it 0."""
    task = data_task(spec, "dpo.data")
    problems = task.generate(split, n)
    replies = answer(task, problems) if answer else [""] * len(problems)
    pairs, own = [], 0
    for problem, reply in zip(problems, replies, strict=True):
        if reply.strip() and task.score(problem, reply) == 0.0:
            pairs.append(([{"role": "user", "content": problem.prompt}], problem.answer, reply))
            own += 1
            continue
        rng = random.Random(f"{seed}:{problem.prompt}")
        for _ in range(8):
            rejected = corrupt(problem.answer, rng)
            if task.score(problem, rejected) == 0.0:
                pairs.append(([{"role": "user", "content": problem.prompt}], problem.answer, rejected))
                break
    if answer:
        print(f"dpo: {own:,} of {len(pairs):,} rejected replies are the model's own (the rest near misses)")
    return pairs


def load_pairs(dpo_cfg, seed: int, answer: Callable | None = None) -> list[Preference]:
    """``dpo.data``'s pairs: a JSONL file's rows, or ``dpo.examples`` made from an embedded task
    (with ``dpo.rejected=model``, ``answer`` gives the model's replies)."""
    task = data_task(dpo_cfg.data, "dpo.data")
    if task is None:
        return load_preferences(dpo_cfg.data)
    return task_preferences(
        dpo_cfg.data, dpo_cfg.examples, seed, answer if dpo_cfg.rejected == "model" else None
    )


def encode_pairs(tokenizer, preferences: list[Preference], seq_len: int) -> list[Pair]:
    """Each pair as the prompt's ids (chat format, ending with the assistant's role token) and the
    two replies' ids with their end of turn; pairs longer than ``seq_len + 1`` are dropped."""
    pairs, dropped, end = [], 0, chat_ids(tokenizer)["end"]
    for prompt, chosen, rejected in preferences:
        prompt_ids = render(tokenizer, prompt, add_generation_prompt=True)[0]
        replies = [tokenizer.encode_after_special(r) + [end] for r in (chosen, rejected)]
        if len(prompt_ids) + max(map(len, replies)) > seq_len + 1:
            dropped += 1
            continue
        pairs.append((prompt_ids, *replies))
    if not pairs:
        raise EmberError(
            f"no preference pair fits train.seq_len + 1 = {seq_len + 1} tokens; raise train.seq_len"
        )
    if dropped:
        print(f"dpo: {dropped} pairs longer than {seq_len + 1} tokens dropped")
    return pairs


class PairLoader(SFTLoader):
    """Batches of (x, y), (rows on this rank, seq_len), from pairs in seeded epoch order: each
    micro-batch of ``micro_batch`` rows holds ``micro_batch / 2`` pairs, chosen rows first, their
    rejected rows after, right-padded; ``y`` is IGNORE off the replies. The epoch order and the
    cursor are SFTLoader's (state_dict, load_state_dict)."""

    def __init__(self, pairs: list[Pair], seq_len: int, rows: int, micro_batch: int, seed: int,
                 rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu"):  # fmt: skip
        if micro_batch % 2:
            raise EmberError(
                f"train.micro_batch={micro_batch}: pairs need an even one (a chosen and a rejected row each)"
            )
        super().__init__(pairs, seq_len, rows, seed, False, rank, world_size, device)
        self.micro_batch = micro_batch

    def next_batch(self) -> tuple[Tensor, Tensor]:
        pairs, half = [self._take() for _ in range(self.rows // 2)], self.micro_batch // 2
        blocks = [pair_rows(pairs[i : i + half], self.seq_len) for i in range(0, len(pairs), half)]
        mine = slice(self.rank * self.rows // self.world_size, (self.rank + 1) * self.rows // self.world_size)
        return tuple(torch.cat(t)[mine].to(self.device) for t in zip(*blocks, strict=True))


def pair_rows(pairs: list[Pair], seq_len: int) -> tuple[Tensor, Tensor]:
    """(x, y), (2 × pairs, seq_len): rows [chosen..., rejected...], prompt + reply right-padded, the
    reply's tokens the trained targets."""
    ids = torch.zeros(2 * len(pairs), seq_len + 1, dtype=torch.long)
    trained = torch.zeros_like(ids, dtype=torch.bool)
    for p, (prompt, *replies) in enumerate(pairs):
        for side, reply in enumerate(replies):
            r, sequence = side * len(pairs) + p, prompt + reply
            ids[r, : len(sequence)] = torch.tensor(sequence)
            trained[r, len(prompt) : len(sequence)] = True
    return ids[:, :-1], torch.where(trained[:, 1:], ids[:, 1:], IGNORE)


# ---------------------------------------------------------------- the loss


def token_logps(model, x: Tensor, y: Tensor, temperature: float = 1.0, share: bool = False) -> Tensor:
    """(rows, T): the log-probability of each trained target ``y[b, t]`` under ``model``'s logits
    divided by ``temperature``, 0 where ``y`` is IGNORE. The head runs on the trained positions
    only (``keep``). ``share``: rows whose untrained prefix is the same (a GRPO group) run it once
    (``shared_prefix_logits``), where the model allows."""
    keep = y != IGNORE
    logits = shared_prefix_logits(model, x, keep) if share else None
    logits = model(x, keep=keep).float() if logits is None else logits
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(1, y[keep][:, None])[:, 0]
    return torch.zeros(y.shape, dtype=logp.dtype, device=x.device).masked_scatter(keep, logp)


def shared_prefix_logits(model, x: Tensor, keep: Tensor) -> Tensor | None:
    """The logits ``model(x, keep=keep)`` gives, (N, vocab), with each distinct prefix before a
    row's first kept position run once: G completions of one prompt then cost one prompt's
    forward and backward, not G. The prefixes go through the model left-padded into a
    ``KVCache`` (ember/infer/engine.py), whose rows are then copied out to every row that shares
    them, and the rest of each row (from its last prefix token on) continues from its copy, in
    training mode, with gradients flowing back through the copies into the one prefix pass. Equal
    to the plain forward up to float rounding (tests/test_grpo.py). None where it does not apply:
    no prefix repeats; a row trains from its first position; a module other than a plain ``GPT``
    (DDP, compiled, pipelined) or dropout while training, which the cache path does not apply.
    (DESIGN allows the model its cache argument "for inference"; this is the one training use:
    the same contract, and autograd runs through the cache's buffers.)"""
    if type(model) is not GPT or (model.training and model.cfg.dropout) or not keep.any(1).all():
        return None
    first = keep.int().argmax(1)  # each row's first kept position: its prefix is x[r, :first]
    if first.min() == 0:
        return None
    prefixes = [row[:f] for row, f in zip(x.tolist(), first.tolist(), strict=True)]
    prefix, pad, inverse = distinct_left_padded(prefixes, 0, x.device)  # the mask hides the pads
    if len(pad) == len(prefixes):
        return None
    width = prefix.size(1)
    last = x.size(1) - 1 - keep.flip(1).int().argmax(1)  # each row's last kept position
    span = int((last - first).max()) + 1
    at = first[:, None] + torch.arange(span, device=x.device)  # (rows, span): the rest of each row
    inside = at < x.size(1)
    at = at.clamp(max=x.size(1) - 1)
    cache = KVCache(width + span, pad, x.device)
    model(prefix, cache=cache, keep=torch.zeros_like(prefix, dtype=torch.bool))  # keys and values only
    cache.select(torch.tensor(inverse, device=x.device))
    return model(x.gather(1, at), cache=cache, keep=keep.gather(1, at) & inside).float()


def sequence_logps(model, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: the summed log-probability of its trained targets, and how many there are."""
    return token_logps(model, x, y).sum(1), (y != IGNORE).sum(1)


def dpo_loss(
    logps: Tensor,
    ref_logps: Tensor,
    lengths: Tensor,
    beta: float,
    loss: str = "sigmoid",
    smoothing: float = 0.0,
    sft_weight: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss (mean over pairs) and TRL's metrics from per-row summed log-probabilities of the
    policy and the reference, rows [chosen..., rejected...] (see the module docstring), plus
    ``sft_weight`` times the chosen replies' negative log-likelihood per token."""
    chosen, rejected = logps.chunk(2)
    ratios = logps - ref_logps
    chosen_ratio, rejected_ratio = ratios.chunk(2)
    h = chosen_ratio - rejected_ratio
    if loss == "sigmoid":
        per_pair = -F.logsigmoid(beta * h)
    elif loss == "robust":
        per_pair = (-(1 - smoothing) * F.logsigmoid(beta * h) + smoothing * F.logsigmoid(-beta * h)) / (
            1 - 2 * smoothing
        )
    elif loss == "ipo":
        chosen_len, rejected_len = lengths.clamp(min=1).to(ratios.dtype).chunk(2)
        per_pair = (chosen_ratio / chosen_len - rejected_ratio / rejected_len - 1 / (2 * beta)) ** 2
    else:
        raise EmberError(f"dpo.loss={loss!r}: choose one of {', '.join(LOSSES)}")
    chosen_reward, rejected_reward = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    metrics = {
        "rewards/chosen": chosen_reward.mean(),
        "rewards/rejected": rejected_reward.mean(),
        "rewards/margins": (chosen_reward - rejected_reward).mean(),
        "rewards/accuracies": (chosen_reward > rejected_reward).float().mean(),
        "logps/chosen": chosen.detach().mean(),
        "logps/rejected": rejected.detach().mean(),
    }
    total = per_pair.mean()
    if sft_weight:
        total = total - sft_weight * chosen.sum() / lengths.chunk(2)[0].sum().clamp(min=1)
    return total, metrics


class DPOTask(SFTTask):
    """The trainer's task for ``train.task=dpo``: ``loss`` on a micro-batch of pairs against
    ``reference(x, y)`` (per-token log-probabilities of the frozen copy, or of the model with its
    adapters off), and SFT's task accuracy on held-out problems at each evaluation."""

    name = "dpo"
    rows_per_example = 2  # a chosen and a rejected row
    reference_on_resume = True
    shards_params = False

    @classmethod
    def prepare(cls, trainer, model) -> None:
        trainer.frozen = frozen_copy(model) if trainer.adapters is None else None

    @classmethod
    def build(cls, trainer, model):
        pairs, _ = preference_pairs(trainer, model)
        task = cls(trainer.cfg.dpo, trainer.tokenizer, reference_policy(trainer, model))
        return task, pair_loader(trainer, pairs), None

    def __init__(self, dpo_cfg, tokenizer, reference: Callable[[Tensor, Tensor], Tensor]):
        super().__init__(False, tokenizer, dpo_cfg.data, dpo_cfg.eval_problems)
        self.beta, self.kind, self.smoothing = dpo_cfg.beta, dpo_cfg.loss, dpo_cfg.label_smoothing
        self.sft_weight = dpo_cfg.sft_weight
        self.reference = reference

    def loss(self, model, batch) -> tuple[Tensor, dict]:
        x, y = batch
        with torch.no_grad():  # first: no forward of the policy waits for its backward meanwhile
            ref_logps = self.reference(x, y).sum(1)
        logps, lengths = sequence_logps(model, x, y)
        return dpo_loss(logps, ref_logps, lengths, self.beta, self.kind, self.smoothing, self.sft_weight)


# ------------------------------------------------------------------ what the trainer builds


def frozen_copy(model):
    """The reference of DPO and GRPO without LoRA: the starting weights, frozen, in eval mode."""
    return copy.deepcopy(model).requires_grad_(False).eval()


def reference_policy(trainer, model, temperature: float = 1.0, share: bool = False):
    """The reference policy of DPO and GRPO: ``(x, y) ->`` per-token log-probabilities of the
    trained targets (``token_logps``, with ``share`` its shared prefixes), from the model with
    its adapters off (LoRA: no second copy) or from the frozen starting weights
    (``trainer.frozen``); in eval mode (no dropout) either way."""
    if trainer.frozen is not None:
        frozen = trainer.frozen
        return lambda x, y: token_logps(frozen, x, y, temperature, share)

    def reference(x, y):
        was_training = model.training
        model.eval()
        try:
            with adapters_disabled(model):
                return token_logps(model, x, y, temperature, share)
        finally:
            model.train(was_training)

    return reference


def preference_pairs(trainer, policy) -> tuple[list[Pair], Callable]:
    """The run's encoded pairs (``dpo.*``), and ``answer(task, problems)``: the greedy replies
    of ``policy`` (DPO: the model about to train), or of ``train.init_from``'s run, loaded
    once (a reward model), that ``dpo.rejected=model`` rejects."""
    cfg, t = trainer.cfg, trainer.cfg.train
    policies = [policy] if policy is not None else []

    def answer(task, problems):
        if not policies and not t.init_from:
            raise ConfigError("train.task=rm with dpo.rejected=model needs train.init_from: the run whose wrong answers are rejected")  # fmt: skip # noqa: E501
        policies[:] = policies or [load_run(t.init_from)[0]]
        return starting_answers(policies[0], trainer.tokenizer, task, problems)

    pairs = encode_pairs(trainer.tokenizer, load_pairs(cfg.dpo, cfg.run.seed, answer), t.seq_len)
    return pairs, answer


def pair_loader(trainer, pairs: list[Pair]) -> PairLoader:
    cfg, env, t = trainer.cfg, trainer.env, trainer.cfg.train
    print0(f"{t.task}: {len(pairs):,} preference pairs from {cfg.dpo.data}")
    where = (env.dp_rank, env.dp_size, env.device)
    return PairLoader(pairs, t.seq_len, trainer.global_rows, t.micro_batch, cfg.run.seed, *where)


def starting_answers(model, tokenizer, task, problems) -> list[str]:
    """The starting model's greedy replies to ``problems`` (``dpo.rejected=model``): before any
    step, and on resume before the checkpoint loads, so the same pairs either way. Special
    tokens it emitted are left out (a reply is text, where they would be plain characters)."""
    print0(f"dpo: the starting model answers {len(problems):,} {task.name} problems (greedy) for the pairs")
    was_training = model.training
    try:
        engine = Engine(model.eval(), tokenizer)
        longest = max(len(tokenizer.encode(p.answer)) for p in problems) + 8  # a wrong reply as long
        outputs = answer_problems(engine, task, problems, max_new_tokens=longest, batch=64)
        replies = [reply_of(text) for _, text, _ in outputs]
        for added in tokenizer.hf.get_added_tokens_decoder().values():  # text cannot hold
            replies = [r.replace(added.content, "") for r in replies]  # the control tokens it emitted
        return replies
    finally:
        model.train(was_training)
