"""``ember report``: one run (or several, compared) as ``report.md`` + ``plots/*.png``.

    write_report([Path("runs/tiny")])                                  # → runs/tiny/report.md
    write_report([Path("runs/a"), Path("runs/b")], Path("runs/a-vs-b"))  # overlaid curves + config diff

Everything comes from the run directory (DESIGN rule 6): ``metrics.jsonl`` for the curves,
``summary.json`` (else the last records) for the final numbers, ``config.yaml`` for the config
diff and the data directory, whose ``manifest.json`` gives the data summary, ``env.json``,
and ``eval.json`` / ``samples.md`` when later verbs have written them.

Design choices:

- matplotlib (the ``plots`` extra) is imported only here and only when a report is made,
  through its object API (``Figure`` + the Agg canvas) rather than ``pyplot``: no global
  figure state and no display backend, so it runs headless and in threads;
- ``data.dir`` in a config is usually relative to where ``ember train`` ran, so the manifest
  is looked for from the current directory, then from the run directory and its parents;
- a truncated last line in ``metrics.jsonl`` (a run killed mid-write) is skipped with a note
  rather than failing the report;
- each file is written to a temporary name and renamed into place, ``report.md`` last.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from ember.atomic import output_dir, write_text_atomic
from ember.data.manifest import MANIFEST, read_manifest
from ember.errors import DataError, EmberError
from ember.run import metrics_lines, read_json

REPORT = "report.md"
PLOTS = "plots"

# (file stem, y key, title, y label), each plotted against the optimizer step
STEP_PLOTS = [
    ("lr", "lr", "Learning rate", "learning rate"),
    ("grad_norm", "grad_norm", "Gradient norm (before clipping)", "grad norm"),
    ("tokens_per_s", "tokens_per_s", "Throughput", "tokens / s"),
    ("dpo_margins", "rewards/margins", "DPO reward margin, chosen − rejected", "β · log-ratio"),
    ("dpo_accuracies", "rewards/accuracies", "DPO pairs whose chosen reply has the larger reward", "share"),
    ("grpo_reward", "reward", "GRPO reward of the sampled completions (mean)", "reward"),
    ("grpo_accuracy", "accuracy", "GRPO sampled completions scored correct", "share"),
    ("grpo_kl", "kl", "GRPO KL to the reference (k3 estimate, per token)", "nats"),
    ("grpo_length", "completion_length", "GRPO completion length", "tokens"),
    ("grpo_zero_std", "zero_std_groups", "GRPO groups whose completions all scored alike", "share"),
    ("train_accuracy", "train_accuracy", "Training accuracy (each step's images)", "accuracy"),
]  # a plot whose key no run logged is left out
DYNAMICS_PLOTS = [  # train.log_dynamics: one line per layer (one run)
    ("update_ratio", "Update / weight RMS per layer (train.log_dynamics)", "ratio", "log"),
    ("act_rms", "Block output RMS (the residual stream)", "RMS", "linear"),
    ("act_kurtosis", "Block output kurtosis (3: Gaussian; large: outlier features)", "kurtosis", "log"),
    ("attn_entropy", "Attention entropy, mean over the heads of each layer", "nats", "linear"),
    ("logit_max", "Largest logit", "logit", "linear"),
]


@dataclass
class Run:
    path: Path
    label: str
    config: dict | None
    env: dict | None
    summary: dict | None
    train: list[dict]  # records with a training "loss"
    evals: list[dict]  # records with "val_loss"
    bad_lines: int
    tasks: list[dict]  # records with "task_accuracy" (runs evaluated on a task) or "pair_accuracy" (rm)
    eval: dict | None
    samples: str | None


# ---------------------------------------------------------------- reading a run


def _num(value) -> float | None:
    """A plottable number; the strings "nan"/"inf" that MetricsLog writes for non-finite values count."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def load_run(path: Path, label: str | None = None) -> Run:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not path.is_dir():
        raise EmberError(f"{path} is not a directory; give a run directory made by `ember train CONFIG`")
    if not metrics.is_file():
        raise EmberError(
            f"{path} is not an ember run directory (no metrics.jsonl); run `ember train CONFIG` first"
        )
    records, bad = metrics_lines(path)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    tasks = [r for r in records if "task_accuracy" in r or "pair_accuracy" in r]
    if not train and not evals:
        raise EmberError(f"{metrics} holds no training records yet; run `ember train CONFIG` first")
    try:
        config = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        config = None
    samples = path / "samples.md"
    return Run(
        path=path,
        label=label or path.name,
        config=config if isinstance(config, dict) else None,
        env=read_json(path / "env.json"),
        summary=read_json(path / "summary.json"),
        train=train,
        evals=evals,
        bad_lines=bad,
        tasks=tasks,
        eval=read_json(path / "eval.json"),
        samples=samples.read_text(encoding="utf-8", errors="replace") if samples.is_file() else None,
    )


def _labels(paths: list[Path]) -> list[str]:
    """Run names, with parent folders added until they are unique."""
    paths = [p.resolve() for p in paths]
    for depth in range(1, 1 + max(len(p.parts) for p in paths)):
        labels = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{p.name} ({i})" for i, p in enumerate(paths, 1)]  # the same directory given twice


def _find_manifest(run: Run) -> tuple[Path | None, dict | None, str]:
    """(data dir, manifest, note): the run's data directory, tried as the module docstring says
    (``runs/NAME`` sits beside ``data/``) and taken only if its manifest was made from the same
    sources and tokenizer settings as the run's config; else why not."""
    data_cfg = (run.config or {}).get("data") or {}
    if not data_cfg.get("dir"):
        return None, None, "config.yaml is missing or names no data.dir"
    d = Path(data_cfg["dir"])
    bases = [Path.cwd(), run.path, *run.path.resolve().parents[:2]]
    for candidate in [d] if d.is_absolute() else [base / d for base in bases]:
        if not (candidate / MANIFEST).is_file():
            continue
        try:
            manifest = read_manifest(candidate)
        except DataError as e:
            return candidate, None, str(e)
        made_from = (manifest.get("config") or {}).get("data") or {}
        if all(
            made_from.get(k, data_cfg.get(k)) == data_cfg.get(k)
            for k in ("sources", "tokenizer", "vocab_size")
        ):
            return candidate, manifest, ""
    return None, None, f"data.dir {str(d)!r} was not found from here or beside the run directory"


# ---------------------------------------------------------------- plots


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise EmberError("plots need matplotlib: pip install 'ember[plots]'") from None
    return Figure, FigureCanvasAgg


def plot_series(
    path: Path, series: list[tuple], title: str, xlabel: str, ylabel: str, yscale: str = "linear", **axes
) -> bool:
    """Draw ``series`` of (label, xs, ys, line style) into one PNG, with error bars where a style
    has ``yerr``; ``axes`` are further ``Axes.set`` properties. False if there is nothing to draw."""
    series = [s for s in series if s[1]]
    if not series:
        return False
    Figure, Canvas = _matplotlib()
    fig = Figure(figsize=(7, 4), dpi=100, layout="tight")
    Canvas(fig)
    ax = fig.add_subplot()
    for label, xs, ys, style in series:
        (ax.errorbar if "yerr" in style else ax.plot)(xs, ys, label=label, **style)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel, yscale=yscale, **axes)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return True


def _xy(records: list[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    pairs = [(_num(r.get(x)), _num(r.get(y))) for r in records]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    return [a for a, _ in pairs], [b for _, b in pairs]


def _running_mean(ys: list[float], window: int) -> list[float]:
    """Each value replaced by the mean of the ``window`` values ending at it (fewer at the start)."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y - (ys[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _draw_plots(runs: list[Run], plots_dir: Path) -> list[tuple[str, str]]:
    """Write the PNGs; return (title, file name) of those drawn."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    many, drawn, loss = len(runs) > 1, [], []
    for i, run in enumerate(runs):
        prefix = f"{run.label} " if many else ""
        val_style = {"color": f"C{i if many else 1}", "linestyle": "--", "marker": "o", "markersize": 3}
        loss.append((f"{prefix}train", *_xy(run.train, "tokens", "loss"), {"color": f"C{i}"}))
        loss.append((f"{prefix}val", *_xy(run.evals, "tokens", "val_loss"), val_style))
    if plot_series(plots_dir / "loss.png", loss, "Loss", "tokens", "loss (nats/token)"):
        drawn.append(("Train and validation loss", "loss.png"))
    val_accuracy = [(f"{run.label} val", *_xy([r for r in run.evals if "val_accuracy" in r], "step",
                                               "val_accuracy"), {"color": f"C{i}", "marker": "o"})
                    for i, run in enumerate(runs)]  # fmt: skip
    if plot_series(plots_dir / "val_accuracy.png", val_accuracy, "Validation accuracy", "step", "accuracy"):
        drawn.append(("Validation accuracy (image classifier)", "val_accuracy.png"))
    for key, title, ylabel in (("task_accuracy", "Task accuracy on held-out test problems", "exact match"),
                               ("pair_accuracy", "Pair accuracy on held-out pairs (reward model)", "ranked right")):  # fmt: skip # noqa: E501
        accuracy = [(run.label, *_xy([r for r in run.tasks if key in r], "step", key), {"color": f"C{i}", "marker": "o"})  # fmt: skip # noqa: E501
                    for i, run in enumerate(runs)]  # fmt: skip
        if plot_series(plots_dir / f"{key}.png", accuracy, title, "step", ylabel):
            drawn.append((title, f"{key}.png"))
    for stem, key, title, ylabel in STEP_PLOTS:
        series = []
        for i, run in enumerate(runs):
            xs, ys = _xy(run.train, "step", key)
            if len(ys) < 200:
                series.append((run.label, xs, ys, {"color": f"C{i}"}))
                continue  # a long noisy series (GRPO's rewards): faint, with its running mean over it
            series.append((f"{run.label} (per step)", xs, ys, {"color": f"C{i}", "alpha": 0.25}))
            series.append((f"{run.label} (mean of {len(ys) // 40})", xs, _running_mean(ys, len(ys) // 40),
                           {"color": f"C{i}"}))  # fmt: skip
        if plot_series(plots_dir / f"{stem}.png", series, title, "step", ylabel):
            drawn.append((title, f"{stem}.png"))
    if not many:
        drawn += _dynamics_plots(runs[0], plots_dir) + _moe_plots(runs[0], plots_dir)
    return drawn


def _moe_plots(run: Run, plots_dir: Path) -> list[tuple[str, str]]:
    """model.mlp=moe: each layer's expert load (the share of the routed (token, expert) pairs each
    expert got, ``moe_load.L.e``, averaged over the last quarter of the logged steps) as bars
    beside the even share, and the routers' balance and z losses per layer over the steps."""
    loads: dict[int, dict[int, str]] = {}
    for key in {k for r in run.train for k in r if k.startswith("moe_load.")}:
        _, layer, expert = key.split(".")
        loads.setdefault(int(layer), {})[int(expert)] = key
    if not loads:
        return []
    tail = run.train[-max(1, len(run.train) // 4) :]
    Figure, Canvas = _matplotlib()
    fig = Figure(figsize=(7, 1.2 + 1.6 * len(loads)), dpi=100, layout="tight")
    Canvas(fig)
    for i, (layer, keys) in enumerate(sorted(loads.items())):
        ax = fig.add_subplot(len(loads), 1, i + 1)
        experts = sorted(keys)
        ax.bar(experts, [sum(_num(r.get(keys[e])) or 0.0 for r in tail) / len(tail) for e in experts])
        ax.axhline(1 / len(experts), color="gray", linestyle="--", linewidth=1)  # an even load
        ax.set(ylabel=f"layer {layer}", xticks=experts)
    ax.set(xlabel="expert")
    fig.suptitle(f"Expert load: share of routed tokens, last {len(tail)} logged steps (dashed: even)")
    tmp = plots_dir / f".moe_load.png.tmp-{os.getpid()}"
    fig.savefig(tmp, format="png")
    os.replace(tmp, plots_dir / "moe_load.png")
    drawn = [("Expert load per MoE layer", "moe_load.png")]
    for family, title in (("moe_balance", "Router load-balancing loss per layer (k at an even load)"),
                          ("moe_z", "Router z-loss per layer")):  # fmt: skip
        series = [(f"layer {i}", *_xy(run.train, "step", f"{family}.{i}"), {}) for i in sorted(loads)]
        if plot_series(plots_dir / f"{family}.png", series, title, "step", family):
            drawn.append((title, f"{family}.png"))
    return drawn


def _dynamics_plots(run: Run, plots_dir: Path) -> list[tuple[str, str]]:
    drawn = []
    for family, title, ylabel, yscale in DYNAMICS_PLOTS:
        prefix = f"dyn/{family}"
        keys = sorted({k for r in run.train for k in r if k == prefix or k.startswith(prefix + "/")})
        groups: dict[str, list[str]] = {}
        for k in keys:  # attention entropy: the heads of a layer averaged into one line
            groups.setdefault("/".join(k.split("/")[2:3]) or family, []).append(k)
        series = []
        for label, members in groups.items():
            rows = [r for r in run.train if all(m in r for m in members)]
            xs = [r["step"] for r in rows]
            ys = [sum(float(r[m]) for m in members) / len(members) for r in rows]  # ("nan" as written)
            series.append((label, xs, ys, {"marker": "o", "markersize": 3}))
        if plot_series(plots_dir / f"dyn_{family}.png", series, title, "step", ylabel, yscale):
            drawn.append((title, f"dyn_{family}.png"))
    return drawn


# ---------------------------------------------------------------- tables


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (list, dict)):
        text = json.dumps(value)
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _count(value) -> str | None:
    return f"{value:,}" if isinstance(value, int) else value


def _fmt(value: float | None, spec: str, unit: str = "") -> str | None:
    return None if value is None else f"{value:{spec}}{unit}"  # nan/inf show as such


def _duration(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def _final_metrics(run: Run) -> dict[str, str | None]:
    """The numbers a reader compares first; summary.json wins, else the last records."""
    s = run.summary or {}
    last_train = run.train[-1] if run.train else {}
    last_eval = run.evals[-1] if run.evals else {}
    val_losses = [v for v in (_num(r["val_loss"]) for r in run.evals) if v is not None and math.isfinite(v)]
    best = _num(s.get("best_val_loss"))
    if best is None and val_losses:
        best = min(val_losses)
    best_step = s.get("best_step")
    if (best_step is None or best_step < 0) and val_losses:
        best_step = next(r["step"] for r in run.evals if _num(r["val_loss"]) == best)
    tps = [v for v in (_num(r.get("tokens_per_s")) for r in run.train) if v is not None and math.isfinite(v)]
    mfu = [v for v in (_num(r.get("mfu")) for r in run.train) if v is not None]
    mem = [v for v in (_num(r.get("peak_mem_mb")) for r in run.train) if v is not None]
    params = _num(s.get("n_params"))

    def pick(key):
        return _num(last_eval.get(key, s.get(key)))

    return {
        "steps": _fmt(_num(s.get("step", last_train.get("step"))), ",.0f"),
        "tokens": _fmt(_num(s.get("tokens", last_train.get("tokens"))), ",.0f"),
        "parameters": None if params is None else f"{params:,.0f} ({params / 1e6:.2f}M)",
        "final train loss": _fmt(_num(s.get("loss", last_train.get("loss"))), ".4f"),
        "best val loss": _fmt(best, ".4f", f" (step {best_step})" if best_step else ""),
        "final val loss": _fmt(pick("val_loss"), ".4f"),
        "final val perplexity": _fmt(pick("val_ppl"), ".2f"),
        "final val bits/byte": _fmt(pick("val_bpb"), ".4f"),
        "tokens/s (median)": _fmt(statistics.median(tps) if tps else None, ",.0f"),
        "MFU (median)": _fmt(100 * statistics.median(mfu) if mfu else None, ".1f", "%"),
        "peak memory": _fmt(max(mem) if mem else None, ",.0f", " MiB"),
        "training time": _duration(_num(s.get("elapsed_s", last_train.get("elapsed_s")))),
        "skipped steps": _fmt(_num(s.get("skipped_steps", last_train.get("skipped"))), ".0f"),
        "GRPO step time: generation / log-probs / update": _time_split(run.train),
    }


def _time_split(records: list[dict]) -> str | None:
    """Where GRPO steps spent their time (sums over the run's steps), or None for other runs."""
    parts = [sum(_num(r.get(k)) or 0.0 for r in records) for k in ("gen_s", "ref_s", "fwd_bwd_s", "opt_s")]
    if not any("gen_s" in r for r in records):
        return None
    gen, ref, update = parts[0], parts[1], parts[2] + parts[3]
    total = max(gen + ref + update, 1e-9)
    shares = " / ".join(f"{100 * v / total:.0f}%" for v in (gen, ref, update))
    return f"{_duration(gen)} / {_duration(ref)} / {_duration(update)} ({shares})"


def _flatten(d: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            flat.update(_flatten(v, f"{key}."))
        else:
            flat[key] = v
    return flat


_MISSING = object()


def config_diff(configs: list[dict]) -> list[tuple[str, list]]:
    """(dotted key, [value per config]) for every key whose value is not the same in all."""
    flats = [_flatten(c) for c in configs]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    rows = []
    for key in keys:
        values = [f.get(key, _MISSING) for f in flats]
        if any(v != values[0] for v in values[1:]):
            rows.append((key, [None if v is _MISSING else v for v in values]))
    return rows


# ---------------------------------------------------------------- sections


def _rel(path: Path, out: Path) -> str:
    return Path(os.path.relpath(path.resolve(), out.resolve())).as_posix()


def _demote(markdown: str) -> str:
    """Push headings one level down so an included file nests under our section."""
    lines, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        lines.append("#" + line if line.startswith("#") and not fenced else line)
    return "\n".join(lines)


def _config_section(runs: list[Run], out: Path) -> list[str]:
    configs = [run for run in runs if run.config is not None]
    links = ", ".join(f"[{run.label}]({_rel(run.path / 'config.yaml', out)})" for run in configs)
    lines = ["## Configuration", ""]
    if len(runs) == 1:
        return lines + ([f"Resolved config: {links}."] if links else ["No readable config.yaml."]) + [""]
    missing = [run.label for run in runs if run.config is None]
    if missing:
        lines += [f"No readable config.yaml in: {', '.join(missing)}; they are left out of the diff.", ""]
    if len(configs) >= 2:
        diff = config_diff([run.config for run in configs])
        if diff:
            header = ["key", *(run.label for run in configs)]
            lines += ["Keys whose values differ:", "", md_table(header, [[k, *vs] for k, vs in diff]), ""]
        else:
            lines += ["The configs are identical.", ""]
    return lines + ([f"Resolved configs: {links}.", ""] if links else [])


def _data_section(runs: list[Run], out: Path) -> list[str]:
    lines = ["## Data", ""]
    groups: dict[str, tuple[Path | None, dict | None, str, list[str]]] = {}
    for run in runs:
        where, manifest, note = _find_manifest(run)
        key = str(where.resolve()) if where else f"missing:{run.label}"
        groups.setdefault(key, (where, manifest, note, []))[3].append(run.label)
    for where, manifest, note, labels in groups.values():
        if len(runs) > 1:
            lines += [f"### {where if where else 'unknown'} ({', '.join(labels)})", ""]
        if manifest is None:
            lines += [f"No data manifest: {note}.", ""]
            continue
        tok, columns = manifest["tokenizer"], ("documents", "tokens", "bytes")
        sources = [
            [d.get("spec"), _count(d.get("documents")), _count(d.get("bytes"))] for d in manifest["sources"]
        ]
        splits = [[name, *(_count(d.get(k)) for k in columns)] for name, d in manifest["splits"].items()]
        lines += [
            f"Data directory [{where}]({_rel(where / MANIFEST, out)}); tokenizer {tok.get('kind', '?')}, "
            f"vocabulary {_count(tok.get('vocab_size', '?'))}, shards of {manifest.get('dtype', '?')}.",
            "",
            md_table(["source", "documents", "bytes"], sources),
            "",
            md_table(["split", *columns], splits),
            "",
        ]
        cleaning = manifest["cleaning"]
        if isinstance(cleaning, dict):
            lines += ["Cleaning: " + ", ".join(f"{k} {_count(v)}" for k, v in cleaning.items()) + ".", ""]
    return lines


def _eval_section(runs: list[Run]) -> list[str]:
    """``eval.json`` as written by ``ember eval`` ({..., "results": {data: metrics}}), else flattened."""
    notes, rows, metric_keys = [], [], []
    for run in runs:
        if run.eval is None:
            continue
        results = run.eval.get("results")
        if isinstance(results, dict) and all(isinstance(v, dict) for v in results.values()):
            settings = {k: v for k, v in run.eval.items() if k != "results"}
            if settings:
                notes.append(f"- {run.label}: " + ", ".join(f"{k} {v}" for k, v in settings.items()))
        else:
            results = {"": _flatten(run.eval)}
        for name, metrics in results.items():
            strata = metrics.get("strata") if isinstance(metrics.get("strata"), dict) else {}
            metrics = {k: v for k, v in metrics.items() if not isinstance(v, dict | list)}
            metric_keys += [k for k in metrics if k not in metric_keys]
            rows.append((run.label, name, metrics))
            rows += [(run.label, f"{name} / {k}", v) for k, v in strata.items() if isinstance(v, dict)]
    if not rows:
        return []
    many = len(runs) > 1
    header = (["run"] if many else []) + ["data", *metric_keys]
    body = [([label] if many else []) + [name, *(m.get(k) for k in metric_keys)] for label, name, m in rows]
    return ["## Evaluation (eval.json)", "", *notes, *([""] if notes else []), md_table(header, body), ""]


ANALYSIS_SUMMARY = {  # instrument: what its results.json says in a line
    "profile": lambda r: (
        f"step {r['step_s'] * 1e3:,.1f} ms: "
        + ", ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in r["split_s"].items())
        + f"; {r['fraction_of_peak']:.1%} of a measured matmul peak"
    ),  # noqa: E501
    "grads": lambda r: "; ".join(f"{x['ckpt']}: B_simple {x['b_simple']:.4g} windows" for x in r["rows"]),
    "hessian": lambda r: "; ".join(
        f"{x['ckpt']}: λ_max {x['eigenvalues'][0]:.4g}, trace {x['trace']:.4g}" for x in r["rows"]
    ),  # noqa: E501
    "memory": lambda r: f"peak {r['peak'] / 2**20:,.2f} MiB over {r['operations']:,} operations",
    "nonfinite": lambda r: (
        f"step {r['step']}: "
        + (
            f"first non-finite: {r['first_nonfinite']['phase']} of {r['first_nonfinite']['name']}"
            if r["first_nonfinite"]
            else "all finite"
        )
    ),  # noqa: E501
    "lens": lambda r: " → ".join(f"{x['loss']:.3f}" for x in r["layers"]) + " nats by layer",
}


def _analysis_section(runs: list[Run], out: Path) -> list[str]:
    """``ember analyze``'s results under RUN/analysis/ (one run): a line each, and their plots."""
    if len(runs) > 1:
        return []
    root = runs[0].path / "analysis"
    lines = []
    for name, summary in ANALYSIS_SUMMARY.items():
        path = root / name / "results.json"
        if not path.is_file():
            continue
        results = read_json(path) or {}
        try:
            text = summary(results)
        except (ValueError, KeyError, TypeError):
            text = f"{path} could not be read"
        lines += [f"- **{name}** ({results.get('seconds', '?')} s): {text}"]
        for image in sorted((root / name).glob("*.png")):
            lines += ["", f"![{name}]({os.path.relpath(image, out)})"]
        lines += [""]
    return ["## Instruments (`ember analyze`)", "", *lines] if lines else []


def _samples_section(runs: list[Run]) -> list[str]:
    lines = []
    for run in runs:
        if run.samples is not None:
            lines += [f"### {run.label}", ""] if len(runs) > 1 else []
            lines += [_demote(run.samples).rstrip(), ""]
    return ["## Samples", "", *lines] if lines else []


def _env_section(runs: list[Run]) -> list[str]:
    envs = [run.env or {} for run in runs]
    keys = list(dict.fromkeys(k for env in envs for k in env))
    if not keys:
        return ["## Environment", "", "No env.json.", ""]
    header = ["", *(run.label for run in runs)] if len(runs) > 1 else ["key", "value"]
    return ["## Environment", "", md_table(header, [[k, *(env.get(k) for env in envs)] for k in keys]), ""]


# ---------------------------------------------------------------- the report


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write ``report.md`` and ``plots/*.png`` for one run (into the run directory unless ``out``
    is given) or several compared (into ``out``, required); return the report's path."""
    if not run_dirs:
        raise EmberError("no run directory given; pass one or more directories made by `ember train`")
    run_dirs = [Path(p) for p in run_dirs]
    if len(run_dirs) > 1 and out is None:
        raise EmberError("comparing several runs needs an output directory for the report (--out DIR)")
    runs = [load_run(p, label) for p, label in zip(run_dirs, _labels(run_dirs), strict=True)]
    _matplotlib()  # fail before writing anything
    # --out: absent, empty or an earlier report; never a run or inside one (ember/atomic.py)
    out = output_dir(out, kind="report", sources=run_dirs, force=True) if out is not None else run_dirs[0]

    many = len(runs) > 1
    labels = ", ".join(r.label for r in runs)
    lines = [f"# Run comparison: {labels}" if many else f"# Run report: {labels}", ""]
    if many:
        lines += [md_table(["run", "directory"], [[r.label, f"{r.path}"] for r in runs]), ""]
    for run in runs:
        if run.bad_lines:
            lines += [f"Note: {run.bad_lines} unreadable line(s) in {run.path}/metrics.jsonl skipped.", ""]
        if run.summary is None:
            note = f"no summary.json in {run.path} (training unfinished?); numbers from the last records"
            lines += [f"Note: {note}.", ""]

    plots = _draw_plots(runs, out / PLOTS)
    lines += ["## Curves", "", *(f"![{plot_title}]({PLOTS}/{name})\n" for plot_title, name in plots)]

    finals = [_final_metrics(run) for run in runs]
    keys = [k for k in finals[0] if any(f[k] is not None for f in finals)]
    header = ["metric", *(run.label for run in runs)] if many else ["metric", "value"]
    lines += ["## Final metrics", "", md_table(header, [[k, *(f[k] for f in finals)] for k in keys]), ""]

    lines += _config_section(runs, out)
    lines += _data_section(runs, out)
    lines += _eval_section(runs)
    lines += _analysis_section(runs, out)
    lines += _samples_section(runs)
    lines += _env_section(runs)

    report = out / REPORT
    write_text_atomic(report, "\n".join(lines).rstrip() + "\n")
    return report
