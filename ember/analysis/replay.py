"""Replaying training steps with every tensor in view: where a step first goes non-finite, and
where two runs of one config first part.

    ember analyze RUN nonfinite --step S          # replay step S from the checkpoint before it
    ember analyze CONFIG determinism [--steps N]  # run the config twice, find the first difference
    ember analyze CONFIG determinism --nproc 2    # one process against two ranks

``Recorder`` hooks every module of the model: in the forward, each module's output (in execution
order); in the backward, the gradient arriving at each module's output (a hook on that tensor:
robust where module backward hooks are not) and each parameter's gradient once accumulated, in
the order autograd computes them. ``nonfinite`` names the first of these that holds a
NaN or an infinity, with the statistics of what came just before it (in the forward the
module's input; in the backward the tensor autograd produced before it). ``determinism``
records two runs of the same config from the same seed and reports the first step and the first
tensor, in that order, whose values differ, with the largest difference; on CPU in fp32 with
``train.deterministic=true`` there should be none. Across two world sizes (``--nproc``) each
run is a torchrun launch whose ranks ``record_rank`` what the worlds share: every micro-batch's
module outputs by its place in the global batch, then the averaged gradients, the clipping norm
and the parameters, whole.
"""

from __future__ import annotations

import gc
import json
import math
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

from ember.analysis import write_results
from ember.config import config_to_yaml
from ember.data.prepare import prepare
from ember.errors import EmberError
from ember.parallel.dist import barrier, destroy_distributed, run_ranks, wants_cuda
from ember.run import checkpoint_steps, read_metrics, run_config
from ember.train.layout import check_layout
from ember.train.recorder import Recorder
from ember.train.trainer import scratch_trainer


def nonfinite(run_dir, step: int | None, inject=None) -> dict:
    """Replay step ``step`` of the run from its last committed checkpoint before it (or from the
    start) and name the first non-finite tensor: in this process, whatever the run's layout (its
    checkpoints move between layouts; the step's global batch is the same on one device).
    ``inject(trainer)``: a test's fault, installed before the replayed step."""
    if step is None:
        raise EmberError("nonfinite replays one step: give --step S (the step the run stopped at)")
    if step < 1:
        raise EmberError(f"--step {step}: steps count from 1")
    started = time.perf_counter()
    cfg = run_config(run_dir)
    last = last_step(run_dir, cfg.train.log_every)
    if last is None:
        raise EmberError(
            f"{run_dir} has no training history (no metrics.jsonl, checkpoints or summary.json: an imported "
            "or quantized run); nonfinite replays a step of a run `ember train` wrote"
        )
    if step > last:
        raise EmberError(f"--step {step} is beyond {run_dir}, which trained to step {last}; give 1 to {last}")
    # record it, do not stop on it; on one device (the layout's defaults: tp = pp = 1, ...)
    cfg = replace(cfg, train=replace(cfg.train, nonfinite="skip"), parallel=type(cfg.parallel)())
    before = [p for s, p, done in checkpoint_steps(Path(run_dir) / "checkpoints") if done and s < step]
    resume = str(before[-1].resolve()) if before else "never"
    # (only cadences, the layout and the non-finite policy differ from the run's config)
    with scratch_trainer(cfg, resume=resume, resume_allow_changes=True) as trainer:
        batches = trainer.loader.iterate(trainer.step)
        while trainer.step < step - 1:
            trainer.advance(batches)
        if inject is not None:
            inject(trainer)
        with Recorder(trainer.model, keep=False) as rec:
            trainer.advance(batches)
    result = {"step": step, "from": before[-1].name if before else "the start", "first_nonfinite": rec.first}
    out = write_results(run_dir, "nonfinite", result, started)
    return {**result, "out": str(out)}


def last_step(run_dir, log_every: int) -> int | None:
    """The last step a run trained: its summary's; for one that stopped (on a non-finite step),
    within ``log_every`` of its last record or checkpoint; None if it has no history."""
    summary = Path(run_dir) / "summary.json"
    if summary.is_file():
        return json.loads(summary.read_text())["step"]
    steps = [r["step"] for r in read_metrics(run_dir) if "step" in r]
    steps += [s for s, _, done in checkpoint_steps(Path(run_dir) / "checkpoints") if done]
    return max(steps) + log_every if steps else None


def nonfinite_summary(r: dict) -> str:
    """What ``ember analyze RUN nonfinite`` prints: the first non-finite tensor and what fed it."""
    replayed = f"step {r['step']} (replayed from {r['from']})"
    first = r["first_nonfinite"]
    if first is None:
        return f"{replayed}: every output and gradient is finite"
    t, fed = first["tensor"], first["before"] or {}
    lines = [f"{replayed}: first non-finite: {first['phase']} of {first['name']} "
             f"({t['nonfinite']} of {t['shape']} entries)"]  # fmt: skip
    if fed:
        lines.append(f"  just before it, {fed['phase']} {fed['name']}: absmax {fed['absmax']:.4g}, "
                     f"mean {fed['mean']:.4g}, {fed['nonfinite']} non-finite")  # fmt: skip
    return "\n".join(lines)


def determinism(cfg, steps: int = 3, perturb=None, worlds: tuple[int, int] = (1, 1)) -> dict:
    """Train ``cfg`` twice for ``steps`` steps, recording every tensor; the first step and tensor
    where the second run differs from the first. ``perturb(trainer)``: a test's non-determinism,
    installed in the second run only. ``worlds``: the two runs' world sizes; other than (1, 1) each
    run is recorded by ``record_rank`` (a torchrun launch of one thread per rank; one rank here). With the
    ``worlds`` and the ``seconds`` it took."""
    started = time.perf_counter()
    if worlds != (1, 1):
        if perturb is not None:
            raise ValueError("perturb installs into this process's trainer: not with other world sizes")
        if cfg.parallel.tp * cfg.parallel.pp > 1:
            raise EmberError("determinism across world sizes compares data-parallel layouts "
                             "(parallel.data=ddp or fsdp): set parallel.tp=1 and parallel.pp=1")  # fmt: skip
        gpus = torch.cuda.device_count()
        if wants_cuda(cfg.train.device) and gpus < max(worlds):
            raise EmberError(f"{max(worlds)} ranks on CUDA need {max(worlds)} GPUs; {gpus} visible: "
                             "set train.device=cpu (gloo) or fewer ranks")  # fmt: skip
        for world in worlds:  # a layout or batch that cannot run fails here, before any launch
            check_layout(cfg, world)
        prepare(cfg)  # once, before the ranks read the data
        runs = [_launch(cfg, steps, w) for w in worlds]
    else:
        runs = [_record(cfg, steps, perturb if attempt == 1 else None) for attempt in range(2)]
    return _first_difference(runs, steps) | {"worlds": list(worlds), "seconds": time.perf_counter() - started}


def parse_worlds(spec: str | None, most: int = 1024) -> tuple[int, int]:
    """``--nproc`` of determinism: none → (1, 1); N → (1, N); A,B → (A, B), each at most ``most``."""
    if spec is None:
        return (1, 1)
    try:
        sizes = [int(part) for part in spec.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2) or min(sizes) < 1:
        raise EmberError(f"--nproc {spec}: give N (one process against N ranks) or A,B (A ranks against B)")
    if max(sizes) > most:
        raise EmberError(f"--nproc {spec}: at most {most} ranks launch on this machine")
    return (1, sizes[0]) if len(sizes) == 1 else (sizes[0], sizes[1])


def determinism_summary(r: dict, config: str) -> str:
    """What ``ember analyze CONFIG determinism`` prints: identical, or where the runs part."""
    one = r["worlds"] == [1, 1]
    runs = "two runs" if one else f"runs on {r['worlds'][0]} and {r['worlds'][1]} rank(s)"
    took = f"({r['seconds']:.1f} s)"
    if r["identical"]:
        what = "module outputs, their gradients, parameter gradients, parameters"
        if not one:
            what = "each micro-batch's module outputs, averaged gradients, gradient norms, parameters"
        return (f"{config}: {runs} of {r['steps']} steps are identical: {r['tensors_compared']:,} tensors "
                f"({what}) equal bit for bit {took}")  # fmt: skip
    diff, apart = r["max_difference"], r.get("parameters_apart_at_end")
    where = f"{r['phase']} {r['name']}".strip()
    return (f"{config}: the {runs} part at step {r['step']}, {where}"
            + (f": largest difference {diff:.3g} ({r['relative']:.2g} of its largest value)" if diff is not None else "")  # fmt: skip # noqa: E501
            + (f"; after step {r['steps']} their parameters are up to {apart:.3g} apart" if apart else "")
            + f" {took}")  # fmt: skip


def _record(cfg, steps: int, perturb=None) -> list[list[tuple]]:
    """One run of ``steps`` steps in this process: per step every recorded tensor, then the
    parameters after it."""
    with scratch_trainer(cfg, resume="never") as trainer:
        if perturb is not None:
            perturb(trainer)
        batches = trainer.loader.iterate(0)
        records = []
        for _ in range(steps):
            with Recorder(trainer.model, keep=True) as rec:
                trainer.advance(batches)
            params = trainer.model.named_parameters()
            after = [("parameter after the step", n, p.detach().clone()) for n, p in params]
            records.append(rec.events + after)
    return records


def _first_difference(runs: list, steps: int) -> dict:
    compared = 0
    for s, (a, b) in enumerate(zip(*runs, strict=True), start=1):
        if len(a) != len(b):
            count = f"{len(a)} tensors recorded against {len(b)}"
            return {"steps": steps, "identical": False, "step": s, "phase": count, "name": "",
                    "max_difference": None}  # fmt: skip
        for (phase, name, x), (_, _, y) in zip(a, b, strict=True):
            compared += 1
            if not _same_bits(x, y):
                diff, scale = _max_difference(x, y), x.double().abs().max().item()
                return {"steps": steps, "identical": False, "step": s, "phase": phase, "name": name,
                        "max_difference": diff, "relative": diff / scale if scale else math.inf,
                        "tensors_compared": compared,
                        "parameters_apart_at_end": _apart(runs[0][-1], runs[1][-1])}  # fmt: skip
    return {"steps": steps, "identical": True, "tensors_compared": compared}


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal bit for bit: unlike ``torch.equal``, a NaN equals the same NaN (a step skipped as
    non-finite in both runs is no difference)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if not x.is_floating_point():
        return torch.equal(x, y)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return torch.equal(x.contiguous().view(bits), y.contiguous().view(bits))


def _max_difference(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x.double() - y.double()).abs().max().item() if x.shape == y.shape else math.inf


def _apart(a: list, b: list) -> float:
    """The largest difference between two runs' parameters after their last step."""
    diffs = [_max_difference(x, y) for (phase, _, x), (_, _, y) in zip(a, b, strict=False)
             if phase == "parameter after the step"]  # fmt: skip
    return max(diffs, default=math.nan)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whole (a DTensor, as FSDP2 shards it, gathered: a collective)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def record_rank(cfg, steps: int, out: Path) -> None:
    """One rank's record of ``steps`` steps (under torchrun, or alone), in a form that lines up
    across world sizes: each micro-batch's module outputs under its index in the global batch
    (rank r of a data-parallel world holds micro-batches r·A … r·A + A − 1 of its A per step);
    then, whole, the parameter gradients as the optimizer's step begins (after the backward and
    the ranks' averaging, before clipping), the gradient norm that clipping uses, and the
    parameters after the step. Written to ``out/rank{r}.pt``. Gradients at module outputs are
    left out: their scale, 1/A, differs between world sizes."""
    try:
        with scratch_trainer(cfg, resume="never") as trainer:
            model = getattr(trainer.model, "module", trainer.model)  # (DDP wraps the model; FSDP2 does not)
            accum, rank = trainer.grad_accum, trainer.env.rank
            synced, unscale = [], trainer.scaler.unscale_

            def before_clipping(optimizer):  # the step's first act; every rank (gathering is a collective)
                unscale(optimizer)  # (under fp16 the gradients carry the loss scale until here)
                grads = [("parameter gradient (averaged)", n, _whole(p.grad))
                         for n, p in model.named_parameters() if p.grad is not None]  # fmt: skip
                synced.extend(grads if rank == 0 else [])

            trainer.scaler.unscale_ = before_clipping
            batches, records = trainer.loader.iterate(0), []
            for _ in range(steps):
                synced.clear()
                batch = next(batches)  # (before recording: GRPO's rollouts run the model to make it)
                with Recorder(model, keep=True, backward=False) as rec:
                    _, norm, _ = trainer.advance(iter([batch]))
                if len(rec.events) % accum:
                    raise EmberError(f"{len(rec.events)} module outputs: not {accum} equal micro-batches")
                per = len(rec.events) // accum
                first = trainer.env.dp_rank * accum
                forward = {first + m: rec.events[m * per : (m + 1) * per] for m in range(accum)}
                after = [("parameter after the step", n, _whole(p)) for n, p in model.named_parameters()]
                whole = [*synced, ("gradient norm (clipping's)", "", _whole(norm)), *after]
                records.append({"forward": forward, "synced": whole if rank == 0 else []})
        torch.save(records, Path(out) / f"rank{rank}.pt")
        barrier()  # every rank is past its last collective before any tears the process group down
    finally:
        destroy_distributed()


def _launch(cfg, steps: int, world: int) -> list[list[tuple]]:
    """``record_rank`` on ``world`` ranks under torchrun (this module's ``__main__``; one rank on
    the CPU runs in this process, as torchrun would run it: one thread, rank 0 of 1, no process
    group), its records in one order whatever the world size: micro-batches by their index in
    the global batch, then rank 0's whole tensors. (On CUDA a lone rank is launched too, so that
    this process holds no GPU memory beside the other run's rank 0.)"""
    with tempfile.TemporaryDirectory(prefix="ember-determinism-") as tmp:
        if world == 1 and not wants_cuda(cfg.train.device):
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                with mock.patch.dict(os.environ, {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}):
                    record_rank(cfg, steps, Path(tmp))
            finally:
                torch.set_num_threads(threads)
                gc.collect()  # (the trainer's scaler and model hold each other)
        else:
            config = Path(tmp) / "config.yaml"
            config.write_text(config_to_yaml(cfg))
            run_ranks(world, str(config), str(steps), tmp, module="ember.analysis.replay", what="the run")
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]
    steps_in_order = []
    for s in range(steps):
        forward = {g: events for rank in ranks for g, events in rank[s]["forward"].items()}
        events = [(f"forward (micro-batch {g})", n, t) for g in sorted(forward) for _, n, t in forward[g]]
        steps_in_order.append(events + ranks[0][s]["synced"])
    return steps_in_order


if __name__ == "__main__":  # a rank of ``_launch``: python -m ember.analysis.replay CONFIG STEPS OUT
    import sys

    from ember.config import load_config

    record_rank(load_config(sys.argv[1], []), int(sys.argv[2]), Path(sys.argv[3]))
