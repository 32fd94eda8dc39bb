"""Masked language modelling on the prepared shards: ``train.task=mlm``, BERT's pretraining task.

    ember train tiny run.name=mlm train.task=mlm model.causal=false model.head=mlm \\
        model.norm_position=post model.gelu=erf model.pos=learned model.norm=layernorm model.mlp=gelu

Each row is a window of ``train.seq_len`` tokens from the same loader as ``train.task=lm``; about
``train.mlm_mask`` of its text tokens are chosen and corrupted 80/10/10 (ember/data/masking.py),
and the loss is the cross-entropy at the chosen positions only, averaged over them. The model's
head runs at those positions alone (``model(x, keep=...)``), 15% of the LM's head work. The
corruption of step ``s`` on rank ``r`` is drawn from ``seeded(run.seed, s, r)``, so a batch is
still a pure function of (seed, step, rank) and resume is bitwise.

Validation corrupts the fixed validation windows with fixed seeds and reports the masked tokens'
loss, accuracy and bits per byte (their nats over their UTF-8 bytes), with the formula ``ember
eval`` uses (``ember.infer.evaluate.masked_sums``). The model must be bidirectional
(``model.causal=false``): the config refuses anything else (ember/config.py says why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.data.loader import TrainLoader
from ember.data.masking import IGNORE, mask_id, mask_tokens, seeded
from ember.infer.evaluate import masked_metrics, masked_sums
from ember.parallel.dist import all_reduce, print0
from ember.train.task import Task
from ember.train.tasks.lm import train_windows, val_loader


class MLMLoader:
    """The LM task's training windows, corrupted: ``iterate(step)`` yields (step, inputs, targets),
    each (rows, seq_len); targets are ``IGNORE`` where nothing is predicted."""

    def __init__(
        self, windows: TrainLoader, rate: float, mask: int, text: torch.Tensor, seed: int, rank: int
    ):  # noqa: E501
        self.windows, self.rate, self.mask, self.text = windows, rate, mask, text
        self.seed, self.rank = seed, rank

    def iterate(self, start_step: int = 0):
        for step, x, _ in self.windows.iterate(start_step):  # the next-token targets are not used
            yield (step, *mask_tokens(x, seeded(self.seed, step, self.rank), self.rate, self.mask, self.text))

    def close(self) -> None:
        self.windows.close()


class MLMTask(Task):
    """``text[i]``: whether id ``i`` stands for text (may be masked); ``token_bytes[i]`` its UTF-8
    bytes, for bits per byte."""

    name = "mlm"

    def __init__(self, rate: float, mask: int, token_bytes: torch.Tensor, seed: int):
        self.rate, self.mask, self.seed = rate, mask, seed
        self.token_bytes, self.text = token_bytes, token_bytes > 0

    @classmethod
    def build(cls, trainer, model):
        cfg, env = trainer.cfg, trainer.env
        token_bytes = torch.tensor(trainer.tokenizer.token_byte_lengths(trainer.model_cfg.vocab_size))
        task = cls(cfg.train.mlm_mask, mask_id(trainer.tokenizer), token_bytes.to(env.device), cfg.run.seed)
        loader = MLMLoader(train_windows(trainer), task.rate, task.mask, task.text, cfg.run.seed, env.dp_rank)
        return task, loader, val_loader(cfg, env)

    def loss(self, model, batch) -> tuple[torch.Tensor, dict]:
        inputs, targets = batch
        keep = targets != IGNORE  # (B, T): the chosen positions
        logits = model(inputs, keep=keep).float()  # (N, V): the head runs only there
        target = targets[keep]  # (N,)
        count = keep.sum().clamp(min=1)  # a micro-batch with none chosen gives loss 0, not NaN
        loss = F.cross_entropy(logits, target, reduction="sum") / count
        return loss, {"mlm_accuracy": (logits.argmax(-1) == target).sum() / count}

    def validate(self, trainer) -> dict:
        if trainer.val_loader is None:
            return {}
        model, sums = trainer.model, torch.zeros(4, dtype=torch.float64, device=self.token_bytes.device)
        was_training = model.training
        model.eval()
        for i, (x, _) in enumerate(trainer.val_loader):  # the same masks at every evaluation
            with trainer.autocast:
                generator = seeded(self.seed, i, trainer.env.dp_rank, "eval")
                sums += masked_sums(model, x, generator, self.rate, self.mask, self.token_bytes)
        model.train(was_training)
        all_reduce(sums)
        result = {f"val_{k}": v for k, v in masked_metrics(*sums.tolist()).items()}
        print0(
            f"step {trainer.step:6d} | val masked loss {result['val_loss']:.4f} | accuracy "
            f"{result['val_masked_accuracy']:.2%} | bpb {result['val_bpb']:.4f}"
        )
        return result
