"""``ember quantize``: a quantized run directory from a float one, and the table that measures
each scheme against fp32 (bytes, bits per byte on the test split, greedy agreement, decode speed).

    quantize_run("runs/cpu-quick", QuantSpec("int8-weight"), "runs/cpu-quick-int8")
    report("runs/cpu-quick", [QuantSpec("int8-weight"), QuantSpec("int4-weight", 32)])

The quantized layers themselves, and the fake quantization of QAT, are model transformations:
``ember.model.quant``.
"""

from __future__ import annotations

import copy
import json
import shutil
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ember.atomic import build_dir, check_target, write_text_atomic
from ember.data.tokenizer import SPECIALS_FILE
from ember.errors import EmberError
from ember.infer.engine import Engine
from ember.infer.evaluate import score, split_text
from ember.infer.sampling import Sampling
from ember.model.quant import QuantSpec, quantize, weight_bytes
from ember.run import QUANT_FILE, export_weights, load_run, read_spec, run_tokenizer, saved_config


def quantize_run(run: str | Path, spec: QuantSpec, out: str | Path, force: bool = False) -> Path:
    """Write run directory ``out``: ``run``'s final weights quantized, its tokenizer and config."""
    run, out = Path(run), check_target(out, kind="run", sources=[run], force=force)
    done = read_spec(run / "model")
    if done is not None:
        raise EmberError(f"{run} is already quantized ({done.label}); quantize the float run it came from")
    model, _ = load_run(run)
    quantize(model, spec)
    tokenizer = run_tokenizer(run)  # load_run above found it

    def fill(tmp: Path) -> None:
        export_weights(model, tmp / "model", asdict(model.cfg), {"tokenizer.json": tokenizer})
        (tmp / "model" / QUANT_FILE).write_text(json.dumps(asdict(spec)) + "\n", encoding="utf-8")
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        if (tokenizer.parent / SPECIALS_FILE).is_file():  # an imported foreign tokenizer's specials
            for folder in (tmp / "model", tmp):
                shutil.copyfile(tokenizer.parent / SPECIALS_FILE, folder / SPECIALS_FILE)
        if (run / "config.yaml").is_file():
            shutil.copyfile(run / "config.yaml", tmp / "config.yaml")

    return build_dir(out, fill, kind="run")


# ------------------------------------------------------------------ the numerics table

PROMPT_TOKENS = 16  # each agreement prompt: the first tokens of a test document
AGREE_TOKENS = 256  # greedy tokens per prompt compared with fp32 (fewer if the context is shorter)


def report(
    run: str | Path, specs: list[QuantSpec], max_windows: int | None = None, prompts: int = 8, reps: int = 3,
    sweep: bool = False,
) -> dict:
    """fp32 and each of ``specs`` applied to ``run``'s final weights, side by side: bytes of the
    saved tensors, bits per byte on every token of the run's ``test`` split (``max_windows``
    caps it), greedy-token agreement with fp32 over ``prompts`` test-document prompts, and
    batch-1 eager decode tokens/s (median of ``reps``). Written to ``RUN/quantize.json``.
    ``sweep``: the specs are a default sweep, so one the model cannot take is left out, not refused."""
    run = Path(run)
    if read_spec(run / "model") is not None:
        raise EmberError(f"{run} is already quantized; --report compares a float run with its quantized ones")
    base, tokenizer = load_run(run)
    config = saved_config(run / "config.yaml")
    data_dir, seq_len = config["data"].get("dir"), config["train"].get("seq_len")
    if not isinstance(data_dir, str) or not isinstance(seq_len, int):
        raise EmberError(f"{run / 'config.yaml'} names no data.dir or train.seq_len; restore its config")
    tokens, strata = split_text(data_dir, "test")
    token_bytes = torch.tensor(tokenizer.token_byte_lengths(base.cfg.vocab_size))
    docs = np.split(tokens, np.flatnonzero(tokens == tokenizer.eos_id) + 1)
    texts = [tokenizer.decode(d[:PROMPT_TOKENS].tolist()) for d in docs if len(d) > PROMPT_TOKENS][:prompts]
    new_tokens = min(AGREE_TOKENS, base.cfg.max_seq_len - 2 * PROMPT_TOKENS)  # room for re-encoding
    greedy = Sampling(new_tokens, temperature=0.0, ignore_eos=True)

    def measure(model) -> dict:
        engine = Engine(model, tokenizer)
        with torch.inference_mode():
            ids = [c.token_ids for c in engine.generate(texts, greedy)]
            engine.generate(texts[:1], greedy)  # warm-up
            seconds = []
            for _ in range(reps):
                start = time.perf_counter()
                engine.generate(texts[:1], greedy)
                seconds.append(time.perf_counter() - start)
        r = score(model, tokens, token_bytes, strata, seq_len, None, 8, max_windows, tokenizer.eos_id)
        return {
            "bytes": weight_bytes(model),
            "bpb": r["bpb"],
            "tokens": r["tokens"],
            "documents": r["documents"],
            "test_bytes": r["bytes"],
            "tok_s": new_tokens / statistics.median(seconds),
            "ids": ids,
        }

    rows = {"fp32": measure(base)}
    for spec in specs:
        try:
            model = quantize(copy.deepcopy(base), spec)
        except EmberError as e:  # a group size of the default sweep wider than this model's rows
            if not sweep:
                raise
            print(f"{spec.label}: left out ({e})")
            continue
        rows[spec.label] = measure(model)
    ref, ref_ids = rows["fp32"], rows["fp32"]["ids"]
    for row in rows.values():
        rows_ids = zip(row.pop("ids"), ref_ids, strict=True)
        pairs = [(a, b) for x, y in rows_ids for a, b in zip(x, y, strict=True)]
        row["agree"] = sum(a == b for a, b in pairs) / len(pairs)
        row["bpb_change"] = row["bpb"] / ref["bpb"] - 1
    out = {
        "run": str(run),
        "measured_on": f"test split of {data_dir}: {ref['documents']} documents, {ref['tokens']:,} tokens, "
        f"{ref['test_bytes']:,} bytes",
        "agreement": f"{len(texts)} prompts of {PROMPT_TOKENS} test tokens, {new_tokens} greedy tokens each",
        "decode": f"batch 1, eager Engine, {new_tokens} tokens, median of {reps}, "
        f"{torch.get_num_threads()} threads",
        "rows": rows,
    }
    write_text_atomic(run / "quantize.json", json.dumps(out, indent=2) + "\n")
    return out


def print_report(out: dict, run: Path) -> None:
    """``report``'s rows as the table `ember quantize --report` prints, then what was measured."""
    from rich.console import Console
    from rich.table import Table

    table = Table("scheme", "weights", "test bits/byte", "change", "greedy agreement", "decode tok/s",
                  title=f"{run}: {out['measured_on']}", title_justify="left")  # fmt: skip
    for label, r in out["rows"].items():
        table.add_row(label, f"{r['bytes'] / 2**20:.2f} MiB", f"{r['bpb']:.4f}", f"{r['bpb_change']:+.2%}",
                      f"{r['agree']:.1%}", f"{r['tok_s']:,.0f}")  # fmt: skip
    Console(width=max(Console().width, 110)).print(table)
    print(f"agreement: {out['agreement']}; decode: {out['decode']}; written {run / 'quantize.json'}")
