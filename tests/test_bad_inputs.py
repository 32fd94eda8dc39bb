"""Bad inputs to every verb: each is refused with exit code 2, one ``ember: error:`` line on
stderr that says what is wrong, no traceback, and no file created, changed or removed.

The cases run in-process (``ember.cli.main``), sharing one prepared corpus, one trained run, an
imported-looking run (weights, no history) and an HF export, so the table costs seconds, not a
torch import per case. Each case names a fragment its message must hold."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from ember.cli import main


@pytest.fixture(scope="module")
def ws(tiny_data, tmp_path_factory):
    """The workspace the cases run in (their cwd): a run, an imported run, an HF folder and bad inputs."""
    from ember.config import load_config
    from ember.export.hf import export_hf
    from ember.train.trainer import train

    root = tmp_path_factory.mktemp("bad")
    cfg = [f"data.dir={tiny_data}", "data.val_fraction=0.1", f"run.out_dir={root / 'runs'}"]
    train(load_config("tiny", [*cfg, "train.device=cpu", "train.max_steps=4", "train.eval_every=0"]))
    run = root / "runs" / "tiny"
    imported = root / "runs" / "imported"  # what `ember import` writes: weights, no training history
    imported.mkdir()
    for name in ("config.yaml", "tokenizer.json"):
        shutil.copy(run / name, imported / name)
    shutil.copytree(run / "model", imported / "model")
    export_hf(run, root / "hf")
    [step] = (run / "checkpoints").glob("step-*")  # damaged copies of the run, one damage each
    for name, damaged, text in [("cfg-empty", "config.yaml", ""), ("cfg-list", "config.yaml", "- a\n"),
                                ("cfg-torn", "config.yaml", "run:\n  name: tiny\n"),
                                ("meta-list", f"checkpoints/{step.name}/meta.json", "[]"),
                                ("meta-torn", f"checkpoints/{step.name}/.metadata", None),
                                ("tensors-torn", f"checkpoints/{step.name}/__0_0.distcp", None)]:  # fmt: skip
        shutil.copytree(run, root / "runs" / name)
        path = root / "runs" / name / damaged
        path.write_text(text) if text is not None else path.write_bytes(path.read_bytes()[:40])
    for name, key, value in [("hf-vocab", "vocab_size", 1024), ("hf-heads", "num_attention_heads", 8)]:
        shutil.copytree(root / "hf", root / name)
        config = json.loads((root / name / "config.json").read_text())
        (root / name / "config.json").write_text(json.dumps({**config, key: value}))
    (root / "nohf").mkdir()
    (root / "foreign").mkdir()
    (root / "foreign" / "mine.txt").write_text("not ember's\n")
    (root / "text.txt").write_text("def f():\n    return 1\n")
    (root / "loop").mkdir()
    (root / "loop" / "a.txt").write_text("some text\n")
    (root / "loop" / "self").symlink_to("self")
    (root / "selfloop").symlink_to("selfloop")
    (root / "dangling").symlink_to("nowhere")
    os.mkfifo(root / "fifo")
    pairs = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    for name, row in [("empty-reply", {**pairs, "chosen": ""}), ("blank-reply", {**pairs, "rejected": "  "}),
                      ("same-reply", {**pairs, "rejected": "2"}), ("no-rejected", {"prompt": "a", "chosen": "b"})]:  # fmt: skip # noqa: E501
        (root / f"{name}.jsonl").write_text(json.dumps(pairs) + "\n" + json.dumps(row) + "\n")
    (root / "bad.yaml").write_text("model:\n  n_layer: [1\n")
    (root / "badkey.yaml").write_text("base: tiny\nmodel:\n  n_layr: 2\n")
    (root / "badval.yaml").write_text("base: tiny\ntrain:\n  schedule: cosin\n")
    (root / "cycle-a.yaml").write_text("base: cycle-b.yaml\n")
    (root / "cycle-b.yaml").write_text("base: cycle-a.yaml\n")
    (root / "list.yaml").write_text("- a\n- b\n")
    (root / "dup.yaml").write_text("model:\n  n_layer: 2\n  n_layer: 3\n")
    (root / "prompts.bin").write_bytes(b"\xff\xfe\x00")
    return root


def _tree(*roots: Path) -> dict:
    """Every entry under ``roots``: its kind, and for a file its size, mtime and (small ones) sha256."""
    seen = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = Path(dirpath, name)
                st = path.lstat()
                entry: tuple = (stat.S_IFMT(st.st_mode),)
                if stat.S_ISREG(st.st_mode):
                    digest = st.st_size < 2**20 and hashlib.sha256(path.read_bytes()).hexdigest()
                    entry += (st.st_size, st.st_mtime_ns, digest)
                seen[str(path)] = entry
    return seen


D, R = "data.dir={data}", "run.out_dir={ws}/out"  # the shared corpus; runs would go to out/
T = ["tiny", D, "data.val_fraction=0.1", R, "train.device=cpu"]  # a config that trains as is
S = ["tiny", D, "data.val_fraction=0.1", "--out", "{ws}/sweep"]  # a sweep of it
RESUME = ["tiny", D, "data.val_fraction=0.1", "run.out_dir={ws}/runs", "train.device=cpu",
          "train.max_steps=4", "train.eval_every=0", "train.resume=auto"]  # the fixture run, renamed

CASES = [
    # --- the command line itself: verbs, nouns, options ---
    ([], "required"),
    (["frob"], "invalid choice"),
    (["data"], "required"),
    (["data", "frob"], "invalid choice"),
    (["config"], "required"),
    (["bench"], "required"),
    (["bench", "disk"], "invalid choice"),
    (["train"], "required: CONFIG"),
    (["train", "tiny", "--frob"], "unrecognized arguments"),
    (["train", "tiny", "notakeyvalue"], "is not key=value"),
    (["eval"], "required: RUN"),
    (["export", "{run}"], "required"),
    (["import", "hf", "{ws}/hf"], "--out"),
    (["export", "{run}", "--to", "gguf", "{ws}/x.gguf", "--type", "q5_k"], "invalid choice"),
    (["analyze", "{run}"], "required"),
    (["analyze", "{run}", "frob"], "invalid choice"),
    (["eval", "{run}", "--split", "dev"], "invalid choice"),
    (["bench", "comm", "--device", "tpu"], "invalid choice"),
    (["config", "keys", "a", "b"], "unrecognized"),
    (["data", "stats"], "required: DIR"),
    # --- bounds of every numeric option, checked by the parser before any work ---
    (["quickstart", "--minutes", "0"], "--minutes: must be float > 0"),
    (["quickstart", "--minutes", "-5"], "--minutes"),
    (["quickstart", "--minutes", "nan"], "--minutes"),
    (["quickstart", "--minutes", "inf"], "--minutes"),
    (["quickstart", "--minutes", "soon"], "--minutes: expects float"),
    (["train", *T, "--nproc", "0"], "--nproc: must be int >= 1"),
    (["train", *T, "--nproc", "-2"], "--nproc"),
    (["train", *T, "--nproc", "100000"], "per CPU core here"),
    (["train", *T, "--nproc", "two"], "--nproc: expects int"),
    (["train", *T, "--nproc", "1.5"], "--nproc: expects int"),
    (["eval", "{run}", "--stride", "0"], "--stride: must be int >= 1"),
    (["eval", "{run}", "--stride", "-4"], "--stride"),
    (["eval", "{run}", "--batch-size", "0"], "--batch-size"),
    (["eval", "{run}", "--seq-len", "0"], "--seq-len"),
    (["eval", "{run}", "--max-windows", "0"], "--max-windows"),
    (["eval", "{run}", "--task", "add-2", "--n", "0"], "--n"),
    (["eval", "{run}", "--task", "add-2", "--skip", "-1"], "--skip"),
    (["serve", "{run}", "--port", "70000"], "--port: must be int >= 1 and <= 65535"),
    (["serve", "{run}", "--port", "0"], "--port"),
    (["serve", "{run}", "--port", "-1"], "--port"),
    (["serve", "{run}", "--port", "http"], "--port"),
    (["sweep", *S, "--seeds", "0"], "--seeds"),
    (["sweep", *S, "--jobs", "0"], "--jobs"),
    (["sweep", *S, "--jobs", "100000"], "--jobs"),
    (["sweep", *S, "--alpha", "0"], "--alpha"),
    (["sweep", *S, "--alpha", "1"], "--alpha"),
    (["sweep", *S, "--alpha", "-0.5"], "--alpha"),
    (["quantize", "{run}", "--scheme", "int4-weight", "--group-size", "0", "--out", "{ws}/q"], "--group"),
    (["quantize", "{run}", "--report", "--max-windows", "0"], "--max-windows"),
    (["plan", "tiny", "--nproc", "0"], "--nproc: must be int >= 1"),
    (["plan", "tiny", "--nproc", "5000"], "--nproc"),
    (["plan", "tiny", "--nproc", "200", "--measure"], "would start 200 processes"),
    (["plan", "tiny", "--mfu", "0"], "--mfu: must be float > 0 and <= 1"),
    (["plan", "tiny", "--mfu", "5"], "--mfu"),
    (["plan", "tiny", "--mfu", "-0.4"], "--mfu"),
    (["plan", "tiny", "--mfu", "nan"], "--mfu"),
    (["plan", "tiny", "--peak-tflops", "-1"], "--peak-tflops: must be float > 0"),
    (["plan", "tiny", "--peak-tflops", "0"], "--peak-tflops"),
    (["plan", "tiny", "--peak-tflops", "inf"], "--peak-tflops"),
    (["plan", "tiny", "--steps", "1"], "--measure tracks the last two steps"),
    (["plan", "tiny", "--steps", "0", "--measure"], "--steps"),
    (["analyze", "{run}", "grads", "--batch", "0"], "--batch: must be int >= 1"),
    (["analyze", "{run}", "grads", "--batch", "-1"], "--batch"),
    (["analyze", "{run}", "grads", "--top", "0"], "--top"),
    (["analyze", "{run}", "grads", "--seed", "-1"], "--seed"),
    (["analyze", "{run}", "hessian", "--k", "0"], "--k: must be int >= 1"),
    (["analyze", "{run}", "hessian", "--iters", "0"], "--iters: must be int >= 1"),
    (["analyze", "{run}", "hessian", "--samples", "-1"], "--samples"),
    (["analyze", "{run}", "profile", "--steps", "0"], "--steps: must be int >= 1"),
    (["analyze", "{run}", "memory", "--steps", "-1"], "--steps"),
    (["analyze", "{run}", "nonfinite", "--step", "0"], "--step: must be int >= 1"),
    (["analyze", "tiny", "determinism", "--steps", "0"], "--steps"),
    (["bench", "comm", "--nproc", "100000"], "per CPU core here"),
    (["bench", "comm", "--nproc", "1"], "--nproc: must be int >= 2"),
    (["bench", "comm", "--nproc", "0"], "--nproc"),
    (["bench", "comm", "--seconds", "0"], "--seconds"),
    (["bench", "comm", "--seconds", "-1"], "--seconds"),
    (["bench", "comm", "--min-bytes", "lots"], "not a size"),
    (["bench", "comm", "--max-bytes", "12Q"], "not a size"),
    (["bench", "comm", "--min-bytes", "0"], "not a size"),
    (["bench", "comm", "--max-bytes", "-5"], "not a size"),
    (["bench", "comm", "--max-bytes", "9999T"], "not a size"),
    # --- sampling options, checked before the run is loaded ---
    (["generate", "{run}", "--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "{run}", "--prompt", "a", "--temperature", "-1"], "--temperature"),
    (["generate", "{run}", "--prompt", "a", "--temperature", "inf"], "must be finite"),
    (["generate", "{run}", "--prompt", "a", "--top-k", "-1"], "--top-k"),
    (["generate", "{run}", "--prompt", "a", "--top-p", "0"], "--top-p"),
    (["generate", "{run}", "--prompt", "a", "--top-p", "1.5"], "--top-p"),
    (["generate", "{run}", "--prompt", "a", "--max-new-tokens", "x"], "--max-new-tokens: invalid int"),
    (["generate", "{run}", "--prompt", "a", "--stop", ""], "stop string is empty"),
    (["generate", "{run}"], "no prompt"),
    (["generate", "{run}", "--prompts-file", "{ws}/missing.txt"], "cannot read --prompts-file"),
    (["chat", "{run}", "--temperature", "-1"], "--temperature"),
    (["chat", "{run}", "--top-p", "2"], "--top-p"),
    (["chat", "{run}", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["generate", "{run}", "--prompt", "a", "--top-k", "some"], "--top-k: invalid int"),
    (["generate", "{run}", "--prompt", "a", "--top-p", "nan"], "--top-p"),
    (["generate", "{run}", "--prompt", "a", "--seed", "-99999999999999999999"], "--seed"),
    # --- configs: files, keys, types, values, rules across fields ---
    (["config", "show", "nosuchpreset"], "not found"),
    (["config", "show", "{ws}/missing.yaml"], "not found"),
    (["config", "show", "{ws}/bad.yaml"], "YAML syntax error"),
    (["config", "show", "{ws}/badkey.yaml"], "did you mean model.n_layer"),
    (["config", "show", "{ws}/badval.yaml"], "train.schedule must be one of"),
    (["config", "show", "{ws}/cycle-a.yaml"], "base cycle"),
    (["config", "show", "{ws}/list.yaml"], "must hold a mapping"),
    (["config", "show", "{ws}/dup.yaml"], "duplicate key model.n_layer"),
    (["config", "show", "{ws}/text.txt"], "unknown config key def f()"),
    (["config", "show", "tiny", "model.n_layr=2"], "did you mean model.n_layer"),
    (["config", "show", "tiny", "n_layer=2"], "did you mean model.n_layer"),
    (["config", "show", "tiny", "model.n_layer=two"], "model.n_layer expects int"),
    (["config", "show", "tiny", "model.n_layer=0"], "model.n_layer must be"),
    (["config", "show", "tiny", "model.n_layer=100000"], "model.n_layer must be in [1, 1024]"),
    (["config", "show", "tiny", "model.d_model=1000000"], "model.d_model must be"),
    (["config", "show", "tiny", "model.vocab_size=-1"], "model.vocab_size must be"),
    (["config", "show", "tiny", "model.n_head=5"], "does not divide"),
    (["config", "show", "tiny", "model.n_kv_head=3"], "model.n_kv_head"),
    (["config", "show", "tiny", "model.mlp=tanh"], "model.mlp must be one of"),
    (["config", "show", "tiny", "model.dropout=1"], "model.dropout"),
    (["config", "show", "tiny", "model.head=score"], "model.head=score"),
    (["config", "show", "tiny", "model=3"], "is a section"),
    (["config", "show", "tiny", "train.lr=-1"], "train.lr"),
    (["config", "show", "tiny", "train.lr=fast"], "train.lr expects float"),
    (["config", "show", "tiny", "train.seq_len=1000"], "beyond model.max_seq_len"),
    (["config", "show", "tiny", "train.micro_batch=0"], "train.micro_batch"),
    (["config", "show", "tiny", "train.keep_last=1"], "train.keep_last"),
    (["config", "show", "tiny", "train.qlora=true"], "train.lora_rank"),
    (["config", "show", "tiny", "train.qlora=true", "train.lora_rank=0"], "train.lora_rank"),
    (["config", "show", "tiny", "train.lora_alpha=0"], "train.lora_alpha"),
    (["config", "show", "tiny", "train.qat_group_size=48"], "train.qat_group_size"),
    (["config", "show", "tiny", "train.precision=fp4"], "train.precision"),
    (["config", "show", "tiny", "train.compile=maybe"], "train.compile"),
    (["config", "show", "tiny", "train.compile_scope=model"], "compile_scope shapes torch.compile: set train.compile=true"),  # fmt: skip # noqa: E501
    (["config", "show", "tiny", "data.val_fraction=1"], "data.val_fraction"),
    (["config", "show", "tiny", "data.val_fraction=0.5", "data.test_fraction=0.5"], "must be < 1"),
    (["config", "show", "tiny", "data.sources=[]"], "data.sources is empty"),
    (["config", "show", "tiny", "data.sources[0]=x"], "whole list"),
    (["config", "show", "tiny", "data.vocab_size=0"], "data.vocab_size"),
    (["config", "show", "tiny", "data.tokenizer=wordpiece"], "data.tokenizer"),
    (["config", "show", "tiny", "parallel.dp_shard=0"], "parallel.dp_shard"),
    (["config", "show", "tiny", "parallel.tp=0"], "parallel.tp"),
    (["config", "show", "tiny", "dpo.beta=0"], "dpo.beta"),
    (["config", "show", "tiny", "dpo.label_smoothing=0.5"], "dpo.label_smoothing"),
    (["config", "show", "tiny", "grpo.group=1"], "grpo.group"),
    (["config", "show", "tiny", "grpo.top_p=0"], "grpo.top_p"),
    (["config", "show", "tiny", "serve.max_seqs=0"], "serve.max_seqs"),
    (["config", "show", "tiny", "serve.kv_memory=0"], "serve.kv_memory"),
    (["config", "show", "tiny", "run.seed=-1"], "run.seed"),
    (["config", "show", "tiny", "=3"], "not key=value"),
    (["config", "show", "tiny", "run.name=${{run.nope}}"], "names no config key"),
    (["config", "show", "tiny", "run.name=${{run.name}}"], "interpolation cycle"),
    # --- train: refused before any launch, model or output ---
    (["train", *T, "train.qlora=true"], "train.lora_rank"),
    (["train", *T, "model.n_layer=1000", "model.d_model=65536"], "this machine's"),
    (["train", *T, "train.max_steps=0", "train.max_time=-1"], "train.max_time"),
    (["train", *T, "train.task=nosuchtask"], "nosuchtask"),
    (["train", *T, "train.sdpa=cudnn"], "train.sdpa=cudnn picks a backend of PyTorch's attention: CUDA only"),
    (["train", *T, "--nproc", "2", "train.compile=true", "train.compile_scope=model"], "compile_scope=block"),
    (["train", *T, "train.task=grpo"], "grpo needs grpo.data"),
    (["train", *T, "train.task=rm"], "model.head=score"),
    (["train", *T, "--nproc", "2", "parallel.tp=3"], "parallel.tp"),
    (["train", *T, "--nproc", "4"], "micro-batches"),
    (["train", *T, "train.init_from={ws}/nowhere"], "nowhere"),
    # --- data sources: missing, empty, not files ---
    (["data", "prepare", "tiny", "data.sources=[{ws}/nowhere.txt]", "data.dir={ws}/d"], "not found"),
    (["data", "prepare", "tiny", "data.sources=[{ws}/*.nomatch]", "data.dir={ws}/d"], "matches no files"),
    (["data", "prepare", "tiny", "data.sources=[embedded:cobol]", "data.dir={ws}/d"], "unknown embedded"),
    (["data", "prepare", "tiny", "data.sources=[{ws}/fifo]", "data.dir={ws}/d"], "is a FIFO"),
    (["data", "prepare", "tiny", "data.sources=[/dev/null]", "data.dir={ws}/d"], "is a character device"),
    (["data", "prepare", "tiny", "data.sources=[{ws}/selfloop]", "data.dir={ws}/d"], "symbolic link loop"),
    (["data", "prepare", "tiny", "data.sources=[{ws}/loop]", "data.dir={ws}/d"], "symbolic link loop"),
    (["data", "prepare", "tiny", "data.sources=[{ws}/dangling]", "data.dir={ws}/d"], "broken symbolic link"),
    (["train", "tiny", "data.sources=[{ws}/fifo]", "data.dir={ws}/d", R], "is a FIFO"),
    (["data", "stats", "{ws}/nowhere"], "nowhere"),
    (["data", "stats", "{ws}/nohf"], "nohf"),
    # --- preference pairs: the file and the line ---
    (["train", *T, "train.task=dpo", "dpo.data={ws}/empty-reply.jsonl"], ".jsonl:2: 'chosen' is empty"),
    (["train", *T, "train.task=dpo", "dpo.data={ws}/blank-reply.jsonl"], "'rejected' is empty"),
    (["train", *T, "train.task=dpo", "dpo.data={ws}/same-reply.jsonl"], "the same reply"),
    (["train", *T, "train.task=dpo", "dpo.data={ws}/no-rejected.jsonl"], "no-rejected.jsonl:2: expected"),
    (["train", *T, "train.task=dpo", "dpo.data={ws}/nowhere.jsonl"], "nowhere.jsonl"),
    # --- eval, generate, export, import, quantize on runs that are not there or not right ---
    (["eval", "{ws}/nowhere"], "nowhere"),
    (["eval", "{run}", "--task", "add-2", "--split", "val"], "--task scores generated answers"),
    (["eval", "{run}", "--task", "nosuchtask"], "nosuchtask"),
    (["eval", "{run}", "--data", "{ws}/nowhere.txt"], "not found"),
    (["eval", "{run}", "--data", "{ws}/fifo"], "is a FIFO"),
    (["eval", "{run}", "--ckpt", "step-999"], "999"),
    (["generate", "{ws}/nowhere", "--prompt", "a"], "nowhere"),
    (["generate", "{ws}/nohf", "--prompt", "a"], "nohf"),
    (["serve", "{ws}/nowhere"], "no run directory"),
    (["serve", "{run}", "train.lr=1"], "serve.* settings only"),
    (["export", "{ws}/nowhere", "--to", "hf", "{ws}/x"], "nowhere"),
    (["export", "{run}", "--to", "onnx2", "{ws}/x"], "unknown export target"),
    (["import", "gguf", "{ws}/hf", "--out", "{ws}/x"], "is a folder"),
    (["export", "{run}", "--to", "hf", "{ws}/hf"], "hf"),
    (["export", "{run}", "--to", "hf", "{ws}/x", "--ckpt", "step-999"], "999"),
    (["import", "hf", "{ws}/nohf", "--out", "{ws}/x"], "no config.json"),
    (["import", "hf", "{ws}/nowhere", "--out", "{ws}/x"], "config.json"),
    (["import", "hf", "{ws}/hf-vocab", "--out", "{ws}/x"], "does not match the weights"),
    (["import", "hf", "{ws}/hf-heads", "--out", "{ws}/x"], "does not match the weights"),
    (["import", "hf", "{ws}/hf", "--out", "{run}"], "tiny"),
    (["quantize", "{run}", "--scheme", "int3", "--out", "{ws}/q"], "unknown scheme"),
    (["quantize", "{run}", "--scheme", "int8-weight"], "--out"),
    (["quantize", "{run}", "--scheme", "int4-weight", "--group-size", "48", "--out", "{ws}/q"], "group"),
    (["quantize", "{run}", "--report", "--out", "{ws}/q"], "drop --out"),
    (["quantize", "{ws}/nowhere", "--scheme", "int8-weight", "--out", "{ws}/q"], "nowhere"),
    (["quantize", "{run}", "--scheme", "int8-weight", "--out", "{run}"], "is the source"),
    # --- plan: sizes, layouts ---
    (["plan", "tiny", "model.n_layer=100000", "model.d_model=65536"], "model.n_layer must be in [1, 1024]"),
    (["plan", "tiny", "model.n_layer=1024", "model.d_model=65536"], "this machine's"),
    (["plan", "tiny", "model.n_layer=64", "model.d_model=65536", "--measure"], "this machine's"),
    (["plan", "tiny", "--nproc", "4"], "micro-batches"),
    (["plan", "tiny", "--nproc", "2", "parallel.tp=3"], "parallel.tp"),
    (["plan", "nosuchpreset"], "not found"),
    (["plan", "tiny", "model.n_head=5"], "does not divide"),
    # --- analyze: runs, instruments, replays ---
    (["analyze", "{ws}/nowhere", "grads"], "does not exist"),
    (["analyze", "{run}", "hessian", "--k", "5", "--iters", "2"], "--iters"),
    (["analyze", "{run}", "grads", "--batch", "1"], "at least 2 windows"),
    (["analyze", "{run}", "nonfinite"], "give --step"),
    (["analyze", "{run}", "nonfinite", "--step", "9999"], "trained to step 4"),
    (["analyze", "{imp}", "nonfinite", "--step", "3"], "no training history"),
    (["analyze", "{ws}/nohf", "nonfinite", "--step", "3"], "config.yaml"),
    (["analyze", "tiny", "determinism", "--nproc", "0"], "--nproc 0"),
    (["analyze", "tiny", "determinism", "--nproc", "a,b"], "--nproc a,b"),
    (["analyze", "tiny", "determinism", "--nproc", "1,100000"], "at most"),
    (["analyze", "nosuchpreset", "determinism"], "not found"),
    # --- sweep and report ---
    (["sweep", *S, "--seed-list", "1,x"], "--seed-list"),
    (["sweep", *S, "--grid", "model.n_layr=1,2"], "model.n_layer"),
    (["sweep", *S, "--grid", "train.lr"], "is not key=v1,v2"),
    (["sweep", *S, "--metric", "accuracy"], "is not SOURCE.KEY"),
    (["sweep", *S, "--metric", "train.loss"], "is not SOURCE.KEY"),
    (["report", "{ws}/nowhere"], "nowhere"),
    (["report", "{run}", "{imp}"], "--out"),
    # --- bench ---
    (["bench", "comm", "--min-bytes", "2M", "--max-bytes", "1K"], "above --max-bytes"),
    # --- outputs that would destroy the source or cannot be written (tests/test_atomic.py has the rules) ---
    (["export", "{run}", "--to", "hf", "{run}", "--force"], ""),
    (["export", "{run}", "--to", "hf", "{ws}/runs", "--force"], ""),
    (["quantize", "{run}", "--scheme", "int8-weight", "--out", "{ws}/runs", "--force"], ""),
    (["import", "hf", "{ws}/hf", "--out", "{ws}/hf", "--force"], ""),
    (["export", "{run}", "--to", "hf", "/proc/x"], ""),
    (["export", "{run}", "--to", "hf", "{ws}/text.txt/x"], ""),
    (["export", "{run}", "--to", "pt2", "/proc/x.pt2"], ""),
    (["quantize", "{run}", "--scheme", "int8-weight", "--out", "/proc/q"], ""),
    (["import", "hf", "{ws}/hf", "--out", "/proc/r"], ""),
    (["import", "hf", "{ws}/hf", "--out", "{ws}/text.txt/r"], ""),
    (["train", "tiny", D, "data.val_fraction=0.1", "run.out_dir=/proc/runs"], ""),
    (["train", "tiny", "data.dir={ws}/text.txt/d", R], ""),
    (["data", "prepare", "tiny", "data.dir=/proc/d"], ""),
    (["report", "{run}", "{imp}", "--out", "/proc/r"], ""),
    (["report", "{run}", "--out", "/proc/r"], ""),
    (["sweep", "tiny", D, "data.val_fraction=0.1", "--out", "/proc/s"], ""),
    (["sweep", "tiny", D, "data.val_fraction=0.1", "--out", "{run}"], ""),
    (["export", "{run}", "--to", "hf", "{ws}/foreign", "--force"], ""),
    (["export", "{run}", "--to", "onnx", "{ws}/foreign", "--force"], ""),
    (["quantize", "{run}", "--scheme", "int8-weight", "--out", "{ws}/foreign", "--force"], ""),
    (["import", "hf", "{ws}/hf", "--out", "{ws}/foreign", "--force"], ""),
    (["data", "prepare", "tiny", "data.dir={ws}/foreign", "--force"], ""),
    (["bench", "comm", "--out", "/proc/c"], ""),
    # --- a run whose files were damaged after training (a crash, a full disk, a hand edit) ---
    (["eval", "{ws}/runs/cfg-empty"], "config.yaml is damaged"),
    (["generate", "{ws}/text.txt", "--prompt", "a"], "is a file, not a run directory"),
    (["eval", "{ws}/runs/cfg-torn"], "config.yaml is damaged"),
    (["export", "{ws}/runs/cfg-list", "--to", "hf", "{ws}/x-hf"], "config.yaml is damaged"),
    (["export", "{ws}/runs/cfg-list", "--to", "gguf", "{ws}/x.gguf"], "config.yaml is damaged"),
    (["quantize", "{ws}/runs/cfg-list", "--report"], "config.yaml is damaged"),
    (["train", *RESUME, "run.name=cfg-empty"], "config.yaml is damaged"),
    (["train", *RESUME, "run.name=meta-list"], "meta.json is not the record a save writes (no step)"),
    (["train", *RESUME, "run.name=meta-torn"], "cannot be read (UnpicklingError"),
    (["train", *RESUME, "run.name=tensors-torn"], "cannot be read (EOFError)"),  # not the rank's stack
    # --- serve: address and device, before the model loads (tests/test_server_robust.py has the rest) ---
    (["serve", "{run}", "serve.device=tpu"], "serve.device=tpu"),
    (["serve", "{run}", "serve.device=cuda:99"], "serve.device=cuda:99"),
    (["serve", "{run}", "--host", "999.1.1.1"], "--host"),
    (["serve", "{run}", "--host", "8.8.8.8"], "8.8.8.8"),
]


@pytest.fixture(scope="module")
def places(ws, tiny_data):
    return {"ws": ws, "run": ws / "runs" / "tiny", "imp": ws / "runs" / "imported", "data": tiny_data}


def _id(case) -> str:
    return " ".join(a for a in case[0] if a not in T[1:] + S[1:] + RESUME[1:])[:80] or "(nothing)"


@pytest.mark.parametrize("argv, message", CASES, ids=[_id(c) for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_written(argv, message, places, ws, tiny_data, capsys, monkeypatch):  # fmt: skip # noqa: E501
    monkeypatch.chdir(ws)  # what a case would write by default lands in the workspace
    argv = [a.format(**places) for a in argv]
    before = _tree(ws, tiny_data)
    capsys.readouterr()
    code = main(argv)  # argparse's errors too are returned, not raised as SystemExit
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("ember: error: "), err
    assert sum(line.startswith("ember: error:") for line in lines) == 1, err
    assert message in lines[-1], err
    assert _tree(ws, tiny_data) == before


def test_the_table_covers_every_verb():
    from ember.cli import VERBS

    verbs = {name.split()[0] for name, *_ in VERBS}
    covered = {c[0][0] for c in CASES if c[0]}
    assert verbs <= covered, verbs - covered
    assert len(CASES) >= 150


GPT2 = ["model.tie_embeddings=false", "model.pos=learned", "model.mlp=gelu"]
SHAPES = [[], GPT2, ["model.n_kv_head=1", "model.n_layer=5"]]


@pytest.mark.parametrize("overrides", SHAPES)
def test_the_size_estimate_that_refuses_big_models_counts_the_parameters(overrides):
    from ember.analysis.plan import estimated_params
    from ember.config import load_config
    from ember.model.gpt import GPT

    cfg = load_config("tiny", ["model.vocab_size=512", *overrides]).model
    n = sum(p.numel() for p in GPT(cfg).parameters())
    assert 0.97 * n <= estimated_params(cfg) <= n  # norms (and biases) left out
