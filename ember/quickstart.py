"""The main job: from the embedded corpus to a trained, evaluated model in one command.

    ember quickstart                 # prepare → train cpu-quick for 5 minutes → evaluate
    ember quickstart --minutes 1 --out /tmp/runs

Steps, each reusing the library: ``prepare`` the embedded Python corpus (reused when
already prepared), ``train`` the ``cpu-quick`` preset (a larger one on CUDA) for a
wall-clock budget, ``evaluate_run`` on every token of the test split (CPython's own test
suite, which nothing trained on or chose a model by: the headline) and of the validation
split, then print where everything is. Running it again replaces the previous quickstart
run (its own output, nothing else).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from ember.atomic import check_target, write_text_atomic
from ember.config import load_config
from ember.data.prepare import prepare
from ember.data.stats import print_manifest
from ember.infer.engine import Engine
from ember.infer.evaluate import evaluate_run
from ember.infer.sampling import Sampling
from ember.report.report import write_report
from ember.train.trainer import train

RUN_NAME = "quickstart"
PROMPTS = ["def ", "import ", "class ", "The "]


def write_samples(run_dir: Path, prompts: Sequence[str] = PROMPTS, max_new_tokens: int = 64) -> None:
    """Sample each prompt (temperature 0.8, seed 0) and write ``samples.md``; print them too."""
    engine = Engine.from_run(run_dir)
    completions = engine.generate(list(prompts), Sampling(max_new_tokens, temperature=0.8, seed=0))
    parts = ["# Samples\n", f"temperature 0.8, seed 0, up to {max_new_tokens} new tokens\n"]
    for prompt, c in zip(prompts, completions, strict=True):
        parts.append(f"\n## `{prompt.strip()}`\n\n```\n{prompt}{c.text}\n```\n")
        print(f"  --- {prompt!r}\n{prompt}{c.text}")
    write_text_atomic(run_dir / "samples.md", "".join(parts))


def quickstart(
    minutes: float = 5.0,
    out: str = "runs",
    data_dir: str | None = None,
    overrides: Sequence[str] = (),
    command: str | None = None,
) -> dict:
    """Run the main job; returns {"data": dir, "run": dir, "eval": results}."""
    on_gpu = torch.cuda.is_available()
    preset = "gpt2-small" if on_gpu else "cpu-quick"
    settings = [
        f"run.out_dir={out}",
        f"run.name={RUN_NAME}",
        "train.max_steps=0",
        "train.max_tokens=0",
        f"train.max_time={minutes * 60}",
    ]
    if data_dir:
        settings.append(f"data.dir={data_dir}")
    cfg = load_config(preset, [*settings, *overrides])

    print(f"[1/3] data: the embedded Python corpus → {cfg.data.dir}")
    prepared = prepare(cfg, command=command)
    print_manifest(prepared.manifest, prepared.directory)

    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    check_target(run_dir, kind="run", sources=[cfg.data.dir], force=True)
    if run_dir.exists():  # ember's own run (check_target): anything else is refused above
        print(f"replacing the previous quickstart run in {run_dir}")
        shutil.rmtree(run_dir)
    print(
        f"\n[2/3] train: {preset} for {minutes:g} minute(s) on {'CUDA' if on_gpu else 'the CPU'} → {run_dir}"
    )
    train(cfg)

    print("\n[3/3] evaluate on the test split (held out by origin) and the validation split, and sample")
    results = evaluate_run(run_dir, splits=["test", "val"])
    for name, r in results.items():
        lo, hi = r["bpb_ci95"] or (float("nan"), float("nan"))
        print(
            f"  {name}: {r['bpb']:.4f} bits/byte (95% interval over documents {lo:.4f} … {hi:.4f}), "
            f"loss {r['loss']:.4f}, perplexity {r['ppl']:.2f} "
            f"({r['documents']:,} documents, {r['tokens']:,} tokens, {r['bytes']:,} bytes)"
        )

    write_samples(run_dir)

    test, val = results["test"], results["val"]
    print(f"\nheadline: {test['bpb']:.4f} test bits/byte (validation {val['bpb']:.4f})")
    print(f"data (shards, tokenizer, manifest): {prepared.directory}/")
    print(f"run (config, metrics, checkpoints): {run_dir}/")
    print(f"weights for inference:              {run_dir / 'model'}/")
    print(f"evaluation:                         {run_dir / 'eval.json'}")
    print(f"samples:                            {run_dir / 'samples.md'}")
    report = write_report([run_dir])
    print(f"report with plots:                  {report}")
    return {"data": prepared.directory, "run": run_dir, "eval": results}
