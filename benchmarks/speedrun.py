"""The 5-minute CPU speedrun: ember's quickstart model against a plain script, same clock.

    .venv/bin/python benchmarks/speedrun.py                      # 5 minutes, seeds 0 1 2, both sides
    .venv/bin/python benchmarks/speedrun.py --minutes 2 --seeds 3 --out runs/speedrun-2min
    .venv/bin/python benchmarks/speedrun.py train.lr=0.006       # ember side with overrides

For each seed it trains, one after the other on this machine, (a) ember: ``cpu-quick`` as
``ember quickstart`` trains it, for ``--minutes`` of wall clock, and (b) the reference:
``benchmarks/reference.py``, the ~90-line nanoGPT-style script, for the same wall clock, on
the same train shards and tokenizer. Both models are then scored by the same function
(``ember.infer.evaluate.score``) on every token of the ``test`` split: CPython's own test
suite, which neither trained on nor chose anything by. It prints each side's test bits per
byte (mean ± 95% CI over seeds), ember − reference with Welch's 95% CI and p, and the exact
permutation p, as ``ember sweep`` computes them (``ember.stats``).

Design choices:

- The two sides alternate per seed (ember, reference, ember, ...), so slow drift of the
  machine falls on both; anything else running on the machine spoils a wall-clock race, so
  run it on an idle machine.
- Results are kept per run in ``OUT/results.json``; running again skips the runs that are
  done (change the overrides or minutes → use another ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ember.atomic import write_text_atomic
from ember.config import load_config
from ember.data.manifest import load_tokenizer
from ember.data.prepare import prepare
from ember.infer.evaluate import evaluate_run, score, split_text
from ember.stats import permutation_test, summarize, welch
from ember.train.trainer import train

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference  # noqa: E402  (benchmarks/ is not a package)
from printing import cpu_model, print_table  # noqa: E402


def run_ember(seconds: float, seed: int, out: Path, data: str, overrides: list[str]) -> dict:
    cfg = load_config(
        "cpu-quick",
        [
            f"run.out_dir={out}",
            f"run.name=ember-seed{seed}",
            f"run.seed={seed}",
            f"data.dir={data}",
            "train.max_steps=0",
            "train.max_tokens=0",
            f"train.max_time={seconds}",
            *overrides,
        ],
    )
    run_dir = out / cfg.run.name
    if run_dir.exists():  # an unfinished earlier attempt: start over
        import shutil

        shutil.rmtree(run_dir)
    last = train(cfg)
    results = evaluate_run(run_dir, splits=["test", "val"])
    return {
        "test_bpb": results["test"]["bpb"],
        "val_bpb": results["val"]["bpb"],
        "steps": last["step"],
        "tokens": last["tokens"],
        "train_loss": last["loss"],
    }


def run_reference(seconds: float, seed: int, data: str) -> dict:
    model, info = reference.train(data, seconds, seed)
    tokenizer = load_tokenizer(data)
    token_bytes = torch.tensor(tokenizer.token_byte_lengths(model.emb.num_embeddings))
    out = {}
    for split in ("test", "val"):
        tokens, strata = split_text(data, split)
        with torch.no_grad():
            out[f"{split}_bpb"] = score(model, tokens, token_bytes, strata, 256, eos_id=tokenizer.eos_id)[
                "bpb"
            ]
    return {**out, "steps": info["steps"], "tokens": info["tokens"], "train_loss": info["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="wall clock per run (default 5)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per side (default 3)")
    ap.add_argument("--out", default="runs/speedrun", help="where runs and results.json go")
    ap.add_argument("--data", default="data/python", help="prepared python data (prepared if missing)")
    ap.add_argument("--only", choices=["ember", "reference"], help="run one side only")
    ap.add_argument("overrides", nargs="*", help="config overrides for the ember side")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prepare(load_config("python", [f"data.dir={args.data}"]), log=lambda m: print(f"data: {m}"))
    path = out / "results.json"
    record = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    setting = {"minutes": args.minutes, "overrides": args.overrides}
    if record.get("setting", setting) != setting:
        sys.exit(f"{path} holds results for {record['setting']}; use another --out")
    record["setting"] = setting
    seconds = args.minutes * 60
    for seed in range(args.seeds):
        for side in ("ember", "reference"):
            key = f"{side}-seed{seed}"
            if key in record["runs"] or (args.only and side != args.only):
                continue
            print(f"\n=== {key}: {args.minutes:g} minutes ===", flush=True)
            t0 = time.perf_counter()
            if side == "ember":
                r = run_ember(seconds, seed, out, args.data, args.overrides)
            else:
                r = run_reference(seconds, seed, args.data)
            r["wall_s"] = time.perf_counter() - t0
            print(
                f"{key}: test {r['test_bpb']:.4f} bits/byte, val {r['val_bpb']:.4f}, {r['tokens']:,} tokens"
            )
            record["runs"][key] = r
            write_text_atomic(path, json.dumps(record, indent=2) + "\n")

    sides = {
        s: [r for k, r in sorted(record["runs"].items()) if k.startswith(s)] for s in ("ember", "reference")
    }
    print(f"\nspeedrun: {args.minutes:g} minutes per run on {cpu_model()}, {torch.get_num_threads()} threads")
    rows = []
    for side, runs in sides.items():
        if not runs:
            continue
        s = summarize([r["test_bpb"] for r in runs])
        v = summarize([r["val_bpb"] for r in runs])
        tokens = sum(r["tokens"] for r in runs) / len(runs)
        rows.append(
            [
                side,
                str(s["n"]),
                f"{s['mean']:.4f} ± {s['mean'] - s['ci_low']:.4f}",
                f"{v['mean']:.4f}",
                f"{tokens / 1e6:.2f}M",
                " ".join(f"{r['test_bpb']:.4f}" for r in runs),
            ]
        )
    print_table(["side", "seeds", "test bits/byte (95% CI)", "val bits/byte", "tokens", "per seed"], rows)
    a, b = [r["test_bpb"] for r in sides["ember"]], [r["test_bpb"] for r in sides["reference"]]
    if len(a) >= 2 and len(b) >= 2:
        w, perm = welch(a, b), permutation_test(a, b)
        ci = f"95% CI {w['ci_low']:+.4f} … {w['ci_high']:+.4f}"
        print(
            f"\nember − reference: {w['diff']:+.4f} bits/byte ({ci}), "
            f"Welch p = {w['p']:.2g} (df {w['df']:.1f})"
        )
        print(f"permutation p = {perm['p']:.3g} (its floor with these seeds: {perm['p_min']:.3g})")
        met = w["diff"] <= -0.10 and w["p"] < 0.01
        print(f"target (ember at least 0.10 below, Welch p < 0.01): {'met' if met else 'not met'}")


if __name__ == "__main__":
    main()
