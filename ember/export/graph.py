"""A run's model as one graph file: a torch.export program, an AOTInductor package, or ONNX.

    export_graph("runs/tiny", "pt2", "out/tiny.pt2")     # ember export runs/tiny --to pt2 out/tiny.pt2
    export_graph("runs/tiny", "aoti", "out/tiny.aoti.pt2")
    export_graph("runs/tiny", "onnx", "out/tiny.onnx")

Each file holds ``GPT.forward(idx) -> logits``: idx (B, T) int64 token ids, logits
(B, T, vocab_size) fp32, with B and T dynamic (1 <= T <= max_seq_len); there is no KV cache,
so decoding re-runs the whole sequence. The tokenizer is not in the file: it stays in the run.

- ``pt2``: ``torch.export.export`` then ``torch.export.save``; load with
  ``torch.export.load(f).module()``. Needs torch only.
- ``aoti``: the same program compiled ahead of time by Inductor into a ``.pt2`` package
  (``torch._inductor.aoti_compile_and_package``); load with
  ``torch._inductor.aoti_load_package(f)``. Needs a C++ compiler at export time.
- ``onnx``: ``torch.onnx.export(..., dynamo=True, dynamic_shapes=...)`` (the torch.export
  based exporter); run with onnxruntime. Needs the ``export`` extra.

After writing, the file is loaded back and called once on the example input; ``check``
returns the load and first-call times and the max |logit diff| against eager, which the
CLI prints. The file is written beside the target and renamed into place, so a failure
leaves nothing half-written; an existing target is refused unless ``force``.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ember.errors import EmberError
from ember.train.checkpoint import load_run

TARGETS = ("pt2", "aoti", "onnx")
EXAMPLE = (2, 8)  # (B, T) of the tracing input; neither 1 (export would specialize a size-1 dim)


@dataclass
class Check:
    """What loading the written file back and calling it once measured."""

    load_s: float
    first_call_s: float
    max_abs_diff: float  # max |logits - eager logits| on the example input


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
    name = session.get_inputs()[0].name

    def run(idx: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {name: idx.numpy()})[0])

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
    if target == "onnx":
        _onnxruntime()
        idx = torch.zeros(EXAMPLE, dtype=torch.long)
        with torch.no_grad():
            torch.onnx.export(
                model, (idx,), str(tmp), dynamo=True, external_data=False,
                input_names=["idx"], output_names=["logits"],
                dynamic_shapes=_dynamic_shapes(model.cfg.max_seq_len),
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
    out = Path(out)
    if out.is_dir():
        raise EmberError(f"{out} is a directory; --to {target} writes one file, give a file path")
    if out.exists() and not force:
        raise EmberError(f"{out} exists; choose another path or pass --force to replace it")
    if target == "onnx":
        _onnxruntime()  # before loading the run: a missing package is the first thing to hear
    model, _ = load_run(run_dir, ckpt)  # EmberError for a missing or damaged run
    model = model.float().eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    suffix = ".onnx" if target == "onnx" else ".pt2"  # aoti_compile_and_package wants .pt2
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}{suffix}"
    try:
        _write(model, target, tmp)
        idx = torch.randint(0, model.cfg.vocab_size, EXAMPLE, generator=torch.Generator().manual_seed(0))
        result = check(model, target, tmp, idx)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    return result
