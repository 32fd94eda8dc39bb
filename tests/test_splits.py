"""The split rules: val per stratum by bytes, test held out by origin or from the top of the
digest order, nothing shared, and the fallback when CPython ships no test suite."""

import pytest

from ember.config import DataConfig
from ember.data.clean import content_digest
from ember.data.sources import Document
from ember.data.splits import plan_splits


class FakeSource:
    def __init__(self, spec, docs):
        self.spec, self.docs = spec, docs

    def documents(self):
        for stratum, text in self.docs:
            yield Document(text, "x", stratum)


def _docs(stratum, n, size):
    return [(stratum, f"{stratum} document {i} " + "x" * (size + i % 7)) for i in range(n)]


def _bytes(docs):
    return sum(len(t.encode()) for _, t in docs)


def _split_bytes(plan, docs, split):
    return sum(len(t.encode()) for stratum, t in docs if plan.split_of(stratum, content_digest(t)) == split)


def test_val_is_a_systematic_sample_per_stratum_and_test_comes_by_origin():
    code, prose = _docs("code", 400, 300), _docs("prose", 40, 80)
    tests = _docs("tests", 200, 500) + [code[3]]  # a test file that duplicates a training one
    cfg = DataConfig(val_fraction=0.05, test_bytes=20_000, test_fraction=0.5)
    plan = plan_splits([FakeSource("c", code + prose)], [FakeSource("t", tests)], cfg)
    for docs in (code, prose):
        stratum = docs[0][0]
        split = [
            plan.split_of(stratum, content_digest(t))
            for _, t in sorted(docs, key=lambda d: (len(d[1]), content_digest(d[1])))
        ]
        picked = [i for i, s in enumerate(split) if s == "val"]
        assert len(picked) in (int(0.05 * len(docs)), int(0.05 * len(docs)) + 1)  # n·f, rounded by the offset
        assert all(b - a == 20 for a, b in zip(picked, picked[1:], strict=False))  # every 20th by size
        assert set(split) == {"train", "val"}  # test_fraction is unused: there are test sources
    chosen = _split_bytes(plan, tests[:-1], "test")
    assert 0.8 * 20_000 <= chosen <= 1.2 * 20_000
    assert plan.split_of("tests", content_digest(code[3][1])) is None  # seen in training: not test
    assert "held out by origin: t" in plan.rule["test"]


def test_the_sample_follows_the_bytes_of_each_kind_of_file():
    """A folder of big easy tables and small modules: over many corpora (each its own hashed
    offset), val holds each kind in proportion to its bytes; a group per folder."""
    shares = []
    for k in range(40):
        tables = [("s", f"table {k} {i} " + "t" * 5000) for i in range(30)]
        modules = [("s", f"module {k} {i} " + "m" * (200 + 7 * i)) for i in range(300)]
        sources = [FakeSource("s", tables + modules)]
        plan = plan_splits(sources, [], DataConfig(val_fraction=0.1, test_fraction=0.0))
        val = _split_bytes(plan, tables + modules, "val")
        shares.append(_split_bytes(plan, tables, "val") / val)
    corpus = _bytes(tables) / (_bytes(tables) + _bytes(modules))
    assert abs(sum(shares) / len(shares) - corpus) < 0.02
    assert max(abs(s - corpus) for s in shares) < 0.08  # size order spreads the picks


def test_without_test_sources_a_share_of_what_val_left():
    docs = _docs("a", 300, 200)
    plan = plan_splits([FakeSource("a", docs)], [], DataConfig(val_fraction=0.1, test_fraction=0.1))
    splits = [plan.split_of("a", content_digest(t)) for _, t in docs]
    assert (splits.count("val"), splits.count("test")) in {(30, 30), (30, 31), (31, 30), (31, 29), (30, 29)}
    assert "hashed share" in plan.rule["test"]
    none = plan_splits([FakeSource("a", docs)], [], DataConfig(val_fraction=0.1, test_fraction=0.0))
    assert "test" not in {none.split_of("a", content_digest(t)) for _, t in docs}


def test_a_stratum_keeps_a_training_document():
    plan = plan_splits(
        [FakeSource("a", _docs("a", 1, 50))], [], DataConfig(val_fraction=0.9, test_fraction=0.05)
    )
    assert list(plan.assign.values()) == ["train"]


def test_fallback_when_python_ships_no_test_suite(monkeypatch, tmp_path):
    from ember.config import load_config
    from ember.data import prepare as prep

    monkeypatch.setattr(prep, "tests_available", lambda: False)
    notes = []
    cfg = load_config("tiny", [f"data.dir={tmp_path / 'd'}", "data.test_fraction=0.05"])
    assert cfg.data.test_sources == ["embedded:python-tests"]
    result = prep.prepare(cfg, log=notes.append)
    assert any("ships no test suite" in n for n in notes)
    assert "hashed share" in result.manifest["split_rules"]["test"]
    assert result.manifest["splits"]["test"]["strata"][0]["name"] == "embedded:python-docs"


def test_embedded_python_has_docs_and_code_in_val_and_tests_in_test(tiny_data):
    from ember.data.manifest import read_manifest

    m = read_manifest(tiny_data)
    assert {s["name"] for s in m["splits"]["test"]["strata"]} == {"embedded:python-tests"}
    assert 100_000 <= m["splits"]["test"]["bytes"]
    assert m["test_sources"][0]["spec"] == "embedded:python-tests"


@pytest.mark.parametrize(
    "bad", ["data.test_fraction=1.0", "data.test_bytes=-1", "data.val_fraction=0.6 data.test_fraction=0.5"]
)
def test_bad_split_settings(bad):
    from ember.config import load_config
    from ember.errors import ConfigError

    with pytest.raises(ConfigError, match="data.test"):
        load_config("tiny", bad.split())
