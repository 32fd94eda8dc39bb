"""What a training task is: the one small interface between ``Trainer`` and what it trains.

    class MyTask(Task):                      # ember/train/tasks/my.py
        name = "my"                          # train.task=my
        @classmethod
        def build(cls, trainer, model): return cls(), MyLoader(...), None
        def loss(self, model, batch): return loss, {"my_metric": value}

    # and one registry line in ember/train/tasks/__init__.py: TASKS = {..., MyTask}

The loop (``ember.train.trainer``) is written once and has no task branches: it asks the task,
by ``train.task``'s name in the registry (``ember.train.tasks.task_class``), for its layout
constraints (``check_layout``, before torchrun starts any rank), for its tokenizer and
resolved model config (``start``: a language task's from the data dir or the starting run; an
image task has no tokenizer and fills the classes and image shape from its data), to adjust the single-device
model before the layout is applied (``prepare``: a frozen reference copy, rows that train), for
its data (``build``: the task object, a loader whose ``iterate(step)`` yields batches, and an
optional validation loader), for the loss of each micro-batch (``loss``) and for its evaluation
at every ``train.eval_every`` (``validate``). What the trainer keeps of the model's start
(tokenizer, weights, LoRA) the class attributes say.
"""

from __future__ import annotations

from torch import Tensor

from ember.data.tokenizer import file_sha256
from ember.train.start import resolve_model_config, start_tokenizer


class Task:
    """The interface; each method's default is what a plain task needs."""

    name = ""  # the value of train.task that picks it
    chat = False  # trains on conversations: the starting run's tokenizer (chat tokens added), no shards
    reference_on_resume = False  # train.init_from is loaded on resume too: the reference is those weights
    splits_model = False  # may run under parallel.tp and parallel.pp
    shards_params = True  # may run under FSDP2 (a reference copy or rollouts want whole weights)
    tokens = True  # a language task: a tokenizer, and train.batch_tokens counts tokens (else images)
    best = "val_loss"  # the validation metric, lower better, that picks the best model (train.keep_best)
    whole_graph = False  # loss() traces to one graph (fixed shapes, no host reads): train.compile_scope=model
    rows_per_example = 1  # a micro-batch holds whole examples of this many rows (a preference pair: 2)

    @classmethod
    def check_layout(cls, cfg, world_size: int, dp: int) -> None:
        """A ConfigError for a layout this task cannot run on (``world_size`` ranks, ``dp`` of
        them data-parallel); called by ``ember.train.layout.check_layout``."""

    @classmethod
    def start(cls, trainer):
        """Set the run's tokenizer (``trainer.tokenizer``, the file it is copied from or None when
        saved from memory, its sha256) and return (the resolved model config, the tokenizer's size
        before chat tokens were appended to it, or None)."""
        trainer.tokenizer, trainer.tokenizer_file, known = start_tokenizer(trainer.cfg, cls.chat)
        file = trainer.tokenizer_file
        trainer.tokenizer_sha = file_sha256(file) if file else trainer.tokenizer.sha256
        return resolve_model_config(trainer.cfg.model, trainer.tokenizer, grown=known is not None), known

    @classmethod
    def prepare(cls, trainer, model) -> None:
        """The single-device model on its device, before the layout is applied."""

    @classmethod
    def build(cls, trainer, model) -> tuple[Task, object, object | None]:
        """(the task, the training loader, the validation loader or None), after the layout;
        ``model`` is the module inside any wrapper."""
        raise NotImplementedError

    def loss(self, model, batch) -> tuple[Tensor, dict]:
        """The micro-batch's loss and the task's own metrics (tensors are averaged over the step)."""
        raise NotImplementedError

    def validate(self, trainer) -> dict:
        """The evaluation at ``train.eval_every`` and at the end: printed here, recorded by the
        trainer; a ``val_loss`` in it picks the best model (``train.keep_best``)."""
        return {}
