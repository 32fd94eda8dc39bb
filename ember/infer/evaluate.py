"""``ember eval``: loss, perplexity and bits per byte of a run's model on any text.

    results = evaluate_run(Path("runs/tiny"), sources=["notes/"], ckpt="best")
    results["notes/"]["val_bpb"]

The model comes from the run directory alone: ``model/`` (the final weights, ``last``),
``model-best/`` (``best``) or a committed training checkpoint (``STEP``, e.g. 1200 or
step-001200). Text is the run's validation split, or any source string ``ember data``
accepts, tokenized with the run's tokenizer: each document then ``<|eos|>``, cut into
consecutive windows of ``seq_len`` (+1) tokens. Bits per byte divide the loss on text
tokens by the UTF-8 bytes they stand for, so runs with different tokenizers compare fairly.
The numbers come from the same ``LMTask.evaluate`` the trainer logs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import yaml

from ember.atomic import write_text_atomic
from ember.config import ModelConfig
from ember.data.loader import TokenDataset, ValLoader
from ember.data.sources import open_source
from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.model.gpt import GPT
from ember.train.checkpoint import latest_checkpoint, load_checkpoint, load_weights
from ember.train.trainer import LMTask


def _run_file(run_dir: Path, *names: str) -> Path:
    for name in names:
        if (run_dir / name).is_file():
            return run_dir / name
    raise EmberError(
        f"{run_dir} has no {names[0]}: is it a run directory? train one with `ember train CONFIG`"
    )


def load_model(run_dir: Path, ckpt: str = "last") -> tuple[GPT, Tokenizer]:
    """The run's model (eval mode, CPU) at ``ckpt`` and its tokenizer, checked to match."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise EmberError(f"run directory {run_dir} does not exist")
    model_cfg = ModelConfig(**json.loads(_run_file(run_dir, "model/model_config.json").read_text()))
    tokenizer = Tokenizer.load(_run_file(run_dir, "model/tokenizer.json", "tokenizer.json"))
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise EmberError(
            f"the tokenizer in {run_dir} has {tokenizer.vocab_size} tokens but the weights only "
            f"{model_cfg.vocab_size}: the tokenizer does not match the weights"
        )
    model = GPT.build(model_cfg)
    if ckpt in ("last", "best"):
        folder = run_dir / ("model" if ckpt == "last" else "model-best")
        load_weights(model, folder)
    else:
        m = re.fullmatch(r"(?:step-)?(\d+)", ckpt)
        if not m:
            raise EmberError(f"--ckpt {ckpt!r}: use last, best, or a step number (e.g. 1200)")
        folder = run_dir / "checkpoints" / f"step-{int(m.group(1)):06d}"
        if not folder.is_dir():
            newest = latest_checkpoint(run_dir / "checkpoints")
            raise EmberError(
                f"no checkpoint {folder.name} in {run_dir}"
                + (f" (newest: {newest.name})" if newest else " (none kept)")
            )
        load_checkpoint(folder, model, None)
    return model.eval(), tokenizer


def _source_windows(
    specs: list[str], tokenizer: Tokenizer, seq_len: int, batch_size: int, max_windows: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    ids: list[int] = []
    for spec in specs:
        for doc in open_source(spec).documents():
            ids.extend(tokenizer.encode(doc.text))
            ids.append(tokenizer.eos_id)
    tokens = np.asarray(ids, dtype=np.int64)
    n = min((len(tokens) - 1) // seq_len, max_windows)
    if n == 0:
        raise EmberError(
            f"{', '.join(specs)}: only {len(tokens)} tokens, fewer than one window of "
            f"{seq_len + 1}; give more text or a smaller --seq-len"
        )
    starts = np.arange(n) * seq_len
    for i in range(0, n, batch_size):
        rows = np.stack([tokens[s : s + seq_len + 1] for s in starts[i : i + batch_size]])
        t = torch.from_numpy(rows)
        yield t[:, :-1].contiguous(), t[:, 1:].contiguous()


def evaluate_run(
    run_dir: Path,
    sources: list[str] | None = None,
    ckpt: str = "last",
    seq_len: int | None = None,
    batch_size: int = 8,
    max_windows: int = 512,
) -> dict:
    """Evaluate and write ``RUN/eval.json``; returns {dataset label: metrics}."""
    run_dir = Path(run_dir)
    model, tokenizer = load_model(run_dir, ckpt)
    config = yaml.safe_load(_run_file(run_dir, "config.yaml").read_text())
    seq_len = seq_len or config["train"]["seq_len"]
    if seq_len > model.cfg.max_seq_len:
        raise EmberError(f"--seq-len {seq_len} is beyond the model's max_seq_len {model.cfg.max_seq_len}")
    token_bytes = torch.zeros(model.cfg.vocab_size, dtype=torch.int64)
    token_bytes[: tokenizer.vocab_size] = torch.tensor(tokenizer.token_byte_lengths())
    task = LMTask(0.0, token_bytes)
    results = {}
    if not sources:
        data_dir = config["data"]["dir"]
        loader = ValLoader(TokenDataset(data_dir, "val"), seq_len, batch_size, max_windows=max_windows)
        results[f"val ({data_dir})"] = task.evaluate(model, loader, torch.autocast("cpu", enabled=False))
    for spec in sources or []:
        batches = list(_source_windows([spec], tokenizer, seq_len, batch_size, max_windows))
        results[spec] = task.evaluate(model, batches, torch.autocast("cpu", enabled=False))
    record = {"ckpt": ckpt, "seq_len": seq_len, "results": results}
    write_text_atomic(run_dir / "eval.json", json.dumps(record, indent=2) + "\n")
    return results
