"""Checkpoints that never lie: the training state of a step, saved and loaded on every rank.

    save_checkpoint(run_dir / "checkpoints", step, model, optimizer, meta, keep_last=2)
    folder = latest_checkpoint(run_dir / "checkpoints")      # ember.run: newest *committed* step
    meta = load_checkpoint(folder, model, optimizer)

Layout of ``checkpoints/step-NNNNNN/``: the model and optimizer state written by
``torch.distributed.checkpoint`` (each rank writes its own shards; a checkpoint saved by
FSDP2 at one world size loads at another, because DCP re-shards by global shape), one
``rng-rankR.pt`` per rank, ``meta.json`` (step, tokens, elapsed time, best val loss, grad
scaler state), and last of all the ``COMMITTED`` marker. A folder without the marker —
a save that was killed — is ignored on resume and removed at the next save.

A checkpoint written before a param-group setting existed still loads: the setting keeps
the value the optimizer was built with (tensors and state must all be there). Optimizer state
is keyed by parameter name (``FLAT``), so pipeline stages, which hold different param groups,
save and load it; checkpoints from before, keyed by group position, still load.

The folders' names and marker, and the inference weights (``model/``), are the run directory's
(``ember.run``). Nothing is loaded with ``weights_only=False``: DCP reads tensors, the RNG files hold
only tensors, everything else is JSON.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from ember.parallel.dist import barrier, get_rank
from ember.run import (
    CHECKPOINT_ERRORS,
    MARKER,
    checkpoint_steps,
    committed,
    quiet_dcp,
    step_dir,
    unreadable,
    write_json,
)

# optimizer state keyed by parameter name, not by position in the param groups: a pipeline stage
# has only some groups (the embedding's on the first stage, the head's on the last), so positions
# would differ from rank to rank, and layouts could not load each other's checkpoints
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _dist_on() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict,
    keep_last: int = 2,
    keep_steps: tuple[int, ...] = (),
    only: set[str] | None = None,
) -> Path:
    """Save on every rank (collective); rank 0 commits and prunes. Returns the folder. ``only``:
    the model entries to save (LoRA: the adapters; the frozen base comes from its own run)."""
    root = Path(root)
    folder = step_dir(root, step)
    rank = get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)  # leftovers of an uncommitted earlier attempt
        folder.mkdir()
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)
    if only is not None:
        model_sd = {k: v for k, v in model_sd.items() if k in only}
    with quiet_dcp():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder), no_dist=not _dist_on())
    torch.save(_rng_state(), folder / f"rng-rank{rank}.pt")
    barrier()
    if rank == 0:
        write_json(folder / "meta.json", {"step": step, **meta})
        write_json(folder / MARKER, {"step": step})
        _prune(root, keep_last, set(keep_steps) | {step})
    barrier()
    return folder


def _prune(root: Path, keep_last: int, keep: set[int]) -> None:
    """Keep the newest ``keep_last`` committed steps and ``keep``; drop older half-written ones."""
    steps = checkpoint_steps(root)
    committed = [s for s, _, done in steps if done]
    keep = keep | set(committed[-keep_last:])
    for s, p, _ in steps:
        if s not in keep and s < committed[-1]:
            shutil.rmtree(p, ignore_errors=True)


def _drop_unsaved_group_settings(optim_sd: dict, saved) -> dict:
    """Param-group settings newer than the checkpoint (``saved``: its keys; e.g. ``peak_lr``,
    added with per-group learning rates) are not asked of it; they keep the values the optimizer
    was built with, which are returned to be put back after the load (the flat form asks for
    every one)."""
    for i, group in enumerate(optim_sd.get("param_groups", [])):  # the nested form
        for key in [k for k in group if k != "params" and f"optim.param_groups.{i}.{k}" not in saved]:
            del group[key]
    flat = [k for k in optim_sd if k.startswith("param_groups.") and f"optim.{k}" not in saved]
    return {k: optim_sd.pop(k) for k in flat}


def load_checkpoint(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, only: set[str] | None = None
) -> dict:
    """Load model and optimizer state and this rank's RNG; returns meta.json's content. ``only``:
    the model entries the checkpoint holds (as saved); the others stay as they are. (The
    weights alone, for inference: ``ember.run.read_checkpoint_weights``.)"""
    folder = committed(folder)
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            raise ValueError("meta.json is not the record a save writes (no step)")
        saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        # optimizer state by parameter name (FLAT), as every checkpoint since pipeline
        # parallel has it, or by position in the param groups (before)
        flat = not any(k.startswith("optim.param_groups.0.") for k in saved)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flat))  # fmt: skip # noqa: E501
        if only is not None:
            model_sd = {k: v for k, v in model_sd.items() if k in only}
        built = [dict(group) for group in optimizer.param_groups]
        kept = _drop_unsaved_group_settings(optim_sd, saved)
        state = {"model": model_sd, "optim": optim_sd}
        with quiet_dcp():
            dcp.load(state, checkpoint_id=str(folder), no_dist=not _dist_on())
        state["optim"].update(kept)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(strict=only is None, flatten_optimizer_state_dict=flat),
        )
        for group, before in zip(optimizer.param_groups, built, strict=True):
            for key, value in before.items():
                group.setdefault(key, value)
        rank_file = folder / f"rng-rank{get_rank()}.pt"
        if not rank_file.exists():  # resumed at a different world size: take rank 0's stream
            rank_file = folder / "rng-rank0.pt"
        rng = torch.load(rank_file, weights_only=True)
    except CHECKPOINT_ERRORS as e:
        raise unreadable(folder, e) from None
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return meta
