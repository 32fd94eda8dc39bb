"""Sources and cleaning: order, counts, errors, split stability."""

import hashlib
import json
import sysconfig
from pathlib import Path

import pytest

from ember.data.clean import Cleaner, content_digest, nontext_fraction
from ember.data.sources import open_source
from ember.errors import DataError


def _texts(spec, **kw):
    src = open_source(spec)
    for k, v in kw.items():
        setattr(src, k, v)
    return [d.text for d in src.documents()], src.stats.to_dict()


def test_embedded_docs_are_pydoc_topics_in_sorted_order():
    from pydoc_data.topics import topics

    texts, stats = _texts("embedded:python-docs")
    assert texts == [topics[k] for k in sorted(topics)]
    assert stats["documents"] == len(topics)
    assert stats["sha256"] == hashlib.sha256("".join(texts).encode()).hexdigest()


def test_embedded_stdlib_excludes_tests_idlelib_site_packages():
    src = open_source("embedded:python-stdlib")
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [p.relative_to(root).as_posix() for p in src.files]
    assert rel == sorted(rel)
    assert "os.py" in rel and "json/decoder.py" in rel
    for r in rel:
        parts = r.split("/")
        assert not {"test", "tests", "idlelib", "site-packages"} & set(parts), r
        assert r.endswith(".py")
    both = open_source("embedded:python")
    assert both.files == src.files and both.parts == ["docs", "stdlib"]


def test_unknown_embedded_and_missing_path_fail(tmp_path):
    with pytest.raises(DataError, match="embedded:python-docs"):
        open_source("embedded:nope")
    with pytest.raises(DataError, match="not found"):
        open_source(str(tmp_path / "absent.txt"))
    with pytest.raises(DataError, match="matches no files"):
        open_source(str(tmp_path / "*.md"))


def test_directory_order_binary_and_invalid_utf8(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("zed")
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "c.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "d.txt").write_bytes(b"caf\xe9 ok")
    (tmp_path / ".hidden").write_text("secret")
    texts, stats = _texts(str(tmp_path))
    assert texts == ["alpha", "zed", "caf\ufffd ok"]  # a.txt, b/z.txt, (c.bin skipped), d.txt
    assert stats["binary_skipped"] == 1 and stats["invalid_utf8"] == 1
    assert stats["files"] == 4 and stats["documents"] == 3


def test_glob_source(tmp_path):
    for name in ("x2.md", "x1.md", "y.txt"):
        (tmp_path / name).write_text(name)
    texts, _ = _texts(str(tmp_path / "*.md"))
    assert texts == ["x1.md", "x2.md"]


def test_only_binary_directory_fails(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\x00" * 10)
    (tmp_path / "b.bin").write_bytes(b"ab\x00cd")
    with pytest.raises(DataError, match="only binary files.*2 skipped"):
        _texts(str(tmp_path))


def test_jsonl_fields_and_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"body": "x", "text": "two"}) + "\n")
    assert _texts(str(good))[0] == ["one", "two"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        _texts(str(bad))
    with pytest.raises(DataError, match=r"good.jsonl:1: record has no field 'body'"):
        _texts(str(good), jsonl_field="body")


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"content": ["p1", None, "p3"], "n": [1, 2, 3]}), path)
    assert _texts(str(path), parquet_column="content")[0] == ["p1", "", "p3"]
    with pytest.raises(DataError, match="no column 'text'"):
        _texts(str(path))


def test_cleaner_counts_each_reason_once():
    c = Cleaner(min_chars=3, max_nontext_fraction=0.2, dedup=True)
    docs = ["ab", "hello", "hello", "\x00\x01\x02ok", "world", "\ufffd\ufffdab"]
    kept = [d for d in docs if c.keep(d, content_digest(d))]
    assert kept == ["hello", "world"]
    assert c.counts == {"too_short": 1, "nontext": 2, "duplicate": 1, "kept": 2}
    assert nontext_fraction("a\tb\nc\r") == 0.0
    assert nontext_fraction("\x07bc\ue000") == 0.5
