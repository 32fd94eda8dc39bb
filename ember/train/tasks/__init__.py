"""The training tasks, registered by name: ``train.task=NAME`` picks one.

    cls = task_class("dpo")          # the class; its interface is ember.train.task.Task

Adding a task is one module in this folder (a ``Task`` subclass with a ``name``) and one entry
in ``TASKS`` below; nothing else in the trainer, the layout check or the CLI changes
(docs/ARCHITECTURE.md shows one, and tests/test_architecture.py trains a toy task).
"""

from __future__ import annotations

from ember.errors import ConfigError
from ember.train.task import Task
from ember.train.tasks.classify import ClassifyTask
from ember.train.tasks.dpo import DPOTask
from ember.train.tasks.grpo import GRPOTask
from ember.train.tasks.lm import LMTask
from ember.train.tasks.mlm import MLMTask
from ember.train.tasks.rm import RMTask
from ember.train.tasks.sft import SFTTask

TASKS: dict[str, type[Task]] = {
    t.name: t for t in (LMTask, SFTTask, DPOTask, GRPOTask, RMTask, MLMTask, ClassifyTask)
}


def task_class(name: str) -> type[Task]:
    """The registered task called ``name``, or a ConfigError that lists them."""
    if name not in TASKS:
        raise ConfigError(f"train.task={name!r} is not a registered task; choose one of {', '.join(TASKS)}")
    return TASKS[name]
