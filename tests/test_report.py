"""ember report: report.md + plots from a hand-made run directory (no training needed)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from ember.config import config_to_yaml, load_config
from ember.errors import EmberError
from ember.report.report import config_diff, write_report

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ["loss.png", "lr.png", "grad_norm.png", "tokens_per_s.png"]


@pytest.fixture(autouse=True)
def _isolated_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a data/tiny prepared in the real cwd must not leak in


def make_run(root: Path, name: str, lr: float = 0.003, val_bpb: float = 2.3456789) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(
        config_to_yaml(load_config("tiny", [f"run.name={name}", f"train.lr={lr}"]))
    )
    (run / "env.json").write_text(json.dumps({"torch": "2.13.0", "device": "cpu", "git_sha": "abc123"}))
    lines = []
    for step in range(1, 7):
        lines.append(
            {
                "skipped": 0,
                "step": step,
                "tokens": 256 * step,
                "loss": 6.0 - 0.1 * step,
                "lr": lr * step / 6,
                "grad_norm": 1.0 / step,
                "tokens_per_s": 1000.0 + step,
                "step_s": 0.25,
                "elapsed_s": 0.25 * step,
                "peak_mem_mb": 300.0 + step,
            }
        )
        if step % 3 == 0:
            bpb = val_bpb if step == 6 else val_bpb + 0.5
            lines.append(
                {
                    "step": step,
                    "tokens": 256 * step,
                    "val_loss": 5.5 - step / 10,
                    "val_ppl": 100.0,
                    "val_bpb": bpb,
                }
            )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 7, "lo')
    summary = {
        **lines[-2],
        **lines[-1],
        "best_val_loss": 4.9,
        "best_step": 6,
        "skipped_steps": 0,
        "n_params": 131392,
    }
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def links(report: Path) -> list[str]:
    return re.findall(r"\]\(([^)]+)\)", report.read_text())


def test_a_torn_metrics_line_is_skipped_on_resume_and_counted(tmp_path):
    """A crash or a full disk mid-write leaves half a line: a resume keeps the records up to its
    checkpoint and drops the torn one, where the strict reader raised a traceback."""
    from ember.run import metrics_lines
    from ember.train.metrics import MetricsLog

    lines = [json.dumps({"step": s, "loss": 5.0 - s}) for s in (1, 2, 3)] + ['{"step": 4, "lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert [r["step"] for r in metrics_lines(tmp_path)[0]] == [1, 2, 3] and metrics_lines(tmp_path)[1] == 1
    MetricsLog(tmp_path, enabled=True, truncate_after=2).file.close()
    assert metrics_lines(tmp_path) == ([{"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0}], 0)


def test_single_run_report(tmp_path):
    run = make_run(tmp_path, "tiny")
    results = {"val (data/tiny)": {"val_loss": 4.5, "val_ppl": 90.0, "val_bpb": 1.75}}
    (run / "eval.json").write_text(json.dumps({"ckpt": "last", "seq_len": 32, "results": results}))
    (run / "samples.md").write_text("# Samples\n\nprompt: def\n\n```\n# not a heading\n```\n")
    report = write_report([run])
    assert report == run / "report.md"
    text = report.read_text()
    assert "| final val bits/byte | 2.3457 |" in text
    assert "| best val loss | 4.9000 (step 6) |" in text
    assert "| final train loss | 5.4000 |" in text
    assert "| tokens/s (median) | 1,004 |" in text  # median of 1001..1006
    assert "| peak memory | 306 MiB |" in text
    assert "131,392 (0.13M)" in text
    assert "1 unreadable line(s)" in text  # the truncated last line
    assert "abc123" in text  # env.json
    assert "| val (data/tiny) | 4.5 | 90 | 1.75 |" in text  # eval.json
    assert "ckpt last, seq_len 32" in text
    assert "## Samples\n\n## Samples\n\nprompt: def\n\n```\n# not a heading" in text
    assert "No data manifest" in text  # data/tiny is not prepared under tmp_path
    for name in PLOTS:
        assert (run / "plots" / name).read_bytes()[:8] == PNG_MAGIC
    targets = links(report)
    assert {f"plots/{p}" for p in PLOTS} | {"config.yaml"} <= set(targets)
    for target in targets:
        assert (run / target).is_file(), target


def test_data_manifest_summary(tmp_path, monkeypatch):
    run = make_run(tmp_path / "runs", "tiny")
    data = tmp_path / "data" / "tiny"
    data.mkdir(parents=True)
    manifest = {
        "format": "ember-shards",
        "format_version": 2,
        "sources": [{"spec": "embedded:python-docs", "documents": 79, "bytes": 466117}],
        "cleaning": {"documents_in": 79, "kept": 78},
        "tokenizer": {"kind": "bpe", "vocab_size": 512, "sha256": "0"},
        "dtype": "uint16",
        "splits": {
            "train": {"documents": 75, "tokens": 215851, "bytes": 1},
            "val": {"documents": 3, "tokens": 4120, "bytes": 1},
        },
    }
    (data / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.chdir(tmp_path / "runs")  # data.dir=data/tiny is found beside the run's parent
    report = write_report([run])
    text = report.read_text()
    assert "| embedded:python-docs | 79 | 466,117 |" in text
    assert "| train | 75 | 215,851 | 1 |" in text
    assert "tokenizer bpe, vocabulary 512" in text
    for target in links(report):
        assert (run / target).is_file(), target

    manifest["config"] = {"data": {"sources": ["file:other.txt"], "tokenizer": "bpe", "vocab_size": 512}}
    (data / "manifest.json").write_text(json.dumps(manifest))  # made from other data: not this run's
    assert "No data manifest" in write_report([run]).read_text()


def test_compare_runs_config_diff(tmp_path):
    a = make_run(tmp_path, "a", lr=0.003, val_bpb=2.5)
    b = make_run(tmp_path, "b", lr=0.001, val_bpb=2.25)
    out = tmp_path / "a-vs-b"
    report = write_report([a, b], out)
    assert report == out / "report.md"
    text = report.read_text()
    diff = text.split("## Configuration")[1].split("##")[0]
    assert re.search(r"\| train\.lr \| 0\.003 \| 0\.001 \|", diff)
    assert "| run.name | a | b |" in diff
    assert "model.d_model" not in diff and "train.seq_len" not in diff
    assert "| final val bits/byte | 2.5000 | 2.2500 |" in text
    for name in PLOTS:
        assert (out / "plots" / name).read_bytes()[:8] == PNG_MAGIC
    for target in links(report):
        assert (out / target).is_file(), target


def test_config_diff_flattens_and_marks_missing():
    rows = dict(config_diff([{"a": {"b": 1, "c": [1]}, "d": 1}, {"a": {"b": 2, "c": [1]}}]))
    assert rows == {"a.b": [1, 2], "d": [1, None]}


def test_same_name_runs_get_distinct_labels(tmp_path):
    a = make_run(tmp_path / "x", "tiny")
    b = make_run(tmp_path / "y", "tiny")
    text = write_report([a, b], tmp_path / "out").read_text()
    assert "| metric | x/tiny | y/tiny |" in text


def test_not_a_run(tmp_path):
    with pytest.raises(EmberError, match=r"no metrics\.jsonl.*ember train"):
        write_report([tmp_path])
    with pytest.raises(EmberError, match="ember train"):
        write_report([tmp_path / "absent"])
    assert not (tmp_path / "report.md").exists()


def test_several_runs_need_out(tmp_path):
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    with pytest.raises(EmberError, match="output directory"):
        write_report([a, b])


def test_missing_matplotlib_is_explained(tmp_path, monkeypatch):
    run = make_run(tmp_path, "tiny")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(EmberError, match=r"pip install 'ember\[plots\]'"):
        write_report([run])
    assert not (run / "report.md").exists() and not (run / "plots").exists()
