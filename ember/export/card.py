"""A model card (``README.md``) for an exported run: what the HF convention asks of a folder that
is published, every figure read from the run's own files, none typed by hand.

    text = model_card(Path("runs/tiny"), model, "LlamaForCausalLM", "tiny-hf")   # ember export --to hf

Sources, each optional (a card says "not recorded" rather than guess): ``config.yaml`` (the
architecture and the training settings), ``summary.json`` (steps, tokens, wall time, the last
losses), ``env.json`` (hardware and versions), ``eval.json`` (every ``ember eval`` result, with
its 95% interval over documents, and task accuracies) and the prepared data's ``manifest.json``
(sources, tokenizer, documents/bytes/tokens per split). An imported run has only its config.

The YAML front matter is the Hub's metadata block: ``library_name``, ``pipeline_tag``,
``license`` (``other``: ember cannot know the terms of the data a run trained on; the card
says so), ``datasets`` (the run's source specs) and ``metrics``.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import yaml

from ember.data.manifest import read_manifest
from ember.errors import EmberError
from ember.report.report import md_table
from ember.run import read_json, saved_config


def _architecture(m: dict, n_params: int, kind: str) -> str:
    rows = [
        ["class", kind],
        ["parameters", f"{n_params:,}"],
        ["layers × width", f"{m['n_layer']} × {m['d_model']}"],
        ["heads (key/value)", f"{m['n_head']} ({m['n_kv_head'] or m['n_head']})"],
        ["context", f"{m['max_seq_len']} tokens"],
        ["vocabulary", f"{m['vocab_size']:,}"],
        ["positions · norm · MLP", f"{m['pos']} · {m['norm']} · {m['mlp']}"],
        ["tied embeddings", str(m["tie_embeddings"]).lower()],
    ]
    return md_table(["", ""], rows)


def _data(cfg: dict, manifest: dict) -> str:
    if not manifest:
        return "Not recorded (an imported run, or its prepared data directory is gone)."
    tok = manifest.get("tokenizer", {})
    specs = manifest.get("sources", []) + manifest.get("test_sources", [])
    sources = ", ".join(f"`{s['spec']}`" for s in specs)
    rows = [
        [split, f"{s['documents']:,}", f"{s['bytes']:,}", f"{s['tokens']:,}"]
        for split, s in manifest.get("splits", {}).items()
    ]
    rules = manifest.get("split_rules", {})
    text = (
        f"Sources: {sources}. Tokenizer: {tok.get('kind', cfg['data']['tokenizer'])}, "
        f"{tok.get('vocab_size', cfg['data']['vocab_size']):,} tokens. Splits (`ember data prepare`):\n\n"
        + md_table(["split", "documents", "bytes", "tokens"], rows)
    )
    if rules.get("test"):
        text += f"\n\nThe test split: {rules['test']}."
    return text


def _training(cfg: dict, summary: dict, env: dict) -> str:
    if not summary:
        return "Not recorded (an imported run: its weights came from elsewhere)."
    t = cfg["train"]
    device = env.get("device_name") or env.get("device", "?")
    hardware = f"{env.get('world_size', 1)} × {device}" + (
        f" ({env['cpu_threads']} threads)" if env.get("device") == "cpu" else ""
    )
    minutes = summary.get("elapsed_s")
    minutes = minutes / 60 if isinstance(minutes, (int, float)) else None
    rows = [
        ["steps", _number(summary.get("step"), ",")],
        ["tokens", _number(summary.get("tokens"), ",")],
        ["wall time", _number(minutes, ".1f", " min")],
        ["hardware", hardware],
        ["software", f"ember {env.get('ember', '?')}, torch {env.get('torch', '?')}"],
        ["task · optimizer", f"{t['task']} · {t['optimizer']} (lr {t['lr']:g})"],
        ["batch", f"{t['batch_tokens']:,} tokens of {t['seq_len']}-token rows"],
        ["precision", t["precision"]],
        ["last train loss", _number(summary.get("loss"), ".4f")],
    ]
    if isinstance(summary.get("best_val_loss"), (int, float)):
        best = f"{summary['best_val_loss']:.4f} (step {summary.get('best_step', '?')})"
        rows.append(["best validation loss", best])
    return md_table(["", ""], rows)


def _number(value, spec: str, unit: str = "") -> str:
    """``value`` in ``spec``; "not recorded" where summary.json lacks it (a damaged record)."""
    return f"{value:{spec}}{unit}" if isinstance(value, (int, float)) else "not recorded"


def _evaluation(results: dict) -> tuple[str, list[str]]:
    """The table of ``eval.json``'s results and the metric names it reports."""
    if not results:
        return "Not evaluated yet: `ember eval RUN --split test` records the test figures.", []
    rows, metrics = [], set()
    for name, r in results.items():
        if name.startswith("task:"):
            lo, hi = r["accuracy_ci95"]
            rows.append([f"`{name}`", f"accuracy {r['accuracy']:.1%} [{lo:.1%}, {hi:.1%}]",
                         f"{r['problems']} problems of its test split"])  # fmt: skip
            metrics.add("accuracy")
            continue
        ci = r.get("bpb_ci95")
        interval = f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else ""
        measured = f"{r['documents']:,} documents, {r['tokens']:,} tokens, {r['bytes']:,} bytes"
        rows.append([f"`{name}`", f"{r['bpb']:.4f} bits/byte{interval}, perplexity {r['ppl']:.2f}", measured])
        metrics |= {"bits_per_byte", "perplexity"}
    note = "Brackets: 95% interval over documents (bits/byte) or Wilson interval (accuracy)."
    return md_table(["data", "result", "measured on"], rows) + f"\n\n{note}", sorted(metrics)


def run_record(run_dir: Path) -> dict:
    """What a card is made of, read once from ``run_dir``: ``config`` (config.yaml), ``summary``,
    ``env``, ``results`` (eval.json's), ``manifest`` and the data ``sources`` (each empty when the
    run has none). The GGUF writer summarises the same record in its metadata."""
    cfg = saved_config(run_dir / "config.yaml")
    summary, env = (read_json(run_dir / name) or {} for name in ("summary.json", "env.json"))
    results = (read_json(run_dir / "eval.json") or {}).get("results")
    results = results if isinstance(results, dict) else {}
    try:
        manifest = read_manifest(cfg["data"]["dir"]) if summary else {}
    except EmberError:
        manifest = {}
    sources = [s["spec"] for s in manifest.get("sources", []) + manifest.get("test_sources", [])]
    return dict(config=cfg, summary=summary, env=env, results=results, manifest=manifest, sources=sources)


def model_card(run_dir: Path, model, kind: str, name: str) -> str:
    """The card of ``run_dir``'s ``model`` (a GPT) exported as HF class ``kind`` into a folder ``name``."""
    n_params = model.num_params()
    record = run_record(run_dir)
    cfg, summary, env, manifest = record["config"], record["summary"], record["env"], record["manifest"]
    evaluation, metrics = _evaluation(record["results"])
    sources = record["sources"]
    front = {"library_name": "transformers", "pipeline_tag": "text-generation", "license": "other",
             "tags": ["ember", kind], "datasets": sources, "metrics": metrics}  # fmt: skip
    load = (
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f'model = AutoModelForCausalLM.from_pretrained("{name}")\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")\n'
        'ids = tokenizer("def main(", return_tensors="pt").input_ids\n'
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=32)[0]))\n```\n\n"
        "With PEFT: a LoRA run of ember saves PEFT adapters beside its weights (RUN/adapter); "
        "`PeftModel.from_pretrained(model, ADAPTER_DIR)` puts them on this base. With llama.cpp: "
        "`ember export RUN --to gguf MODEL.gguf [--type q8_0]` (or llama.cpp's "
        f"`convert_hf_to_gguf.py {name}`), then `llama-cli -m MODEL.gguf -p 'def main('`."
    )
    sections = [
        f"# {cfg['run']['name']}",
        f"A {n_params:,}-parameter `{kind}` trained with ember from the run "
        f"directory `{run_dir.name}`. License: not set by ember; choose one that the training data's "
        "terms allow before publishing.",
        "## Architecture\n\n" + _architecture(asdict(model.cfg), n_params, kind),
        "## Data\n\n" + _data(cfg, manifest),
        "## Training\n\n" + _training(cfg, summary, env),
        "## Evaluation\n\n" + evaluation,
        "## How to load\n\n" + load,
    ]
    head = yaml.safe_dump(front, sort_keys=False, allow_unicode=True)
    return f"---\n{head}---\n\n" + "\n\n".join(sections) + "\n"
