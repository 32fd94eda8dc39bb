"""ember sweep: the statistics against scipy, the checks made before anything runs, failure and
resume handling, and one tiny end-to-end sweep through the CLI."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from ember import sweep as sweep_mod
from ember.atomic import mark
from ember.cli import main
from ember.config import load_config
from ember.errors import ConfigError, EmberError
from ember.run import MARKER
from ember.stats import betainc, permutation_test, summarize, t_cdf, t_ppf, t_sf, welch
from ember.sweep import parse_baseline, parse_grid, parse_metric, plan_sweep, read_metric, run_sweep

scipy_stats = pytest.importorskip("scipy.stats")

A = [2.1, 2.25, 2.0, 2.3, 2.18]
B = [2.4, 2.5, 2.31, 2.29]


# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize("df", [1, 2, 2.7, 4.9972, 9, 30, 1e4])
def test_t_distribution_matches_scipy(df):
    for p in [1e-6, 0.001, 0.025, 0.3, 0.5, 0.7, 0.975, 0.999999]:
        assert t_ppf(p, df) == pytest.approx(scipy_stats.t.ppf(p, df), rel=1e-10, abs=1e-12)
    for t in [-40.0, -3.0, -0.2, 0.0, 0.1, 2.5, 12.0, 1e3]:
        assert t_cdf(t, df) == pytest.approx(scipy_stats.t.cdf(t, df), rel=1e-10, abs=1e-15)
        assert t_sf(t, df) == pytest.approx(scipy_stats.t.sf(t, df), rel=1e-10, abs=1e-300)


def test_incomplete_beta_matches_scipy():
    from scipy.special import betainc as ref

    for a, b, x in itertools.product([0.5, 1.0, 2.5, 15.0], [0.5, 3.0, 40.0], [1e-4, 0.2, 0.5, 0.9, 0.9999]):
        assert betainc(a, b, x) == pytest.approx(ref(a, b, x), rel=1e-10, abs=1e-300)


def test_hand_computed_ci_and_quantile():
    # Student t with 2 df has a closed-form quantile: t = (2p - 1) / sqrt(2 p (1 - p))
    t975 = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    assert t_ppf(0.975, 2) == pytest.approx(t975, rel=1e-13)
    s = summarize([1.0, 2.0, 3.0])  # mean 2, sample std 1, CI 2 ± t975 / sqrt(3)
    assert (s["n"], s["mean"], s["std"]) == (3, 2.0, 1.0)
    assert s["ci_low"] == pytest.approx(2 - t975 / math.sqrt(3), rel=1e-13)
    assert s["ci_high"] == pytest.approx(2 + t975 / math.sqrt(3), rel=1e-13)
    assert summarize([5.0])["ci_low"] is None and summarize([])["mean"] is None


def test_welch_matches_scipy():
    w = welch(A, B)
    ref = scipy_stats.ttest_ind(A, B, equal_var=False)
    ci = ref.confidence_interval(0.95)
    assert w["diff"] == pytest.approx(np.mean(A) - np.mean(B), rel=1e-13)
    assert w["t"] == pytest.approx(ref.statistic, rel=1e-10)
    assert w["df"] == pytest.approx(ref.df, rel=1e-10)
    assert w["p"] == pytest.approx(ref.pvalue, rel=1e-8)
    assert (w["ci_low"], w["ci_high"]) == pytest.approx((ci.low, ci.high), rel=1e-8)
    # 1,2,3 vs 4,5,6: t = -3/sqrt(2/3), df = 4 exactly
    w = welch([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    assert w["df"] == pytest.approx(4.0, rel=1e-14) and w["t"] == pytest.approx(-3 / math.sqrt(2 / 3))
    assert w["p"] == pytest.approx(2 * scipy_stats.t.sf(3 / math.sqrt(2 / 3), 4), rel=1e-10)
    assert welch([1.0, 1.0], [1.0, 1.0])["p"] is None  # zero variance: no test, no crash


def _brute_force_p(a, b):
    pooled = [*a, *b]
    observed = abs(np.mean(a) - np.mean(b))
    hits = total = 0
    for idx in itertools.combinations(range(len(pooled)), len(a)):
        x = [pooled[i] for i in idx]
        y = [pooled[i] for i in range(len(pooled)) if i not in idx]
        hits += abs(np.mean(x) - np.mean(y)) >= observed - 1e-12
        total += 1
    return hits / total


def test_permutation_test_is_exact():
    perm = permutation_test(A, B)
    assert perm["exact"] and perm["relabelings"] == math.comb(9, 5)
    assert perm["p"] == pytest.approx(_brute_force_p(A, B), abs=1e-15)
    a, b = [2.1, 2.25, 2.0, 2.3], [2.4, 2.5, 2.31, 2.29]  # equal sizes: scipy's two-sided p is the same
    ref = scipy_stats.permutation_test(
        (a, b), lambda x, y: np.mean(x) - np.mean(y), permutation_type="independent", n_resamples=np.inf
    )
    assert permutation_test(a, b)["p"] == pytest.approx(ref.pvalue, abs=1e-12)
    # the floor: 3 seeds against 3 can never give p below 2 / C(6, 3) = 0.1
    floor = permutation_test([1.0, 2.0, 3.0], [10.0, 11.0, 12.0])
    assert floor["p"] == pytest.approx(0.1) and floor["p_min"] == pytest.approx(0.1)


def test_permutation_monte_carlo_is_seeded_and_close():
    exact = permutation_test(A, B)["p"]
    mc = permutation_test(A, B, max_exact=10)
    assert not mc["exact"] and mc["relabelings"] == 20_000
    assert mc == permutation_test(A, B, max_exact=10)  # same seed, same p
    assert abs(mc["p"] - exact) < 0.01  # 20k draws: standard error about 0.002


# ---------------------------------------------------------------- checks before anything runs


def test_parse_grid_metric_baseline():
    grid = parse_grid(["train.lr=0.003, 0.01", "model.n_layer=2,4"])
    assert grid == {"train.lr": ["0.003", "0.01"], "model.n_layer": ["2", "4"]}
    assert parse_metric("test.bpb") == ("test", "bpb") and parse_metric("summary.val_bpb") == (
        "summary",
        "val_bpb",
    )
    assert parse_baseline(None, grid) == {"train.lr": "0.003", "model.n_layer": "2"}
    assert parse_baseline("model.n_layer=4", grid) == {"train.lr": "0.003", "model.n_layer": "4"}
    for bad in (
        ["train.lr"],
        ["train.lr="],
        ["train.lr=1,,2"],
        ["=1,2"],
        ["train.lr=1", "train.lr=2"],
        ["run.seed=1,2"],
    ):
        with pytest.raises(EmberError):
            parse_grid(bad)
    for bad in ("bpb", "train.bpb", "test.", "test.b-p"):
        with pytest.raises(EmberError):
            parse_metric(bad)
    for bad in ("train.lr=0.5", "model.d_model=64"):
        with pytest.raises(EmberError):
            parse_baseline(bad, grid)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--grid", "train.lrr=0.1,0.2"], "train.lr"),  # unknown key: the nearest one suggested
        (["--grid", "train.lr=abc,0.01"], "train.lr"),  # wrong type
        (["--grid", "train.lr="], "empty value"),
        (["--grid", "train.lr=0.1", "--seeds", "0"], "--seeds"),
        (["--grid", "train.lr=0.1", "--metric", "loss"], "--metric"),
        (["--grid", "train.lr=0.1", "--grid", "train.lr=0.2"], "twice"),
        (["--grid", "train.lr=0.1", "run.seed=3"], "--seeds"),
        (["--grid", "train.lr=0.1,0.2", "--baseline", "train.lr=0.3"], "--baseline"),
    ],
)
def test_bad_sweeps_fail_before_any_run(tmp_path, capsys, argv, message):
    out = tmp_path / "sw"
    assert main(["sweep", "tiny", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ember: error:") and message in err
    assert not out.exists()


def test_wrong_type_is_a_config_error():
    with pytest.raises(ConfigError, match="lr=abc"):
        plan_sweep("tiny", ["train.lr=0.003,abc"], seeds=2, out="unused")


def test_read_metric_from_summary_and_eval(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"loss": 3.5, "val_bpb": float("nan")}))
    (tmp_path / "eval.json").write_text(json.dumps({"results": {"test": {"bpb": 1.25, "loss": 2.0}}}))
    assert read_metric(tmp_path, "summary.loss") == 3.5
    assert read_metric(tmp_path, "test.bpb") == 1.25
    for missing in ("summary.val_bpb", "summary.nope", "val.bpb", "test.ppl"):
        with pytest.raises(EmberError):
            read_metric(tmp_path, missing)


# ---------------------------------------------------------------- orchestration without training


def test_failed_run_is_reported_and_left_out(tmp_path, monkeypatch, capsys):
    """A fake `ember train` (no torch work): one run fails, one is half-finished and resumed."""
    calls = []

    def fake_call(cmd, log, env):
        calls.append(cmd)
        run_dir = Path(log).parent
        Path(log).write_text("step 1 | loss 9.9\nTraceback: boom\n")
        if "train.lr=0.01" in cmd and "run.seed=1" in cmd:
            return 1
        seed = int(next(a for a in cmd if a.startswith("run.seed=")).split("=")[1])
        (run_dir / "summary.json").write_text(json.dumps({"loss": 5.0 + seed + ("train.lr=0.01" in cmd)}))
        return 0

    monkeypatch.setattr(sweep_mod, "_call", fake_call)
    monkeypatch.setattr("ember.data.prepare.prepare", lambda *a, **k: None)
    out = tmp_path / "sw"
    killed = out / "runs" / "lr=0.003-seed2"  # unfinished, killed before its first checkpoint
    mark(out, "sweep")  # a sweep marks its folder before its first run (ember/atomic.py)
    killed.mkdir(parents=True)
    (killed / "metrics.jsonl").write_text('{"step": 1, "loss": 9.9}\n')
    resumable = out / "runs" / "lr=0.003-seed1" / "checkpoints" / "step-000002"  # unfinished, with one
    resumable.mkdir(parents=True)
    (resumable / MARKER).write_text("")
    (resumable.parent.parent / "metrics.jsonl").write_text('{"step": 2, "loss": 9.0}\n')
    sweep = plan_sweep("tiny", ["train.lr=0.003,0.01"], seeds=3, metric="summary.loss", out=out)
    record = run_sweep(sweep, log=print)
    assert record["failed"] == ["lr=0.01-seed1"]
    assert "Traceback: boom" in capsys.readouterr().out  # the end of its log
    assert all("train.resume=auto" in c for c in calls) and len(calls) == 6
    base, other = record["settings"]
    assert base["values"] == [5.0, 6.0, 7.0] and other["values"] == [6.0, 8.0] and other["n"] == 2
    assert "lr=0.01-seed1" in (out / "sweep.md").read_text()
    assert not (killed / "metrics.jsonl").exists()  # cleared, so the fresh run keeps one history
    assert (resumable.parent.parent / "metrics.jsonl").exists() and resumable.is_dir()  # kept to resume
    # again: only the failed run is tried again
    calls.clear()
    run_sweep(sweep, log=lambda _: None)
    assert len(calls) == 1 and "run.name=lr=0.01-seed1" in calls[0]


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_tiny_sweep_end_to_end(tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "sw"
    argv = [
        "sweep",
        "tiny",
        "--grid",
        "train.lr=0.003,0.01",
        "--seeds",
        "2",
        "--metric",
        "summary.loss",
        "--out",
        str(out),
        f"data.dir={tiny_data}",
        "data.val_fraction=0.1",
        "train.device=cpu",
        "train.max_steps=4",
        "train.eval_every=0",
        "train.report=false",
    ]
    assert main(argv) == 0
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert runs == ["lr=0.003-seed0", "lr=0.003-seed1", "lr=0.01-seed0", "lr=0.01-seed1"]
    record = json.loads((out / "sweep.json").read_text())
    values = {
        lr: [
            json.loads((out / "runs" / f"lr={lr}-seed{k}" / "summary.json").read_text())["loss"]
            for k in (0, 1)
        ]
        for lr in ("0.003", "0.01")
    }
    base, other = record["settings"]
    for s, lr in ((base, "0.003"), (other, "0.01")):
        assert s["values"] == values[lr]
        assert s["mean"] == pytest.approx(np.mean(values[lr]), rel=1e-12)
        assert s["std"] == pytest.approx(np.std(values[lr], ddof=1), rel=1e-12)
        half = scipy_stats.t.ppf(0.975, 1) * s["std"] / math.sqrt(2)
        assert (s["ci_low"], s["ci_high"]) == pytest.approx((s["mean"] - half, s["mean"] + half), rel=1e-9)
    ref = scipy_stats.ttest_ind(values["0.01"], values["0.003"], equal_var=False)
    assert other["welch"]["p"] == pytest.approx(ref.pvalue, rel=1e-8)
    assert other["permutation"]["p"] == pytest.approx(_brute_force_p(values["0.01"], values["0.003"]))
    assert base["verdict"] == "baseline"
    assert {r["seed"] for r in record["runs"]} == {0, 1} and record["failed"] == []
    assert (out / "plots" / "loss.png").exists() and (out / "plots" / "metric-vs-train.lr.png").exists()

    # again: everything is skipped, nothing is re-trained
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/*") if p.is_file()}
    capsys.readouterr()
    assert main(argv) == 0
    assert capsys.readouterr().out.count("skipped") == 4
    assert stamps == {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/*") if p.is_file()}
    assert json.loads((out / "sweep.json").read_text())["settings"] == record["settings"]

    # ember report SWEEP redraws sweep.md and the plots from sweep.json
    (out / "sweep.md").unlink()
    (out / "plots" / "loss.png").unlink()
    assert main(["report", str(out)]) == 0
    assert "| lr=0.01 | 2 |" in (out / "sweep.md").read_text()
    assert (out / "plots" / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_a_config_per_setting(tiny_data, tmp_path, monkeypatch, capsys):
    """``--grid config=A,B``: each setting trains its own config (an architecture that differs
    in several keys), checked before any run and trained as that config's own runs."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "wide.yaml").write_text("base: tiny\nmodel:\n  d_model: 96\n  n_head: 4\n")
    common = ["--seeds", "1", "--metric", "summary.loss", f"data.dir={tiny_data}", "data.val_fraction=0.1",
              "train.device=cpu", "train.max_steps=2", "train.eval_every=0",
              "train.report=false"]  # fmt: skip
    assert main(["sweep", "tiny", "--grid", "config=tiny,nope.yaml", *common]) == 2
    assert "nope.yaml" in capsys.readouterr().err and not (tmp_path / "runs").exists()
    assert sweep_mod.train_args("tiny", {"config": "wide.yaml", "train.lr": "0.01"}) == ("wide.yaml", ["train.lr=0.01"])  # fmt: skip # noqa: E501
    out = tmp_path / "sw"
    assert main(["sweep", "tiny", "--grid", "config=tiny,wide.yaml", "--out", str(out), *common]) == 0
    runs = (out / "runs").iterdir()
    widths = {run.name: load_config(str(run / "config.yaml")).model.d_model for run in runs}
    assert widths == {"config=tiny-seed0": 64, "config=wide.yaml-seed0": 96}
