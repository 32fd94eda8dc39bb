"""``ember train``: one loop for a CPU, a GPU, or many ranks under torchrun.

    result = train(load_config("tiny", ["train.max_steps=20"]))

The loop (``Trainer.run``) reads top to bottom: budget check, learning rates, batch, the
step (``train_step``: micro-batches with loss scaled by accumulation, backward, unscale +
clip, non-finite guard agreed across ranks, optimizer step), log (``_log``), evaluate,
checkpoint. What is trained is a *task*, registered by name (``train.task``:
``ember.train.tasks``; the interface is ``ember.train.task.Task``): it checks its own layout
constraints, builds its data (its loader), supplies the loss of a micro-batch and evaluates
itself; the loop has no task branches. The model starts as ``ember.train.start`` says (the
tokenizer, ``train.init_from``, QAT, LoRA), then the layout is applied
(``ember.parallel.parallelize``) after one check of it (``ember.train.layout``). The optimizer
(``train.optimizer``: AdamW, or Muon on the block matrices) comes from ``ember.train.optim``
with one parameter group per role; each group has its own peak learning rate
(``group["peak_lr"]``) and the schedule scales each peak alike. The logged ``lr`` is the
schedule at ``train.lr``. The loop waits for the device once per ``train.log_every`` steps
(``to_host`` in ``_flush``, also before an evaluation or a checkpoint): losses and gradient
norms stay on the device until then, and the non-finite guard skips an update there
(``found_inf``, which fused AdamW and ember's Muon take); ``_skips_on_device`` says where it
still reads one flag a step. ``train.precision=fp8`` converts the block linears to torchao's
float8 training (``ember.train.start.apply_fp8``; CUDA, compute capability 8.9+).

Numbers you can trust:

- the global batch at step ``s`` is a pure function of ``(run.seed, s)`` (see
  ``ember.data.loader``), the schedule is a pure function of step and budget progress, and
  checkpoints hold model, optimizer (Muon momenta included), scaler, RNG, step, tokens and
  elapsed time (the peak learning rates come from the config on resume): resuming
  reproduces the uninterrupted run bitwise on CPU in fp32 deterministic mode; and a run resumes
  only as itself (``_resume_folder``, ``_check_resumed_config``: one history per directory);
- the weights are initialised identically on every rank (seeded, on the CPU, before the
  layout is applied), so DDP and FSDP2 runs match a single process at the same global batch.
  Building on the meta device and initialising sharded parameters in place, which very
  large models need, comes with the scaling work.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import yaml
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import record_function

import ember
from ember.atomic import check_target, mark, write_text_atomic
from ember.config import config_to_yaml
from ember.data.chat import chat_ids
from ember.data.manifest import TOKENIZER
from ember.data.tokenizer import SPECIALS_FILE, file_sha256
from ember.errors import ConfigError, EmberError
from ember.export.peft import save_peft
from ember.kernels import triton_ready
from ember.model.lora import merge_lora
from ember.model.vision import build_model
from ember.parallel.dist import Watchdog, all_reduce, barrier, destroy_distributed, init_distributed, print0
from ember.parallel.parallelize import compile_mode, parallelize, unwrap
from ember.parallel.pipeline import pipeline_grad_norm
from ember.report.report import write_report
from ember.run import export_weights, latest_checkpoint, read_json, saved_config, write_json
from ember.train.checkpoint import load_checkpoint, save_checkpoint
from ember.train.dynamics import Dynamics
from ember.train.layout import check_layout, compile_scope
from ember.train.metrics import MetricsLog, ProgressBar, peak_flops, peak_memory_mb
from ember.train.optim import build_optimizer, lr_at
from ember.train.recorder import Recorder
from ember.train.start import (
    FP8_RECIPES,
    apply_fp8,
    apply_lora_cfg,
    apply_qat_cfg,
    check_fp8,
    init_from,
)
from ember.train.tasks import task_class

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
AUTOCAST |= dict.fromkeys(FP8_RECIPES, torch.bfloat16)  # float8 block linears, the rest in bf16
SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}  # train.sdpa's
SDPA |= {"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


# On resume the config must equal the run's, but for where the run lives, computes and logs
# (RESUME_FREE). RESUME_FIXED keys and the tokenizer shape the weights, the optimizer state and every
# batch: no opt-in accepts a change to them. Other changes (budgets and so the schedule's length,
# eval and checkpoint cadence, learning rates) need train.resume_allow_changes=true.
RESUME_FREE = ("run.name", "run.out_dir", "train.resume", "train.device", "train.log_every", "parallel.")
RESUME_FREE += ("train.log_dynamics", "train.report", "train.compile", "train.sdpa")  # how, not what
RESUME_FREE += ("train.init_from",)  # it only starts a run: a resumed one loads its checkpoint
RESUME_FIXED = ("model.", "run.seed", "train.batch_tokens", "train.seq_len", "train.optimizer", "data.dir")
RESUME_FIXED += ("data.sampling", "tokenizer")


class NonFiniteError(EmberError):
    """Loss or gradients became NaN/Inf."""


def to_host(values: list) -> list[float]:
    """The loop's one host sync: device scalars (losses, gradient norms, the non-finite flags of
    the steps since the last call) read together, once per ``train.log_every`` steps."""
    if not values:
        return []
    return torch.stack([v.detach().float().reshape(()).to(values[0].device) for v in values]).tolist()


# ---------------------------------------------------------------- helpers


def _set_deterministic(on: bool) -> None:
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def _git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parents[2],
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _env_record(env) -> dict:
    return {
        "ember": ember.__version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device": str(env.device),
        "device_name": torch.cuda.get_device_name(env.device)
        if env.device.type == "cuda"
        else platform.processor(),
        "world_size": env.world_size,
        "cpu_threads": torch.get_num_threads(),
        "git_sha": _git_sha(),
        "command": " ".join(sys.argv),
    }


def clip_grad_norm(params, max_norm: float, pipeline=None) -> torch.Tensor:
    """``clip_grad_norm_`` that also takes a mix of DTensor and plain gradients, or DTensors on
    different meshes (tensor parallel splits the blocks' matrices and leaves norms whole; FSDP2
    over it puts the two on a 2-D and a 1-D mesh): each norm as a plain number (a DTensor's is
    reduced over its mesh), the total, then every gradient scaled in place. Gradients of one
    kind (one device, DDP, FSDP2 alone) on a GPU take torch's own batched path; on a CPU each
    matrix's norm is taken row by row, then over its rows in float64: torch's CPU norm sums a
    whole tensor's squares in one float32 accumulator, which on an embedding's gradient of 0.5 M
    elements came out 1.1e-4 low (``ember analyze CONFIG determinism --nproc 2
    parallel.data=fsdp`` found it: FSDP2's half-size shards lost less) and on 40 M entries of
    0.1, 2% (pytorch/pytorch#169237); by rows, 1e-7. Under pipeline parallel (``pipeline``: the
    rank's PipelineGPT) the norm sums every stage's gradients."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    on_cpu = bool(grads) and grads[0].device.type == "cpu"
    if pipeline is not None:
        total = pipeline_grad_norm(params, pipeline.group)
    elif not on_cpu and len({(type(g), getattr(g, "device_mesh", None)) for g in grads}) <= 1:
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)  # one kind: torch's own
        return total.full_tensor() if hasattr(total, "full_tensor") else total
    else:
        rows = [torch.linalg.vector_norm(g, dim=-1) if on_cpu and g.dim() > 1 else g for g in grads]
        norms = [r.double().norm(2.0) if on_cpu else r.norm(2.0) for r in rows]
        norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
        total = torch.stack(norms).norm(2.0).float() if norms else torch.zeros(())
    if max_norm < math.inf:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device) if not hasattr(g, "device_mesh") else coef.item())
    return total


def _find_nonfinite_module(model, task, batch, autocast, attention, loss_parallel) -> str:
    """Re-run the micro-batch, forward and backward, with every module output, gradient at a
    module output and parameter gradient checked in the order they are computed
    (``ember.train.recorder.Recorder``); say where the first non-finite one is."""
    model.zero_grad(set_to_none=True)  # the failed step's gradients would be seen again
    rec = Recorder(unwrap(model), keep=False)
    try:
        with loss_parallel():  # as in training (precision, attention backend, split logits' loss)
            with autocast, attention():
                loss, _ = task.loss(model, batch)
            if rec.first is None:
                loss.backward()
    finally:
        rec.close()
        model.zero_grad(set_to_none=True)
    first = rec.first
    if first is None:
        return "none in the forward or the backward pass (the loss itself?)"
    if first["phase"] == "forward":
        return first["name"]
    return f"none in the forward pass; in the backward, the {first['phase'].replace('backward', 'gradient at the output')} of {first['name']}"  # fmt: skip # noqa: E501


# ---------------------------------------------------------------- the trainer


class Trainer:
    def __init__(self, cfg, run_dir: Path | None = None):
        self.cfg, t = cfg, cfg.train
        if not (t.max_steps or t.max_tokens or t.max_time):
            raise ConfigError("no training budget: set train.max_steps, train.max_tokens or train.max_time")
        self.env = env = init_distributed(cfg.parallel, t.device)
        self.watch = Watchdog(env, cfg.parallel.timeout_s)  # a failed collective says who and why
        fsdp = env.distributed and cfg.parallel.data == "fsdp"
        check_fp8(t, env.device, tuple(k for k, on in (("TP", env.tp > 1), ("PP", env.pp > 1), ("FSDP", fsdp)) if on))  # fmt: skip # noqa: E501
        if t.precision != "fp32" and env.device.type == "cpu":
            print0(f"ember: note: {t.precision} autocast on a CPU is slow; fp32 is the CPU default")
        _set_deterministic(t.deterministic)
        task = task_class(t.task)
        self.tokenizer = self.tokenizer_file = self.tokenizer_sha = None  # (an image task has none)
        self.model_cfg, known = task.start(self)  # the tokenizer, and the model config resolved by it
        self.units = ("tokens", "tok") if task.tokens else ("images", "img")  # what a step counts
        layout = check_layout(cfg, env.world_size, self.model_cfg)
        self.global_rows, self.grad_accum = layout.rows, layout.grad_accum
        if t.log_dynamics and (env.distributed and (cfg.parallel.data == "fsdp" or env.tp > 1 or env.pp > 1) or t.compile):  # fmt: skip # noqa: E501
            raise ConfigError("train.log_dynamics reads whole weights and eager attention: one device or DDP, without train.compile")  # fmt: skip # noqa: E501
        self.run_dir = Path(run_dir) if run_dir else Path(cfg.run.out_dir) / cfg.run.name
        # absent, empty or a run (resumed below); never the data or the run it starts from
        sources = [cfg.data.dir] + ([t.init_from] if t.init_from else [])
        check_target(self.run_dir, kind="run", sources=sources, force=True)
        self.resume_from = self._resume_folder()
        if self.resume_from is not None:
            self._check_resumed_config()
        barrier()  # every rank has read the run directory before rank 0 writes into it (a race otherwise)

        torch.manual_seed(cfg.run.seed)
        model = build_model(self.model_cfg, device="cpu")  # meta → to_empty → init_weights (seeded above)
        # on resume the checkpoint's weights win; a LoRA checkpoint holds only the adapters, so
        # its frozen base is loaded again from init_from, and DPO's reference copy comes from it
        if t.init_from and (self.resume_from is None or t.lora_rank or task.reference_on_resume):
            chat = task.chat and t.init_from  # the tokenizer is the source's own: nothing to compare
            init_from(model, t.init_from, self.model_cfg, None if chat else self.tokenizer_sha, known)
        if t.qat != "none":  # before parallelize: compile then traces the fake quantization too
            apply_qat_cfg(model, t)
        self.adapters = apply_lora_cfg(model, t) if t.lora_rank else None  # the entries that train
        self.n_params = model.num_params()
        self.flops_per_token = model.flops_per_token(t.seq_len)
        self.peak_flops = peak_flops(env.device)
        model.to(env.device)
        if t.kernels == "triton":
            ready, why = triton_ready(env.device)
            if not ready:
                raise ConfigError(f"train.kernels=triton: {why}; use train.kernels=torch")
            model.set_kernels("triton")
        if t.sdpa != "auto" and (t.kernels == "triton" or t.sdpa in ("cudnn", "efficient") and env.device.type != "cuda"):  # fmt: skip # noqa: E501
            raise ConfigError(f"train.sdpa={t.sdpa} picks a backend of PyTorch's attention: {'CUDA' if t.kernels == 'torch' else 'train.kernels=torch'} only; set train.sdpa=auto")  # fmt: skip # noqa: E501
        if t.sdpa in ("flash", "cudnn") and env.device.type == "cuda" and t.precision == "fp32":
            raise ConfigError(f"train.sdpa={t.sdpa}: its CUDA kernels take bf16 or fp16, not fp32; set train.precision=bf16, or train.sdpa=efficient or math")  # fmt: skip # noqa: E501
        if t.precision in FP8_RECIPES:  # after the kernels: they leave the block linears alone
            apply_fp8(model, t)
        self.frozen = None  # a reference copy of the starting weights, if the task keeps one
        task.prepare(self, model)
        scope = compile_scope(t, env.device.type, env.world_size)  # "model", "block" or "" (no compile)
        resolved = replace(cfg, train=replace(t, compile_scope=scope)) if scope else cfg
        self.model = parallelize(model, env, resolved)
        self.loss_parallel = contextlib.nullcontext
        if env.tp > 1 and cfg.parallel.loss_parallel:  # forward and backward of the loss on split logits
            self.loss_parallel = loss_parallel
        self.attention = contextlib.nullcontext  # train.sdpa: the one backend PyTorch's attention may use
        if t.sdpa != "auto":
            self.attention = functools.partial(sdpa_kernel, [SDPA[t.sdpa]])
        self.optimizer = build_optimizer(self.model, t, env.device)
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=t.precision == "fp16")
        dtype = AUTOCAST.get(t.precision)
        fsdp_casts = env.distributed and cfg.parallel.data == "fsdp"  # its MixedPrecisionPolicy does it
        self.autocast = torch.autocast(env.device.type, dtype=dtype) if dtype and not fsdp_casts else contextlib.nullcontext()  # fmt: skip # noqa: E501
        self.step_metrics: dict[str, torch.Tensor] = {}  # the task's own, per step (DPO's rewards, ...)
        self.task, self.loader, self.val_loader = task.build(self, model)
        self.compiled_loss = None  # train.compile_scope=model: the task's forward + loss in one graph
        if scope == "model":
            self.compiled_loss = torch.compile(self.task.loss, mode=compile_mode(t.compile_mode))
        self._resume()
        # a finished run resumed again: nothing to train, and nothing in its directory changes
        self.done = self.progress(self.elapsed_before) >= 1.0 and (self.run_dir / "summary.json").is_file()
        if not self.done:
            self._prepare_run_dir()
        resumed_at = self.step if self.resume_from is not None else None
        self.metrics = MetricsLog(self.run_dir, env.is_main and not self.done, t.tensorboard, resumed_at)
        self.dynamics = Dynamics(unwrap(self.model)) if t.log_dynamics else None
        self.dyn_metrics = {}
        # the non-finite guard on the device (run() turns it on; advance() decides on the host):
        # records and first micro-batches of the steps not yet read, a stop-mode latch
        self.deferred, self.pending, self.pending_batches, self.latch = False, [], {}, None
        self.plain_params = not any(hasattr(p, "device_mesh") for p in self.model.parameters())

    def _resume(self) -> None:
        """The counters at the start, or the checkpoint's state on resume."""
        self.step, self.tokens, self.elapsed_before = 0, 0, 0.0
        self.best_val, self.best_step, self.skipped = math.inf, -1, 0
        if self.resume_from is None:
            return
        # the config's peaks win, and this layout's kernels (TP cannot take a 1-process run's foreach)
        keys = ("peak_lr", "foreach", "fused")
        mine = [{k: g[k] for k in keys if k in g} for g in self.optimizer.param_groups]
        meta = load_checkpoint(self.resume_from, self.model, self.optimizer, only=self.adapters)
        for group, kept in zip(self.optimizer.param_groups, mine, strict=True):
            group.update(kept)
        if not {"tokens", "elapsed"} <= meta.keys():
            raise EmberError(f"{self.resume_from}/meta.json lacks tokens or elapsed, which a save writes; "
                             "delete the checkpoint to resume from the one before")  # fmt: skip
        self.step, self.tokens = meta["step"], meta["tokens"]
        self.elapsed_before = meta["elapsed"]
        self.best_val, self.best_step = meta.get("best_val", math.inf), meta.get("best_step", -1)
        self.skipped = meta.get("skipped", 0)
        if meta.get("scaler"):
            self.scaler.load_state_dict(meta["scaler"])
        if meta.get("data_cursor"):  # SFT's epoch order (LM batches are a function of the step)
            self.loader.load_state_dict(meta["data_cursor"])
        print0(f"resumed from {self.resume_from} (step {self.step}, {self.tokens:,} tokens)")

    # ------------------------------------------------------------ run directory

    def _resume_folder(self) -> Path | None:
        """The checkpoint to resume from, or None to start afresh; a ConfigError where either
        would mix two histories in one run directory."""
        resume, run_dir = self.cfg.train.resume, self.run_dir
        ckpts = run_dir / "checkpoints"
        newest = latest_checkpoint(ckpts)
        if resume == "never" and newest is not None:
            raise ConfigError(
                f"{run_dir} already holds checkpoints; resume it with train.resume=auto, "
                "or pick another run.name (nothing was overwritten)"
            )
        if resume in ("never", "auto"):
            metrics = run_dir / "metrics.jsonl"
            if newest is None and metrics.is_file() and metrics.stat().st_size:
                raise ConfigError(
                    f"{run_dir} holds the metrics of an earlier run but no committed checkpoint to resume "
                    "from (train.ckpt_every=0 saves one only at the end); delete that folder to start over, "
                    "or pick another run.name (nothing was overwritten)"
                )
            return newest
        folder = Path(resume) if Path(resume).is_dir() else ckpts / resume
        if not folder.is_dir():
            raise ConfigError(
                f"train.resume={resume!r}: no such checkpoint folder (use 'auto' or step-NNNNNN)"
            )
        if (
            newest is not None
            and newest.name > folder.name
            and newest.parent.resolve() == folder.parent.resolve()
        ):
            raise ConfigError(
                f"train.resume={resume!r} is older than {newest.name}; resuming from it would mix two "
                "histories. Move the newer step folders out of checkpoints/ first, or use train.resume=auto"
            )
        return folder

    def _check_resumed_config(self) -> None:
        """Compare the config with the one the checkpoint's run was last started with (its newest
        config-resume-*.yaml, else config.yaml), and the tokenizer with the run's copy."""
        run = self.resume_from.parent.parent
        saved = max(run.glob("config-resume-step-*.yaml"), default=run / "config.yaml")
        if not saved.is_file():
            return  # a checkpoint folder outside its run: nothing to compare with
        old = saved_config(saved)
        new = yaml.safe_load(config_to_yaml(replace(self.cfg, model=self.model_cfg)))
        changed = {
            f"{section}.{k}": (old[section][k], v)
            for section, values in new.items()
            for k, v in values.items()
            if k in old.get(section, {}) and old[section][k] != v
        }
        changed = {k: change for k, change in changed.items() if not k.startswith(RESUME_FREE)}
        sha = self.tokenizer_sha
        if (run / TOKENIZER).is_file() and (run_sha := file_sha256(run / TOKENIZER)) != sha:
            changed["tokenizer sha256"] = (run_sha[:12], sha[:12])
        fixed = [k for k in changed if k.startswith(RESUME_FIXED)]
        if changed and (fixed or not self.cfg.train.resume_allow_changes):
            listing = ", ".join(f"{k} {a!r} → {b!r}" for k, (a, b) in changed.items())
            fix = "pass train.resume_allow_changes=true to resume with these"
            if fixed:
                fix = f"{', '.join(fixed)} cannot change on resume: put them back, or start another run.name"
            raise ConfigError(f"resuming {run} with a config that differs from {saved}: {listing}. {fix}")

    def _prepare_run_dir(self) -> None:
        if not self.env.is_main:
            return
        mark(self.run_dir, "run")  # created, and known as a run to the next writer (ember/atomic.py)
        cfg = replace(self.cfg, model=self.model_cfg)
        name = "config.yaml" if self.resume_from is None else f"config-resume-{self.resume_from.name}.yaml"
        write_text_atomic(self.run_dir / name, config_to_yaml(cfg))  # the first leg's config.yaml is kept
        write_json(self.run_dir / "env.json", _env_record(self.env))
        if self.tokenizer is not None and self.tokenizer_file is None:  # grown by the chat tokens
            self.tokenizer.save(self.run_dir / TOKENIZER)
        elif self.tokenizer is not None:  # (an image task has none)
            shutil.copyfile(self.tokenizer_file, self.run_dir / TOKENIZER)
            self.tokenizer.save_specials(self.run_dir)  # a foreign tokenizer's; none for ember's

    # ------------------------------------------------------------ budget

    def progress(self, elapsed: float, steps_done: int = 0) -> float:
        """Fraction of the budget spent, counting ``steps_done`` more steps: a step's lr is set by
        where the budget stands when that step ends, so the last step of a step or token budget
        runs at the final learning rate."""
        t = self.cfg.train
        fractions = [
            (self.step + steps_done) / t.max_steps if t.max_steps else 0.0,
            (self.tokens + steps_done * t.batch_tokens) / t.max_tokens if t.max_tokens else 0.0,
            elapsed / t.max_time if t.max_time else 0.0,
        ]
        return max(fractions)

    # ------------------------------------------------------------ the loop

    def run(self) -> dict:
        t, env = self.cfg.train, self.env
        if self.done:  # a larger budget needs train.resume_allow_changes=true
            print0(f"{self.run_dir} spent its budget at step {self.step}: nothing to do")
            return read_json(self.run_dir / "summary.json") or {"step": self.step, "tokens": self.tokens}
        print0(
            f"training {self.n_params / 1e6:.2f}M parameters on {env.world_size} × {env.device.type}, "
            f"{t.batch_tokens:,} {self.units[0]}/step ({self.grad_accum} micro-steps of "
            f"{t.micro_batch}×{t.seq_len} per rank) → {self.run_dir}"
        )
        bar = ProgressBar(env.is_main)
        start = time.perf_counter()
        last = {}
        progress = self.progress(self.elapsed_before)
        batches = self.loader.iterate(self.step)  # background prefetch + pinned copies on CUDA
        self.deferred = True  # one host sync per train.log_every steps (_flush)
        comm = {"ddp": "DDP's gradient all-reduce", "fsdp": "FSDP's all-gathers and reduce-scatters"}
        if self.env.pp > 1:
            comm = dict.fromkeys(comm, f"the pipeline's sends and receives ({self.cfg.parallel.pp_schedule})")
        try:
            while progress < 1.0:
                self.watch.at(self.step + 1)
                t0 = time.perf_counter()
                lr = self.set_lr(self.progress(self._elapsed(start), steps_done=1))
                with record_function("ember/data"):
                    _, *batch = next(batches)  # (x, y), or (x, y, doc) for packed SFT
                t1 = time.perf_counter()
                self.watch.phase(f"the forward and backward ({comm[self.cfg.parallel.data]})")
                observe = self.dynamics is not None and (self.step + 1) % t.log_dynamics == 0
                if observe:
                    self.dynamics.begin()
                loss, grad_norm, fwd_bwd_s = self.train_step(batch)
                if observe:
                    self.dyn_metrics = self.dynamics.end()
                t3 = time.perf_counter()
                self.step += 1
                self.tokens += t.batch_tokens
                elapsed = self._elapsed(start)
                progress = self.progress(elapsed)
                final = progress >= 1.0
                evaluate = (t.eval_every and self.step % t.eval_every == 0) or final
                checkpoint = (t.ckpt_every and self.step % t.ckpt_every == 0) or final
                read = evaluate or checkpoint or self.step % t.log_every == 0 or self.step == 1
                times = (t0, t1, t1 + fwd_bwd_s, t3)
                last = self._log(bar, lr, loss, grad_norm, times, elapsed, progress, read)
                if evaluate:
                    self.watch.phase("evaluation")
                    last.update(self._evaluate())
                if checkpoint:
                    self.watch.phase("the checkpoint save")
                    self._checkpoint(elapsed)
        except torch.OutOfMemoryError:
            t = self.cfg.train
            raise EmberError(
                f"out of {env.device.type} memory in {self.watch.where} at step {self.step + 1}, "
                f"micro-batch {t.micro_batch} × {t.seq_len}: `ember plan` with this config and --memory GIB "
                "names the largest micro-batch that fits; set train.micro_batch to it (the step "
                f"keeps train.batch_tokens={t.batch_tokens:,}, in more micro-batches)"
            ) from None
        except Exception as e:
            explained = self.watch.explain(e)
            if explained is None:
                raise
            raise explained from None
        finally:
            self._write_unread()
            self.watch.stop()
            bar.close()
            self.loader.close()
            self.metrics.close()
        self._finish(last)
        return last

    def set_lr(self, progress_after: float) -> float:
        """The learning rates of the coming step, the budget at ``progress_after`` when it ends:
        each group's own peak, one schedule; returns the schedule at ``train.lr``."""
        t = self.cfg.train
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, progress_after, t, peak=group["peak_lr"])
        return lr_at(self.step, progress_after, t)

    def advance(self, batches) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One step outside ``run`` (``ember plan --measure``, ``ember analyze``): the schedule's
        learning rates, the next batch of ``batches`` (``loader.iterate``), ``train_step``."""
        self.set_lr(self.progress(0.0, steps_done=1))
        with record_function("ember/data"):
            _, *batch = next(batches)
        out = self.train_step(batch)
        self.step += 1
        self.tokens += self.cfg.train.batch_tokens
        return out

    def train_step(self, batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step on this rank's rows (x, y, ...: (rows, seq_len)): micro-batches with the
        loss scaled by accumulation, backward, unscale + clip, the non-finite guard agreed across
        ranks, step. Returns the loss (mean over ranks), the gradient norm and the seconds spent
        in forward + backward."""
        t = self.cfg.train
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=self.env.device)
        self.step_metrics = {}
        pipeline = getattr(self.model, "schedule", None) is not None
        forward_loss = self.compiled_loss or self.task.loss
        if pipeline:  # the schedule runs every micro-batch's forward and backward
            with self.autocast:
                loss_sum = self.model.train_step(*batch)
            loss_sum *= self.env.pp  # only the last stage's ranks hold it: the average below is right
        for micro in range(0 if pipeline else self.grad_accum):
            rows = slice(micro * t.micro_batch, (micro + 1) * t.micro_batch)
            with self._sync_grads(micro == self.grad_accum - 1), self.loss_parallel():
                if t.compile_mode == "reduce-overhead":  # the last replay's outputs are done with
                    torch.compiler.cudagraph_mark_step_begin()
                with self.autocast, self.attention(), record_function("ember/forward"):  # (profilers' label)
                    loss, info = forward_loss(self.model, tuple(b[rows] for b in batch))
                    loss = loss / self.grad_accum
                with record_function("ember/backward"):
                    self.scaler.scale(loss).backward()
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # (a replicated DTensor)
            loss_sum += loss.detach()
            for key, value in info.items():
                if isinstance(value, torch.Tensor):
                    share = value.detach().float() / self.grad_accum
                    self.step_metrics[key] = self.step_metrics.get(key, 0) + share
        self.watch.phase("the loss and metrics all-reduces")
        for value in self.step_metrics.values():
            all_reduce(value, "avg")
        fwd_bwd_s = time.perf_counter() - start

        with record_function("ember/optimizer"):
            self.scaler.unscale_(self.optimizer)
            max_norm = t.grad_clip or math.inf
            grad_norm = clip_grad_norm(self.model.parameters(), max_norm, self.model if pipeline else None)
            all_reduce(loss_sum, "avg")
            bad = ~torch.isfinite(loss_sum)
            if not self.scaler.is_enabled():  # under fp16 the scaler skips inf-gradient steps itself
                bad |= ~torch.isfinite(grad_norm)
            self.bad = all_reduce(bad.float(), "max")  # agreed across ranks, on the device
            if self._skips_on_device():
                self._step_on_device(tuple(b[: t.micro_batch] for b in batch))
            elif to_host([self.bad])[0]:
                self._on_nonfinite(tuple(b[: t.micro_batch] for b in batch), self.step + 1)
            else:
                self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm, fwd_bwd_s

    def _log(self, bar, lr, loss, grad_norm, times: tuple, elapsed: float, progress: float, read: bool):
        """The finished step's record, kept with its device scalars until ``read`` (a log, eval or
        checkpoint step, or the last): then every kept record is read in one host sync
        (``_flush``), written to metrics.jsonl, and a line printed every ``train.log_every``
        steps. ``times``: when the step began, its batch came, forward + backward ended, and it
        ended (host clocks: on a GPU the host runs ahead between syncs, so ``tokens_per_s`` and
        ``mfu`` are each window's average, the wait for the device included)."""
        t0, t1, t2, t3 = times
        record = {
            "skipped": self.skipped,
            "step": self.step,
            "tokens": self.tokens,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "step_s": t3 - t0,
            "data_s": t1 - t0,
            "fwd_bwd_s": t2 - t1,
            "opt_s": t3 - t2,
            "elapsed_s": elapsed,
            "peak_mem_mb": peak_memory_mb(self.env.device),
            **self.step_metrics,
            **getattr(self.loader, "metrics", {}),  # GRPO's rollout: rewards, lengths, times
            **self.dyn_metrics,  # train.log_dynamics, on the steps it observes
        }
        if self._skips_on_device():
            record["_bad"] = self.bad
        self.dyn_metrics = {}
        self.pending.append(record)
        return self._flush(bar, lr, progress) if read else record

    def _flush(self, bar, lr: float, progress: float) -> dict:
        """Read the kept records' device scalars at once, act on the non-finite ones (skip: count
        them; stop: raise at the first, whose update and every later one were skipped on the
        device, so the weights are those it started from), write them; the newest one back."""
        t, env = self.cfg.train, self.env
        batches, self.pending_batches, self.latch = self.pending_batches, {}, None
        start = time.perf_counter()
        records = self._read_pending()
        window_s = sum(r["step_s"] for r in records) + time.perf_counter() - start
        for r in records:
            if "_bad" in r:  # guarded on the device: the skip is counted (or the stop raised) here
                if r.pop("_bad"):
                    self._on_nonfinite(batches.get(r["step"]), r["step"])
                r["skipped"] = self.skipped
            r["tokens_per_s"] = t.batch_tokens * len(records) / window_s
            if self.peak_flops:
                r["mfu"] = self.flops_per_token * r["tokens_per_s"] / (self.peak_flops * env.world_size)
            self.metrics.write(r)
        last = records[-1]
        bar.update(progress, f"step {self.step} loss {last['loss']:.3f}")
        if self.step % t.log_every == 0 or self.step == 1:
            eta = last["elapsed_s"] / max(progress, 1e-9) * (1 - progress)
            print0(
                f"step {self.step:6d} | loss {last['loss']:.4f} | lr {lr:.2e} "
                f"| grad {last['grad_norm']:.2f} | "
                f"{last['tokens_per_s']:,.0f} {self.units[1]}/s | "
                f"{100 * progress:5.1f}% | eta {eta:6.0f}s"
            )
        return last

    def _read_pending(self) -> list[dict]:
        """The kept records, their device scalars read in one ``to_host``."""
        records, self.pending = self.pending, []
        values = iter(to_host([v for r in records for v in r.values() if isinstance(v, torch.Tensor)]))
        for r in records:
            r.update({k: next(values) for k, v in r.items() if isinstance(v, torch.Tensor)})
        return records

    def _write_unread(self) -> None:
        """When an exception (an interrupt, a crash) leaves the loop: the records not yet read,
        up to the first non-finite one, so that no finished step goes unrecorded."""
        if not self.pending:
            return
        try:
            records = self._read_pending()
        except Exception:  # the device itself failed: nothing more to read
            return
        for r in records:
            if r.pop("_bad", 0.0) and self.cfg.train.nonfinite == "stop":
                break
            r["tokens_per_s"] = self.cfg.train.batch_tokens / r["step_s"]
            self.metrics.write(r)

    def _elapsed(self, start: float) -> float:
        """Seconds of training so far, including earlier legs; under a time budget on many
        ranks, the slowest rank's clock, so all agree when it is spent (a collective and a host
        sync each step: the learning rate of every step depends on it)."""
        elapsed = self.elapsed_before + time.perf_counter() - start
        if not (self.env.distributed and self.cfg.train.max_time):
            return elapsed
        return all_reduce(torch.tensor(elapsed, device=self.env.device), "max").item()

    def _sync_grads(self, sync: bool):
        """Skip the gradient all-reduce on all but the last micro-step of accumulation."""
        if not sync and hasattr(self.model, "no_sync"):  # DDP
            return self.model.no_sync()
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def _skips_on_device(self) -> bool:
        """Whether this step's non-finite guard acts on the device (``_step_on_device``): in
        ``run`` (``advance`` decides on the host, as its callers read every step anyway), with
        an optimizer that takes ``found_inf`` (fused AdamW, CUDA's default; ember's Muon), plain
        parameters (one device, DDP: a DTensor's optimizer step beside a plain flag is untried
        here) and no fp16 GradScaler (which reads its own found-inf on the host unless the
        optimizer is fused). Otherwise the guard reads one flag a step: free on a CPU, where
        there is no device to wait for; a sync on a GPU under FSDP2, TP or fp16."""
        fused = any(g.get("fused") for g in self.optimizer.param_groups)
        takes_found_inf = fused or hasattr(self.optimizer, "ns_dtype")  # (ember's Muon)
        return self.deferred and takes_found_inf and self.plain_params and not self.scaler.is_enabled()

    def _step_on_device(self, batch: tuple) -> None:
        """The optimizer step, skipped on the device where ``self.bad``: skip mode skips that
        step; stop mode latches, skipping it and every step after it until ``_flush`` reads the
        flags and raises, with the weights the bad step started from and its micro-batch kept."""
        found = self.bad
        if self.cfg.train.nonfinite == "stop":
            self.latch = found = found if self.latch is None else torch.maximum(self.latch, found)
            self.pending_batches[self.step + 1] = batch
        self.optimizer.found_inf = found
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf

    def _on_nonfinite(self, batch: tuple, step: int) -> None:
        """Skip the update (the step still counts: the data moves on), or stop naming the culprit."""
        if self.cfg.train.nonfinite == "skip":
            self.skipped += 1
            print0(f"step {step}: non-finite loss or gradient norm; update skipped ({self.skipped} so far)")
            return
        module = "not located under pipeline parallel"
        if getattr(self.model, "schedule", None) is None:
            contexts = (self.autocast, self.attention, self.loss_parallel)
            try:  # the rerun is eager: at a compiled step's micro-batch it may not fit
                module = _find_nonfinite_module(self.model, self.task, batch, *contexts)
            except torch.OutOfMemoryError:
                module = "not located (the eager rerun that looks for it ran out of memory)"
        raise NonFiniteError(
            f"step {step}: loss or gradient norm is not finite; first non-finite output: {module}. "
            "Lower train.lr, set train.grad_clip, or pass train.nonfinite=skip. With the statistics of what "
            f"came before it: `ember analyze {self.run_dir} nonfinite --step {step}`"
        )

    def _evaluate(self) -> dict:
        result = self.task.validate(self)
        if result:
            self.metrics.write({"step": self.step, "tokens": self.tokens, **result})
        if result.get(self.task.best, math.inf) < self.best_val:
            self.best_val, self.best_step = result[self.task.best], self.step
            if self.cfg.train.keep_best:
                self._export("model-best")
        return result

    def _checkpoint(self, elapsed: float) -> None:
        meta = {
            "tokens": self.tokens,
            "elapsed": elapsed,
            "best_val": self.best_val,
            "best_step": self.best_step,
            "skipped": self.skipped,
            "world_size": self.env.world_size,
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "data_cursor": self.loader.state_dict() if hasattr(self.loader, "state_dict") else None,
        }
        keep = (self.best_step,) if self.cfg.train.keep_best and self.best_step >= 0 else ()
        save_checkpoint(
            self.run_dir / "checkpoints",
            self.step,
            self.model,
            self.optimizer,
            meta,
            keep_last=self.cfg.train.keep_last,
            keep_steps=keep,
            only=self.adapters,
        )

    def _write_report(self) -> None:
        try:
            print0(f"report: {write_report([self.run_dir])}")
        except EmberError as e:  # e.g. matplotlib not installed: the run itself is complete
            print0(f"ember: note: no report written ({e})")

    def _export(self, name: str) -> None:
        model = self.model
        if self.adapters is not None:  # a plain model for every later verb: the adapters merged in
            # the chat tokens' rows go as PEFT's trainable tokens; a grown vocabulary does not fit
            # the source run's model, which adapter/ is for
            rows = list(chat_ids(self.tokenizer).values()) if "tok_embeddings.weight" in self.adapters else []
            grown = self.tokenizer_file is None  # _chat_tokenizer added the chat tokens
            if name == "model" and self.env.is_main and not grown:
                try:
                    src = str(self.cfg.train.init_from)
                    save_peft(unwrap(self.model), self.run_dir / "adapter", src, token_rows=rows)
                except EmberError as e:  # a layout transformers has no class for
                    print0(f"ember: note: no PEFT adapter/ written ({e})")
            model = merge_lora(copy.deepcopy(unwrap(self.model)))
        export_weights(
            model,
            self.run_dir / name,
            asdict(self.model_cfg),
            {
                file: self.run_dir / file  # as _prepare_run_dir wrote them
                for file in (TOKENIZER, SPECIALS_FILE)
                if self.tokenizer is not None and (file == TOKENIZER or self.tokenizer.specials is not None)
            },
        )

    def _finish(self, last: dict) -> None:
        self._export("model")
        if self.env.is_main:
            summary = {
                **last,
                f"best_{self.task.best}": self.best_val if math.isfinite(self.best_val) else None,
                "best_step": self.best_step,
                "skipped_steps": self.skipped,
                "n_params": self.n_params,
            }
            write_json(self.run_dir / "summary.json", summary)
            if self.cfg.train.report:  # (matplotlib's import and the plots: most of a tiny run's end)
                self._write_report()
        done = f"done: step {self.step}, {self.tokens:,} {self.units[0]}"
        print0(f"{done}; weights in {self.run_dir / 'model'}")


@contextlib.contextmanager
def scratch_trainer(cfg, **train_changes):
    """A Trainer for ``cfg`` in a temporary run directory, no evaluation or checkpoints (and
    ``train_changes``), closed after: what ``ember plan --measure`` and ``ember analyze`` run
    their steps on. Stepping it is the caller's: ``set_lr``, a batch, ``train_step``."""
    with tempfile.TemporaryDirectory(prefix="ember-scratch-") as tmp:
        t = replace(cfg.train, **{"eval_every": 0, "ckpt_every": 0, **train_changes})
        trainer = Trainer(replace(cfg, run=replace(cfg.run, out_dir=tmp, name="scratch"), train=t))
        try:
            yield trainer
        finally:
            trainer.loader.close()
            trainer.watch.stop()
            trainer.metrics.close()


def train(cfg, run_dir: Path | None = None) -> dict:
    """Build a Trainer for ``cfg``, run it, and leave the process group."""
    try:
        result = Trainer(cfg, run_dir).run()
        barrier()  # every rank is past its last collective before any tears the process group down
        return result
    finally:
        destroy_distributed()
