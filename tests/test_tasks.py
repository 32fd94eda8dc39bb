"""Embedded verifiable tasks: seeded, disjoint splits, verifiers; users' JSONL conversations."""

import json

import pytest

from ember.data.tasks import TASKS, Problem, load_jsonl, split_of, token_f1
from ember.errors import EmberError

EXACT = [name for name in TASKS if name != "pydoc"]


@pytest.mark.parametrize("name", EXACT)
def test_problems_are_seeded_and_splits_are_disjoint(name):
    task = TASKS[name]
    train, test = task.generate("train", 3000), task.generate("test", 600)
    assert len(train) == 3000 and len(test) == 600
    assert task.generate("test", 600) == test  # seeded: the same problems again
    assert task.generate("test", 50) == test[:50] and task.generate("train", 70) == train[:70]  # not on n
    assert len(test) == len({p.prompt for p in test}) and len(train) == len({p.prompt for p in train})
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert {split_of(p.prompt) for p in train} == {"train"} and {split_of(p.prompt) for p in test} == {"test"}


def test_an_unknown_split_is_refused():
    with pytest.raises(EmberError, match="train, test"):
        TASKS["add-2"].generate("val", 10)


@pytest.mark.parametrize("name", EXACT)
def test_the_verifier_takes_the_answer_and_rejects_another(name):
    task = TASKS[name]
    for p in task.generate("test", 50):
        assert task.score(p, p.answer) == 1.0
        assert task.score(p, f"  {p.answer}\n<junk after the line>") == 1.0  # first line, stripped
        assert task.score(p, f"\n{p.answer} <|end_turn|>more") == 1.0  # the reply ends at end-of-turn
        assert task.score(p, p.answer + "0") == 0.0
        assert task.score(p, f"The answer is {p.answer}") == 0.0  # exact, not contained


def test_answers_are_right():
    for p in TASKS["add-3"].generate("test", 200):
        a, b = p.prompt.removeprefix("What is ").removesuffix("?").split(" + ")
        assert len(a) == len(b) == 3 and int(p.answer) == int(a) + int(b)
    for p in TASKS["mul-2"].generate("test", 200):
        a, b = p.prompt.removeprefix("What is ").removesuffix("?").split(" * ")
        assert int(p.answer) == int(a) * int(b)
    for p in TASKS["sort"].generate("test", 100):
        values = [int(v) for v in p.prompt.split(": ")[1].split()]
        assert p.answer == " ".join(map(str, sorted(values)))
    for p in TASKS["count"].generate("test", 100):
        letter, word = p.prompt.split("'")[1], p.prompt.split(" in ")[1].rstrip("?")
        assert p.answer == str(word.count(letter))
    for p in TASKS["reverse"].generate("test", 100):
        word = p.prompt.removeprefix("Reverse: ")
        assert 3 <= len(word) <= 12 and word.isalpha() and p.answer == word[::-1]


def test_a_problem_is_a_user_turn_and_the_reference_reply():
    p = Problem("What is 47 + 85?", "132", "add-2")
    assert p.messages() == [
        {"role": "user", "content": "What is 47 + 85?"},
        {"role": "assistant", "content": "132"},
    ]


def test_pydoc_questions_are_scored_by_token_f1():
    task = TASKS["pydoc"]
    test, train = task.generate("test", 1000), task.generate("train", 1000)
    assert len(test) >= 30 and len(train) >= 4 * len(test) // 2  # the whole pool, split about 1 : 4
    assert task.generate("test", 1000) == test and not {p.prompt for p in test} & {p.prompt for p in train}
    assert any(p.prompt.startswith("What does `") for p in test)  # docstrings as well as topics
    for p in test[:20]:
        assert p.answer and task.score(p, p.answer) == 1.0
        assert task.score(p, p.answer + "<|end_turn|>unrelated words after the turn") == 1.0
        words = p.answer.split()
        assert 0 < task.score(p, " ".join(words[: len(words) // 2])) < 1.0  # half the words: recall 1/2
        assert task.score(p, "bananas zeppelin") == 0.0
    assert token_f1("The cat sat.", "the cat sat on the mat") == pytest.approx(2 * 1 * 0.5 / 1.5)


def test_jsonl_in_both_formats(tmp_path):
    path = tmp_path / "c.jsonl"
    rows = [
        {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}]},
        {"prompt": "Capital of France?", "completion": "Paris"},
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    conversations = load_jsonl(path)
    assert conversations[0] == rows[0]["messages"]
    assert conversations[1] == [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not JSON"),
        ('{"text": "hi"}', "expected"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "role 'robot'"),
        ('{"messages": [{"role": "user", "content": 3}]}', "content"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant"),
        ('{"prompt": "hi", "completion": null}', "strings"),
        ('{"messages": "hi"}', "non-empty list"),
        ("[1, 2]", "expected"),
    ],
)
def test_a_malformed_line_names_its_number(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n' + line + "\n")
    with pytest.raises(EmberError, match=message) as e:
        load_jsonl(path)
    assert f"{path}:2" in str(e.value)


def test_an_empty_file_is_refused(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(EmberError, match="no conversations"):
        load_jsonl(tmp_path / "e.jsonl")


def test_choice_problems_hold_the_answer_among_four_distinct_options():
    from ember.data.tasks import split_of

    problems = TASKS["add-2-choice"].generate("test", 200)
    for p in problems:
        options = p.meta["options"]
        assert len(options) == len(set(options)) == 4 and p.answer in options
        assert split_of(p.prompt) == "test"  # the same partition as add-2: SFT on add-2 never saw these
    positions = {p.meta["options"].index(p.answer) for p in problems}
    assert positions == {0, 1, 2, 3}  # the answer is not always in one place
