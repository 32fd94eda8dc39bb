"""Shared fixtures: one tiny prepared corpus per test session, and configs that use it."""

import pytest

from ember.config import load_config
from ember.data.prepare import prepare


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """The tiny preset's corpus (CPython's pydoc topics, BPE 512), prepared once."""
    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare(load_config("tiny", [f"data.dir={out}", "data.val_fraction=0.1"]), log=lambda _: None)
    return out


@pytest.fixture
def tiny_cfg(tiny_data, tmp_path):
    """``tiny_cfg(*overrides)``: the tiny preset on the shared corpus, runs under tmp_path."""

    def make(*overrides):
        return load_config(
            "tiny",
            [
                f"data.dir={tiny_data}",
                "data.val_fraction=0.1",
                f"run.out_dir={tmp_path / 'runs'}",
                "train.device=cpu",
                "train.report=false",  # a second of plots per run; the tests of reports turn it on
                *overrides,
            ],
        )

    return make
