"""Atomic writes: whole or nothing, and leftovers of killed writers are cleaned up."""

import os

from ember.atomic import publish_dir, staging_dir, write_text_atomic

DEAD = 999_999_999  # no such process


def test_write_text_atomic_replaces_and_leaves_no_temp(tmp_path):
    path = tmp_path / "a.json"
    write_text_atomic(path, "one")
    write_text_atomic(path, "two")
    assert path.read_text() == "two" and os.listdir(tmp_path) == ["a.json"]


def test_publish_replaces_an_existing_directory(tmp_path):
    target = tmp_path / "model"
    for text in ("v1", "v2"):
        tmp = staging_dir(target)
        (tmp / "w").write_text(text)
        publish_dir(tmp, target)
    assert (target / "w").read_text() == "v2"
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_leftovers_of_dead_writers(tmp_path):
    target = tmp_path / "model"
    (tmp_path / f".model.tmp-{DEAD}").mkdir()  # killed while writing
    old = tmp_path / f".model.old-{DEAD}"  # killed between the two renames: target missing
    old.mkdir()
    (old / "w").write_text("good")
    (tmp_path / f".model.tmp-{os.getppid()}").mkdir()  # a live writer's folder is left alone
    tmp = staging_dir(target)
    assert (target / "w").read_text() == "good"  # the old complete version is back
    assert sorted(os.listdir(tmp_path)) == sorted(["model", tmp.name, f".model.tmp-{os.getppid()}"])
