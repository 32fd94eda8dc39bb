"""The ``ember`` command: a table of verbs, each a thin call into the library.

    ember --help
    ember data prepare python data.vocab_size=8192

Each verb is one block: ``@verb(name, help, description, *arguments)`` declares its parser
above the ``cmd_*`` function that runs it, and ``build_parser`` walks the table. Every verb that
takes a config accepts a YAML path or a preset name (``configs/NAME.yaml``) followed by
``key.sub=value`` overrides. An ``EmberError`` (a bad option too: every number declares its range
with ``bounded``) is printed as one short message and exits with code 2; anything else is a bug
and keeps its traceback. Imports of torch and what stands on it stay inside the commands, so that
``ember --help`` answers at once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path

import ember
from ember.config import COMPARE
from ember.data.chat import render
from ember.errors import EmberError
from ember.infer.sampling import Sampling

VERBS: list[tuple[str, dict, tuple, Callable]] = []  # (name, parser settings, arguments, command)
NOUNS = {  # `ember NOUN ACTION`: help, description, and what the action is called
    "config": ("show the resolved config or list every key",
               "Inspect configs: resolved values and the keys that exist.", "ACTION"),
    "bench": ("measure the machine: collectives between ranks", "Measure the machine.", "WHAT"),
    "data": ("prepare token shards and inspect them",
             "Turn sources into a tokenizer and train/val token shards.", "ACTION"),
}  # fmt: skip


def verb(name: str, help: str, description: str, *arguments: tuple, epilog: str | None = None):
    """Register the command below as ``ember NAME`` (``NOUN ACTION`` for a noun of NOUNS), with
    its ``arg(...)`` arguments; ``ember --help`` lists the verbs in the order they register."""

    def register(command: Callable) -> Callable:
        VERBS.append((name, {"help": help, "description": description, "epilog": epilog}, arguments, command))
        return command

    return register


def arg(*flags: str, **settings) -> tuple:
    """One ``add_argument`` call, written down for a verb's table."""
    return flags, settings


LOCAL_RANKS = max(8, 4 * (os.cpu_count() or 1))  # processes one launch may start on this machine


def bounded(kind: type, *, why: str = "", **bounds: float) -> Callable[[str], int | float]:
    """An argparse ``type``: ``kind`` (int or float, finite) within ``ge=``/``gt=``/``le=``/``lt=``,
    so that every numeric option declares its range and the parser refuses one outside it before
    any work (one line, exit 2). ``why`` explains a bound that is not obvious."""
    rules = [(op, bounds[name]) for name, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if name in bounds]  # fmt: skip # noqa: E501
    wanted = f"{kind.__name__} {' and '.join(f'{op} {b:g}' for op, b in rules)}".strip()

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {wanted}; got {text!r}") from None
        if not math.isfinite(value) or not all(COMPARE[op](value, b) for op, b in rules):
            raise argparse.ArgumentTypeError(f"must be {wanted}{f' ({why})' if why else ''}; got {text}")
        return value

    return parse


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as EmberErrors: one line ``ember: error: ...``, exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        verb = self.prog.partition(" ")[2]
        raise EmberError(f"{verb + ': ' if verb else ''}{message} (see `{self.prog} --help`)")


CONFIG = arg("config", metavar="CONFIG", help="a YAML config file or a preset name from configs/ (e.g. python, tiny)")  # fmt: skip # noqa: E501
OVERRIDES = arg("overrides", nargs="*", metavar="key=value",
                help="config overrides as key.sub=value (e.g. data.vocab_size=8192 run.seed=3)")  # fmt: skip
CONFIGURED = (CONFIG, OVERRIDES)  # CONFIG key=value ...
RUN = arg("run", metavar="RUN", help="a run directory written by `ember train` or `ember import`")
CKPT = arg("--ckpt", default="last", help="last (final weights), best (best val), or a step number")
NPROC = arg("--nproc", type=bounded(int, ge=1, le=LOCAL_RANKS, why="at most 4 ranks per CPU core here"), default=1, metavar="N", help="ranks: processes under torch.distributed.run (default 1)")  # fmt: skip # noqa: E501


def sampling_args(seed_help: str) -> list[tuple]:
    """The fields of ``ember.infer.sampling.Sampling`` as options, shared by `generate` and `chat`."""
    options = [
        ("--max-new-tokens", int, "tokens to generate at most (default %(default)s)"),
        ("--temperature", float, "0 = greedy (default %(default)s)"),
        ("--top-k", int, "sample among the k most likely tokens"),
        ("--top-p", float, "nucleus sampling: smallest set with mass p"),
        ("--seed", int, seed_help),
    ]  # their bounds are Sampling's, which the server checks too: checked by `_sampling`, before any work
    stop = arg("--stop", action="append", default=[], help="stop when this text appears (repeatable)")
    default = lambda flag: getattr(Sampling, flag[2:].replace("-", "_"))  # noqa: E731
    return [*(arg(flag, type=kind, default=default(flag), help=text) for flag, kind, text in options), stop]


def _sampling(args) -> Sampling:
    """The ``Sampling`` that the options of `generate` or `chat` spell out (checked here)."""
    return Sampling(**{f.name: getattr(args, f.name) for f in fields(Sampling) if hasattr(args, f.name)})


def _command_line() -> str:
    return shlex.join(["ember", *sys.argv[1:]])


@verb(
    "quickstart",
    "the main job: embedded corpus → tokenizer + shards → trained model → evaluation",
    "Prepare the embedded Python corpus (CPython's docs and standard library; reused when already "
    "prepared), train the cpu-quick preset (gpt2-small on CUDA) for a wall-clock budget, evaluate it on "
    "the test and validation splits, and print where each output is. Running it again replaces the "
    "previous quickstart run.",
    arg("--minutes", type=bounded(float, gt=0), default=5.0, help="training budget in minutes (default 5)"),
    arg("--out", default="runs", help="runs root; the run is OUT/quickstart (default runs)"),
    arg("--data-dir", help="where the shards go (default: data/python)"),
    OVERRIDES,
)
def cmd_quickstart(args) -> int:
    from ember.quickstart import quickstart

    print(f"ember {ember.__version__} quickstart")
    quickstart(args.minutes, args.out, args.data_dir, args.overrides, command=_command_line())
    return 0


@verb(
    "train",
    "pretrain a GPT on prepared shards (CPU, GPU, or N ranks with DDP/FSDP2)",
    "Train CONFIG's model on the shards in data.dir (prepared first if needed) until a budget "
    "(train.max_steps, max_tokens, max_time) is spent, writing RUN = run.out_dir/run.name: config.yaml, "
    "env.json, metrics.jsonl, checkpoints/ (DCP, committed) and model/ (safetensors). Resume with "
    "train.resume=auto. Under torchrun, each process joins the group from the environment.",
    *CONFIGURED,
    NPROC,
    epilog="examples: ember train tiny | ember train cpu-quick train.max_time=60 | "
    "ember train tiny --nproc 2 parallel.data=fsdp",
)
def cmd_train(args) -> int:
    from ember.analysis.plan import check_size, model_config_for
    from ember.config import load_config
    from ember.data.prepare import prepare
    from ember.parallel.dist import torchrun_cmd
    from ember.train.layout import check_layout
    from ember.train.tasks import task_class
    from ember.train.trainer import train

    cfg = load_config(args.config, args.overrides)  # bad configs fail here, before any launch
    if "LOCAL_RANK" not in os.environ:
        check_layout(cfg, args.nproc)  # a layout that cannot run fails here, before any work
        if task_class(cfg.train.task).tokens:  # (an image task reads its images itself: no shards)
            check_size(model_config_for(cfg), args.nproc, 1)  # a model that cannot fit, before it is built
            prepare(cfg, command=_command_line())  # once, before any rank starts: reuses prepared data
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        cmd = torchrun_cmd(args.nproc, "train", args.config, *args.overrides)
        print(f"launching {args.nproc} processes: {shlex.join(cmd)}", flush=True)
        return subprocess.call(cmd)
    train(cfg)
    return 0


@verb(
    "eval",
    "loss, perplexity and bits per byte of a run's model on its val/test split or any text",
    "Evaluate RUN's model on a split of its prepared data (--split val, the default, or test: held out by "
    "origin) or on --data sources (files, directories, globs, .jsonl/.parquet, embedded:NAME): every "
    "token once unless --max-windows caps it, per stratum too; bits per byte count the text's UTF-8 "
    "bytes, so runs with different tokenizers compare fairly. Results accumulate in RUN/eval.json. Guide: "
    "docs/eval.md.",
    RUN,
    arg("--split", action="append", choices=["train", "val", "test"],
        help="a split of the run's data (repeatable; default val when no --data is given); train, with "
        "--max-windows, compares the final model on seen and unseen text alike"),
    arg("--data", action="append", metavar="SOURCE", help="text to evaluate on (repeatable)"),
    arg("--task", metavar="NAME",
        help="instead: accuracy on an embedded task's test problems (add-2, sort, ...)"),
    arg("--n", type=bounded(int, ge=1), default=200, help="--task: problems to answer (default 200)"),
    arg("--skip", type=bounded(int, ge=0), default=0,
        help="--task: leave out the first K test problems (those a run's own "
        "evaluations used to pick its settings) and answer the next N"),
    CKPT,
    arg("--seq-len", type=bounded(int, ge=1), default=None, help="window length (default: train.seq_len)"),
    arg("--batch-size", type=bounded(int, ge=1), default=8, help="windows per forward pass (default 8)"),
    arg("--stride", type=bounded(int, ge=1), default=None,
        help="score each window's last STRIDE tokens only, with the rest "
        "as context (default: the window length, disjoint windows; smaller costs seq_len/STRIDE times more)"),
    arg("--max-windows", type=bounded(int, ge=1), default=None,
        help="score only this many evenly spaced windows per dataset (default: all, every token)"),
)  # fmt: skip
def cmd_eval(args) -> int:
    from ember.infer.evaluate import evaluate_run, evaluate_task, print_results, print_task

    if args.task:
        if args.data or args.split:
            raise EmberError("--task scores generated answers; give it without --split or --data")
        run = Path(args.run)
        print_task(evaluate_task(run, args.task, args.n, args.ckpt, skip=args.skip), run)
        return 0
    results = evaluate_run(Path(args.run), args.data, args.ckpt, args.seq_len, args.batch_size,
                           args.max_windows, splits=args.split, stride=args.stride)  # fmt: skip
    print_results(results, f"{args.run} ({args.ckpt})", Path(args.run))
    return 0


@verb(
    "generate",
    "sample text from a run's model (KV cache, streaming)",
    "Continue each prompt with RUN's final weights, streaming text to the terminal as it is produced (or "
    "--json for machine-readable output). Stops at the tokenizer's eos (<|eos|>, or an imported "
    "tokenizer's own), a --stop string, or --max-new-tokens.",
    RUN,
    arg("--prompt", action="append", help="prompt text (repeatable)"),
    arg("--prompts-file", help="a file with one prompt per line"),
    *sampling_args("sampling seed (default %(default)s): same seed, same text"),
    arg("--truncate", action="store_true", help="drop the start of prompts that are too long"),
    arg("--json", action="store_true", help="print completions as JSON"),
)
def cmd_generate(args) -> int:
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
        rows = [{"prompt": p, **asdict(c)} for p, c in zip(prompts, completions, strict=True)]
        print(json.dumps(rows, indent=2))
        return 0
    for i, prompt in enumerate(prompts):  # stream each prompt's text as it is produced
        print(f"--- {i + 1}/{len(prompts)}" if len(prompts) > 1 else "---", flush=True)
        print(prompt, end="", flush=True)
        # row i of a batch samples with seed + i: the same text as --json gives for this prompt
        for _, piece in engine.stream([prompt], replace(sampling, seed=sampling.seed + i), args.truncate):
            print(piece, end="", flush=True)
        print(flush=True)
    return 0


@verb(
    "chat",
    "an interactive loop: a conversation with a fine-tuned run, or text a base model continues",
    "A small interactive loop over RUN's final weights. A run fine-tuned with train.task=sft gets the "
    "conversation so far in the chat format (ember/data/chat.py) and replies until <|end_turn|>; a base "
    "model has no chat format, so each line you type is continued as plain text. Long inputs keep their "
    "end.",
    RUN,
    *sampling_args("sampling seed (each turn adds its number)"),
)
def cmd_chat(args) -> int:
    from ember.infer.engine import Engine
    from ember.run import saved_config

    sampling = _sampling(args)
    engine = Engine.from_run(args.run)
    config = Path(args.run) / "config.yaml"
    task = config.is_file() and saved_config(config)["train"].get("task")
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


@verb(
    "serve",
    "an OpenAI-compatible HTTP server (paged KV cache, continuous batching)",
    "Serve RUN over HTTP with OpenAI's API (POST /v1/completions, /v1/chat/completions, streaming; GET "
    "/v1/models, /health, /metrics), batching continuously over a paged KV cache that common prefixes "
    "share. Needs the serve extra (fastapi, uvicorn). Guide: docs/serve.md.",
    RUN,
    arg("overrides", nargs="*", metavar="serve.key=value", help="settings (`ember config keys`)"),
    arg("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"),
    arg("--port", type=bounded(int, ge=1, le=65535), default=8000, help="port (default 8000)"),
    arg("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1"),
    epilog="example: ember serve runs/add2-sft --port 8000 serve.max_seqs=16; then "
    "OpenAI(base_url='http://localhost:8000/v1', api_key='-').completions.create(model='add2-sft', "
    "prompt='12+30=', max_tokens=8)",
)
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


@verb(
    "report",
    "write report.md + plots for a run, or compare several runs",
    "One RUN: writes RUN/report.md and RUN/plots/*.png (loss, lr, grad norm, tokens/s), final metrics, "
    "data manifest, environment, evaluation and samples. Several RUNs: overlaid curves and a config diff, "
    "written into --out. Needs matplotlib (the plots extra).",
    arg("runs", nargs="+", metavar="RUN", help="run directories (`ember train`), or one sweep directory"),
    arg("--out", default=None, help="output directory (required for several runs)"),
)
def cmd_report(args) -> int:
    from ember.report.report import write_report
    from ember.sweep import render_sweep

    runs = [Path(p) for p in args.runs]
    if len(runs) == 1 and (runs[0] / "sweep.json").exists():  # a sweep: redrawn where it is (or in --out)
        path = render_sweep(runs[0], Path(args.out) if args.out else None)
    else:
        path = write_report(runs, Path(args.out) if args.out else None)
    print(f"written {path}")
    return 0


@verb(
    "sweep",
    "a grid of settings × seeds as ordinary runs, with CIs and significance tests",
    "Train CONFIG once per (grid setting, seed) as `ember train CONFIG [key=value ...] <setting> "
    "run.seed=K` into OUT/runs/<setting>-seed<K>/, then compare each setting's metric with the "
    "baseline's: mean ± 95% CI, Welch's difference of means with its CI and p (the verdict), and an exact "
    "permutation test; writes OUT/sweep.json, sweep.md and plots/. Checked before the first run; "
    "resumable. A failed run is reported and left out, and the sweep exits with code 1. Guide: "
    "docs/sweep.md.",
    CONFIG,
    arg("overrides", nargs="*", metavar="key=value",
        help="config overrides shared by every run (e.g. train.max_steps=200)"),
    arg("--grid", action="append", metavar="KEY=V1,V2", help="a config key and its values, split on commas "
        "(repeatable; the settings are the product of all --grid keys); config=A,B: a config per setting"),
    arg("--seeds", type=bounded(int, ge=1), default=3, metavar="N",
        help="seeds 0..N-1 per setting (default 3; the "
        "permutation p shown beside Welch's needs 4+ to go below 0.05)"),
    arg("--seed-list", metavar="S1,S2", help="these seeds instead of 0..N-1"),
    arg("--jobs", type=bounded(int, ge=1, le=LOCAL_RANKS), default=1, metavar="J",
        help="runs at a time (default 1)"),
    arg("--metric", default="test.bpb", help="what to compare: test.KEY or val.KEY (from `ember eval RUN "
        "--split test|val`, KEY one of loss, ppl, bpb; of an image run accuracy, error) or summary.KEY (from "
        "the run's summary.json, e.g. summary.loss, summary.val_bpb). Default test.bpb"),
    arg("--baseline", metavar="KEY=V,...",
        help="the setting the others are tested against (default: the first value of each --grid key)"),
    arg("--alpha", type=bounded(float, gt=0, lt=1), default=0.05,
        help="significance level of the verdict (default 0.05)"),
    arg("--out", default=None, help="the sweep directory (default runs/sweep-<config name>)"),
    epilog="example: ember sweep tiny --grid train.lr=0.003,0.01 --grid model.n_layer=2,4 --seeds 3 "
    "--jobs 2 --metric summary.loss train.max_steps=50",
)  # fmt: skip
def cmd_sweep(args) -> int:
    from ember.sweep import SWEEP_MD, plan_sweep, print_table, run_sweep

    seed_list = None
    if args.seed_list is not None:
        try:
            seed_list = [int(s) for s in args.seed_list.split(",")]
        except ValueError:
            raise EmberError(f"--seed-list {args.seed_list!r} is not integers separated by commas") from None
    sweep = plan_sweep(args.config, args.grid or [], seeds=args.seeds, seed_list=seed_list,
                       metric=args.metric, baseline=args.baseline, out=args.out, overrides=args.overrides,
                       jobs=args.jobs, alpha=args.alpha)  # fmt: skip
    record = run_sweep(sweep, command=_command_line())
    print_table(record, f"{sweep.metric} ({sweep.out})")
    print(f"written {sweep.out / SWEEP_MD}")
    if record["failed"]:
        print(f"ember: {len(record['failed'])} run(s) failed: {', '.join(record['failed'])}", file=sys.stderr)
        return 1
    return 0


@verb(
    "export",
    "write a run's model for another library (--to hf, gguf, pt2, aoti, onnx)",
    "Write RUN's final weights (or --ckpt) and tokenizer into DIR, for another library to load without "
    "ember. hf: a save_pretrained folder (GPT-2 or Llama) giving the same logits in transformers; a "
    "layout it cannot represent is refused, naming the option. gguf: one FILE for llama.cpp/Ollama, "
    "--type f32|f16|q8_0|q4_0. pt2 (torch.export), aoti (AOTInductor), "
    "onnx (needs onnx, onnxscript, onnxruntime) and onnx-decode (with past keys/values): one FILE holding "
    "forward(idx) -> logits with dynamic batch and sequence, checked against eager. DIR appears only when "
    "complete. Guide: docs/export.md.",
    RUN,
    arg("--to", required=True, metavar="FORMAT", help="hf, gguf, pt2, aoti, onnx, onnx-decode"),
    arg("--type", choices=["f32", "f16", "q8_0", "q4_0"], help="gguf only: the weights' type (default f32)"),
    arg("dir", metavar="DIR", help="the folder (hf) or file (gguf, pt2, aoti, onnx) to write; must be new"),
    CKPT,
    arg("--force", action="store_true", help="replace DIR if it holds ember's own output of this format"),
    epilog="examples: ember export runs/tiny --to hf out/tiny-hf; "
    "ember export runs/tiny --to onnx out/tiny.onnx; ember export runs/tiny --to gguf out/t.gguf --type q8_0",
)
def cmd_export(args) -> int:
    from ember.export.gguf import TARGETS as GGUFS
    from ember.export.gguf import export_gguf
    from ember.export.graph import TARGETS as GRAPHS
    from ember.export.graph import export_graph
    from ember.export.hf import TARGETS, export_hf

    if args.type and args.to not in GGUFS:
        raise EmberError(f"--type {args.type} is for --to gguf; --to {args.to} writes fp32")
    if args.to in GGUFS:
        out = export_gguf(args.run, args.dir, args.type or "f32", ckpt=args.ckpt, force=args.force)
        print(f"written {out} (run it with llama.cpp: llama-cli -m {out} -p TEXT)")
        return 0
    if args.to in GRAPHS:
        c = export_graph(args.run, args.to, args.dir, ckpt=args.ckpt, force=args.force)
        print(f"written {args.dir}: load {c.load_s * 1e3:.1f} ms, first call {c.first_call_s * 1e3:.1f} ms, "
              f"max |logit diff| vs eager {c.max_abs_diff:.1e}")  # fmt: skip
        return 0
    if args.to not in TARGETS:  # checked here, not by argparse, for a one-line error and exit 2
        choices = ", ".join(TARGETS + GGUFS + GRAPHS)
        raise EmberError(f"--to {args.to!r}: unknown export target; choose one of {choices}")
    out = export_hf(args.run, args.dir, ckpt=args.ckpt, force=args.force)
    print(f"written {out} (load it with transformers' AutoModelForCausalLM and AutoTokenizer)")
    return 0


@verb(
    "import",
    "make a run directory from another library's checkpoint (hf folder, gguf file; GPT-2 or Llama)",
    "Read DIR, a transformers save_pretrained folder of a GPT-2 or Llama-family causal LM with its fast "
    "tokenizer.json (ember's own, or a stock byte-level or SentencePiece-style BPE), and write the run "
    "directory OUT that `ember eval` and `ember generate` read. A config ember cannot represent is "
    "refused, naming the field. gguf: a gpt2/llama FILE with a byte-level BPE vocabulary. OUT appears only "
    "when complete. hf needs transformers, gguf the gguf package. Guide: "
    "docs/export.md.",
    arg("source", choices=["hf", "gguf"], metavar="FORMAT", help="the source format: hf, gguf"),
    arg("dir", metavar="DIR", help="the folder to read (hf), or the .gguf file (gpt2/llama, byte-level BPE)"),
    arg("--out", required=True, metavar="RUN", help="the run directory to write"),
    arg("--force", action="store_true", help="replace OUT if it holds a run ember wrote"),
    epilog="examples: ember import hf out/tiny-hf --out runs/back; ember import gguf out/t.gguf --out runs/t",
)
def cmd_import(args) -> int:
    from ember.export.gguf import import_gguf
    from ember.export.hf import import_hf

    out = (import_gguf if args.source == "gguf" else import_hf)(args.dir, args.out, force=args.force)
    print(f"written {out} (try `ember generate {out} --prompt TEXT`)")
    return 0


@verb(
    "quantize",
    "write a run with int8 or int4 weights, or compare the schemes (--report)",
    "Quantize RUN's block linears (int8-weight: per-channel int8; int8-dynamic: with per-row int8 "
    "activations; int4-weight: group-wise 4-bit, --group-size 32, 64 or 128) and its head (int8) into the "
    "run directory OUT, which eval, generate and chat read. --report instead measures fp32 and each "
    "scheme on RUN's test split (bytes, bits/byte, greedy agreement, decode tokens/s) into "
    "RUN/quantize.json. Guide: docs/quantize.md.",
    arg("run", metavar="RUN", help="a run directory with float weights (model/)"),
    arg("--scheme", action="append", metavar="S",
        help="int8-weight, int8-dynamic or int4-weight (with --report: repeatable, default all)"),
    arg("--group-size", type=bounded(int, ge=1), default=None,
        help="int4-weight group size: 32 (default), 64, 128"),
    arg("--out", metavar="RUN2", help="the quantized run directory to write"),
    arg("--force", action="store_true", help="replace OUT if it holds a run ember wrote"),
    arg("--float-head", action="store_true", help="keep the output head fp32 (default: int8)"),
    arg("--report", action="store_true", help="compare fp32 with the schemes; write no run"),
    arg("--max-windows", type=bounded(int, ge=1), default=None,
        help="--report: score at most this many test windows"),
    epilog="examples: ember quantize runs/cpu-quick --scheme int4-weight --out runs/cpu-quick-int4; "
    "ember quantize runs/cpu-quick --report",
)  # fmt: skip
def cmd_quantize(args) -> int:
    from ember.export.quantize import print_report, quantize_run, report
    from ember.model.quant import GROUP_SIZES, QuantSpec

    if not args.report:
        if not args.out or not args.scheme or len(args.scheme) > 1:
            raise EmberError("give one --scheme and --out RUN2 (or --report to compare schemes)")
        spec = QuantSpec(args.scheme[0], args.group_size or 32, head=not args.float_head)
        out = quantize_run(args.run, spec, args.out, force=args.force)
        print(f"written {out} ({spec.label}); `ember eval {out} --split test` and `ember generate {out}` read it")  # fmt: skip # noqa: E501
        return 0
    if args.out:
        raise EmberError("--report writes RUN/quantize.json and no run; drop --out")
    specs = []
    for scheme in args.scheme or ["int8-weight", "int8-dynamic", "int4-weight"]:
        groups = [args.group_size] if args.group_size else GROUP_SIZES if scheme == "int4-weight" else [32]
        specs += [QuantSpec(scheme, g, head=not args.float_head) for g in groups]
    print_report(report(args.run, specs, args.max_windows, sweep=not args.group_size), Path(args.run))
    return 0


@verb(
    "config show",
    "print the resolved config as YAML",
    "Load CONFIG (following its `base:` chain), apply overrides, validate, and print the result as YAML.",
    *CONFIGURED,
)
def cmd_config_show(args) -> int:
    from ember.config import config_to_yaml, load_config

    print(config_to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


@verb(
    "config keys",
    "list every config key with its type, default and meaning",
    "List every config key with its type, default and meaning.",
    arg("prefix", nargs="?", default="", help="only keys starting with this (e.g. data.)"),
)
def cmd_config_keys(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from ember.config import config_keys

    table = Table("key", "type", "default", "meaning", box=None, header_style="bold")
    for key, type_name, default, help_text in config_keys():
        if key.startswith(args.prefix):
            cells = (key, type_name, default, help_text)
            table.add_row(*(Text(str(c)) for c in cells))  # literal: list[str] is not markup
    Console(width=max(120, Console().width)).print(table)
    return 0


@verb(
    "plan",
    "will it fit? bytes per rank of parameters, gradients, optimizer state, activations, peak",
    "Predict each rank's bytes of parameters, gradients, optimizer state and activations (with and "
    "without activation checkpointing; per pipeline stage) and a step's peak, for CONFIG's layout on "
    "--nproc ranks, and FLOPs per step (with --peak-tflops, the step time at --mfu). --measure runs a few "
    "real steps (torchrun for N > 1) and sets each component against a tracker of live tensor storages.",
    *CONFIGURED,
    arg("--nproc", type=bounded(int, ge=1, le=1024), default=1, metavar="N",
        help="ranks to plan for (default 1)"),
    arg("--measure", action="store_true", help="run --steps real steps and compare"),
    arg("--steps", type=bounded(int, ge=2, why="--measure tracks the last two steps"), default=4,
        help="steps of --measure; the last 2 (3 from 5 steps on) tracked (default 4)"),
    arg("--mfu", type=bounded(float, gt=0, le=1), default=0.4,
        help="model FLOPs utilisation for the step time (0.4)"),
    arg("--peak-tflops", type=bounded(float, gt=0), help="a rank's peak TFLOP/s (an H100: 989 in bf16)"),
    arg("--memory", type=bounded(float, gt=0), metavar="GIB",
        help="also the largest micro-batch whose predicted peak fits in GIB (default: this GPU's)"),
    arg("--json", action="store_true", help="print one JSON object instead of tables"),
    epilog="examples: ember plan cpu-quick | ember plan tiny --nproc 2 parallel.tp=2 --measure | "
    "ember plan gpt2-small --nproc 8 parallel.data=fsdp --peak-tflops 989 --memory 80",
)
def cmd_plan(args) -> int:
    from ember.analysis.plan import plan_command

    if args.measure and args.nproc > LOCAL_RANKS:
        raise EmberError(f"--measure --nproc {args.nproc} would start {args.nproc} processes here; "
                         f"at most {LOCAL_RANKS} (4 per CPU core)")  # fmt: skip
    plan_command(args.config, args.overrides, args.nproc, args.measure, args.steps, args.json,
                 args.peak_tflops, args.mfu, command=_command_line(), memory_gib=args.memory)  # fmt: skip
    return 0


def _instruments(args, run: Path) -> dict:
    """name -> (the instrument run on RUN with the options it reads, what renders its result)."""
    from ember.analysis import ckpt_names, curvature, grads, lens, memory, profile, replay

    a, ckpts = args, ckpt_names(run, args.ckpt)
    return {
        "profile": (lambda: profile.analyze(run, steps=a.steps, stack=a.stack), profile.summary),
        "grads": (lambda: grads.analyze(run, ckpts, a.batch or 16, a.seed, a.text, a.top), grads.summary),
        "hessian": (lambda: curvature.analyze(run, ckpts, a.batch or 4, a.k, a.iters, a.samples, a.seed),
                    curvature.summary),
        "memory": (lambda: memory.analyze(run, steps=a.steps), memory.summary),
        "nonfinite": (lambda: replay.nonfinite(run, a.step), replay.nonfinite_summary),
        "lens": (lambda: lens.analyze(run, a.text, ckpts[-1]), lens.summary),
    }  # fmt: skip


@verb(
    "analyze",
    "instruments on a run: profile, per-example gradients, Hessian curvature, memory",
    "Read RUN (config, data, weights or checkpoints) and write RUN/analysis/INSTRUMENT/results.json and a "
    "plot. profile: a torch.profiler trace, top operators, the step's phases, achieved FLOP/s against a "
    "measured matmul peak. grads: per-example gradient norms per layer, the gradient noise scale, with "
    "--text the windows agreeing most and least (TracIn). hessian: top --k eigenvalues (Lanczos), trace "
    "(Hutchinson), against 2/lr across checkpoints. memory: live bytes by category over a step. "
    "nonfinite: a replayed --step's first non-finite tensor. lens: each layer read through the head. "
    "determinism: where two runs of a CONFIG first differ. Guide: docs/analysis.md.",
    arg("run", metavar="RUN", help="a run directory (determinism: a CONFIG)"),
    arg("instrument", choices=["profile", "grads", "hessian", "memory", "nonfinite", "lens", "determinism"],
        help="what to measure (determinism: of a CONFIG)"),
    arg("--ckpt", default="last", help="last, best, all, or steps such as 100,200 (default last)"),
    arg("--batch", type=bounded(int, ge=1), default=None,
        help="windows of seq_len tokens (default: grads 16, hessian 4)"),
    arg("--seed", type=bounded(int, ge=0), default=0,
        help="which windows, and the random vectors (default 0)"),
    arg("--text", default=None, help="grads: rank the windows by agreement with this text's gradient"),
    arg("--top", type=bounded(int, ge=1), default=5, help="grads: windows shown each way (default 5)"),
    arg("--k", type=bounded(int, ge=1), default=3, help="hessian: eigenvalues (default 3)"),
    arg("--iters", type=bounded(int, ge=1), default=20, help="hessian: Lanczos steps (default 20)"),
    arg("--samples", type=bounded(int, ge=0), default=10,
        help="hessian: Hutchinson vectors (default 10; 0: none)"),
    arg("--steps", type=bounded(int, ge=1), default=3,
        help="profile: steps profiled; memory: steps, the last tracked (3)"),
    arg("--stack", action="store_true", help="profile: record Python stacks (slower, larger trace)"),
    arg("--step", type=bounded(int, ge=1), default=None, help="nonfinite: the step to replay"),
    arg("--set", action="append", default=[], metavar="KEY=VALUE", help="determinism: a config override"),
    arg("--nproc", default=None, metavar="N|A,B", help="determinism: compare world sizes, one process "
        "against N ranks (or A against B ranks), each a torchrun launch with one thread per rank "
        "(default: two runs in this process)"),
    epilog="examples: ember analyze runs/tiny grads --batch 16 --text 'def main():' | "
    "ember analyze runs/tiny hessian --ckpt all --k 3",
)  # fmt: skip
def cmd_analyze(args) -> int:
    if args.instrument == "determinism":  # of a CONFIG, trained twice: exit 1 where the runs part
        from ember.analysis.replay import determinism, determinism_summary, parse_worlds
        from ember.config import load_config

        cfg = load_config(args.run, args.set)
        r = determinism(cfg, steps=args.steps, worlds=parse_worlds(args.nproc, LOCAL_RANKS))
        print(determinism_summary(r, args.run))
        return 0 if r["identical"] else 1
    run = Path(args.run)
    if not run.is_dir():
        raise EmberError(f"run directory {run} does not exist")
    analyze, summary = _instruments(args, run)[args.instrument]
    r = analyze()
    print(summary(r))
    took = json.loads((Path(r["out"]) / "results.json").read_text())["seconds"]
    print(f"results: {r['out']} ({took:.1f} s)")
    return 0


def _bytes(text: str) -> int:
    """'64K', '256M', '1G' or a plain number of bytes (powers of 1024)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        size = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, OverflowError):
        size = 0
    if not 1 <= size <= 2**40:
        raise argparse.ArgumentTypeError(f"not a size from 1 byte to 1T: {text!r} (e.g. 4096, 64K, 256M)")
    return size


@verb(
    "bench comm",
    "all-reduce, all-gather, reduce-scatter, all-to-all, send/recv: time and bandwidth by size",
    "Launch N ranks (gloo on CPU, NCCL on GPU) and time each collective at message sizes growing 4x from "
    "--min-bytes to --max-bytes: time per call (slowest rank), algorithm and bus bandwidth (nccl-tests' "
    "definitions) and wrong elements (each result is checked). --out DIR writes comm.json and comm.png.",
    arg("--nproc", default=2,
        type=bounded(int, ge=2, le=LOCAL_RANKS, why="at least 2 ranks to talk, at most 4 per CPU core here"),
        help="ranks (default 2)"),
    arg("--device", choices=["auto", "cpu", "cuda"], default="auto", help="cpu: gloo, cuda: NCCL"),
    arg("--min-bytes", type=_bytes, default=2**10, help="smallest message (default 1K)"),
    arg("--max-bytes", type=_bytes, default=2**28, help="largest message (default 256M)"),
    arg("--seconds", type=bounded(float, gt=0, le=3600), default=0.2,
        help="time spent per size, roughly (default 0.2)"),
    arg("--out", default=None, help="directory for comm.json and comm.png"),
    epilog="example: ember bench comm --nproc 4 --max-bytes 64M --out runs/comm",
)
def cmd_bench_comm(args) -> int:
    import torch

    from ember.parallel.comm import run
    from ember.parallel.dist import torchrun_cmd

    if args.min_bytes > args.max_bytes:
        raise EmberError(f"--min-bytes {args.min_bytes:,} is above --max-bytes {args.max_bytes:,}")
    if "LOCAL_RANK" in os.environ:  # a rank, under torchrun
        run(args.min_bytes, args.max_bytes, Path(args.out) if args.out else None, args.seconds)
        return 0
    if args.out:  # refused, or created, before any rank starts
        from ember.atomic import output_dir

        output_dir(args.out, kind="comm", force=True)
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and torch.cuda.device_count() < args.nproc:
        raise EmberError(f"--nproc {args.nproc} with NCCL needs {args.nproc} GPUs; {torch.cuda.device_count()} visible")  # fmt: skip # noqa: E501
    sizes = (f"--min-bytes={args.min_bytes}", f"--max-bytes={args.max_bytes}", f"--seconds={args.seconds}")
    cmd = torchrun_cmd(args.nproc, "bench", "comm", *sizes, *([f"--out={args.out}"] if args.out else []))
    env = {**os.environ, "EMBER_COMM_DEVICE": device}
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)


@verb(
    "data prepare",
    "stream sources → clean → train tokenizer → write shards + manifest",
    "Read data.sources, clean and deduplicate, train the tokenizer (data.tokenizer, data.vocab_size), "
    "encode in parallel and write train/val shards and manifest.json into data.dir. The directory appears "
    "only when complete. Same inputs again: reused.",
    *CONFIGURED,
    arg("--force", action="store_true",
        help="rebuild even if data.dir holds the same result, or replace data prepared from other inputs"),
)  # fmt: skip
def cmd_data_prepare(args) -> int:
    from ember.config import load_config
    from ember.data.prepare import prepare
    from ember.data.stats import print_manifest

    result = prepare(load_config(args.config, args.overrides), force=args.force, command=_command_line())
    print_manifest(result.manifest, result.directory)
    return 0


@verb(
    "data stats",
    "print a prepared directory's manifest, or an image source's splits, as tables",
    "Print what a prepared data directory holds (sources, cleaning, tokenizer, splits; shard headers and the "
    "tokenizer hash checked), or an image source's (embedded:digits, mnist:DIR, ...; or a config's): each "
    "split's count, shape, dtype, value range and class balance, and train's per-channel mean and std.",
    arg("dir", metavar="DIR", help="a directory from `ember data prepare`, a config, or an image source"),
    arg("--verify", action="store_true", help="also re-hash every shard against the manifest"),
    arg("--json", action="store_true", help="print the manifest as JSON"),
)
def cmd_data_stats(args) -> int:
    from ember.data.images import describe_target
    from ember.data.stats import print_manifest, verify

    if (table := describe_target(args.dir)) is not None:  # an image source, or a config that reads one
        print(table)
        return 0
    manifest = verify(args.dir, check_sha256=args.verify)
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    print_manifest(manifest, Path(args.dir))
    if args.verify:
        print("verified: every shard's header, size and sha256, and the tokenizer's sha256")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ember", epilog="Run `ember VERB --help` for the options of each verb.",
                     description="ember: a hackable, PyTorch-native lab for small GPT-style language models.")  # fmt: skip # noqa: E501
    parser.add_argument("--version", action="version", version=f"ember {ember.__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    actions = {}  # noun -> its subparsers
    for name, settings, arguments, command in VERBS:
        noun, _, action = name.rpartition(" ")
        if noun and noun not in actions:
            help, description, metavar = NOUNS[noun]
            actions[noun] = verbs.add_parser(noun, help=help, description=description).add_subparsers(
                dest=f"{noun}_verb", metavar=metavar, required=True
            )
        p = actions[noun].add_parser(action, **settings) if noun else verbs.add_parser(action, **settings)
        for flags, options in arguments:
            p.add_argument(*flags, **options)
        p.set_defaults(func=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        # Overrides may follow options too (`ember train tiny --nproc 2 run.seed=3`).
        args, extra = parser.parse_known_args(argv)
        stray = not hasattr(args, "overrides") or any("=" not in a or a.startswith("-") for a in extra)
        if extra and stray:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if extra:
            args.overrides = [*args.overrides, *extra]
        return args.func(args)
    except EmberError as e:
        print(f"ember: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("ember: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
