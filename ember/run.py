"""THE run directory: the one room that reads and writes what a run leaves behind.

    model, tokenizer = load_run("runs/tiny", ckpt="last")   # what eval, generate, serve, export load
    export_weights(model, run / "model", model_cfg)          # model.safetensors + model_config.json
    folder = latest_checkpoint(run / "checkpoints")          # newest *committed* step, or None
    cfg = run_config(run); rows = read_metrics(run); record_eval(run, {"val": {...}})

A run lives in ``runs/<name>/`` (DESIGN rule 6): ``config.yaml`` (resolved; a resumed leg adds
``config-resume-step-N.yaml``), ``env.json``, ``tokenizer.json``, ``metrics.jsonl``,
``checkpoints/step-NNNNNN/`` (training state, written by ``ember.train.checkpoint`` with
``torch.distributed.checkpoint``; a step counts only once its ``COMMITTED`` marker exists),
``model/`` and ``model-best/`` (inference weights: ``model.safetensors``, ``model_config.json``,
``tokenizer.json``; a quantized run's ``quant.json``), ``summary.json``, ``eval.json``,
``report.md``, ``analysis/``. Every verb after ``train`` takes such a directory and needs nothing
else; a fine-tuned, imported or quantized model is one too.

It sits above ``model/`` and ``parallel/`` (not on floor 2, where ../shared/DESIGN.md draws it):
``load_run`` builds the model, swaps in quantized layers and reads DCP checkpoints.
Everything that reads a run (infer, export, analysis, report, sweep, the CLI) comes here, never
to ``train/``: the trainer writes a run, this module knows its shape. Nothing is loaded with
``weights_only=False``: safetensors and DCP read tensors, everything else is JSON or YAML.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_state_dict

from ember.atomic import publish_dir, staging_dir, write_text_atomic
from ember.config import ModelConfig, load_config
from ember.data.tokenizer import Tokenizer
from ember.errors import ConfigError, EmberError
from ember.model.gpt import GPT
from ember.model.quant import QuantSpec, pack, quantize
from ember.model.vision import build_model
from ember.parallel.dist import get_rank

MARKER = "COMMITTED"
QUANT_FILE = "quant.json"  # in model/: the scheme of a quantized run (ember quantize)
STEP_DIR = re.compile(r"^step-(\d{6,})$")


# ------------------------------------------------------------------ checkpoint folders


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def checkpoint_steps(root: Path) -> list[tuple[int, Path, bool]]:
    """(step, folder, committed) for every step folder under ``root``, oldest first."""
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
    committed = [p for _, p, done in checkpoint_steps(root) if done]
    return committed[-1] if committed else None


def checkpoint_step(run_dir: Path, ckpt: str) -> int | None:
    """The training step that ``--ckpt`` names: a step folder's number, the final step for
    ``last`` (from summary.json), None where it is unknown (``best``, an unfinished run)."""
    if ckpt in ("last", "best"):
        step = (read_json(Path(run_dir) / "summary.json") or {}).get("step") if ckpt == "last" else None
        return step if isinstance(step, int) else None  # (missing or damaged: unknown)
    return int(ckpt.removeprefix("step-"))


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``; None if it is missing, unreadable or not an object."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_json(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


# ------------------------------------------------------------------ records


def run_config(run_dir: Path):
    """The run's own config (its config.yaml), as the trainer wrote it."""
    path = Path(run_dir) / "config.yaml"
    saved_config(path)  # (an empty or damaged file would load as the defaults)
    return load_config(str(path), [])


def saved_config(path: Path) -> dict:
    """A config YAML that ``ember train`` wrote (a run's config.yaml, config-resume-*.yaml), as
    a plain mapping; EmberError where it is missing, does not parse, or lacks its sections."""
    path = Path(path)
    if not path.is_file():
        raise EmberError(f"{path} not found: give a run directory that `ember train` wrote")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise EmberError(f"cannot read {path} ({e}); `ember train` writes it") from None
    sections = ("data", "model", "train")
    if not (isinstance(data, dict) and all(isinstance(data.get(k), dict) for k in sections)):
        raise EmberError(
            f"{path} is damaged: not the config `ember train` writes (a mapping with data, model and train "
            "sections); restore it, or `ember config show` the preset the run was trained from and save that"
        )
    return data


def read_metrics(run_dir: Path) -> list[dict]:
    """Every record of ``metrics.jsonl``, in order (empty if there is none), past any line that
    does not parse: ``metrics_lines``."""
    return metrics_lines(run_dir)[0]


def metrics_lines(run_dir: Path) -> tuple[list[dict], int]:
    """(``metrics.jsonl``'s records, how many lines did not parse): a line torn by a crash or a
    full disk mid-write is skipped, so a resume or a report still reads the rest."""
    path, records, bad = Path(run_dir) / "metrics.jsonl", [], 0
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.is_file() else []
    for line in filter(str.strip, lines):
        try:
            record = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(record, dict):
            records.append(record)
    return records, bad


def record_eval(run_dir: Path, results: dict) -> None:
    """Merge ``results`` into ``RUN/eval.json``, one entry per dataset label."""
    path = Path(run_dir) / "eval.json"
    record = {"results": {}}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            if isinstance(old, dict) and isinstance(old.get("results"), dict):
                record["results"] = old["results"]
        except json.JSONDecodeError:
            pass  # a damaged record is replaced
    record["results"].update(results)
    write_json(path, record)


# ------------------------------------------------------------------ inference weights


def export_weights(
    model: torch.nn.Module, out: Path, model_cfg: dict, extra_files: dict[str, Path] | None = None
):
    """Write ``model.safetensors`` + ``model_config.json`` (+ e.g. tokenizer.json) into ``out``
    atomically. Collective under FSDP (gathers the full state); rank 0 writes."""
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
    write_json(tmp / "model_config.json", model_cfg)
    for name, src in (extra_files or {}).items():
        shutil.copyfile(src, tmp / name)
    publish_dir(tmp, out)


def load_weights(model: torch.nn.Module, folder: Path, adapt=None) -> None:
    """Load ``model.safetensors`` into ``model`` (tied weights are re-shared by the model),
    through ``adapt(state) -> state`` if given (a grown vocabulary)."""
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


def read_spec(model_dir: Path) -> QuantSpec | None:
    """The ``QuantSpec`` of a quantized run's ``model/`` folder, or None for float weights."""
    path = Path(model_dir) / QUANT_FILE
    if not path.is_file():
        return None
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
        return QuantSpec(**{"head": False, **fields})  # a record without "head" predates the int8 head
    except (OSError, ValueError, TypeError, EmberError) as e:
        raise EmberError(f"{path} is not a valid quantization record ({e}); quantize the run again") from None


def run_tokenizer(run_dir: str | Path) -> Path | None:
    """The tokenizer file of a run directory: ``model/tokenizer.json``, else ``tokenizer.json``."""
    run_dir = Path(run_dir)
    candidates = (run_dir / "model" / "tokenizer.json", run_dir / "tokenizer.json")
    return next((p for p in candidates if p.is_file()), None)


def load_run_tokenizer(run_dir: str | Path, key: str = "") -> tuple[Tokenizer, Path]:
    """The run's tokenizer and the file it came from (``run_tokenizer``); an EmberError, which
    names ``key`` (the setting that pointed here) when given, if there is none."""
    path = run_tokenizer(run_dir)
    if path is None:
        where = f"no tokenizer.json in {Path(run_dir) / 'model'} or {run_dir}"
        if key:
            raise ConfigError(f"{key}={run_dir}: {where}; give a run directory that `ember train` or `ember import` wrote")  # fmt: skip # noqa: E501
        raise EmberError(f"{where}; copy the tokenizer the run was trained with there")
    return Tokenizer.load(path), path


def model_kind(run_dir: str | Path) -> str:
    """``model.kind`` of the run's final weights: gpt, or an image classifier (mlp, cnn, vit)."""
    try:
        return json.loads((Path(run_dir) / "model" / "model_config.json").read_text()).get("kind", "gpt")
    except (OSError, ValueError, AttributeError):
        return "gpt"  # (no readable weights: load_run says what is wrong)


def load_run(
    run_dir: str | Path, ckpt: str = "last", device: str | torch.device = "cpu", images: bool = False
) -> tuple[GPT, Tokenizer | None]:
    """A run directory's model (eval mode, on ``device``) and tokenizer, checked to match: the
    one loader behind ``ember eval``, ``generate``, ``chat`` and ``Engine.from_run``. ``ckpt``
    is ``last`` (``model/``, the final weights), ``best`` (``model-best/``) or a committed
    training checkpoint (``1200`` or ``step-001200``). A missing, unreadable or damaged file
    raises an EmberError that names it. A quantized run
    (``model/quant.json``, written by ``ember quantize``) gets its quantized linear layers
    swapped in before loading. Returns ``(model, tokenizer)``; ``model.cfg`` is the
    ``ModelConfig``. An image classifier (``model.kind`` mlp, cnn or vit) has no tokenizer (None)
    and loads only where the caller takes one (``images``)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is a file, not a run directory" if run_dir.exists() else "does not exist"
        raise EmberError(f"run directory {run_dir} {what}: give the folder `ember train` wrote")
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
    if cfg.kind != "gpt":
        if not images:
            raise EmberError(f"{run_dir} holds an image classifier (model.kind={cfg.kind}): `ember eval` and `ember analyze RUN profile` take it; this verb needs a language model")  # fmt: skip # noqa: E501
        tokenizer = None
    else:
        tokenizer, tokenizer_path = load_run_tokenizer(run_dir)
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise EmberError(
            f"{tokenizer_path} has {tokenizer.vocab_size} tokens but {config_path} only "
            f"{cfg.vocab_size}: the tokenizer does not match the weights"
        )
    model = build_model(cfg, device=device)
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
        read_checkpoint_weights(folder, model)
    return model.eval(), tokenizer


# DCP wraps load failures in CheckpointException, a BaseException subclass
# (a torn DCP metadata file raises UnpicklingError; a torn tensor file EOFError)
CHECKPOINT_ERRORS = (
    OSError, ValueError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError, CheckpointException
)


def committed(folder: Path) -> Path:
    """``folder``, or an EmberError if its save never finished (no commit marker)."""
    folder = Path(folder)
    if not (folder / MARKER).exists():
        raise EmberError(
            f"checkpoint {folder} has no {MARKER} marker: it was never finished; "
            "resume from an earlier step or use train.resume=auto"
        )
    return folder


def unreadable(folder: Path, e: BaseException) -> EmberError:
    failure = next(iter(getattr(e, "failures", {}).values()), None)  # CheckpointException: (error, stack)s
    if failure is not None:
        e = failure[0] if isinstance(failure, tuple) else failure
    text = [line for line in str(e).splitlines() if line.strip()]  # (its message held a rank's traceback)
    reason = type(e).__name__ + (f": {text[-1].strip()[:200]}" if text else "")
    return EmberError(
        f"checkpoint {folder} cannot be read ({reason}); if it is damaged, "
        "delete it to resume from the one before (a different model or optimizer needs a new run)"
    )


@contextlib.contextmanager
def quiet_dcp():
    """DCP warns that it 'assumes' a single process even when told so (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def read_checkpoint_weights(folder: Path, model: torch.nn.Module) -> None:
    """The model weights of committed training checkpoint ``folder`` (DCP) into ``model``, which
    is whole and on one device (``load_run --ckpt STEP``); the training state is left out."""
    folder = committed(folder)
    try:
        dcp.FileSystemReader(str(folder)).read_metadata()  # a torn one fails here, before DCP logs its stack
        state = {"model": get_model_state_dict(model)}
        with quiet_dcp():
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    except CHECKPOINT_ERRORS as e:
        raise unreadable(folder, e) from None
