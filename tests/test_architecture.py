"""The map in code: the package's floors, checked import by import with ``ast``.

A module imports only from its own floor or below (function-level imports included), never a
``_private`` name of another module, and no two modules reach each other through a circle of
imports. docs/ARCHITECTURE.md draws the same floors. The checker is tested on a copy of the
package with an upward import planted in it, so a green run here means something.
"""

import ast
import itertools
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.run import load_run, read_metrics
from ember.train.task import Task
from ember.train.tasks import TASKS
from ember.train.trainer import train

PACKAGE = Path(ember.__file__).parent

# Floors, lowest first: a module may import from its own floor and the ones before it.
FLOORS = [
    ("errors", "atomic", "stats"),  # user-facing errors, atomic files, statistics
    ("config",),  # typed sections, YAML, overrides
    ("data", "model", "kernels"),  # what is trained, and on what
    ("parallel",),  # process groups, layouts, pipelines
    ("run",),  # THE run directory: everything that reads a run comes here
    ("infer", "report"),  # engine, evaluation, server; reports of a run
    ("train", "export"),  # the loop and its tasks; other formats
    ("analysis", "sweep"),  # instruments on runs and configs; many runs
    ("cli", "quickstart", "__main__"),  # the front door
]


def floor_of(module: str) -> int:
    """The floor of ``ember.X...`` by its first component (``ember`` itself: the ground)."""
    parts = module.split(".")
    if parts == ["ember"]:
        return 0
    for i, names in enumerate(FLOORS):
        if parts[1] in names:
            return i
    raise AssertionError(f"{module} is on no floor: add it to FLOORS (and to docs/ARCHITECTURE.md)")


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = ["ember", *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for every ember import, at any depth."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "ember"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if base.split(".")[0] != "ember":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, "", node.lineno) if sub in known else (base, a.name, node.lineno))
    return out


def violations(root: Path) -> list[str]:
    known = modules(root)
    found, edges = [], {m: set() for m in known}
    for module, path in known.items():
        for target, name, line in imports(module, path, known):
            where = f"{path.relative_to(root.parent)}:{line}"
            if target == module:
                continue
            edges[module].add(target)
            if floor_of(target) > floor_of(module):
                found.append(f"{where}: {module} (floor {floor_of(module)}) imports {target} (floor {floor_of(target)})")  # fmt: skip # noqa: E501
            if name.startswith("_") and not name.startswith("__"):
                found.append(f"{where}: {module} imports the private name {target}.{name}")
    for a, b in itertools.combinations(sorted(known), 2):  # a circle passes through a pair that meet
        if _reaches(edges, a, b) and _reaches(edges, b, a):
            found.append(f"import circle through {a} and {b}")
    return found


def _reaches(edges: dict[str, set], a: str, b: str) -> bool:
    seen, todo = set(), [a]
    while todo:
        m = todo.pop()
        for n in edges.get(m, ()):
            if n == b:
                return True
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return False


def test_every_import_points_down_the_floors():
    assert violations(PACKAGE) == []


@pytest.mark.parametrize(
    "where, line, expect",
    [
        ("model/gpt.py", "    from ember.cli import main\n", "imports ember.cli (floor 8)"),
        ("run.py", "from ember.train import trainer\n", "imports ember.train.trainer (floor 6)"),
        ("infer/engine.py", "from ember.run import _missing\n", "the private name ember.run._missing"),
        ("data/tokenizer.py", "from ember.data.manifest import read_manifest\n", "import circle through"),
    ],
)
def test_the_checker_sees_a_planted_defect(tmp_path, where, line, expect):
    copy = tmp_path / "ember"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    path = copy / where
    text = path.read_text(encoding="utf-8")
    if line.startswith(" "):  # a function-level import: inside the first function
        i = text.index("\n", text.index("\ndef ") + 1) + 1
        text = text[:i] + line + text[i:]
    else:
        text += "\n" + line
    path.write_text(text, encoding="utf-8")
    found = violations(copy)
    assert any(expect in v for v in found), found


# ------------------------------------------------------------------ a task is one module


class ShiftLoader:
    """Batches of random tokens whose targets are the next id in the vocabulary, a pure
    function of (seed, step) like every ember loader."""

    def __init__(self, rows: int, seq_len: int, vocab: int, seed: int):
        self.rows, self.seq_len, self.vocab, self.seed = rows, seq_len, vocab, seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + step)
        x = torch.randint(self.vocab, (self.rows, self.seq_len), generator=g)
        return x, (x + 1) % self.vocab

    def iterate(self, step: int):
        for s in itertools.count(step):
            yield s, *self.batch(s)

    def close(self) -> None:
        pass


class ShiftTask(Task):
    """The toy task of docs/ARCHITECTURE.md: at each position, predict the id after the token's."""

    name = "shift"

    @classmethod
    def build(cls, trainer, model):
        rows, t = trainer.global_rows // trainer.env.dp_size, trainer.cfg.train
        loader = ShiftLoader(rows, t.seq_len, trainer.tokenizer.vocab_size, trainer.cfg.run.seed)
        return cls(), loader, None

    def loss(self, model, batch):
        x, y = batch
        logits = model(x).float()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()), {"shift_accuracy": accuracy(logits, y)}

    def validate(self, trainer) -> dict:
        return {"held_out_shift_accuracy": held_out_accuracy(trainer.model, trainer.tokenizer.vocab_size)}


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(-1) == y).float().mean()


@torch.no_grad()
def held_out_accuracy(model, vocab: int) -> float:
    x, y = ShiftLoader(64, 32, vocab, seed=-1).batch(0)  # a seed no training batch uses
    return accuracy(model(x).float(), y).item()


def test_a_new_task_is_one_class_and_one_registry_line(tiny_cfg, monkeypatch):
    monkeypatch.setitem(TASKS, ShiftTask.name, ShiftTask)  # the registry line
    cfg = tiny_cfg("train.task=shift", "train.max_steps=30", "train.lr=1e-2", "train.warmup_steps=3",
                   "train.eval_every=30")  # fmt: skip
    train(cfg)
    rows = read_metrics(Path(cfg.run.out_dir) / cfg.run.name)
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 30
    assert steps[-1]["loss"] < 0.7 * steps[0]["loss"]  # it learns
    assert steps[-1]["shift_accuracy"] > steps[0]["shift_accuracy"] + 0.2  # the task's own metric, per step
    evaluated = [r for r in rows if "held_out_shift_accuracy" in r]
    assert [r["step"] for r in evaluated] == [30]
    model, tokenizer = load_run(Path(cfg.run.out_dir) / cfg.run.name)  # the exported weights
    again = held_out_accuracy(model, tokenizer.vocab_size)
    assert again == pytest.approx(evaluated[0]["held_out_shift_accuracy"], abs=1e-6)
