"""Checkpoints that never lie, and the weights that inference needs.

    save_checkpoint(run_dir / "checkpoints", step, model, optimizer, meta, keep_last=2)
    folder = latest_checkpoint(run_dir / "checkpoints")      # newest *committed* step, or None
    meta = load_checkpoint(folder, model, optimizer)
    export_weights(model, run_dir / "model", model_cfg)        # model.safetensors + model_config.json
    model, tokenizer = load_run(run_dir, ckpt="last")           # what eval, generate and chat load

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

Nothing is loaded with ``weights_only=False``: DCP reads tensors, the RNG files hold
only tensors, everything else is JSON.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ember.atomic import publish_dir, staging_dir, write_text_atomic
from ember.config import ModelConfig
from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.model.gpt import GPT
from ember.parallel.dist import barrier, get_rank

MARKER = "COMMITTED"
# optimizer state keyed by parameter name, not by position in the param groups: a pipeline stage
# has only some groups (the embedding's on the first stage, the head's on the last), so positions
# would differ from rank to rank, and layouts could not load each other's checkpoints
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
STEP_DIR = re.compile(r"^step-(\d{6,})$")


def _dist_on() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes' a single process even when told so (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def _steps(root: Path) -> list[tuple[int, Path, bool]]:
    """(step, folder, committed) for every step folder, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p, (p / MARKER).exists()))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest step whose commit marker exists (half-written folders are skipped)."""
    committed = [p for _, p, done in _steps(root) if done]
    return committed[-1] if committed else None


def _write_json(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


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
    with _quiet_single_process():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder), no_dist=not _dist_on())
    torch.save(_rng_state(), folder / f"rng-rank{rank}.pt")
    barrier()
    if rank == 0:
        _write_json(folder / "meta.json", {"step": step, **meta})
        _write_json(folder / MARKER, {"step": step})
        _prune(root, keep_last, set(keep_steps) | {step})
    barrier()
    return folder


def _prune(root: Path, keep_last: int, keep: set[int]) -> None:
    """Keep the newest ``keep_last`` committed steps and ``keep``; drop older half-written ones."""
    steps = _steps(root)
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
    folder: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    only: set[str] | None = None,
) -> dict:
    """Load model (+ optimizer) state and this rank's RNG; returns meta.json's content. ``only``:
    the model entries the checkpoint holds (as saved); the others stay as they are."""
    folder = Path(folder)
    if not (folder / MARKER).exists():
        raise EmberError(
            f"checkpoint {folder} has no {MARKER} marker: it was never finished; "
            "resume from an earlier step or use train.resume=auto"
        )
    try:
        meta = json.loads((folder / "meta.json").read_text())
        with _quiet_single_process():
            if optimizer is None:
                state = {"model": get_model_state_dict(model)}
                dcp.load(state, checkpoint_id=str(folder), no_dist=not _dist_on())
                set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
            else:
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
    # DCP wraps load failures in CheckpointException, a BaseException subclass
    except (OSError, ValueError, RuntimeError, KeyError, json.JSONDecodeError, CheckpointException) as e:
        raise EmberError(
            f"checkpoint {folder} cannot be read ({type(e).__name__}: {str(e)[:200]}); if it is damaged, "
            "delete it to resume from the one before (a different model or optimizer needs a new run)"
        ) from None
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return meta


# ------------------------------------------------------------------ inference weights


def export_weights(
    model: torch.nn.Module, out: Path, model_cfg: dict, extra_files: dict[str, Path] | None = None
):
    """Write ``model.safetensors`` + ``model_config.json`` (+ e.g. tokenizer.json) into ``out``
    atomically. Collective under FSDP (gathers the full state); rank 0 writes."""
    from safetensors.torch import save_file

    pipeline = getattr(model, "schedule", None) is not None
    # (cpu_offload gives the state to rank 0 only; a pipeline stage's first rank needs its own)
    options = StateDictOptions(full_state_dict=True, cpu_offload=not pipeline)
    full = get_model_state_dict(model, options=options)
    if pipeline:  # pipeline stages: rank 0 gathers their layers
        mine = 0 in torch.distributed.get_process_group_ranks(model.group)  # one copy of each stage
        full = {k: v.cpu() for k, v in full.items()} if mine else {}
        parts = [None] * torch.distributed.get_world_size() if get_rank() == 0 else None
        torch.distributed.gather_object(full, parts, dst=0)
        full = {k: v for part in parts or [] for k, v in part.items()}
    if get_rank() != 0:
        return
    tmp = staging_dir(out)
    tensors, seen = {}, {}
    for name, t in full.items():  # tied weights share storage: safetensors stores each once
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen[key] = name
        tensors[name] = t.detach().contiguous().cpu()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    _write_json(tmp / "model_config.json", model_cfg)
    for name, src in (extra_files or {}).items():
        shutil.copyfile(src, tmp / name)
    publish_dir(tmp, out)


def load_weights(model: torch.nn.Module, folder: Path, adapt=None) -> None:
    """Load ``model.safetensors`` into ``model`` (tied weights are re-shared by the model),
    through ``adapt(state) -> state`` if given (a grown vocabulary)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        raise EmberError(f"{path} not found; train the run first (`ember train CONFIG`)")
    try:
        state = load_file(str(path))
        missing, unexpected = model.load_state_dict(adapt(state) if adapt else state, strict=False)
    except (OSError, SafetensorError, RuntimeError) as e:  # RuntimeError: a shape that does not fit
        raise EmberError(
            f"cannot load {path} ({str(e).strip().splitlines()[0]}): the file is truncated, damaged or "
            "from another model; export or copy the weights again"
        ) from None
    first: dict[int, str] = {}
    aliases = set()  # second names of tied parameters, which export_weights stores once
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            aliases.add(name)
    if unexpected or set(missing) - aliases:
        raise EmberError(
            f"{path} does not match the model (missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]})"
        )


def run_tokenizer(run_dir: str | Path) -> Path | None:
    """The tokenizer file of a run directory: ``model/tokenizer.json``, else ``tokenizer.json``."""
    run_dir = Path(run_dir)
    candidates = (run_dir / "model" / "tokenizer.json", run_dir / "tokenizer.json")
    return next((p for p in candidates if p.is_file()), None)


def load_run(
    run_dir: str | Path, ckpt: str = "last", device: str | torch.device = "cpu"
) -> tuple[GPT, Tokenizer]:
    """A run directory's model (eval mode, on ``device``) and tokenizer, checked to match: the
    one loader behind ``ember eval``, ``generate``, ``chat`` and ``Engine.from_run``. ``ckpt``
    is ``last`` (``model/``, the final weights), ``best`` (``model-best/``) or a committed
    training checkpoint (``1200`` or ``step-001200``). A missing, unreadable or damaged file
    raises an EmberError that names it. A quantized run
    (``model/quant.json``, written by ``ember quantize``) gets its quantized linear layers
    swapped in before loading. Returns ``(model, tokenizer)``; ``model.cfg`` is the
    ``ModelConfig``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise EmberError(f"run directory {run_dir} does not exist")
    config_path = run_dir / "model" / "model_config.json"
    if not config_path.is_file():
        raise EmberError(
            f"{config_path} not found: {run_dir} has no final weights; "
            "`ember train CONFIG` writes model/ when training ends"
        )
    try:
        cfg = ModelConfig(**json.loads(config_path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, EmberError) as e:  # ValueError: bad JSON or UTF-8
        raise EmberError(f"{config_path} is not a valid model config ({e}); re-export the weights") from None
    tokenizer_path = run_tokenizer(run_dir)
    if tokenizer_path is None:
        raise EmberError(
            f"no tokenizer.json in {run_dir / 'model'} or {run_dir}; "
            "copy the tokenizer the run was trained with there"
        )
    tokenizer = Tokenizer.load(tokenizer_path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise EmberError(
            f"{tokenizer_path} has {tokenizer.vocab_size} tokens but {config_path} only "
            f"{cfg.vocab_size}: the tokenizer does not match the weights"
        )
    model = GPT.build(cfg, device=device)
    from ember.export.quantize import pack, quantize, read_spec

    spec = read_spec(run_dir / "model")
    if spec is not None:  # a quantized run (ember quantize): only its final weights exist
        if ckpt != "last":
            raise EmberError(f"--ckpt {ckpt}: {run_dir} is quantized ({spec.label}) and holds only `last`")
        load_weights(quantize(model, spec, empty=True), run_dir / "model")
        pack(model)
    elif ckpt in ("last", "best"):
        load_weights(model, run_dir / ("model" if ckpt == "last" else "model-best"))
    else:
        m = re.fullmatch(r"(?:step-)?(\d+)", ckpt)
        if not m:
            raise EmberError(f"--ckpt {ckpt!r}: use last, best, or a step number (e.g. 1200)")
        folder = step_dir(run_dir / "checkpoints", int(m.group(1)))
        if not folder.is_dir():
            newest = latest_checkpoint(run_dir / "checkpoints")
            raise EmberError(
                f"no checkpoint {folder.name} in {run_dir}"
                + (f" (newest: {newest.name})" if newest else " (none kept)")
            )
        load_checkpoint(folder, model, None)
    return model.eval(), tokenizer
