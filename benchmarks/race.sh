#!/usr/bin/env bash
# Issue 30's race on the CPU: dense cpu-quick against a mixture of experts at equal active
# parameters, a pure Mamba model and an attention/Mamba hybrid (benchmarks/race/*.yaml), each
# for cpu-quick's 5-minute budget, 3 seeds, compared on the held-out test split's bits per byte
# (mean, 95% interval, Welch p against dense); then tokens/s and peak memory from each run's
# summary.json. About 70 minutes on the 2-core machine; run it on a quiet machine (the budget
# is wall clock). Extra arguments go to `ember sweep` (e.g. --jobs 1 --seeds 5).
set -euo pipefail
cd "$(dirname "$0")/.."
race=benchmarks/race
.venv/bin/ember sweep cpu-quick --grid "config=cpu-quick,$race/moe.yaml,$race/mamba.yaml,$race/hybrid.yaml" \
  --seeds 3 --metric test.bpb --out runs/race "$@"
.venv/bin/python - <<'PY'
import json, pathlib, statistics
runs = sorted(pathlib.Path("runs/race/runs").glob("*/summary.json"))
by = {}
for s in runs:
    setting = s.parent.name.rsplit("-seed", 1)[0]
    d = json.loads(s.read_text())
    by.setdefault(setting, []).append((d["tokens_per_s"], d["peak_mem_mb"], d["step"], d["n_params"]))
print(f"{'setting':48} {'tokens/s':>9} {'peak MB':>8} {'steps':>6} {'params':>9}")
for setting, rows in by.items():
    tps, mem, steps, n = (statistics.mean(c) for c in zip(*rows))
    print(f"{setting:48} {tps:9.0f} {mem:8.0f} {steps:6.0f} {n:9.0f}")
PY
