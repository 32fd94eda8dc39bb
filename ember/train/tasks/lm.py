"""Next-token prediction on the prepared shards: ``train.task=lm``, the pretraining task.

    loss, _ = LMTask(z_loss=1e-4, token_bytes=token_bytes).loss(model, (x, y))

Cross-entropy on shifted windows, with the optional z-loss of PaLM (§5): ``z · logsumexp²``
keeps the softmax normaliser near one. The batch at step ``s`` is a pure function of
``(run.seed, s)`` (``ember.data.loader.TrainLoader``); validation scores fixed windows of the
``val`` split with the formula ``ember eval`` uses (``language_metrics``), in bits per UTF-8
byte of the text as well as nats per token, so runs with different tokenizers compare.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.data.loader import TokenDataset, TrainLoader, ValLoader
from ember.data.manifest import read_manifest
from ember.errors import DataError
from ember.infer.evaluate import language_metrics
from ember.model.moe import moe_loss
from ember.parallel.dist import all_reduce, print0
from ember.parallel.parallelize import unwrap
from ember.train.task import Task

EVAL_BYTES = 2**30  # the fp32 logits an evaluation makes at a time (a few rows of a batch)


class LMTask(Task):
    """``token_bytes[i]`` is the number of UTF-8 bytes token ``i`` stands for, so bits per byte
    counts the bytes of the evaluated text exactly, whatever the tokenizer."""

    name = "lm"
    splits_model = True

    moe = False  # model.mlp=moe: add the routers' losses (decided once, in build)
    whole_graph = True

    def __init__(self, z_loss: float, token_bytes: torch.Tensor, fused: bool = False, softcap: float = 0.0):
        self.z_loss = z_loss
        self.token_bytes = token_bytes
        self.fused, self.softcap = fused, softcap  # train.kernels=triton: ember.kernels.cross_entropy

    @classmethod
    def build(cls, trainer, model):
        cfg, env = trainer.cfg, trainer.env
        token_bytes = torch.tensor(trainer.tokenizer.token_byte_lengths(trainer.model_cfg.vocab_size))
        fused = cfg.train.kernels == "triton"
        task = cls(cfg.train.z_loss, token_bytes.to(env.device), fused, trainer.model_cfg.logit_softcap)
        task.moe = trainer.model_cfg.mlp == "moe"
        return task, train_windows(trainer), val_loader(cfg, env)

    def loss(self, model, batch) -> tuple[torch.Tensor, dict]:
        x, y = batch
        if self.fused:  # the head and the loss in chunks of rows: no (B, T, V) logits
            from ember.kernels.cross_entropy import linear_cross_entropy

            h = model(x, hidden=True)  # (B, T, C)
            head = unwrap(model).output.weight  # (V, C)
            aux, info = moe_loss(model) if self.moe else (0.0, {})  # the routers' losses, per-layer metrics
            return linear_cross_entropy(h, head, y, z_loss=self.z_loss, softcap=self.softcap) + aux, info
        logits = model(x).float()  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        if self.z_loss:
            loss = loss + self.z_loss * torch.logsumexp(logits, dim=-1).pow(2).mean()
        aux, info = moe_loss(model) if self.moe else (0.0, {})
        return loss + aux, info

    def validate(self, trainer) -> dict:
        if trainer.val_loader is None:
            return {}
        result = self.evaluate(trainer.model, trainer.val_loader, trainer.autocast)
        print0(
            f"step {trainer.step:6d} | val loss {result['val_loss']:.4f} | ppl {result['val_ppl']:.2f} | "
            f"bpb {result['val_bpb']:.4f}"
        )
        return result

    @torch.no_grad()
    def evaluate(self, model, val_loader, autocast) -> dict:
        token_bytes = self.token_bytes
        device = token_bytes.device
        sums = torch.zeros(4, dtype=torch.float64, device=device)  # nats, tokens, nats on text, bytes
        was_training = model.training
        model.eval()
        for x, y in val_loader:
            with autocast:
                logits = model(x)
            if logits is None:  # a pipeline rank without the last stage
                continue
            if hasattr(logits, "full_tensor"):  # split by vocabulary (parallel.loss_parallel): gathered
                logits = logits.full_tensor()
            # a few rows at a time in fp32: at gpt2-small's 64 rows the whole batch's fp32 logits and
            # log-probabilities would be 26 GB on top of the training step's memory
            rows = max(1, EVAL_BYTES // (4 * logits[0].numel()))
            nats_per_token = torch.cat([
                F.cross_entropy(part.float().flatten(0, 1), target.reshape(-1), reduction="none")
                for part, target in zip(logits.split(rows), y.split(rows), strict=True)
            ])  # fmt: skip
            text = token_bytes[y.reshape(-1)] > 0  # <|eos|> and friends stand for no bytes of text
            nats = nats_per_token.sum()
            sums += torch.stack(
                [
                    nats.double(),
                    torch.tensor(y.numel(), device=device, dtype=torch.float64),
                    nats_per_token.where(text, 0.0).sum().double(),
                    token_bytes[y].sum().double(),
                ]
            )
        model.train(was_training)
        all_reduce(sums)
        return {f"val_{k}": v for k, v in language_metrics(*sums.tolist()).items()}


def train_windows(trainer) -> TrainLoader:
    """The train split's windows for this rank (the LM task's batches; MLM masks them)."""
    cfg, env = trainer.cfg, trainer.env
    dataset = TokenDataset(cfg.data.dir, "train")
    return TrainLoader(dataset, cfg.train.seq_len, trainer.global_rows, cfg.run.seed, env.dp_rank,
                       env.dp_size, mode=cfg.data.sampling, device=env.device)  # fmt: skip


def val_loader(cfg, env) -> ValLoader | None:
    """Fixed validation windows, the same count on every rank (FSDP forwards are collective);
    None, with a note, when the val split is empty or shorter than one window."""
    t = cfg.train
    if not read_manifest(cfg.data.dir)["splits"]["val"]["shards"]:
        print0("ember: note: the data has no validation split (data.val_fraction=0): no evaluation")
        return None
    val_set = TokenDataset(cfg.data.dir, "val")
    try:
        probe = ValLoader(val_set, t.seq_len, t.micro_batch, max_windows=t.eval_windows)
    except DataError as e:
        print0(f"ember: note: no evaluation: {e}")
        return None
    usable = probe.n_windows_total // env.dp_size * env.dp_size
    if not usable:
        print0("ember: note: fewer validation windows than ranks: no evaluation")
        return None
    return ValLoader(
        val_set,
        t.seq_len,
        t.micro_batch,
        max_windows=usable,
        rank=env.dp_rank,
        world_size=env.dp_size,
        device=env.device,
    )
