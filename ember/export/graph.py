"""A run's model as one graph file: a torch.export program, an AOTInductor package, or ONNX.

    export_graph("runs/tiny", "pt2", "out/tiny.pt2")     # ember export runs/tiny --to pt2 out/tiny.pt2
    export_graph("runs/tiny", "aoti", "out/tiny.aoti.pt2")
    export_graph("runs/tiny", "onnx", "out/tiny.onnx")

Each file holds ``GPT.forward(idx) -> logits`` with B and T dynamic (1 <= T <= max_seq_len) and
no KV cache, except ``onnx-decode``, which takes and returns past keys and values; the tokenizer
stays in the run. docs/export.md ("Graph files") has each format, how to load it and the
measured differences.

Design choices:

- One module, not DESIGN.md's ``onnx.py`` and ``aoti.py``: all targets start from the same
  ``torch.export`` program and share the load-back check and the staged write.
- The file is loaded back and called once; ``check`` returns the load and first-call times
  and the max |logit diff| against eager, which the CLI prints.
- It is written in a staging folder beside the target (ember/atomic.py) and renamed into place,
  so a failure leaves nothing half-written; an existing target is refused unless ``force``.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ember.atomic import check_target, staging_dir
from ember.errors import EmberError
from ember.model.gpt import causal_mask, layer_mixers
from ember.run import load_run

TARGETS = ("pt2", "aoti", "onnx", "onnx-decode")
EXAMPLE = (2, 8)  # (B, T) of the tracing input; neither 1 (export would specialize a size-1 dim)


@dataclass
class Check:
    """What loading the written file back and calling it once measured."""

    load_s: float
    first_call_s: float
    max_abs_diff: float  # max |logits - eager logits| on the example input


class PastCache:
    """The ``KVCache`` protocol of ember/model/gpt.py over past tensors given as inputs:
    positions continue after them, each layer attends over past + new keys and keeps them as
    its present. Every shape stays symbolic (always a bottom-right causal mask, no size
    branch), so one graph serves the prompt (P = 0) and every later step."""

    def __init__(self, past: list[torch.Tensor]) -> None:
        self.past, self.present = past, []

    def extend(self, T: int) -> torch.Tensor:
        P = self.past[0].size(2)
        return torch.arange(P, P + T, device=self.past[0].device)  # (T,)

    def attend(self, layer: str, q, k, v) -> torch.Tensor:
        i = len(self.present) // 2
        k = torch.cat([self.past[2 * i], k], dim=2)  # (B, n_kv_head, P + T, hd)
        v = torch.cat([self.past[2 * i + 1], v], dim=2)
        self.present += [k, v]
        mask = causal_mask(q.size(2), k.size(2), q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.size(1) != k.size(1))


class Decoder(torch.nn.Module):
    """``model`` with past keys and values as inputs and outputs (2 * n_layer tensors)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cache = PastCache(list(past))
        return (self.model(idx, cache), *cache.present)


def _empty_past(model: torch.nn.Module, B: int, P: int) -> list[torch.Tensor]:
    cfg = model.cfg
    shape = (B, cfg.n_kv_head or cfg.n_head, P, cfg.d_model // cfg.n_head)
    return [torch.zeros(shape) for _ in range(2 * cfg.n_layer)]


def ort_greedy(path: str | Path, prompt: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
    """Greedy decoding through an ``onnx-decode`` file with onnxruntime: the new token ids."""
    session = _onnxruntime().InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    past = [np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in session.get_inputs()[1:]]
    idx, new = np.array([prompt], np.int64), []
    for _ in range(max_new_tokens):
        logits, *past = session.run(None, dict(zip(names, [idx, *past], strict=True)))
        token = int(logits[0, -1].argmax())
        if token == eos_id:
            break
        new.append(token)
        idx = np.array([[token]], np.int64)
    return new


def _dynamic_shapes(max_seq_len: int) -> dict:
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("seq", min=1, max=max_seq_len)
    return {"idx": {0: batch, 1: seq}}


def export_program(model: torch.nn.Module) -> torch.export.ExportedProgram:
    """``model.forward(idx)`` traced with dynamic batch and sequence length."""
    idx = torch.zeros(EXAMPLE, dtype=torch.long)
    with torch.no_grad():
        return torch.export.export(model, (idx,), dynamic_shapes=_dynamic_shapes(model.cfg.max_seq_len))


def load_graph(target: str, path: str | Path):
    """A callable ``idx (B, T) int64 -> logits (B, T, V) fp32`` from a written file."""
    path = str(path)
    if target == "pt2":
        return torch.export.load(path).module()
    if target == "aoti":
        return torch._inductor.aoti_load_package(path)
    session = _onnxruntime().InferenceSession(path, providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()  # onnx-decode: idx and the past, given empty (P = 0) here

    def run(idx: torch.Tensor) -> torch.Tensor:
        past = [np.zeros((idx.size(0), i.shape[1], 0, i.shape[3]), np.float32) for i in inputs[1:]]
        feed = dict(zip([i.name for i in inputs], [idx.numpy(), *past], strict=True))
        return torch.from_numpy(session.run(None, feed)[0])

    return run


def _onnxruntime():
    try:
        import onnx  # noqa: F401  (torch.onnx's exporter needs it and onnxscript)
        import onnxruntime
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise EmberError(
            f"--to onnx needs onnx, onnxscript and onnxruntime ({e.name} is missing): "
            "pip install onnx onnxscript onnxruntime (or ember[export])"
        ) from None
    return onnxruntime


def _write(model: torch.nn.Module, target: str, tmp: Path) -> None:
    if target.startswith("onnx"):
        idx, shapes = torch.zeros(EXAMPLE, dtype=torch.long), _dynamic_shapes(model.cfg.max_seq_len)
        inputs, args, outputs = ["idx"], (idx,), ["logits"]
        if target == "onnx-decode":
            past = {0: shapes["idx"][0], 2: torch.export.Dim("past", min=0, max=model.cfg.max_seq_len - 1)}
            layers = [f"{kind}_{i}" for i in range(model.cfg.n_layer) for kind in ("k", "v")]
            inputs += [f"past_{name}" for name in layers]
            outputs += [f"present_{name}" for name in layers]
            args += tuple(_empty_past(model, EXAMPLE[0], 3))
            shapes = (shapes["idx"], tuple(past for _ in layers))  # *past is one tuple argument
            model = Decoder(model).eval()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations, not the user's
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.onnx")  # axis names
            logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
            torch.onnx.export(
                model, args, str(tmp), dynamo=True, external_data=False, verbose=False,
                input_names=inputs, output_names=outputs, dynamic_shapes=shapes,
            )  # fmt: skip
        return
    program = export_program(model)
    if target == "pt2":
        torch.export.save(program, str(tmp))
    else:
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))


def check(model: torch.nn.Module, target: str, path: str | Path, idx: torch.Tensor) -> Check:
    """Load ``path`` and call it on ``idx``: times and max |diff| against ``model(idx)``."""
    start = time.perf_counter()
    graph = load_graph(target, path)
    loaded = time.perf_counter()
    with torch.no_grad():
        logits = graph(idx)
        called = time.perf_counter()
        eager = model(idx)
    diff = (logits.float() - eager).abs().max().item()
    return Check(loaded - start, called - loaded, diff)


def export_graph(
    run_dir: str | Path, target: str, out: str | Path, ckpt: str = "last", force: bool = False
) -> Check:
    """Write ``run_dir``'s model (``ckpt``: last, best or a step) to ``out`` as ``target``."""
    if target not in TARGETS:
        raise EmberError(f"--to {target!r}: unknown graph target; choose one of {', '.join(TARGETS)}")
    kind = "onnx" if target.startswith("onnx") else "pt2"  # aoti packages are PT2 archives too
    out = check_target(out, kind=kind, sources=[run_dir], force=force)
    if target.startswith("onnx"):
        _onnxruntime()  # before loading the run: a missing package is the first thing to hear
    model, _ = load_run(run_dir, ckpt)  # EmberError for a missing or damaged run
    if model.cfg.mlp == "moe":  # its expert loop splits rows by counts read on the host: no static graph
        raise EmberError(f"--to {target}: a model.mlp=moe run does not export as a graph yet; use --to hf")
    if "mamba" in layer_mixers(model.cfg):
        raise EmberError(
            f"--to {target}: the model has Mamba layers, whose scan loops over the sequence length (a "
            "graph would fix T) and whose decode state is no past key/value; export it --to hf instead"
        )
    if target == "onnx-decode" and not model.cfg.causal:
        raise EmberError(
            "--to onnx-decode keeps a KV cache, which a bidirectional model (model.causal=false) "
            "cannot use; export it --to onnx (the whole-sequence logits)"
        )
    model = model.float().eval()
    stage = staging_dir(out)  # ember/atomic.py: a killed process's stage is swept by the next writer
    tmp = stage / ("graph.onnx" if target.startswith("onnx") else "graph.pt2")  # aoti wants .pt2
    try:
        _write(model, target, tmp)
        idx = torch.randint(0, model.cfg.vocab_size, EXAMPLE, generator=torch.Generator().manual_seed(0))
        result = check(model, target, tmp, idx)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return result
