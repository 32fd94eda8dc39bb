"""Embedded verifiable tasks, offline and seeded, and users' own conversations from JSONL.

    problems = TASKS["add-2"].generate("train", 10_000)          # Problem(prompt, answer, task)
    TASKS["add-2"].score(problems[0], "132")                     # reward in [0, 1]
    conversations = load_jsonl("data/chats.jsonl")               # [[{role, content}, ...], ...]

**Splits.** Problem ``i`` of a split is drawn from its own generator, seeded by
``sha256(f"{task}:{split}:{i}")``, so it does not depend on how many are asked for. A candidate
belongs to the split its canonical text hashes into (``sha256`` of the prompt, one bucket in
five for ``test``); candidates of the other split are skipped, so no test problem is ever a
train problem, whatever the counts (tests/test_tasks.py checks thousands).

**Verifiers.** A completion is read up to its first ``<|end_turn|>`` (the engine may keep it).
The exact tasks (arithmetic, sort, reverse, count) take the first line of that reply, stripped of
surrounding whitespace, and compare it with the answer: reward 1.0 if equal, else 0.0, so a model
may explain itself on later lines. ``pydoc`` asks what a documented piece of Python is or does and
answers with the documentation's first paragraph: the topics inside every CPython
(``pydoc_data.topics``, ember's ``embedded:python-docs`` corpus) and the docstrings of a fixed list
of stdlib callables (``embedded:python-stdlib``). Its reward is SQuAD's token F1 (Rajpurkar et al.
2016) over the whole reply: lowercase, punctuation removed, split on whitespace; with ``c`` the
number of words the two share (as multisets), ``P = c/|reply|``, ``R = c/|reference|``,
``F1 = 2PR/(P+R)`` (0 when ``c = 0``). The pydoc problems follow the running Python's
documentation, so they differ between CPython versions; the split rule keeps them disjoint on each.

**JSONL.** One conversation per line: ``{"messages": [{"role": ..., "content": ...}, ...]}``
(OpenAI's chat format; roles system, user, assistant, at least one assistant turn) or
``{"prompt": ..., "completion": ...}`` (a user turn and an assistant turn). A malformed line is
an EmberError naming the file and the line.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import operator
import random
import re
import string
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ember.data.chat import END_TURN, check_messages
from ember.errors import EmberError

Conversation = list[dict]  # [{"role": "system" | "user" | "assistant", "content": str}, ...]

SPLITS = ("train", "test")
TEST_BUCKETS = 5  # one candidate in five (by hash) belongs to the test split
MAX_STREAK = 3000  # candidates in a row that are taken or of the other split: no new ones are left


@dataclass
class Problem:
    prompt: str  # the user's message
    answer: str  # the reference reply
    task: str
    meta: dict = field(default_factory=dict)

    def messages(self) -> Conversation:
        """The problem as a user turn and the reference reply, the shape load_jsonl returns, so
        embedded tasks and users' files reach fine-tuning by one path."""
        return [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.answer}]


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def split_of(prompt: str) -> str:
    """The split a problem belongs to, by the hash of its prompt: a property of the problem, not of
    the order it was drawn in, which is what makes the splits disjoint."""
    return "test" if _digest(prompt) % TEST_BUCKETS == 0 else "train"


def reply_of(completion: str) -> str:
    """The completion up to its first ``<|end_turn|>``: what the model said in its turn."""
    return completion.split(END_TURN, 1)[0]


class Task:
    """A seeded problem generator with fixed train/test splits and a verifier."""

    def __init__(self, name: str, make: Callable[[random.Random], tuple[str, str]], description: str):
        self.name, self.make, self.description = name, make, description

    def generate(self, split: str, n: int) -> list[Problem]:
        """The first ``n`` distinct problems of ``split`` (the same problems for any ``n``; see
        the module docstring). Fewer if the split has fewer (2-digit addition: ~1,600 in test)."""
        if split not in SPLITS:
            raise EmberError(f"split {split!r}: choose one of {', '.join(SPLITS)}")
        problems, seen, i, streak = [], set(), 0, 0
        while len(problems) < n and streak < MAX_STREAK:  # a long run of misses: the split is used up
            prompt, answer = self.make(random.Random(_digest(f"{self.name}:{split}:{i}")))
            i += 1
            if split_of(prompt) != split or prompt in seen:
                streak += 1
                continue
            seen.add(prompt)
            streak = 0
            problems.append(Problem(prompt, answer, self.name))
        return problems

    def score(self, problem: Problem, completion: str) -> float:
        """Exact match: 1.0 if the reply's first non-blank line, stripped, is ``problem.answer``."""
        return float(reply_of(completion).strip().split("\n", 1)[0].strip() == problem.answer)


def _arithmetic(k: int, symbol: str) -> Callable[[random.Random], tuple[str, str]]:
    op = {"+": operator.add, "*": operator.mul}[symbol]

    def make(rng: random.Random) -> tuple[str, str]:
        a, b = rng.randrange(10 ** (k - 1), 10**k), rng.randrange(10 ** (k - 1), 10**k)
        return f"What is {a} {symbol} {b}?", str(op(a, b))

    return make


def _sort(rng: random.Random) -> tuple[str, str]:
    values = [rng.randrange(100) for _ in range(rng.randint(3, 8))]
    return f"Sort ascending: {' '.join(map(str, values))}", " ".join(map(str, sorted(values)))


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 12)))
    return f"Reverse: {word}", word[::-1]


def _count(rng: random.Random) -> tuple[str, str]:
    letters = rng.sample(string.ascii_lowercase[:8], 3)
    word = "".join(rng.choice(letters) for _ in range(rng.randint(5, 14)))
    letter = rng.choice(letters)
    return f"How many times does '{letter}' occur in {word}?", str(word.count(letter))


# ---------------------------------------------------------------- pydoc: questions on the docs


def _normalize(text: str) -> list[str]:
    return text.lower().translate(str.maketrans("", "", string.punctuation)).split()


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD's token F1 between two texts (see the module docstring)."""
    pred, ref = _normalize(prediction), _normalize(reference)
    common = sum((Counter(pred) & Counter(ref)).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


# Stdlib modules whose public callables' docstrings become questions: common, stable, and short
# to document (a class's or function's first paragraph is one or two sentences).
DOC_MODULES = (
    "builtins", "bisect", "collections", "functools", "heapq", "itertools", "json", "math",
    "os.path", "random", "re", "shutil", "statistics", "string", "textwrap",
)  # fmt: skip
MAX_ANSWER = 300  # characters of a reference paragraph; longer ones are cut at a word


def _paragraph(text: str) -> str:
    """``text`` on one line, cut to MAX_ANSWER characters at a word boundary."""
    text = " ".join(text.split())
    return text if len(text) <= MAX_ANSWER else text[:MAX_ANSWER].rsplit(" ", 1)[0]


def _is_prose(paragraph: str) -> bool:
    """Not a heading underline, an indented grammar or code block, a bullet or a version note."""
    if any(line.strip() and set(line.strip()) <= set("*=-~^") for line in paragraph.splitlines()):
        return False
    notes = ("*", "-", "New in version", "Changed in version", "Deprecated", "**Source code:**")
    return not paragraph[:1].isspace() and not paragraph.startswith(notes) and len(paragraph) > 40


def _topic_pairs() -> list[tuple[str, str]]:
    """(question, first prose paragraph) for each documentation topic that has one; the topic's
    title (its first line) names it in the question, since the keys are internal labels."""
    from pydoc_data.topics import topics

    pairs = []
    for key in sorted(topics):
        title, _, body = topics[key].strip().partition("\n")
        prose = [p.strip("\n") for p in re.split(r"\n\s*\n", body) if _is_prose(p.strip("\n"))]
        if prose:
            question = f"What does the Python documentation say about: {title.strip()}?"
            pairs.append((question, _paragraph(prose[0])))
    return pairs


def _docstring_pairs() -> list[tuple[str, str]]:
    """(question, first docstring paragraph) for the public callables defined in DOC_MODULES.
    Re-exports are skipped (they belong to another module), and so are signature-style docstrings
    ("int([x]) -> integer"), which say how to call a thing rather than what it does."""
    pairs = []
    for module_name in DOC_MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(vars(module)):
            obj = getattr(module, name)
            defined_here = getattr(obj, "__module__", None) == module.__name__
            if name.startswith("_") or not callable(obj) or not defined_here:
                continue
            first = re.split(r"\n\s*\n", (inspect.getdoc(obj) or "").strip(), maxsplit=1)[0]
            if len(first) < 20 or "->" in first or first.startswith((f"{name}(", "(")):
                continue
            qualified = name if module_name == "builtins" else f"{module_name}.{name}"
            pairs.append((f"What does `{qualified}` do?", _paragraph(first)))
    return pairs


class PydocTask(Task):
    """Questions on Python's own documentation, scored by token F1 (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("pydoc", self._make, "questions on Python's documentation, token F1")
        self._pairs: list[tuple[str, str]] | None = None

    def _make(self, rng: random.Random) -> tuple[str, str]:
        if self._pairs is None:  # built on first use: importing ember.data.tasks stays cheap
            self._pairs = _topic_pairs() + _docstring_pairs()
        return rng.choice(self._pairs)

    def score(self, problem: Problem, completion: str) -> float:
        """Token F1 between the reply (up to ``<|end_turn|>``) and the reference paragraph."""
        return token_f1(reply_of(completion), problem.answer)


class ChoiceTask(Task):
    """A multiple-choice version of an exact task: each problem carries ``meta["options"]``, the
    answer and three near misses in a seeded order. ``ember eval --task`` scores it by
    log-likelihood, not generation: the option whose tokens the model finds likeliest after the
    prompt (summed log-probabilities, lm-evaluation-harness's ``acc``) is its choice."""

    def __init__(self, name: str, base: Task, distractors: Callable[[str, random.Random], list[str]]):
        super().__init__(name, base.make, f"{base.description}, as a 4-way choice by log-likelihood")
        self.distractors = distractors

    def generate(self, split: str, n: int) -> list[Problem]:
        problems = super().generate(split, n)
        for problem in problems:
            rng = random.Random(_digest(f"{self.name}:options:{problem.prompt}"))
            options = [problem.answer, *self.distractors(problem.answer, rng)]
            rng.shuffle(options)
            problem.meta["options"] = options
        return problems


def _near_sums(answer: str, rng: random.Random) -> list[str]:
    """Three other numbers a careless adder writes: off by one, by ten, by a hundred or digits swapped."""
    value = int(answer)
    candidates = [value + d for d in (-100, -10, -1, 1, 10, 100) if value + d > 0]
    candidates.append(int(answer[::-1]) if answer[::-1] != answer else value + 2)
    picked = dict.fromkeys(str(c) for c in rng.sample(candidates, len(candidates)) if str(c) != answer)
    return list(picked)[:3]


TASKS: dict[str, Task] = {
    "add-2": Task("add-2", _arithmetic(2, "+"), "2-digit addition, exact match"),
    "add-3": Task("add-3", _arithmetic(3, "+"), "3-digit addition, exact match"),
    "mul-2": Task("mul-2", _arithmetic(2, "*"), "2-digit multiplication, exact match"),
    "sort": Task("sort", _sort, "sort 3-8 integers below 100, exact match"),
    "reverse": Task("reverse", _reverse, "reverse 3-12 lowercase letters, exact match"),
    "count": Task("count", _count, "count a letter in a word, exact match"),
    "pydoc": PydocTask(),
}
TASKS["add-2-choice"] = ChoiceTask("add-2-choice", TASKS["add-2"], _near_sums)


# ---------------------------------------------------------------- users' conversations


def jsonl_rows(path: str | Path, what: str) -> Iterator[tuple[str, object]]:
    """``(where, row)`` for each non-blank line of a JSONL file of ``what``, ``where`` being
    ``path:line`` for the caller's errors; an EmberError if the file cannot be read or a line is
    not JSON."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise EmberError(f"cannot read {path} ({e}); give a UTF-8 JSONL file of {what}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            raise EmberError(f"{where}: not JSON ({e.msg}); each line must be one JSON object") from None


def load_jsonl(path: str | Path) -> list[Conversation]:
    """Conversations from a JSONL file (see the module docstring); an EmberError names the line."""
    conversations = []
    for where, row in jsonl_rows(path, "conversations"):
        if isinstance(row, dict) and "messages" in row:
            messages = row["messages"]
            check_messages(messages, where)
            if not any(m["role"] == "assistant" for m in messages):
                raise EmberError(f"{where}: no assistant message, so nothing to learn; add the reply")
        elif isinstance(row, dict) and "prompt" in row and "completion" in row:
            if not isinstance(row["prompt"], str) or not isinstance(row["completion"], str):
                raise EmberError(f"{where}: 'prompt' and 'completion' must be strings")
            messages = [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["completion"]},
            ]
        else:
            raise EmberError(
                f'{where}: expected {{"messages": [...]}} or {{"prompt": ..., "completion": ...}}'
            )
        conversations.append([{"role": m["role"], "content": m["content"]} for m in messages])
    if not conversations:
        raise EmberError(f"{path} holds no conversations; write one JSON object per line")
    return conversations
