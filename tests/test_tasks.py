"""Embedded verifiable tasks: seeded, disjoint splits, verifiers; users' JSONL conversations."""

import json

import pytest

from ember.data.tasks import TASKS, load_jsonl, token_f1
from ember.errors import EmberError

EXACT = [name for name in TASKS if name != "pydoc"]


@pytest.mark.parametrize("name", EXACT)
def test_problems_are_seeded_and_splits_are_disjoint(name):
    task = TASKS[name]
    train, test = task.generate("train", 3000), task.generate("test", 600)
    assert task.generate("test", 50) == test[:50]  # problem i does not depend on n
    assert len(test) == len({p.prompt for p in test})  # distinct
    assert not {p.prompt for p in train} & {p.prompt for p in test}


@pytest.mark.parametrize("name", EXACT)
def test_the_verifier_takes_the_answer_and_rejects_another(name):
    task = TASKS[name]
    for p in task.generate("test", 50):
        assert task.score(p, p.answer) == 1.0
        assert task.score(p, f"  {p.answer}\n<junk after the line>") == 1.0  # first line, stripped
        assert task.score(p, p.answer + "0") == 0.0


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


def test_pydoc_questions_are_scored_by_token_f1():
    task = TASKS["pydoc"]
    test = task.generate("test", 100)
    assert 5 <= len(test) and not {p.prompt for p in test} & {p.prompt for p in task.generate("train", 500)}
    p = test[0]
    assert task.score(p, p.answer) == 1.0
    assert 0 < task.score(p, " ".join(p.answer.split()[:4])) < 1.0
    assert task.score(p, "bananas") == 0.0
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
