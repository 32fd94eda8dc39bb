"""Image classification on ember's trainer: ``train.task=classify``, the seeds' first weeks.

    ember train digits                                   # a CNN on scikit-learn's 8×8 digits
    ember train digits model.kind=vit train.optimizer=sgd train.lr=0.05

The model is an MLP, a CNN or a small ViT (``model.kind``: ember/model/vision.py); the data is
an image source (``data.sources: [embedded:digits]``, ``mnist:DIR``, ``cifar10:DIR``,
``imagefolder:DIR``: ember/data/images.py) split once into fixed train/val/test sets. A
"token" of the loop is an image: ``train.seq_len`` is 1 and ``train.batch_tokens`` the images
per step, so accumulation, data parallel, precision, compile, checkpoints and exact resume are
the language model's own code. The per-channel mean and standard deviation of the training
images are set into the model's normalisation buffers before training (``prepare``), so they
travel with its weights. The loss is the mean cross-entropy of a micro-batch; the validation
reports loss, accuracy and error (1 - accuracy), and the best model is the one of lowest
validation error (``train.keep_best``). ``ember eval RUN --split test`` scores the same way
(ember/infer/classify.py), with a 95% interval and the confusion matrix.

BatchNorm (``model.norm=batchnorm``) normalises by the statistics of each micro-batch on each
rank: unlike every other layer it makes accumulation and data parallel differ from one large
batch (Ioffe & Szegedy 2015; torch's SyncBatchNorm runs on CUDA only). The parity tests use
``model.norm=layernorm`` or ``none``.
"""

from __future__ import annotations

from dataclasses import replace

import torch.nn.functional as F

from ember.data.images import ImageLoader, load_images
from ember.errors import ConfigError
from ember.infer.classify import classify
from ember.parallel.dist import print0
from ember.train.task import Task


def images_of(cfg):
    """The run's image splits (memoised by ``load_images``)."""
    if len(cfg.data.sources) != 1:
        raise ConfigError(
            f"train.task=classify reads one image source; data.sources has {len(cfg.data.sources)}"
        )
    return load_images(cfg.data.sources[0], cfg.data.val_fraction, cfg.data.test_fraction)


class ClassifyTask(Task):
    name = "classify"
    tokens = False
    best = "val_error"
    whole_graph = True

    def __init__(self, val: tuple):
        self.val = val

    @classmethod
    def check_layout(cls, cfg, world_size: int, dp: int) -> None:
        t = cfg.train
        if cfg.parallel.tp > 1 or cfg.parallel.pp > 1:
            raise ConfigError("train.task=classify runs on one device or data parallel (DDP, FSDP2): set parallel.tp=1 and parallel.pp=1")  # fmt: skip # noqa: E501
        if cfg.model.kind == "gpt":
            raise ConfigError(
                "train.task=classify trains an image classifier: set model.kind=mlp, cnn or vit"
            )
        if t.seq_len != 1:
            raise ConfigError(f"train.task=classify counts images: set train.seq_len=1 (not {t.seq_len}) and train.batch_tokens to the images per step (configs/digits.yaml)")  # fmt: skip # noqa: E501
        refused = ((t.kernels == "triton", "train.kernels=triton"), (t.qat != "none", "train.qat"),
                   (t.lora_rank, "train.lora_rank"), (t.precision.startswith("fp8"), "float8"),
                   (t.init_from, "train.init_from"), (t.log_dynamics, "train.log_dynamics"))  # fmt: skip
        for on, what in refused:
            if on:
                raise ConfigError(f"train.task=classify does not take {what}: those are the language model's")

    @classmethod
    def start(cls, trainer):
        data, m = images_of(trainer.cfg), trainer.cfg.model
        for key, ours, theirs in (
            ("classes", m.classes, data.n_classes),
            ("image", m.image, list(data.shape)),
        ):
            if ours and ours != theirs:
                raise ConfigError(f"model.{key}={ours} but {data.source} has {theirs}; set model.{key}={theirs} or leave it out")  # fmt: skip # noqa: E501
        return replace(m, classes=data.n_classes, image=list(data.shape)), None

    @classmethod
    def prepare(cls, trainer, model) -> None:
        data = images_of(trainer.cfg)
        model.set_normalization(data.mean, data.std)
        stats = ", ".join(f"{m:.4f} ± {s:.4f}" for m, s in zip(data.mean, data.std, strict=True))
        print0(
            f"{data.source}: {len(data.train[0]):,} train / {len(data.val[0]):,} val / "
            f"{len(data.test[0]):,} test "
            f"images of {'×'.join(map(str, data.shape))}, {data.n_classes} classes; per-channel mean ± std "
            f"(train): {stats}"
        )

    @classmethod
    def build(cls, trainer, model):
        cfg, env, data = trainer.cfg, trainer.env, images_of(trainer.cfg)
        seed, augment = cfg.run.seed, cfg.data.augment
        loader = ImageLoader(*data.train, trainer.global_rows, seed, env.dp_rank, env.dp_size, augment, data.natural, env.device)  # fmt: skip # noqa: E501
        return cls(data.val), loader, data.val

    def loss(self, model, batch):
        x, y = batch
        logits = model(x).float()
        return F.cross_entropy(logits, y), {"train_accuracy": (logits.argmax(-1) == y).float().mean()}

    def validate(self, trainer) -> dict:
        """Every rank scores all validation images (a few thousand at most): under FSDP2 each
        forward is collective, so all ranks run the same batches; no reduction is needed."""
        r = classify(trainer.model, *self.val, autocast=trainer.autocast)
        lo, hi = r["accuracy_ci95"]
        print0(
            f"step {trainer.step:6d} | val loss {r['loss']:.4f} | accuracy {r['accuracy']:.2%} "
            f"({lo:.1%}–{hi:.1%})"
        )
        return {"val_loss": r["loss"], "val_accuracy": r["accuracy"], "val_error": r["error"]}
