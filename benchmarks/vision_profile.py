"""The seeds' Day 12-13 table for the digits CNN: where a step's time goes (data / forward +
backward / optimizer) and images per second, by global batch × precision × accumulation.

    python benchmarks/vision_profile.py [--steps 60] [--device cpu] [--out table.md]

Each cell is a short ``ember train digits`` run in a scratch directory; the split is the
trainer's own per-step record (``data_s``, ``fwd_bwd_s``, ``opt_s`` in metrics.jsonl), the mean
over the steps after the first ten (warm-up). The ratio column is images/s against the fp32,
no-accumulation cell of the same batch size: the peer is the plain configuration, in this run.
On a CPU without bf16 units (this 2-core AVX2 machine) autocast to bf16 is expected to lose.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from ember.config import load_config
from ember.run import read_metrics
from ember.train.trainer import train


def cell(batch: int, precision: str, accum: int, steps: int, device: str, out: str) -> dict:
    name = f"b{batch}-{precision}-a{accum}"
    overrides = [f"run.out_dir={out}", f"run.name={name}", f"train.max_steps={steps}"]
    overrides += [f"train.batch_tokens={batch}", f"train.micro_batch={batch // accum}"]
    overrides += [f"train.precision={precision}", f"train.device={device}", f"train.log_every={steps}"]
    overrides += ["train.eval_every=0", "train.ckpt_every=0", "train.keep_best=false", "train.report=false"]
    cfg = load_config("digits", overrides)
    train(cfg)
    rows = [r for r in read_metrics(f"{out}/{name}") if "step_s" in r and r["step"] > 10]
    mean = {k: statistics.fmean(r[k] for r in rows) * 1e3 for k in ("step_s", "data_s", "fwd_bwd_s", "opt_s")}
    return {
        "batch": batch,
        "precision": precision,
        "accum": accum,
        **mean,
        "img_s": batch / mean["step_s"] * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="also write the table here (markdown)")
    args = parser.parse_args()
    header = ["batch", "precision", "accumulation", "step ms", "data ms", "fwd+bwd ms", "optimizer ms"]
    header += ["images/s", "× plain"]
    lines = ["| " + " | ".join(header) + " |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as out:
        for batch in (64, 256):
            plain = None
            for precision in ("fp32", "bf16"):
                for accum in (1, 4):
                    c = cell(batch, precision, accum, args.steps, args.device, out)
                    plain = plain or c["img_s"]
                    ms = [f"{c[k]:.2f}" for k in ("step_s", "data_s", "fwd_bwd_s", "opt_s")]
                    row = [
                        str(batch),
                        precision,
                        str(accum),
                        *ms,
                        f"{c['img_s']:,.0f}",
                        f"{c['img_s'] / plain:.2f}",
                    ]
                    lines.append("| " + " | ".join(row) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
