"""The ``ember`` command: a table of verbs, each a thin call into the library.

    ember --help
    ember data prepare python data.vocab_size=8192

Every verb that takes a config accepts a YAML path or a preset name (``configs/NAME.yaml``)
followed by ``key.sub=value`` overrides. An ``EmberError`` is printed as one short message
and exits with code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import ember
from ember.errors import EmberError

CONFIG_HELP = "a YAML config file or a preset name from configs/ (e.g. python, tiny)"
OVERRIDES_HELP = "config overrides as key.sub=value (e.g. data.vocab_size=8192 run.seed=3)"


def _command_line() -> str:
    return shlex.join(["ember", *sys.argv[1:]])


# ---------------------------------------------------------------- verbs


def cmd_config_show(args) -> int:
    from ember.config import config_to_yaml, load_config

    print(config_to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def cmd_config_keys(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from ember.config import config_keys

    table = Table("key", "type", "default", "meaning", box=None, header_style="bold")
    for key, type_name, default, help_text in config_keys():
        if args.prefix and not key.startswith(args.prefix):
            continue
        cells = (key, type_name, default, help_text)
        table.add_row(*(Text(str(c)) for c in cells))  # literal: list[str] is not markup
    Console(width=max(120, Console().width)).print(table)
    return 0


def cmd_data_prepare(args) -> int:
    from ember.config import load_config
    from ember.data.prepare import prepare
    from ember.data.stats import print_manifest

    cfg = load_config(args.config, args.overrides)
    result = prepare(cfg, force=args.force, command=_command_line())
    print_manifest(result.manifest, result.directory)
    return 0


def cmd_data_stats(args) -> int:
    from ember.data.stats import print_manifest, verify

    manifest = verify(args.dir, check_sha256=args.verify)
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        print_manifest(manifest, Path(args.dir))
        if args.verify:
            print("verified: every shard's header, size and sha256, and the tokenizer's sha256")
    return 0


def _bytes(text: str) -> int:
    """'64K', '256M', '1G' or a plain number of bytes (powers of 1024)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 256M)") from None


def cmd_bench_comm(args) -> int:
    import os
    import subprocess

    from ember.parallel.comm import run
    from ember.parallel.dist import torchrun_cmd

    if args.min_bytes > args.max_bytes:
        raise EmberError(f"--min-bytes {args.min_bytes:,} is above --max-bytes {args.max_bytes:,}")
    if "LOCAL_RANK" in os.environ:  # a rank, under torchrun
        run(args.min_bytes, args.max_bytes, Path(args.out) if args.out else None, args.seconds)
        return 0
    if args.nproc < 2:
        raise EmberError(f"ember bench comm needs at least 2 ranks to talk; got --nproc {args.nproc}")
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < args.nproc:
            raise EmberError(f"--nproc {args.nproc} with NCCL needs {args.nproc} GPUs; {torch.cuda.device_count()} visible")  # fmt: skip # noqa: E501
    sizes = (f"--min-bytes={args.min_bytes}", f"--max-bytes={args.max_bytes}")
    cmd = torchrun_cmd(args.nproc, "bench", "comm", *sizes,
                        f"--seconds={args.seconds}", *([f"--out={args.out}"] if args.out else []))  # fmt: skip # noqa: E501
    env = {**os.environ, "EMBER_COMM_DEVICE": device}
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)


def cmd_plan(args) -> int:
    import json
    import os

    from ember.analysis import plan
    from ember.config import load_config
    from ember.parallel.dist import run_ranks
    from ember.train.layout import check_layout

    if args.steps < 2:
        raise EmberError(f"--steps {args.steps}: --measure tracks the last two steps; give at least 2")
    cfg = load_config(args.config, args.overrides)
    ranked = "LOCAL_RANK" in os.environ
    if args.measure and not ranked:
        from ember.data.prepare import prepare

        prepare(cfg, command=_command_line())  # the measured steps read the data, as training would
    model_cfg = plan.model_config_for(cfg)
    if not ranked:
        check_layout(cfg, args.nproc, model_cfg)
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    predicted = plan.predict(cfg, model_cfg, world)
    measured = None
    if args.measure and args.nproc > 1 and not ranked:
        flags = ["--measure", f"--steps={args.steps}", "--json"]  # (the ranks read WORLD_SIZE)
        out = run_ranks(args.nproc, "plan", args.config, *args.overrides, *flags, what="the measured run")
        lines = [line for line in out.splitlines() if line.startswith('{"measured"')]
        if not lines:
            raise EmberError("the measured run printed no measurement:\n" + "\n".join(out.splitlines()[-8:]))
        measured = json.loads(lines[-1])["measured"]
    elif args.measure:
        measured = plan.measure_config(cfg, args.steps)
        if measured is None:  # not rank 0
            return 0
        if ranked:
            print(json.dumps({"measured": measured}), flush=True)
            return 0
    flops = plan.step_flops(model_cfg, cfg)
    if args.json:
        print(json.dumps({"predicted": predicted, "measured": measured, "flops_per_step": flops}))
        return 0
    _print_plan(cfg, predicted, measured, flops, args)
    return 0


def _print_plan(cfg, predicted, measured, flops, args) -> None:
    from rich.console import Console
    from rich.table import Table

    from ember.analysis import plan
    from ember.analysis.plan import COMPONENTS

    mib = lambda b: f"{b / 2**20:,.2f}"  # noqa: E731
    p = cfg.parallel
    layout = [f"{k}={getattr(p, k)}" for k in ("pp", "dp_replicate", "tp") if getattr(p, k) > 1]
    first = predicted[0]
    layout += [f"dp={first['dp']} ({'FSDP2' if first['fsdp'] else 'replicas'})"] if first["dp"] > 1 else []
    if p.pp > 1:
        layout.append(f"{p.pp_schedule}, {first['microbatches']} micro-batches of {first['rows']} rows")
    t = cfg.train
    print(f"{args.config} on {len(predicted)} rank(s): {', '.join(layout) or 'one process'}; "
          f"{t.precision}, {t.optimizer}, micro-batch {first['rows']} × {t.seq_len}")  # fmt: skip
    table = Table(title="predicted bytes per rank (MiB)")
    for col in ("rank", "stages", "params", "grads", "optimizer", "activations", "with AC", "peak"):
        table.add_column(col, justify="right")
    for r in predicted:
        sizes = [mib(r[k]) for k in ("params", "grads", "optimizer", "activations", "activations_ac", "peak")]
        table.add_row(str(r["rank"]), ",".join(map(str, r["stages"])), *sizes)
    Console().print(table)
    step_s = ""
    if args.peak_tflops:
        step_s = f"; at {args.mfu:.0%} MFU of {args.peak_tflops:g} TFLOP/s per rank: {flops / (args.mfu * args.peak_tflops * 1e12 * len(predicted)):.3g} s a step"  # fmt: skip # noqa: E501
    print(f"FLOPs per step: {flops:.3e} (6N + attention, × {cfg.train.batch_tokens:,} tokens){step_s}")
    if measured is None:
        return
    table = Table(title=f"predicted vs measured (MiB), the lower of the last two of {args.steps} steps")
    for col in ("rank", "component", "predicted", "measured", "ratio"):
        table.add_column(col, justify="right")
    worst = 0.0
    for pred, meas in zip(predicted, measured, strict=True):
        for key in COMPONENTS:
            a, b = pred[key], meas[key]
            ratio = a / b if b else (1.0 if a == 0 else float("inf"))
            worst = max(worst, plan.difference(a, b, meas["peak"]))
            table.add_row(str(pred["rank"]), key.replace("_", " "), mib(a), mib(b), f"{ratio:.3f}")
        if "allocator_peak" in meas:  # CUDA
            a, b = pred["peak"], meas["allocator_peak"]
            table.add_row(str(pred["rank"]), "peak (allocator)", mib(a), mib(b), f"{a / b:.3f}")
    Console().print(table)
    print(f"largest difference: {worst:.1%} (relative; under 5% of the peak, as a share of the peak)")


def _ckpts(run: Path, spec: str) -> list[str]:
    """``last``, ``best``, ``all`` (every committed checkpoint, then ``last``) or a list of
    steps/names, as ``load_run`` takes them."""
    if spec == "all":
        import json

        from ember.run import checkpoint_steps

        found = [(s, p.name) for s, p, done in checkpoint_steps(run / "checkpoints") if done]
        summary = run / "summary.json"
        final = json.loads(summary.read_text()).get("step") if summary.is_file() else None
        last = (
            [] if final in {s for s, _ in found} else ["last"]
        )  # the final weights, if no checkpoint has them
        return [name for _, name in found] + last
    return [c.strip() for c in spec.split(",") if c.strip()]


def _worlds(spec: str | None) -> tuple[int, int]:
    """``--nproc``: none → (1, 1); N → (1, N); A,B → (A, B)."""
    if spec is None:
        return (1, 1)
    try:
        sizes = [int(part) for part in spec.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2) or min(sizes) < 1:
        raise EmberError(f"--nproc {spec}: give N (one process against N ranks) or A,B (A ranks against B)")
    return (1, sizes[0]) if len(sizes) == 1 else (sizes[0], sizes[1])


def cmd_analyze(args) -> int:
    import json
    import time

    if args.instrument == "determinism":
        from ember.analysis.replay import determinism
        from ember.config import load_config

        cfg = load_config(args.run, args.set)
        worlds = _worlds(args.nproc)
        started = time.perf_counter()
        r = determinism(cfg, steps=args.steps, worlds=worlds)
        took = f"({time.perf_counter() - started:.1f} s)"
        runs = "two runs" if worlds == (1, 1) else f"runs on {worlds[0]} and {worlds[1]} rank(s)"
        if r["identical"]:
            n, what = r["tensors_compared"], "module outputs, their gradients, parameter gradients, parameters"  # fmt: skip # noqa: E501
            if worlds != (1, 1):
                what = "each micro-batch's module outputs, averaged gradients, gradient norms, parameters"
            print(f"{args.run}: {runs} of {r['steps']} steps are identical: {n:,} tensors ({what}) equal "
                  f"bit for bit {took}")  # fmt: skip
            return 0
        diff, apart = r["max_difference"], r.get("parameters_apart_at_end")
        where = f"{r['phase']} {r['name']}".strip()
        print(f"{args.run}: the {runs} part at step {r['step']}, {where}"
              + (f": largest difference {diff:.3g} ({r['relative']:.2g} of its largest value)" if diff is not None else "")  # fmt: skip # noqa: E501
              + (f"; after step {r['steps']} their parameters are up to {apart:.3g} apart" if apart else "")
              + f" {took}")  # fmt: skip
        return 1
    run = Path(args.run)
    if not run.is_dir():
        raise EmberError(f"run directory {run} does not exist")
    ckpts = _ckpts(run, args.ckpt)
    if args.instrument == "lens":
        from ember.analysis.lens import analyze

        if not args.text:
            raise EmberError("lens reads a text through every layer: give --text '...'")
        try:
            r = analyze(run, args.text, ckpts[-1])
        except ValueError as e:
            raise EmberError(str(e)) from None
        print(f"{'layer':<11} {'loss':>7} {'= final':>8}  top token at each position of {r['tokens']!r}")
        for row in r["layers"]:
            tops = " ".join(repr(t)[1:-1] or "·" for t in row["top_tokens"])
            print(f"{row['layer']:<11} {row['loss']:>7.3f} {row['agrees_with_final']:>8.0%}  {tops[:80]}")
    elif args.instrument == "nonfinite":
        from ember.analysis.replay import check_step, nonfinite

        if args.step is None:
            raise EmberError("nonfinite replays one step: give --step S (the step the run stopped at)")
        check_step(args.step)
        r = nonfinite(run, args.step)
        first = r["first_nonfinite"]
        if first is None:
            print(f"step {args.step} (replayed from {r['from']}): every output and gradient is finite")
        else:
            t, fed = first["tensor"], first["before"] or {}
            print(f"step {args.step} (replayed from {r['from']}): first non-finite: {first['phase']} of "
                  f"{first['name']} ({t['nonfinite']} of {t['shape']} entries)")  # fmt: skip
            if fed:
                print(f"  just before it, {fed['phase']} {fed['name']}: absmax {fed['absmax']:.4g}, "
                      f"mean {fed['mean']:.4g}, {fed['nonfinite']} non-finite")  # fmt: skip
    elif args.instrument == "profile":
        from ember.analysis.profile import analyze

        r = analyze(run, steps=args.steps, stack=args.stack)
        split = ", ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in r["split_s"].items())
        ms = r["step_s"] * 1e3
        print(f"{r['steps']} steps of {ms:,.1f} ms on {r['device']} ({r['threads']} threads): {split}")
        print(f"{'operator':<44} {'calls':>7} {'self ms':>10} {'total ms':>10}")
        for op in r["top_ops"][:10]:
            print(f"{op['op'][:44]:<44} {op['calls']:>7} {op['self_ms']:>10.1f} {op['total_ms']:>10.1f}")
        peak = f"{r['matmul_peak_flops'] / 1e9:,.2f} GFLOP/s ({r['fraction_of_peak']:.1%})"
        print(f"achieved {r['achieved_flops'] / 1e9:,.2f} GFLOP/s of the model's FLOPs; a large "
              f"{r['peak_dtype']} matmul here: {peak}; trace: {Path(r['out']) / 'trace.json'}")  # fmt: skip
    elif args.instrument == "memory":
        from ember.analysis.memory import analyze

        r = analyze(run, steps=args.steps)
        mib = lambda b: f"{b / 2**20:,.2f} MiB"  # noqa: E731
        print(f"{r['operations']:,} operations in the tracked step; peak {mib(r['peak'])}: parameters "
              f"{mib(r['params'])}, gradients {mib(r['grads_at_peak'])}, optimizer {mib(r['optimizer'])}, "
              f"activations and temporaries {mib(r['activations_at_peak'])}")  # fmt: skip
    elif args.instrument == "hessian":
        from ember.analysis.curvature import analyze

        r = analyze(run, ckpts, args.batch or 4, args.k, args.iters, args.samples, args.seed)
        for row in r["rows"]:
            lr = f"; lr {row['lr']:.2e}, 2/lr {row['two_over_lr']:.3g}" if row["lr"] else ""
            print(f"{row['ckpt']} (step {row['step']}): loss {row['loss']:.4f}; top eigenvalues "
                  + ", ".join(f"{e:.4g}" for e in row["eigenvalues"])
                  + f"; trace {row['trace']:.4g} ± {row['trace_stderr']:.2g}{lr} ({row['hvp_calls']} H·v products)")  # fmt: skip # noqa: E501
    else:
        from ember.analysis.grads import analyze

        try:
            r = analyze(run, ckpts, args.batch or 16, args.seed, args.text, args.top)
        except ValueError as e:
            raise EmberError(str(e)) from None
        for row in r["rows"]:
            norms = row["norms"]["total"]
            b = row["b_simple"]
            print(f"{row['ckpt']} (step {row['step']}): gradient norm per window "
                  f"{min(norms):.3g}–{max(norms):.3g}; tr(Σ) {row['trace_sigma']:.4g}, "
                  f"|G|² {row['g2_unbiased']:.4g} (unbiased); "
                  f"B_simple {b:.4g} windows = {b * row['seq_len']:,.0f} tokens")  # fmt: skip
        layers = r["rows"][-1]["norms"]["layers"]
        last = r["rows"][-1]["ckpt"]
        print(f"  {'layer':<16} {'mean':>9} {'min':>9} {'max':>9}   gradient norm per window, {last}")
        for name, norms in layers.items():
            print(f"  {name:<16} {sum(norms) / len(norms):>9.4g} {min(norms):>9.4g} {max(norms):>9.4g}")
        if r["influence"]:
            for key in ("most_aligned", "least_aligned"):
                print(f"{key.replace('_', ' ')} with {args.text!r}:")
                for item in r["influence"][key]:
                    print(f"  {item['dot']:+.4g}  window {item['window']}: {item['text'][:100]!r}")
    took = json.loads((Path(r["out"]) / "results.json").read_text())["seconds"]
    print(f"results: {r['out']} ({took:.1f} s)")
    return 0


def cmd_train(args) -> int:
    import os
    import subprocess

    from ember.config import load_config
    from ember.data.prepare import prepare
    from ember.parallel.dist import torchrun_cmd

    cfg = load_config(args.config, args.overrides)  # bad configs fail here, before any launch
    if "LOCAL_RANK" not in os.environ:
        from ember.train.layout import check_layout

        check_layout(cfg, args.nproc)  # a layout that cannot run fails here, before any work
        prepare(cfg, command=_command_line())  # once, before any rank starts: reuses prepared data
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        cmd = torchrun_cmd(args.nproc, "train", args.config, *args.overrides)
        print(f"launching {args.nproc} processes: {shlex.join(cmd)}", flush=True)
        return subprocess.call(cmd)
    from ember.train.trainer import train

    train(cfg)
    return 0


def cmd_eval(args) -> int:
    from rich.console import Console
    from rich.table import Column, Table
    from rich.text import Text

    from ember.infer.evaluate import evaluate_run, evaluate_task

    if args.task:
        if args.data or args.split:
            raise EmberError("--task scores generated answers; give it without --split or --data")
        r = evaluate_task(Path(args.run), args.task, args.n, args.ckpt, skip=args.skip)
        lo, hi = r["accuracy_ci95"]
        for ex in r["examples"]:
            print(
                f"  {ex['prompt']!r} -> {ex['output']!r} (want {ex['answer']!r}, reward {ex['reward']:.2f})"
            )
        print(
            f"{args.task}: accuracy {r['accuracy']:.1%} (95% interval {lo:.1%} … {hi:.1%}), mean reward "
            f"{r['mean_reward']:.3f}, over {r['problems']} problems of its test split"
            f"{f' after the first {args.skip}' if args.skip else ''}, greedy, chat format; "
            f"written {Path(args.run) / 'eval.json'}"
        )
        return 0
    results = evaluate_run(
        Path(args.run),
        args.data,
        args.ckpt,
        args.seq_len,
        args.batch_size,
        args.max_windows,
        splits=args.split,
        stride=args.stride,
    )
    table = Table(
        Column("data", no_wrap=True), "documents", "tokens", "bytes", "loss", "perplexity", "bits/byte",
        title=Text(f"{args.run} ({args.ckpt})"), title_justify="left",
    )  # fmt: skip
    for name, r in results.items():
        rows = [(name, r)] + [(f"  {k}", v) for k, v in r.get("strata", {}).items()]
        for label, m in rows:
            table.add_row(
                Text(label),  # literally: a glob like test_[a-c]*.py is not markup
                f"{m['documents']:,}",
                f"{m['tokens']:,}",
                f"{m['bytes']:,}",
                f"{m['loss']:.4f}",
                f"{m['ppl']:.2f}",
                f"{m['bpb']:.4f}",
            )
        if r.get("bpb_ci95"):
            lo, hi = r["bpb_ci95"]
            print(
                f"{name}: bits/byte 95% interval over its {r['documents']:,} documents: {lo:.4f} … {hi:.4f}"
            )
        if r["windows"] < r["windows_total"]:
            print(f"note: {name}: {r['windows']} of {r['windows_total']} windows scored (--max-windows)")
    width = max(len(name) for name in results) + 100
    Console(width=max(Console().width, width)).print(table)
    stride = next(iter(results.values()))["stride"]
    seq_len = next(iter(results.values()))["seq_len"]
    print(f"windows of {seq_len} tokens, stride {stride}; written {Path(args.run) / 'eval.json'}")
    return 0


def _sampling(args):
    """The ``Sampling`` that the options of `generate` or `chat` spell out (checked here)."""
    from dataclasses import fields

    from ember.infer.sampling import Sampling

    return Sampling(**{f.name: getattr(args, f.name) for f in fields(Sampling) if hasattr(args, f.name)})


def cmd_generate(args) -> int:
    from dataclasses import asdict, replace

    from ember.infer.engine import Engine

    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            prompts += [line for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
        except OSError as e:
            raise EmberError(f"cannot read --prompts-file {args.prompts_file} ({e.strerror})") from None
    if not prompts:
        raise EmberError("no prompt: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    sampling = _sampling(args)
    sampling.check_seed(len(prompts))  # before the run is loaded or the first prompt streams
    engine = Engine.from_run(args.run)
    if args.json:
        completions = engine.generate(prompts, sampling, args.truncate)
        print(
            json.dumps(
                [{"prompt": p, **asdict(c)} for p, c in zip(prompts, completions, strict=True)], indent=2
            )
        )
        return 0
    for i, prompt in enumerate(prompts):  # stream each prompt's text as it is produced
        print(f"--- {i + 1}/{len(prompts)}" if len(prompts) > 1 else "---", flush=True)
        print(prompt, end="", flush=True)
        # row i of a batch samples with seed + i: the same text as --json gives for this prompt
        for _, piece in engine.stream([prompt], replace(sampling, seed=sampling.seed + i), args.truncate):
            print(piece, end="", flush=True)
        print(flush=True)
    return 0


def cmd_chat(args) -> int:
    from dataclasses import replace

    import yaml

    from ember.data.chat import render
    from ember.infer.engine import Engine

    sampling = _sampling(args)
    engine = Engine.from_run(args.run)
    config = Path(args.run) / "config.yaml"
    task = config.is_file() and (yaml.safe_load(config.read_text()) or {}).get("train", {}).get("task")
    chat = task in ("sft", "dpo", "grpo")
    kind = "a chat model: turns in the chat format" if chat else "a base model: it continues your text"
    print(f"ember chat with {args.run} ({kind}). Empty line or Ctrl-D to quit.")
    messages: list[dict] = []
    for turn in itertools.count(1):
        try:
            prompt = input("> ")
        except EOFError:
            break
        if not prompt.strip():
            break
        messages.append({"role": "user", "content": prompt})
        text = render(engine.tokenizer, messages, add_generation_prompt=True)[0] if chat else prompt
        reply = ""
        for _, piece in engine.stream([text], replace(sampling, seed=sampling.seed + turn), truncate=True):
            print(piece, end="", flush=True)
            reply += piece
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_report(args) -> int:
    from ember.report.report import write_report
    from ember.sweep import render_sweep

    runs = [Path(p) for p in args.runs]
    if len(runs) == 1 and (runs[0] / "sweep.json").exists():  # a sweep: redrawn where it is
        path = render_sweep(runs[0])
    else:
        path = write_report(runs, Path(args.out) if args.out else None)
    print(f"written {path}")
    return 0


def cmd_sweep(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from ember.sweep import SWEEP_MD, plan_sweep, run_sweep, table

    seed_list = None
    if args.seed_list is not None:
        try:
            seed_list = [int(s) for s in args.seed_list.split(",")]
        except ValueError:
            raise EmberError(f"--seed-list {args.seed_list!r} is not integers separated by commas") from None
    sweep = plan_sweep(
        args.config,
        args.grid or [],
        seeds=args.seeds,
        seed_list=seed_list,
        metric=args.metric,
        baseline=args.baseline,
        out=args.out,
        overrides=args.overrides,
        jobs=args.jobs,
        alpha=args.alpha,
    )
    record = run_sweep(sweep, command=_command_line())
    header, rows = table(record)
    out = Table(*header, title=f"{sweep.metric} ({sweep.out})", title_justify="left")
    for row in rows:
        out.add_row(*row)
    Console(width=max(Console().width, 120)).print(out)
    print(f"written {sweep.out / SWEEP_MD}")
    if record["failed"]:
        print(f"ember: {len(record['failed'])} run(s) failed: {', '.join(record['failed'])}", file=sys.stderr)
        return 1
    return 0


def cmd_export(args) -> int:
    from ember.export.graph import TARGETS as GRAPHS
    from ember.export.graph import export_graph
    from ember.export.hf import TARGETS, export_hf

    if args.to in GRAPHS:
        c = export_graph(args.run, args.to, args.dir, ckpt=args.ckpt, force=args.force)
        print(f"written {args.dir}: load {c.load_s * 1e3:.1f} ms, first call {c.first_call_s * 1e3:.1f} ms, "
              f"max |logit diff| vs eager {c.max_abs_diff:.1e}")  # fmt: skip
        return 0
    if args.to not in TARGETS:  # checked here, not by argparse, for a one-line error and exit 2
        raise EmberError(
            f"--to {args.to!r}: unknown export target; choose one of {', '.join(TARGETS + GRAPHS)}"
        )
    out = export_hf(args.run, args.dir, ckpt=args.ckpt, force=args.force)
    print(f"written {out} (load it with transformers' AutoModelForCausalLM and AutoTokenizer)")
    return 0


def cmd_import(args) -> int:
    from ember.export.hf import import_hf

    out = import_hf(args.dir, args.out, force=args.force)
    print(f"written {out} (try `ember generate {out} --prompt TEXT`)")
    return 0


def cmd_quantize(args) -> int:
    from ember.export.quantize import quantize_run, report
    from ember.model.quant import GROUP_SIZES, QuantSpec

    if not args.report:
        if not args.out or not args.scheme or len(args.scheme) > 1:
            raise EmberError("give one --scheme and --out RUN2 (or --report to compare schemes)")
        spec = QuantSpec(args.scheme[0], args.group_size or 32, head=not args.float_head)
        out = quantize_run(args.run, spec, args.out, force=args.force)
        print(
            f"written {out} ({spec.label}); "
            f"`ember eval {out} --split test` and `ember generate {out}` read it"
        )
        return 0
    if args.out:
        raise EmberError("--report writes RUN/quantize.json and no run; drop --out")
    specs = []
    for scheme in args.scheme or ["int8-weight", "int8-dynamic", "int4-weight"]:
        groups = [args.group_size] if args.group_size else GROUP_SIZES if scheme == "int4-weight" else [32]
        specs += [QuantSpec(scheme, g, head=not args.float_head) for g in groups]
    out = report(args.run, specs, args.max_windows)
    from rich.console import Console
    from rich.table import Table

    table = Table(
        "scheme", "weights", "test bits/byte", "change", "greedy agreement", "decode tok/s",
        title=f"{args.run}: {out['measured_on']}", title_justify="left",
    )  # fmt: skip
    for label, r in out["rows"].items():
        table.add_row(
            label,
            f"{r['bytes'] / 2**20:.2f} MiB",
            f"{r['bpb']:.4f}",
            f"{r['bpb_change']:+.2%}",
            f"{r['agree']:.1%}",
            f"{r['tok_s']:,.0f}",
        )
    Console(width=max(Console().width, 110)).print(table)
    written = Path(args.run) / "quantize.json"
    print(f"agreement: {out['agreement']}; decode: {out['decode']}; written {written}")
    return 0


def cmd_serve(args) -> int:
    from ember.config import load_config
    from ember.infer.server import serve

    others = [o for o in args.overrides if not o.startswith("serve.")]
    if others:
        raise EmberError(f"ember serve takes serve.* settings only; got {others[0]!r} (`ember config keys`)")
    if not Path(args.run).is_dir():
        raise EmberError(f"no run directory at {args.run}")
    serve(args.run, args.host, args.port, args.api_key, load_config(None, args.overrides).serve)
    return 0


def cmd_quickstart(args) -> int:
    from ember.quickstart import quickstart

    print(f"ember {ember.__version__} quickstart")
    quickstart(args.minutes, args.out, args.data_dir, args.overrides, command=_command_line())
    return 0


# ---------------------------------------------------------------- parser


def _add_sampling_args(p: argparse.ArgumentParser, seed_help: str) -> None:
    """The fields of ``ember.infer.sampling.Sampling`` as options, shared by `generate` and `chat`."""
    from ember.infer.sampling import Sampling

    for flag, kind, help_text in (
        ("--max-new-tokens", int, "tokens to generate at most (default %(default)s)"),
        ("--temperature", float, "0 = greedy (default %(default)s)"),
        ("--top-k", int, "sample among the k most likely tokens"),
        ("--top-p", float, "nucleus sampling: smallest set with mass p"),
        ("--seed", int, seed_help),
    ):
        default = getattr(Sampling, flag[2:].replace("-", "_"))
        p.add_argument(flag, type=kind, default=default, help=help_text)
    p.add_argument("--stop", action="append", default=[], help="stop when this text appears (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ember",
        description="ember: a hackable, PyTorch-native lab for small GPT-style language models.",
        epilog="Run `ember VERB --help` for the options of each verb.",
    )
    parser.add_argument("--version", action="version", version=f"ember {ember.__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    p = verbs.add_parser(
        "quickstart",
        help="the main job: embedded corpus → tokenizer + shards → trained model → evaluation",
        description="Prepare the embedded Python corpus (CPython's docs and standard library; reused "
        "when already prepared), train the cpu-quick preset (gpt2-small on CUDA) for a wall-clock "
        "budget, evaluate it on the validation split, and print where each output is. Running it "
        "again replaces the previous quickstart run.",
    )
    p.add_argument("--minutes", type=float, default=5.0, help="training budget in minutes (default 5)")
    p.add_argument("--out", default="runs", help="runs root; the run is OUT/quickstart (default runs)")
    p.add_argument("--data-dir", help="where the shards go (default: data/python)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    p.set_defaults(func=cmd_quickstart)

    p = verbs.add_parser(
        "train",
        help="pretrain a GPT on prepared shards (CPU, GPU, or N ranks with DDP/FSDP2)",
        description="Train the model in CONFIG on the shards in data.dir until a budget "
        "(train.max_steps, max_tokens, max_time) is spent; data.dir is prepared first if needed. "
        "Writes RUN = run.out_dir/run.name: config.yaml, "
        "env.json, metrics.jsonl, checkpoints/step-NNNNNN/ (DCP, committed), model/ (safetensors + "
        "model_config.json + tokenizer.json). Resume with train.resume=auto. Under torchrun, each "
        "process joins the group from the environment.",
        epilog="examples: ember train tiny | ember train cpu-quick train.max_time=60 | "
        "ember train tiny --nproc 2 parallel.data=fsdp",
    )
    p.add_argument("config", metavar="CONFIG", help=CONFIG_HELP)
    p.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="launch N processes on this machine through torch.distributed.run (default 1)",
    )
    p.set_defaults(func=cmd_train)

    p = verbs.add_parser(
        "eval",
        help="loss, perplexity and bits per byte of a run's model on its val/test split or any text",
        description="Evaluate RUN's model on a split of its prepared data (--split val, the default, "
        "or test: held out by origin) or on --data sources (files, directories, globs, "
        ".jsonl/.parquet, embedded:NAME), tokenized with the run's tokenizer. Every token is scored "
        "once unless --max-windows caps it; the table gives the documents, tokens and bytes scored, "
        "per stratum too (documentation vs code). Bits per byte count the UTF-8 bytes of the text, "
        "so runs with different tokenizers compare fairly. Results accumulate in RUN/eval.json, one "
        "entry per dataset.",
    )
    p.add_argument("run", metavar="RUN", help="a run directory written by `ember train`")
    p.add_argument(
        "--split",
        action="append",
        choices=["train", "val", "test"],
        help="a split of the run's data (repeatable; default val when no --data is given); train, "
        "with --max-windows, compares the final model on seen and unseen text alike",
    )
    p.add_argument("--data", action="append", metavar="SOURCE", help="text to evaluate on (repeatable)")
    p.add_argument(
        "--task",
        metavar="NAME",
        help="instead: accuracy on an embedded task's test problems (add-2, sort, ...)",
    )
    p.add_argument("--n", type=int, default=200, help="--task: problems to answer (default 200)")
    p.add_argument(
        "--skip",
        type=int,
        default=0,
        help="--task: leave out the first K test problems (those a run's own evaluations used to pick "
        "its settings) and answer the next N",
    )
    p.add_argument("--ckpt", default="last", help="last (final weights), best (best val), or a step number")
    p.add_argument(
        "--seq-len", type=int, default=None, help="window length (default: the run's train.seq_len)"
    )
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
    p.add_argument(
        "--stride",
        type=int,
        default=None,
        help="score each window's last STRIDE tokens only, with the rest as context "
        "(default: the window length, disjoint windows; smaller costs seq_len/STRIDE times more)",
    )
    p.add_argument(
        "--max-windows",
        type=int,
        default=None,
        help="score only this many evenly spaced windows per dataset (default: all, every token)",
    )
    p.set_defaults(func=cmd_eval)

    p = verbs.add_parser(
        "generate",
        help="sample text from a run's model (KV cache, streaming)",
        description="Continue each prompt with RUN's final weights, streaming text to the terminal as "
        "it is produced (or --json for machine-readable output). Stops at the tokenizer's eos "
        "(<|eos|>, or an imported tokenizer's own), a --stop string, or --max-new-tokens.",
    )
    p.add_argument("run", metavar="RUN", help="a run directory written by `ember train`")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    _add_sampling_args(p, seed_help="sampling seed (default %(default)s): same seed, same text")
    p.add_argument("--truncate", action="store_true", help="drop the start of prompts that are too long")
    p.add_argument("--json", action="store_true", help="print completions as JSON")
    p.set_defaults(func=cmd_generate)

    p = verbs.add_parser(
        "chat",
        help="an interactive loop: a conversation with a fine-tuned run, or text a base model continues",
        description="A small interactive loop over RUN's final weights. A run fine-tuned with "
        "train.task=sft gets the conversation so far in the chat format (ember/data/chat.py) and replies "
        "until <|end_turn|>; a base model has no chat format, so each line you type is continued as plain "
        "text. Long inputs keep their end.",
    )
    p.add_argument("run", metavar="RUN", help="a run directory written by `ember train`")
    _add_sampling_args(p, seed_help="sampling seed (each turn adds its number)")
    p.set_defaults(func=cmd_chat)

    p = verbs.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (paged KV cache, continuous batching)",
        description="Serve RUN's final weights over HTTP with OpenAI's API: POST /v1/completions and "
        '/v1/chat/completions (streaming with "stream": true), GET /v1/models, /health and /metrics '
        "(Prometheus). Requests join and leave the running batch at every step; their keys and values "
        "live in a pool of fixed-size blocks shared by common prompt prefixes (docs/serve.md). Needs the "
        "serve extra (fastapi, uvicorn).",
        epilog="example: ember serve runs/add2-sft --port 8000 serve.max_seqs=16; then "
        "OpenAI(base_url='http://localhost:8000/v1', api_key='-').completions.create(model='add2-sft', "
        "prompt='12+30=', max_tokens=8)",
    )
    p.add_argument("run", metavar="RUN", help="a run directory written by `ember train` or `ember import`")
    p.add_argument("overrides", nargs="*", metavar="serve.key=value", help="settings (`ember config keys`)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.set_defaults(func=cmd_serve)

    p = verbs.add_parser(
        "report",
        help="write report.md + plots for a run, or compare several runs",
        description="One RUN: writes RUN/report.md and RUN/plots/*.png (loss, lr, grad norm, tokens/s), "
        "final metrics, data manifest, environment, evaluation and samples. Several RUNs: overlaid "
        "curves and a config diff, written into --out. Needs matplotlib (the plots extra).",
    )
    p.add_argument(
        "runs", nargs="+", metavar="RUN", help="run directories made by `ember train`, or one sweep directory"
    )
    p.add_argument("--out", default=None, help="output directory (required for several runs)")
    p.set_defaults(func=cmd_report)

    p = verbs.add_parser(
        "sweep",
        help="a grid of settings × seeds as ordinary runs, with CIs and significance tests",
        description="Train CONFIG once per (grid setting, seed) as `ember train CONFIG [key=value ...] "
        "<setting> run.seed=K`, each a run directory OUT/runs/<setting>-seed<K>/ with its log in train.log, "
        "then read the metric of each run and compare every setting with the baseline: mean ± 95% CI "
        "(Student t), the difference of means with Welch's CI and p (which gives the verdict), and an "
        "exact permutation test beside it. Writes OUT/sweep.json, OUT/sweep.md and OUT/plots/. Everything is "
        "checked before the first run starts. Resumable: run it again and finished runs are skipped, "
        "unfinished ones resume from their last checkpoint (train.resume=auto). A failed run is "
        "reported with the end of its log and left out of the statistics; the sweep goes on and "
        "exits with code 1.",
        epilog="example: ember sweep tiny --grid train.lr=0.003,0.01 --grid model.n_layer=2,4 --seeds 3 "
        "--jobs 2 --metric summary.loss train.max_steps=50",
    )
    p.add_argument("config", metavar="CONFIG", help=CONFIG_HELP)
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides shared by every run (e.g. train.max_steps=200)",
    )
    p.add_argument(
        "--grid",
        action="append",
        metavar="KEY=V1,V2",
        help="a config key and its values, split on commas (repeatable; the settings are the product "
        "of all --grid keys)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=3,
        metavar="N",
        help="seeds 0..N-1 per setting (default 3; the permutation p shown beside Welch's needs 4+ "
        "to go below 0.05)",
    )
    p.add_argument("--seed-list", metavar="S1,S2", help="these seeds instead of 0..N-1")
    p.add_argument("--jobs", type=int, default=1, metavar="J", help="runs at a time (default 1)")
    p.add_argument(
        "--metric",
        default="test.bpb",
        help="what to compare: test.KEY or val.KEY (from `ember eval RUN --split test|val`, KEY one of "
        "loss, ppl, bpb) or summary.KEY (from the run's summary.json, e.g. summary.loss, "
        "summary.val_bpb). Default test.bpb",
    )
    p.add_argument(
        "--baseline",
        metavar="KEY=V,...",
        help="the setting the others are tested against (default: the first value of each --grid key)",
    )
    p.add_argument(
        "--alpha", type=float, default=0.05, help="significance level of the verdict (default 0.05)"
    )
    p.add_argument("--out", default=None, help="the sweep directory (default runs/sweep-<config name>)")
    p.set_defaults(func=cmd_sweep)

    p = verbs.add_parser(
        "export",
        help="write a run's model for another library (--to hf, pt2, aoti, onnx)",
        description="Write RUN's final weights (or --ckpt) and tokenizer into DIR for another library. "
        "--to hf writes what save_pretrained writes: config.json (GPT2LMHeadModel for learned "
        "positions, LlamaForCausalLM for RoPE), model.safetensors, generation_config.json and a fast "
        "tokenizer (tokenizer.json, tokenizer_config.json), so AutoModelForCausalLM.from_pretrained(DIR) "
        "and AutoTokenizer.from_pretrained(DIR) load it without ember, with the same logits. A layout HF "
        "cannot represent (qk_norm, logit_softcap, ...) is refused, naming the option. DIR appears "
        "only when complete. Needs transformers. --to pt2 (torch.export program), aoti (AOTInductor "
        "package) and onnx (ONNX, needs onnx, onnxscript, onnxruntime) write one FILE holding "
        "forward(idx) -> logits with dynamic batch and sequence length (onnx-decode: ONNX with past "
        "keys/values as inputs and outputs, for decoding with onnxruntime); it is loaded back and "
        "checked against eager, and the load and first-call times are printed.",
        epilog="examples: ember export runs/tiny --to hf out/tiny-hf; "
        "ember export runs/tiny --to onnx out/tiny.onnx",
    )
    p.add_argument("run", metavar="RUN", help="a run directory written by `ember train` or `ember import`")
    p.add_argument(
        "--to", required=True, metavar="FORMAT", help="the target format: hf, pt2, aoti, onnx, onnx-decode"
    )
    p.add_argument(
        "dir", metavar="DIR", help="the folder (hf) or file (pt2, aoti, onnx) to write; must not exist"
    )
    p.add_argument("--ckpt", default="last", help="last (final weights), best (best val), or a step number")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists and is not empty")
    p.set_defaults(func=cmd_export)

    p = verbs.add_parser(
        "import",
        help="make a run directory from another library's checkpoint (hf: a GPT-2 or Llama folder)",
        description="Read DIR, a folder written by transformers' save_pretrained holding a GPT-2 or "
        "Llama-family causal LM and its fast tokenizer.json (ember's own, as `ember export --to hf` "
        "writes, or a stock one such as GPT-2's byte-level BPE or a Llama-style SentencePiece BPE, "
        "its bos/eos/pad/unk read from tokenizer_config.json, special_tokens_map.json, "
        "generation_config.json or config.json), and write a run directory OUT: model/ "
        "(model.safetensors, model_config.json, tokenizer.json, and specials.json for a stock "
        "tokenizer), tokenizer.json and config.yaml, which `ember eval OUT "
        "--data ...` and `ember generate OUT` read. A config ember cannot represent is refused, naming "
        "the field. OUT appears only when complete. Needs transformers.",
        epilog="example: ember import hf out/tiny-hf --out runs/tiny-back",
    )
    p.add_argument("source", choices=["hf"], metavar="FORMAT", help="the source format: hf")
    p.add_argument("dir", metavar="DIR", help="the folder to read (config.json, weights, tokenizer.json)")
    p.add_argument("--out", required=True, metavar="RUN", help="the run directory to write")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists and is not empty")
    p.set_defaults(func=cmd_import)

    p = verbs.add_parser(
        "quantize",
        help="write a run with int8 or int4 weights, or compare the schemes (--report)",
        description="Quantize the linear layers of RUN's blocks and its output head (int8 per row in "
        "every scheme; a tied embedding stays fp32 for its lookups) and write the run directory OUT, "
        "which `ember eval`, `ember generate` and `ember chat` read like any run. Schemes: int8-weight "
        "(per-channel int8 weights), int8-dynamic (int8 weights and "
        "per-row int8 activations, for GPUs with int8 tensor cores), int4-weight (group-wise 4-bit, "
        "--group-size 32, 64 or 128). --report instead measures fp32 and each scheme on RUN's test "
        "split: bytes of weights, bits/byte and its change, greedy-token agreement with fp32, and "
        "batch-1 decode tokens/s, and writes RUN/quantize.json.",
        epilog="examples: ember quantize runs/cpu-quick --scheme int4-weight --out runs/cpu-quick-int4; "
        "ember quantize runs/cpu-quick --report",
    )
    p.add_argument("run", metavar="RUN", help="a run directory with float weights (model/)")
    p.add_argument(
        "--scheme", action="append", metavar="S", help="int8-weight, int8-dynamic or int4-weight "
        "(with --report: repeatable, default all)",
    )  # fmt: skip
    p.add_argument(
        "--group-size", type=int, default=None, help="int4-weight group size: 32 (default), 64, 128"
    )
    p.add_argument("--out", metavar="RUN2", help="the quantized run directory to write")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists and is not empty")
    p.add_argument("--float-head", action="store_true", help="keep the output head fp32 (default: int8)")
    p.add_argument("--report", action="store_true", help="compare fp32 with the schemes; write no run")
    p.add_argument(
        "--max-windows", type=int, default=None, help="--report: score at most this many test windows"
    )
    p.set_defaults(func=cmd_quantize)

    cfg = verbs.add_parser(
        "config",
        help="show the resolved config or list every key",
        description="Inspect configs: resolved values and the keys that exist.",
    )
    cfg_verbs = cfg.add_subparsers(dest="config_verb", metavar="ACTION", required=True)
    p = cfg_verbs.add_parser(
        "show",
        help="print the resolved config as YAML",
        description="Load CONFIG (following its `base:` chain), apply overrides, "
        "validate, and print the result as YAML.",
    )
    p.add_argument("config", metavar="CONFIG", help=CONFIG_HELP)
    p.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    p.set_defaults(func=cmd_config_show)
    p = cfg_verbs.add_parser(
        "keys",
        help="list every config key with its type, default and meaning",
        description="List every config key with its type, default and meaning.",
    )
    p.add_argument("prefix", nargs="?", default="", help="only keys starting with this (e.g. data.)")
    p.set_defaults(func=cmd_config_keys)

    p = verbs.add_parser(
        "plan",
        help="will it fit? bytes per rank of parameters, gradients, optimizer state, activations, peak",
        description="Predict, for CONFIG under its layout on --nproc ranks, each rank's bytes of "
        "parameters, gradients, optimizer state and activations (as configured, and with activation "
        "checkpointing; per pipeline stage and micro-batch count) and the peak of a step; FLOPs per step "
        "and, with --peak-tflops, the step time at --mfu. --measure runs a few real steps (torchrun for "
        "N > 1) and prints predicted / measured per component, from a tracker of live tensor storages.",
        epilog="examples: ember plan cpu-quick | ember plan tiny --nproc 2 parallel.tp=2 --measure | "
        "ember plan gpt2-small --nproc 8 parallel.data=fsdp --peak-tflops 989",
    )
    p.add_argument("config", metavar="CONFIG", help=CONFIG_HELP)
    p.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    p.add_argument("--nproc", type=int, default=1, metavar="N", help="ranks (default 1)")
    p.add_argument("--measure", action="store_true", help="run --steps real steps and compare")
    p.add_argument("--steps", type=int, default=4, help="steps of --measure; the last 2 tracked (default 4)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for the step time (0.4)")
    p.add_argument(
        "--peak-tflops", type=float, default=0.0, help="a rank's peak TFLOP/s (an H100: 989 in bf16)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=cmd_plan)

    p = verbs.add_parser(
        "analyze",
        help="instruments on a run: profile, per-example gradients, Hessian curvature, memory",
        description="Read RUN (its config, data and weights or checkpoints) and write RUN/analysis/"
        "INSTRUMENT/results.json (and a plot). profile: torch.profiler over --steps training steps: a "
        "Chrome/Perfetto trace, the top operators by self time, the step split (data, forward, backward, "
        "optimizer, communication) and achieved FLOP/s against a matmul peak measured on the spot. grads: "
        "per-example gradients by torch.func (vmap of grad), their norms per layer, the gradient noise "
        "scale B_simple = tr(Σ)/|G|² (McCandlish et al. 2018), "
        "and with --text the training windows whose gradients agree most and least with the text's "
        "(TracIn). hessian: the top --k eigenvalues of the loss's Hessian on a fixed batch by Lanczos on "
        "Hessian-vector products, the trace by Hutchinson's estimator, and across checkpoints "
        "(--ckpt all) the sharpness against 2/lr. memory: live bytes of parameters, gradients, optimizer "
        "state and activations after every operation of a training step of the run's config (and on "
        "CUDA the allocator's history, for PyTorch's memory visualiser).",
        epilog="examples: ember analyze runs/tiny grads --batch 16 --text 'def main():' | "
        "ember analyze runs/tiny hessian --ckpt all --k 3",
    )
    p.add_argument("run", metavar="RUN", help="a run directory (determinism: a CONFIG)")
    instruments = ["profile", "grads", "hessian", "memory", "nonfinite", "lens", "determinism"]
    p.add_argument("instrument", choices=instruments, help="what to measure (determinism: of a CONFIG)")
    p.add_argument("--ckpt", default="last", help="last, best, all, or steps such as 100,200 (default last)")
    p.add_argument(
        "--batch", type=int, default=0, help="windows of seq_len tokens (default: grads 16, hessian 4)"
    )
    p.add_argument("--seed", type=int, default=0, help="which windows, and the random vectors (default 0)")
    p.add_argument(
        "--text", default=None, help="grads: rank the windows by agreement with this text's gradient"
    )
    p.add_argument("--top", type=int, default=5, help="grads: windows shown each way (default 5)")
    p.add_argument("--k", type=int, default=3, help="hessian: eigenvalues (default 3)")
    p.add_argument("--iters", type=int, default=20, help="hessian: Lanczos steps (default 20)")
    p.add_argument(
        "--samples", type=int, default=10, help="hessian: Hutchinson vectors (default 10; 0: none)"
    )
    p.add_argument(
        "--steps", type=int, default=3, help="profile: steps profiled; memory: steps, the last tracked (3)"
    )
    p.add_argument(
        "--stack", action="store_true", help="profile: record Python stacks (slower, larger trace)"
    )
    p.add_argument("--step", type=int, default=None, help="nonfinite: the step to replay")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="determinism: a config override"
    )
    p.add_argument(
        "--nproc",
        default=None,
        metavar="N|A,B",
        help="determinism: compare world sizes, one process against N ranks (or A against B ranks), "
        "each a torchrun launch with one thread per rank (default: two runs in this process)",
    )
    p.set_defaults(func=cmd_analyze)

    bench = verbs.add_parser(
        "bench", help="measure the machine: collectives between ranks", description="Measure the machine."
    )
    bench_verbs = bench.add_subparsers(dest="bench_verb", metavar="WHAT", required=True)
    p = bench_verbs.add_parser(
        "comm",
        help="all-reduce, all-gather, reduce-scatter, all-to-all, send/recv: time and bandwidth by size",
        description="Launch N ranks (gloo on CPU, NCCL on GPU) and time each collective over message "
        "sizes growing 4x from --min-bytes to --max-bytes; print time per call (slowest rank), "
        "algorithm bandwidth (bytes / time) and bus bandwidth (nccl-tests' definition: algbw × 2(n-1)/n "
        "for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for send/recv), and "
        "the count of wrong elements (each result is checked). --out DIR writes comm.json and comm.png.",
        epilog="example: ember bench comm --nproc 4 --max-bytes 64M --out runs/comm",
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="cpu: gloo, cuda: NCCL")
    p.add_argument("--min-bytes", type=_bytes, default=2**10, help="smallest message (default 1K)")
    p.add_argument("--max-bytes", type=_bytes, default=2**28, help="largest message (default 256M)")
    p.add_argument("--seconds", type=float, default=0.2, help="time spent per size, roughly (default 0.2)")
    p.add_argument("--out", default=None, help="directory for comm.json and comm.png")
    p.set_defaults(func=cmd_bench_comm)

    data = verbs.add_parser(
        "data",
        help="prepare token shards and inspect them",
        description="Turn sources into a tokenizer and train/val token shards.",
    )
    data_verbs = data.add_subparsers(dest="data_verb", metavar="ACTION", required=True)
    p = data_verbs.add_parser(
        "prepare",
        help="stream sources → clean → train tokenizer → write shards + manifest",
        description="Read data.sources, clean and deduplicate, train the tokenizer (data.tokenizer, "
        "data.vocab_size), encode in parallel and write train/val shards and manifest.json into "
        "data.dir. The directory appears only when complete. Same inputs again: reused.",
    )
    p.add_argument("config", metavar="CONFIG", help=CONFIG_HELP)
    p.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    p.add_argument(
        "--force",
        action="store_true",
        help="rebuild even if data.dir holds the same result, or replace data prepared from other inputs",
    )
    p.set_defaults(func=cmd_data_prepare)
    p = data_verbs.add_parser(
        "stats",
        help="print a prepared directory's manifest as tables",
        description="Print what a prepared data directory holds: sources, "
        "cleaning, tokenizer, splits. Checks shard headers and the tokenizer hash.",
    )
    p.add_argument("dir", metavar="DIR", help="a directory written by `ember data prepare`")
    p.add_argument("--verify", action="store_true", help="also re-hash every shard against the manifest")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(func=cmd_data_stats)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may follow options too (`ember train tiny --nproc 2 run.seed=3`).
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "overrides") or any("=" not in a or a.startswith("-") for a in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.func(args)
    except EmberError as e:
        print(f"ember: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("ember: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
