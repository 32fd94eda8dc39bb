"""Supervised fine-tuning: conversations in the chat format, a loss on the assistant's tokens
only, and rows packed without attention crossing between conversations.

    examples = encode_conversations(tokenizer, conversations, seq_len)   # (ids, trained) pairs
    loader = SFTLoader(examples, seq_len, rows=16, seed=0, packing=True)
    x, y, doc = loader.next_batch()                                       # (rows, seq_len) each
    loss, _ = SFTTask().loss(model, (x, y, doc))

**Targets.** ``y[t]`` is the id at ``t + 1`` when that token is trained (assistant content and
its end-of-turn) and -100 otherwise: TRL's completion-only loss, averaged over the trained
tokens of the micro-batch.

**Packing** (``sft.packing=true``) fills each row with whole conversations, the rest padding
(ids 0, targets -100); the model gets a ``PackedDocuments`` where an inference cache would go,
restarting positions per conversation under a block-diagonal causal mask, so a conversation's
logits are those it would get alone (tested to 1e-5). A conversation longer than a row is cut
to its first ``seq_len + 1`` tokens (counted and printed).

**Order.** Epoch ``e`` is the permutation drawn from ``(seed, e)``; the loader's (epoch,
position) is saved in every checkpoint, so a resumed run takes the same batches bit for bit
(DESIGN rule 3). Every rank builds the same global batch and keeps its own rows. docs/sft.md has
the loss, the measured speed-up of ``keep=`` and the demonstration.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ember.data.chat import chat_ids, render
from ember.data.tasks import TASKS, load_jsonl
from ember.errors import EmberError
from ember.infer.engine import Engine
from ember.infer.evaluate import answer_problems
from ember.model.gpt import sdpa_attention
from ember.model.moe import moe_loss
from ember.parallel.dist import print0
from ember.parallel.parallelize import unwrap
from ember.train.task import Task

IGNORE = -100  # cross_entropy's ignore_index: a token no loss is taken on

Example = tuple[list[int], list[bool]]  # ids and, per id, whether it is a trained target


class PackedDocuments:
    """The model's ``KVCache`` protocol used for training: nothing is stored; ``extend`` gives
    each token its position within its own conversation and ``attend`` lets a query see only
    earlier keys of the same conversation. ``doc`` (B, T): the conversation index of each
    token, non-decreasing along a row."""

    def __init__(self, doc: Tensor, dropout: float = 0.0):
        self.doc, self.dropout = doc, dropout

    def extend(self, T: int) -> Tensor:
        index = torch.arange(T, device=self.doc.device).expand_as(self.doc)
        first = torch.ones_like(self.doc, dtype=torch.bool)
        first[:, 1:] = self.doc[:, 1:] != self.doc[:, :-1]
        starts = torch.where(first, index, 0).cummax(dim=1).values  # where each token's document began
        self.mask = (self.doc[:, :, None] == self.doc[:, None, :]).tril()[:, None]  # (B, 1, T, T)
        return index - starts  # (B, T)

    def attend(self, layer: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return sdpa_attention(q, k, v, self.dropout, self.mask)


def data_task(spec: str, key: str = "sft.data"):
    """The embedded task ``spec`` (the value of config ``key``) names, or None for a JSONL file;
    an EmberError otherwise."""
    if not spec:
        task = key.split(".")[0]
        raise EmberError(f"train.task={task} needs {key}: an embedded task name or a JSONL file")
    if spec.endswith(".jsonl"):
        return None
    if spec not in TASKS:
        raise EmberError(
            f"{key}={spec!r} is neither a .jsonl file nor an embedded task; tasks: {', '.join(TASKS)}"
        )
    return TASKS[spec]


def load_conversations(sft_cfg) -> list[list[dict]]:
    """``sft.data``'s conversations: a JSONL file's rows, or ``sft.examples`` problems of an
    embedded task's train split (ember/data/tasks.py), each as [user, assistant] messages."""
    task = data_task(sft_cfg.data)
    if task is None:
        return load_jsonl(sft_cfg.data)
    return [problem.messages() for problem in task.generate("train", sft_cfg.examples)]


def encode_conversations(tokenizer, conversations: list[list[dict]], seq_len: int) -> list[Example]:
    """Each conversation rendered in the chat format (``render``), cut to ``seq_len + 1`` tokens;
    conversations with no trained token left are dropped. Prints how many were cut or dropped."""
    examples, cut, dropped = [], 0, 0
    for messages in conversations:
        ids, trained = render(tokenizer, messages)
        if len(ids) > seq_len + 1:
            ids, trained, cut = ids[: seq_len + 1], trained[: seq_len + 1], cut + 1
        if not any(trained[1:]):
            dropped += 1
            continue
        examples.append((ids, trained))
    if not examples:
        raise EmberError(
            f"no conversation has an assistant token within train.seq_len + 1 = {seq_len + 1} tokens; "
            "raise train.seq_len or shorten the prompts"
        )
    if cut or dropped:
        print(f"sft: {cut} conversations cut to {seq_len + 1} tokens, {dropped} dropped (nothing to train)")
    return examples


class SFTLoader:
    """Batches of (x, y, doc), each (rows on this rank, seq_len), from ``examples`` in seeded
    epoch order; ``state_dict``/``load_state_dict`` carry the position (see the module docstring)."""

    def __init__(
        self,
        examples: list[Example],
        seq_len: int,
        rows: int,
        seed: int,
        packing: bool = True,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
    ):
        if rows % world_size:
            raise EmberError(f"{rows} rows per step do not split over {world_size} ranks")
        self.examples, self.seq_len, self.rows, self.seed = examples, seq_len, rows, seed
        self.packing, self.rank, self.world_size, self.device = packing, rank, world_size, device
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.examples), generator=generator).tolist()

    def _take(self) -> Example:
        if self.position == len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        example = self.examples[self._order[self.position]]
        self.position += 1
        return example

    def _peek_length(self) -> int:
        if self.position == len(self._order):
            return len(self.examples[self._permutation(self.epoch + 1)[0]][0])
        return len(self.examples[self._order[self.position]][0])

    def next_batch(self) -> tuple[Tensor, Tensor, Tensor]:
        width = self.seq_len + 1  # inputs and the targets shifted by one
        ids = torch.zeros(self.rows, width, dtype=torch.long)
        trained = torch.zeros(self.rows, width, dtype=torch.bool)
        doc = torch.zeros(self.rows, width, dtype=torch.long)
        for r in range(self.rows):
            used, n = 0, 0
            while n == 0 or (self.packing and used + self._peek_length() <= width):
                example_ids, example_trained = self._take()
                end = used + len(example_ids)
                ids[r, used:end] = torch.tensor(example_ids)
                trained[r, used:end] = torch.tensor(example_trained)
                doc[r, used:end] = n
                used, n = end, n + 1
            doc[r, used:] = n  # the padding is a document of its own
        y = torch.where(trained[:, 1:], ids[:, 1:], IGNORE)
        mine = slice(self.rank * self.rows // self.world_size, (self.rank + 1) * self.rows // self.world_size)
        return tuple(t[mine].to(self.device) for t in (ids[:, :-1], y, doc[:, :-1]))

    def iterate(self, step: int):
        """(step, x, y, doc) forever, as the trainer's loop reads batches."""
        while True:
            yield (step, *self.next_batch())
            step += 1

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


class SFTTask(Task):
    """Cross-entropy on the trained tokens of packed (or padded) conversations; evaluated, when
    the data is an embedded task, by accuracy on ``eval_problems`` of its held-out test problems."""

    name = "sft"
    chat = True

    moe = False  # model.mlp=moe (set in build)

    def __init__(self, packing: bool = True, tokenizer=None, task: str = "", eval_problems: int = 0):
        self.packing, self.tokenizer = packing, tokenizer
        self.problems: list = []
        self.task = data_task(task) if task else None
        if self.task is not None and eval_problems:
            self.problems = self.task.generate("test", eval_problems)

    @classmethod
    def prepare(cls, trainer, model) -> None:
        t = trainer.cfg.train
        if t.lora_rank and t.lora_chat_tokens:  # (DPO's reference would move with them)
            trainer.adapters |= train_rows(model, list(chat_ids(trainer.tokenizer).values()))

    @classmethod
    def build(cls, trainer, model):
        cfg, env, t = trainer.cfg, trainer.env, trainer.cfg.train
        task = cls(cfg.sft.packing, trainer.tokenizer, cfg.sft.data, cfg.sft.eval_problems)
        task.moe = trainer.model_cfg.mlp == "moe"  # add the routers' losses
        examples = encode_conversations(trainer.tokenizer, load_conversations(cfg.sft), t.seq_len)
        print0(f"sft: {len(examples):,} conversations from {cfg.sft.data}")
        where = (env.dp_rank, env.dp_size, env.device)
        loader = SFTLoader(examples, t.seq_len, trainer.global_rows, cfg.run.seed, cfg.sft.packing, *where)
        return task, loader, None  # task accuracy on held-out problems: `ember eval RUN --task NAME`

    def validate(self, trainer) -> dict:
        result = self.accuracy(unwrap(trainer.model))
        if "task_accuracy" in result:
            print0(
                f"step {trainer.step:6d} | {self.task.name} accuracy {result['task_accuracy']:.1%} "
                f"on {len(self.problems)} test problems"
            )
        return result

    def accuracy(self, model) -> dict:
        """{"task_accuracy": the share of the test problems answered exactly}, or {} without any."""
        if not self.problems:
            return {}
        was_training = model.training
        outputs = answer_problems(Engine(model, self.tokenizer), self.task, self.problems)
        model.train(was_training)
        return {"task_accuracy": sum(reward == 1.0 for _, _, reward in outputs) / len(outputs)}

    def loss(self, model, batch) -> tuple[Tensor, dict]:
        x, y, doc = batch
        trained = y != IGNORE  # the head runs on these positions only
        cache = PackedDocuments(doc) if self.packing else None
        loss = F.cross_entropy(model(x, cache=cache, keep=trained).float(), y[trained])
        aux, info = moe_loss(model) if self.moe else (0.0, {})  # the routers' losses, per-layer metrics
        return loss + aux, {"trained_tokens": int(trained.sum()), **info}


def train_rows(model, ids: list[int]) -> set[str]:
    """Let only the rows ``ids`` of the embedding and of an untied head train: each table's
    gradient is masked to those rows, and as such tables take the embedding role (no weight
    decay, ``param_role``) AdamW leaves the other rows exactly as they were. The fine-tuning of
    new special tokens that PEFT offers as ``trainable_token_indices``; returns the tables'
    state dict names."""
    names = {"tok_embeddings.weight"}
    if model.output.weight is not model.tok_embeddings.weight:
        names.add("output.weight")
    for name in names:
        weight = model.get_parameter(name)
        mask = torch.zeros(weight.size(0), 1, dtype=weight.dtype, device=weight.device)
        mask[ids] = 1
        weight.requires_grad_(True)
        weight.register_hook(lambda grad, mask=mask: grad * mask.to(grad.device, grad.dtype))
        weight.row_mask = mask  # read by param_role
    count = len(ids) * model.tok_embeddings.weight.size(1) * len(names)
    tables = " and ".join(sorted(names))
    print0(f"and {len(ids)} rows of the {tables} (the chat tokens): {count:,} parameters")
    return names
