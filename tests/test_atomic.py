"""Atomic writes: whole or nothing, and leftovers of killed writers are cleaned up."""

import os

import pytest

from ember.atomic import check_target, make_dirs, output_kind, publish_dir, staging_dir, write_text_atomic
from ember.errors import EmberError

DEAD = 999_999_999  # no such process


def test_write_text_atomic_replaces_and_leaves_no_temp(tmp_path):
    path = tmp_path / "a.json"
    write_text_atomic(path, "one")
    write_text_atomic(path, "two")
    assert path.read_text() == "two" and os.listdir(tmp_path) == ["a.json"]


def test_a_folder_that_cannot_be_written_is_an_ember_error_and_the_first_cause(tmp_path, monkeypatch):
    """A read-only or full folder: one EmberError naming the file, not the temp file's cleanup
    failing in turn (which hid the first error behind a second traceback)."""
    def refuse(path, *args, **kwargs):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(os, "fsync", refuse)
    monkeypatch.setattr(os, "unlink", refuse)
    with pytest.raises(EmberError, match=r"cannot write .*a.json \(Read-only file system\)"):
        write_text_atomic(tmp_path / "a.json", "one")


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


def test_leftovers_of_any_dead_writer_in_the_same_folder(tmp_path):
    """A killed export, prepare or atomic write leaves ``.NAME.tmp-PID``; the next writer of any
    target in that folder removes it, and leaves a live process's (this one's included) alone."""
    (tmp_path / f".tiny-hf.tmp-{DEAD}" / "model").mkdir(parents=True)  # a killed export
    (tmp_path / f".swap.tmp-{DEAD}").mkdir()  # a killed data prepare --force
    (tmp_path / f".meta.json.tmp-{DEAD}").write_text("half")  # a killed write_text_atomic
    old = tmp_path / f".gone.old-{DEAD}"  # killed between publish_dir's renames: put back
    old.mkdir()
    alive = [f".other.tmp-{os.getppid()}", f".mine.tmp-{os.getpid()}"]  # another thread's, in this process
    for name in alive:
        (tmp_path / name).mkdir()
    (tmp_path / "keep.tmp-1").write_text("not a staging name")
    tmp = staging_dir(tmp_path / "model")
    assert sorted(os.listdir(tmp_path)) == sorted([*alive, "gone", "keep.tmp-1", tmp.name])
    (tmp_path / f".x.tmp-{DEAD}").mkdir()
    check_target(tmp_path / "report", kind="report")  # the checks of sweep, report, train sweep too
    assert not (tmp_path / f".x.tmp-{DEAD}").exists()


def test_check_target_refuses_what_is_not_embers_own(tmp_path):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "model_config.json").write_text("{}")  # a run from before the marker
    assert output_kind(run) == "run"
    with pytest.raises(EmberError, match="not an ember hf directory: it holds ember's run output"):
        check_target(run, kind="hf", force=True)
    for target, kind, words in [
        (tmp_path, "run", "contains the source"),
        (run / "model", "run", "is inside the source"),
        (run / "model" / "model_config.json", "pt2", "is inside"),
    ]:
        with pytest.raises(EmberError, match=words):
            check_target(target, kind=kind, sources=[run], force=True)
    with pytest.raises(EmberError, match="--force"):
        check_target(run, kind="run")
    assert check_target(run, kind="run", force=True) == run
    (tmp_path / "file").write_text("x")
    with pytest.raises(EmberError, match="is not a folder"):
        check_target(tmp_path / "file" / "out", kind="hf")
    with pytest.raises(EmberError, match="not an ember pt2 file"):
        check_target(tmp_path / "file", kind="pt2", force=True)
    with pytest.raises(EmberError, match="cannot create the folder"):
        make_dirs(tmp_path / "file" / "out")
