"""``ember sweep``: a grid of settings × seeds, run as ordinary ember runs and compared with
a significance test against a baseline setting (DESIGN rule 10: "helps" is shown by a sweep).

    ember sweep tiny --grid train.lr=0.003,0.01 --seeds 3 --metric summary.loss train.max_steps=50
    ember sweep cpu-quick --grid config=cpu-quick,race/moe.yaml    # a config file per setting
    → runs/sweep-tiny/  runs/<setting>-seed<k>/ (each a run directory), sweep.json, sweep.md, plots/

    sweep = plan_sweep("tiny", ["train.lr=0.003,0.01"], seeds=3, metric="test.bpb")
    record = run_sweep(sweep)        # runs what is missing, writes sweep.json + sweep.md + plots

Each run is ``ember train CONFIG <overrides> <setting> run.seed=k`` in a subprocess (``--jobs``
at a time, output in ``RUN/train.log``), then, for a ``test.*`` or ``val.*`` metric,
``ember eval RUN --split SPLIT`` (``RUN/eval.log``); the metric is read back from the files the
run wrote (``read_metric``), so the sweep holds no state of its own that the runs lack.

Design choices:

- everything is checked before the first run starts: the grid syntax, and ``load_config`` of
  every grid combination, so an unknown key or a wrong type costs nothing;
- resumable: a run whose ``summary.json`` exists and whose metric can be read is skipped; one
  with ``summary.json`` but no metric only gets its evaluation; an unfinished run directory is
  trained again with ``train.resume=auto``, so it continues exactly from its last committed
  checkpoint (bitwise, see tests/test_trainer.py) instead of starting over; one killed before
  its first checkpoint holds nothing to continue, and the sweep, which owns that folder,
  clears it and starts the run afresh;
- a failed run is reported with the end of its log; the others go on, the statistics leave it
  out and say so, and the sweep exits nonzero;
- the verdict comes from Welch's t-test (unequal variances, Welch–Satterthwaite df): with the
  3–5 seeds a CPU affords it is the test that can reach p < 0.05 (an exact permutation test
  cannot go below 0.1 with 3 seeds a side), at the price of assuming roughly normal seed
  noise; the exact permutation p is shown beside it as the assumption-free check (see
  ember/stats.py and docs/sweep.md);
- the statistics are in ember/stats.py, and sweep.md + plots are drawn from sweep.json alone,
  so ``ember report SWEEP`` can redraw them.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ember.atomic import check_target, mark, output_dir, write_text_atomic
from ember.errors import ConfigError, EmberError
from ember.report.report import md_table, plot_series
from ember.run import latest_checkpoint, read_json, read_metrics, write_json
from ember.stats import CONFIDENCE, permutation_test, summarize, welch

SWEEP_JSON = "sweep.json"
SWEEP_MD = "sweep.md"
PLOTS = "plots"
RUNS = "runs"
METRIC_SOURCES = ("summary", "val", "test")  # summary.json, or eval.json of that split
ALPHA = 0.05
RESERVED = {"run.seed": "use --seeds or --seed-list", "run.name": "use --out", "run.out_dir": "use --out"}


@dataclass
class Sweep:
    config: str  # a YAML path or preset name
    grid: dict[str, list[str]]  # key -> values, as override text
    seeds: list[int]
    metric: str  # SOURCE.KEY
    baseline: dict[str, str]
    out: Path
    overrides: list[str] = field(default_factory=list)
    jobs: int = 1
    alpha: float = ALPHA

    def runs(self) -> list[tuple[str, dict[str, str], int]]:
        """(name, setting, seed), seed-major: every setting's first seed comes before any second."""
        return [
            (f"{setting_name(s, self.grid)}-seed{k}", s, k)
            for k in self.seeds
            for s in grid_points(self.grid)
        ]


# ---------------------------------------------------------------- parsing and validation


CONFIG_KEY = "config"  # --grid config=A,B: each setting trains its own config file or preset


def train_args(config: str, setting: dict[str, str]) -> tuple[str, list[str]]:
    """The config a setting trains and its overrides: ``--grid config=...`` picks the config
    (architectures that differ in several keys: a file each), every other key overrides it."""
    return setting.get(CONFIG_KEY, config), [f"{k}={v}" for k, v in setting.items() if k != CONFIG_KEY]


def grid_points(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """Every combination of the grid's values, as ``{key: value}``."""
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def parse_grid(specs: list[str]) -> dict[str, list[str]]:
    """``["train.lr=0.003,0.01", ...]`` -> ``{"train.lr": ["0.003", "0.01"]}``; values split on commas."""
    grid: dict[str, list[str]] = {}
    for spec in specs:
        key, eq, text = spec.partition("=")
        key = key.strip()
        if not eq or not key or " " in key:
            raise EmberError(f"--grid {spec!r} is not key=v1,v2,... (for example --grid train.lr=0.003,0.01)")
        if key in RESERVED:
            raise EmberError(f"--grid {key}: the sweep sets {key} itself; {RESERVED[key]}")
        if key in grid:
            raise EmberError(f"--grid {key} is given twice; list all its values in one --grid {key}=v1,v2")
        values = [v.strip() for v in text.split(",")]
        if not text.strip() or any(not v for v in values):
            raise EmberError(
                f"--grid {spec!r} has an empty value; write --grid {key}=v1,v2 with no empty item"
            )
        if len(set(values)) < len(values):
            raise EmberError(f"--grid {spec!r} repeats a value")
        grid[key] = values
    return grid


def parse_metric(metric: str) -> tuple[str, str]:
    """``"test.bpb"`` -> ``("test", "bpb")``."""
    source, dot, key = metric.partition(".")
    if not dot or source not in METRIC_SOURCES or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise EmberError(
            f"--metric {metric!r} is not SOURCE.KEY with SOURCE one of {', '.join(METRIC_SOURCES)} "
            "(for example test.bpb, val.loss, summary.loss)"
        )
    return source, key


def parse_baseline(spec: str | None, grid: dict[str, list[str]]) -> dict[str, str]:
    """``"train.lr=0.01,model.n_layer=2"`` -> a grid point; unnamed keys take their first value."""
    baseline = {key: values[0] for key, values in grid.items()}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or key not in grid:
            raise EmberError(
                f"--baseline {spec!r}: {item!r} is not key=value for a swept key ({', '.join(grid)})"
            )
        if value not in grid[key]:
            raise EmberError(f"--baseline {key}={value}: not among the swept values {', '.join(grid[key])}")
        baseline[key] = value
    return baseline


def setting_name(setting: dict[str, str], grid: dict[str, list[str]]) -> str:
    """A directory-safe name: ``lr=0.003+n_layer=2`` (the key's last part, whole if ambiguous)."""
    if not setting:
        return "base"
    lasts = [k.rsplit(".", 1)[-1] for k in grid]
    parts = []
    for key, value in setting.items():
        short = key.rsplit(".", 1)[-1]
        label = short if lasts.count(short) == 1 else key
        parts.append(f"{label}={re.sub(r'[^A-Za-z0-9._-]', '_', value)}")
    return "+".join(parts)


def plan_sweep(
    config: str,
    grid: list[str],
    seeds: int | None = None,
    seed_list: list[int] | None = None,
    metric: str = "test.bpb",
    baseline: str | None = None,
    out: str | os.PathLike | None = None,
    overrides: list[str] = (),
    jobs: int = 1,
    alpha: float = ALPHA,
) -> Sweep:
    """Parse and check everything; raise ``EmberError`` before any run starts."""
    from ember.config import load_config

    overrides = list(overrides)
    for o in overrides:
        key = o.partition("=")[0].strip()
        if key in RESERVED:
            raise EmberError(f"override {o!r}: the sweep sets {key} itself; {RESERVED[key]}")
    parsed = parse_grid(list(grid))
    if seed_list is not None and (not seed_list or len(set(seed_list)) < len(seed_list)):
        raise EmberError("--seed-list needs distinct seeds, e.g. --seed-list 0,1,2")
    if seed_list is None and (seeds is None or seeds < 1):
        raise EmberError(f"--seeds must be at least 1 (got {seeds}); statistics need 2 or more")
    parse_metric(metric)
    if jobs < 1:
        raise EmberError(f"--jobs must be at least 1 (got {jobs})")
    if not 0 < alpha < 1:
        raise EmberError(f"--alpha must be between 0 and 1 (got {alpha})")
    sweep = Sweep(
        config=str(config),
        grid=parsed,
        seeds=list(seed_list) if seed_list is not None else list(range(seeds)),
        metric=metric,
        baseline=parse_baseline(baseline, parsed),
        out=Path(out) if out is not None else Path("runs") / f"sweep-{Path(str(config)).stem}",
        overrides=overrides,
        jobs=jobs,
        alpha=alpha,
    )
    load_config(config, overrides)  # the base alone first: its errors are not the grid's
    for setting in grid_points(parsed):
        try:
            setting_config, setting_overrides = train_args(config, setting)
            load_config(setting_config, [*overrides, *setting_overrides])
        except ConfigError as e:
            raise ConfigError(f"--grid setting {setting_name(setting, parsed)}: {e}") from None
    names = [name for name, _, _ in sweep.runs()]
    if len(set(names)) < len(names):
        raise EmberError("two grid settings give the same run directory name; use distinct values")
    check_target(sweep.out, kind="sweep", force=True)  # a run or a foreign folder is refused here
    previous = read_json(sweep.out / SWEEP_JSON)
    if previous and (previous.get("config"), previous.get("overrides")) != (sweep.config, overrides):
        raise EmberError(
            f"{sweep.out} holds a sweep of {previous.get('config')} "
            f"{' '.join(previous.get('overrides', []))}; its runs would not match. Pass another --out, "
            "or remove that directory"
        )
    return sweep


# ---------------------------------------------------------------- one run


def read_metric(run_dir: Path, metric: str) -> float:
    """The metric from the run's files: ``summary.KEY`` from ``summary.json``; ``val.KEY`` /
    ``test.KEY`` from ``eval.json["results"][split][KEY]``. Raises EmberError if absent or not finite."""
    source, key = parse_metric(metric)
    name = "summary.json" if source == "summary" else "eval.json"
    record = read_json(Path(run_dir) / name)
    if record is None:
        raise EmberError(f"no readable {name} in {run_dir}")
    if source != "summary":
        record = (record.get("results") or {}).get(source)
        if not isinstance(record, dict):
            raise EmberError(f"{run_dir / name} has no results for split {source!r}")
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EmberError(f"{run_dir / name} has no number {key!r} (keys: {', '.join(sorted(record))})")
    if not math.isfinite(value):
        raise EmberError(f"{metric} of {run_dir.name} is {value} (the run diverged?)")
    return float(value)


def _child_env(jobs: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # each run is a fresh single-process job
    root = str(Path(__file__).resolve().parent.parent)  # this ember, even if not installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if jobs > 1 and "OMP_NUM_THREADS" not in env:  # share the cores instead of oversubscribing
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    return env


def _call(cmd: list[str], log: Path, env: dict[str, str]) -> int:
    """Run ``cmd`` with its output appended to ``log``; its exit code."""
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _run_one(sweep: Sweep, name: str, setting: dict[str, str], seed: int, env: dict[str, str]) -> dict:
    run_dir = sweep.out / RUNS / name
    result = {"name": name, "setting": setting, "seed": seed, "value": None, "status": "ok", "error": None}

    def failed(error: str, log: str = "train.log") -> dict:
        return {**result, "status": "failed", "error": error, "log": log}

    try:
        return {**result, "value": read_metric(run_dir, sweep.metric), "status": "skipped"}
    except EmberError:
        pass
    if not (run_dir / "summary.json").exists():
        if latest_checkpoint(run_dir / "checkpoints") is None:
            shutil.rmtree(run_dir, ignore_errors=True)  # killed before its first checkpoint: start over
        mark(run_dir, "run")  # before train.log: `ember train` then knows the folder as a run
        config, setting_overrides = train_args(sweep.config, setting)
        cmd = [
            *(sys.executable, "-m", "ember", "train", config),
            *sweep.overrides,
            *setting_overrides,
            f"run.seed={seed}",
            f"run.out_dir={sweep.out / RUNS}",
            f"run.name={name}",
            "train.resume=auto",
        ]
        code = _call(cmd, run_dir / "train.log", env)
        if code != 0:
            return failed(f"ember train exited with code {code}")
    source = parse_metric(sweep.metric)[0]
    if source != "summary":
        cmd = [sys.executable, "-m", "ember", "eval", str(run_dir), "--split", source]  # writes eval.json
        code = _call(cmd, run_dir / "eval.log", env)
        if code != 0:
            return failed(f"ember eval exited with code {code}", "eval.log")
    try:
        return {**result, "value": read_metric(run_dir, sweep.metric)}
    except EmberError as e:
        return failed(str(e))


# ---------------------------------------------------------------- statistics


def _verdict(w: dict, alpha: float) -> str:
    if w["p"] is None or not math.isfinite(w["p"]):
        return "no data"
    if w["p"] <= alpha:
        return "lower" if w["diff"] < 0 else "higher"
    return "no significant difference"


def analyze(record: dict) -> list[dict]:
    """Per setting: n, mean, std, CI; and against the baseline: the difference of means with
    its Welch CI, Welch's p, the permutation p and the verdict. Failed runs are left out."""
    grid, baseline, alpha = record["grid"], record["baseline"], record["alpha"]

    def values_of(setting):
        runs = [r for r in record["runs"] if r["setting"] == setting and r["value"] is not None]
        return [r["value"] for r in sorted(runs, key=lambda r: r["seed"])]

    base = values_of(baseline)
    rows = []
    for setting in grid_points(grid):
        values = values_of(setting)
        row = {"name": setting_name(setting, grid), "setting": setting, "values": values, **summarize(values)}
        if setting == baseline:
            row.update(baseline=True, welch=None, permutation=None, verdict="baseline")
        else:
            w, perm = welch(values, base, record["confidence"]), permutation_test(values, base)
            row.update(baseline=False, welch=w, permutation=perm, verdict=_verdict(w, alpha))
        rows.append(row)
    return rows


# ---------------------------------------------------------------- outputs


def _g(x: float | None, spec: str = ".5g") -> str:
    return "—" if x is None else f"{x:{spec}}"


def table(record: dict) -> tuple[list[str], list[list[str]]]:
    """The summary table (header, rows) that sweep.md and the terminal show."""
    ci = f"{100 * record['confidence']:g}% CI"
    header = ["setting", "n", f"mean ± {ci}", f"Δ vs baseline [{ci}]", "Welch p", "perm. p", "verdict"]
    rows = []
    for s in record["settings"]:
        half = f" ± {_g(s['ci_high'] - s['mean'], '.2g')}" if s["ci_high"] is not None else ""
        w, perm = s["welch"] or {}, s["permutation"] or {}
        delta = "—" if w.get("diff") is None else f"{w['diff']:+.4g}"
        if w.get("ci_low") is not None:  # only where there is a diff
            delta += f" [{w['ci_low']:+.3g}, {w['ci_high']:+.3g}]"
        pm = _g(perm.get("p"), ".3g") + ("" if perm.get("exact", True) else " (MC)")
        rows.append(
            [s["name"], str(s["n"]), _g(s["mean"]) + half, delta, _g(w.get("p"), ".3g"), pm, s["verdict"]]
        )
    return header, rows


def print_table(record: dict, title: str) -> None:
    """``table`` in the terminal, as `ember sweep` prints it."""
    from rich.console import Console
    from rich.table import Table

    header, rows = table(record)
    out = Table(*header, title=title, title_justify="left")
    for row in rows:
        out.add_row(*row)
    Console(width=max(Console().width, 120)).print(out)


def _markdown(record: dict, plots: list[tuple[str, str]] | None) -> str:
    header, rows = table(record)
    failed = [r for r in record["runs"] if r["status"] == "failed"]
    base = setting_name(record["baseline"], record["grid"])
    lines = [
        f"# Sweep: {record['config']} {' '.join(record['overrides'])}".rstrip(),
        "",
        f"Metric `{record['metric']}` over seeds {', '.join(map(str, record['seeds']))}; "
        f"{len(record['runs'])} runs ({len(failed)} failed). Baseline: `{base}`.",
        "",
        md_table(header, rows),
        "",
        f"Δ is the setting's mean minus the baseline's, with Welch's {100 * record['confidence']:g}% CI. "
        f"The verdict (lower / higher / no significant difference at α = {record['alpha']:g}) comes from "
        "Welch's t-test (two-sided, unequal variances), which assumes roughly normal seed noise. The "
        "permutation p beside it is exact over every relabeling of the seeds (MC: 20 000 seeded random "
        "ones) with no such assumption, but has a floor: with 3 seeds against 3 it cannot go below 0.1.",
        "",
    ]
    if failed:
        lines += ["## Failed runs (left out of the statistics)", ""]
        lines += [f"- `{r['name']}`: {r['error']} (see runs/{r['name']}/{r['log']})" for r in failed] + [""]
    if plots is None:
        lines += ["Plots skipped: matplotlib is not installed (pip install 'ember[plots]').", ""]
    elif plots:
        lines += ["## Plots", ""] + [f"![{title}]({PLOTS}/{name})\n" for title, name in plots]
    runs = [[r["name"], r["seed"], r["value"], r["status"]] for r in record["runs"]]
    lines += ["## Runs", "", md_table(["run", "seed", "value", "status"], runs)]
    return "\n".join(lines) + "\n"


def _draw_plots(record: dict, sweep_dir: Path, out: Path) -> list[tuple[str, str]] | None:
    """metric-vs-KEY.png per swept key (95% CI error bars) and loss.png (mean over seeds) in
    ``out``/plots; None when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401  (plot_series draws with it)
    except ImportError:
        return None
    plots_dir = out / PLOTS
    plots_dir.mkdir(parents=True, exist_ok=True)
    grid, metric, drawn = record["grid"], record["metric"], []
    for key, values in grid.items():
        try:
            xs = [float(v) for v in values]
            axes = {"xscale": "log"} if min(xs) > 0 and max(xs) / min(xs) >= 10 else {}
        except ValueError:  # values that are not numbers: evenly spaced, labelled
            xs = list(range(len(values)))
            axes = {"xticks": xs, "xticklabels": values}
        others = {k: v for k, v in grid.items() if k != key}
        series = []
        for i, fixed in enumerate(grid_points(others)):
            line = [
                s
                for s in record["settings"]
                if fixed.items() <= s["setting"].items() and s["mean"] is not None
            ]
            err = [s["mean"] - s["ci_low"] if s["ci_low"] is not None else 0.0 for s in line]
            style = {"yerr": err, "marker": "o", "capsize": 4, "color": f"C{i}"}
            x = [xs[values.index(s["setting"][key])] for s in line]  # settings are in grid order
            series.append((setting_name(fixed, others), x, [s["mean"] for s in line], style))
        title = f"{metric} vs {key} (mean, {100 * record['confidence']:g}% CI)"
        if plot_series(plots_dir / f"metric-vs-{key}.png", series, title, key, metric, **axes):
            drawn.append((f"{metric} vs {key}", f"metric-vs-{key}.png"))

    loss = []
    for i, s in enumerate(record["settings"]):
        curves = [
            {r["step"]: float(r["loss"]) for r in read_metrics(sweep_dir / RUNS / run["name"]) if "loss" in r}
            for run in record["runs"]
            if run["setting"] == s["setting"] and run["value"] is not None
        ]
        steps = sorted(set().union(*curves))
        means = [math.fsum(c[t] for c in curves if t in c) / sum(t in c for c in curves) for t in steps]
        loss.append((f"{s['name']} (n={len(curves)})", steps, means, {"color": f"C{i}"}))
    title = "Training loss, mean over seeds"
    if plot_series(plots_dir / "loss.png", loss, title, "step", "loss (nats/token)"):
        drawn.append((title, "loss.png"))
    return drawn


def _write_markdown(record: dict, sweep_dir: Path, out: Path | None = None) -> Path:
    """plots/ and sweep.md from ``record`` (with its ``settings``) in ``out`` (default: the
    sweep's own folder); the path of sweep.md."""
    out = out or sweep_dir
    write_text_atomic(out / SWEEP_MD, _markdown(record, _draw_plots(record, sweep_dir, out)))
    return out / SWEEP_MD


def render_sweep(sweep_dir: Path, out: Path | None = None) -> Path:
    """Redraw sweep.md + plots from an existing sweep.json (``ember report SWEEP [--out OUT]``)."""
    record = read_json(Path(sweep_dir) / SWEEP_JSON)
    if record is None or "runs" not in record:
        raise EmberError(f"{sweep_dir / SWEEP_JSON} is missing or unreadable; run `ember sweep` again")
    record["settings"] = analyze(record)
    if out is not None:
        out = output_dir(out, kind="report", sources=[sweep_dir], force=True)
    return _write_markdown(record, Path(sweep_dir), out)


# ---------------------------------------------------------------- the sweep


def run_sweep(sweep: Sweep, command: str | None = None, log=print) -> dict:
    """Run every (setting, seed) not done yet, ``sweep.jobs`` at a time; write and return the record."""
    from ember.config import load_config
    from ember.data.prepare import prepare
    from ember.train.tasks import task_class

    output_dir(sweep.out, kind="sweep", force=True)
    runs = sweep.runs()
    todo = [r for r in runs if not (sweep.out / RUNS / r[0] / "summary.json").exists()]
    prepared = set()
    for _, setting, _ in todo:  # once, here: parallel runs must not race to prepare the same data
        config, setting_overrides = train_args(sweep.config, setting)
        cfg = load_config(config, [*sweep.overrides, *setting_overrides])
        data = json.dumps(vars(cfg.data), sort_keys=True, default=str)
        if data not in prepared and task_class(cfg.train.task).tokens:  # (an image task reads no shards)
            prepared.add(data)
            prepare(cfg, command=command, log=log)

    env = _child_env(sweep.jobs)
    done = len(runs) - len(todo)
    log(f"sweep: {len(runs)} runs ({done} trained before) into {sweep.out}, {sweep.jobs} at a time")
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=sweep.jobs) as pool:
        futures = {pool.submit(_run_one, sweep, name, s, k, env): name for name, s, k in runs}
        for i, future in enumerate(concurrent.futures.as_completed(futures), 1):
            r = future.result()
            results[r["name"]] = r
            value = f"{sweep.metric} = {r['value']:.6g}" if r["value"] is not None else r["error"]
            log(f"[{i}/{len(runs)}] {r['name']}: {r['status']}, {value}")

    record = {
        "config": sweep.config,
        "overrides": sweep.overrides,
        "grid": sweep.grid,
        "seeds": sweep.seeds,
        "metric": sweep.metric,
        "baseline": sweep.baseline,
        "alpha": sweep.alpha,
        "confidence": CONFIDENCE,
        "verdict_test": "welch",
        "command": command,
        "runs": [results[name] for name, _, _ in runs],
    }
    record["settings"] = analyze(record)
    record["failed"] = [r["name"] for r in record["runs"] if r["status"] == "failed"]
    write_json(sweep.out / SWEEP_JSON, record)  # sweep.json, then plots/ and sweep.md last
    _write_markdown(record, sweep.out)
    for r in record["runs"]:
        if r["status"] == "failed":
            tail = _tail(sweep.out / RUNS / r["name"] / r["log"])
            log(f"run {r['name']} failed: {r['error']}; its log ends:\n{tail}")
    return record
