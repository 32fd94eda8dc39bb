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


def test_val_is_drawn_per_stratum_by_bytes_and_test_by_origin():
    code, prose = _docs("code", 400, 300), _docs("prose", 40, 80)
    tests = _docs("tests", 200, 500) + [code[3]]  # a test file that duplicates a training one
    cfg = DataConfig(val_fraction=0.05, test_bytes=20_000, test_fraction=0.5)
    plan = plan_splits([FakeSource("c", code + prose)], [FakeSource("t", tests)], cfg)
    for docs in (code, prose):
        stratum = docs[0][0]
        split = {t: plan.split_of(stratum, content_digest(t)) for _, t in docs}
        val = sorted((content_digest(t), len(t.encode())) for t, s in split.items() if s == "val")
        val_bytes = sum(n for _, n in val)
        # the smallest digests of the stratum, just enough to reach 5% of its bytes
        assert val_bytes >= 0.05 * _bytes(docs) > val_bytes - val[-1][1]
        assert [d for d, _ in val] == sorted(content_digest(t) for _, t in docs)[: len(val)]
        assert set(split.values()) == {"train", "val"}  # test_fraction is unused: there are test sources
    chosen = [t for _, t in tests[:-1] if plan.split_of("tests", content_digest(t)) == "test"]
    chosen_bytes = sum(len(t.encode()) for t in chosen)
    assert 20_000 <= chosen_bytes < 20_000 + 600
    assert plan.split_of("tests", content_digest(code[3][1])) is None  # seen in training: not test
    assert "held out by origin: t" in plan.rule["test"]


def test_without_test_sources_a_share_from_the_top_of_the_digest_order():
    docs = _docs("a", 300, 200)
    plan = plan_splits([FakeSource("a", docs)], [], DataConfig(val_fraction=0.1, test_fraction=0.1))
    order = sorted(docs, key=lambda d: content_digest(d[1]))
    splits = [plan.split_of("a", content_digest(t)) for _, t in order]
    n_val, n_test = splits.count("val"), splits.count("test")
    assert splits == ["val"] * n_val + ["train"] * (300 - n_val - n_test) + ["test"] * n_test
    assert 0.1 <= sum(len(t.encode()) for _, t in order[-n_test:]) / _bytes(docs) < 0.11
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
