"""The single-GPU training levers of issue 29, checked on the CPU against the plain path.

- host syncs: ``Trainer.run`` reads the device once per ``train.log_every`` steps
  (``trainer.to_host``), with the non-finite guard acting on the device, and trains the same
  bits as the guard read on the host every step;
- Muon's Newton–Schulz batched across same-shape matrices equals the per-matrix chain;
- ``train.precision=fp8`` is refused before any work where it cannot run (here: a CPU);
- ``train.compile_scope=model`` (one graph of forward and loss) and ``train.sdpa`` (one
  attention backend) train the losses of the plain path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import ember.train.trainer as trainer_module
from ember.config import load_config
from ember.errors import ConfigError
from ember.run import read_metrics
from ember.train.layout import check_layout, compile_scope
from ember.train.optim import Muon, orthogonalize
from ember.train.start import check_fp8, fp8_filter
from ember.train.trainer import NonFiniteError, Trainer

LEVERS = ("train.max_steps=6", "train.log_every=3", "train.eval_every=0", "train.deterministic=true")
LEVERS += ("train.schedule=constant", "train.eval_windows=1")


def _fused_adamw(trainer):
    """CUDA's default optimizer (fused AdamW, which takes ``found_inf``), built on the CPU."""
    groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in trainer.optimizer.param_groups]  # fmt: skip # noqa: E501
    trainer.optimizer = torch.optim.AdamW(groups, fused=True)


OPTIMIZERS = {"muon": ("train.optimizer=muon",), "adamw-fused": ()}


def _train(
    tiny_cfg, optimizer, *overrides, host_guard=False, counts=None, flaky_call=None, name="", out=None
):
    trainer = Trainer(tiny_cfg(*LEVERS, *OPTIMIZERS[optimizer], f"run.name={name}", *overrides))
    if optimizer == "adamw-fused":
        _fused_adamw(trainer)
    trainer._write_report = lambda: None  # (seconds of plotting, beside the point here)
    if host_guard:  # the guard as before: one flag read on the host every step
        trainer._skips_on_device = lambda: False
    if flaky_call is not None:
        real, calls = trainer.task.loss, {"n": 0}

        def flaky(model, batch):
            calls["n"] += 1
            loss, m = real(model, batch)
            return (loss * float("inf") if calls["n"] == flaky_call else loss), m

        trainer.task.loss = flaky
    if out is not None:
        out.append(trainer)
    if counts is not None:
        _count_syncs(counts)
    try:
        trainer.run()
    finally:
        _count_syncs(None)
    return trainer


_REAL = {}


def _count_syncs(counts):
    """Count ``to_host`` calls, and every other read of a tensor's value made from trainer.py
    (``.item()``, ``.tolist()``, ``float()``, ``bool()``, ``.cpu()``) outside it: there must be none."""
    names = ("item", "tolist", "__float__", "__bool__", "cpu")
    if counts is None:
        for n, f in _REAL.items():
            setattr(torch.Tensor, n, f)
        trainer_module.to_host = _REAL.pop("to_host", trainer_module.to_host)
        _REAL.clear()
        return
    _REAL.update({n: getattr(torch.Tensor, n) for n in names})
    _REAL["to_host"] = real_to_host = trainer_module.to_host

    def to_host(values):
        counts["to_host"] += 1
        return real_to_host(values)

    def wrap(n):
        def read(self, *a, **k):
            frame = sys._getframe(1)
            if frame.f_code.co_filename == trainer_module.__file__ and frame.f_code.co_name != "to_host":
                counts["stray"].append(f"{n} in {frame.f_code.co_name}:{frame.f_lineno}")
            return _REAL[n](self, *a, **k)

        return read

    for n in names:
        setattr(torch.Tensor, n, wrap(n))
    trainer_module.to_host = to_host


def _steps(trainer):
    return [r for r in read_metrics(trainer.run_dir) if "loss" in r]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_one_host_sync_per_log_every_and_the_same_bits(tiny_cfg, optimizer):
    counts = {"to_host": 0, "stray": []}
    device = _train(tiny_cfg, optimizer, counts=counts, name="device")
    assert counts["stray"] == []
    assert counts["to_host"] == 3  # steps 1, 3 and 6 (log_every=3; the first is always shown)
    host_counts = {"to_host": 0, "stray": []}
    host = _train(tiny_cfg, optimizer, host_guard=True, counts=host_counts, name="host")
    assert host_counts["to_host"] == 6 + 3  # the instrument sees the old path's per-step reads
    a, b = _steps(device), _steps(host)
    assert [r["step"] for r in a] == list(range(1, 7))
    for key in ("loss", "grad_norm", "lr", "skipped"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    for (name, p), q in zip(device.model.state_dict().items(), host.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_skip_on_the_device(tiny_cfg, optimizer):
    """Step 2's loss is inf (its first micro-batch's, the 3rd call): skipped on the device,
    counted when read (step 3), the record of step 2 says so, and the losses before and after
    agree with the host guard's run."""
    skip = ("train.nonfinite=skip",)
    device = _train(tiny_cfg, optimizer, *skip, flaky_call=3, name="device")
    host = _train(tiny_cfg, optimizer, *skip, flaky_call=3, host_guard=True, name="host")
    assert device.skipped == host.skipped == 1
    a, b = _steps(device), _steps(host)
    assert [r["skipped"] for r in a] == [r["skipped"] for r in b] == [0] + [1] * 5
    assert [r["loss"] for r in a][:3] == [r["loss"] for r in b][:3]  # step 2's update left nothing behind
    if optimizer == "adamw-fused":  # fused AdamW also takes the skipped step off its count: exact
        assert [r["loss"] for r in a] == [r["loss"] for r in b]
    else:  # Muon's AdamW part counts the skipped step in its bias correction (optim.Muon.step)
        after = [r["loss"] for r in a[3:]], [r["loss"] for r in b[3:]]  # steps 4-6
        assert after[0] == pytest.approx(after[1], rel=1e-2) and after[0] != after[1]


def test_stop_on_the_device_keeps_the_weights_the_bad_step_started_from(tiny_cfg):
    """Step 2 is bad, read at step 3: the error names step 2, the records stop at step 1, and the
    weights are those of a 1-step run (steps 2 and 3 were skipped on the device)."""
    raised = []
    with pytest.raises(NonFiniteError, match=r"step 2: loss or gradient norm is not finite"):
        _train(tiny_cfg, "muon", flaky_call=3, name="device", out=raised)
    two = _train(tiny_cfg, "muon", "train.max_steps=1", name="one")
    assert [r["step"] for r in _steps(raised[0])] == [1]
    assert [r["loss"] for r in _steps(raised[0])] == [r["loss"] for r in _steps(two)]
    for (name, p), q in zip(
        raised[0].model.state_dict().items(), two.model.state_dict().values(), strict=True
    ):
        assert torch.equal(p, q), name


def test_batched_newton_schulz_equals_per_matrix():
    """CUDA's road (``batched``: same-shape matrices as one stack, the AdamW group in torch's fused
    kernel) against the CPU's per-parameter road, on the CPU: the same update within fp32 rounding,
    a skipped step leaves everything as it was, and the batched step's launches do not grow with
    the number of matrices."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n = getattr(self, "n", 0) + (not func.is_view)  # a launch on a GPU (a view is none)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    shapes = [(64, 96), (64, 96), (96, 64), (96, 64), (96, 64), (32, 32), (48, 80)]
    stack = torch.randn(3, 96, 64)
    torch.testing.assert_close(orthogonalize(stack), torch.stack([orthogonalize(g) for g in stack]), rtol=0, atol=1e-5)  # fmt: skip # noqa: E501

    def model(n: int):  # n copies of the shapes, and vectors for the AdamW group
        mats = [torch.nn.Parameter(torch.randn(s)) for s in shapes * n]
        vecs = [torch.nn.Parameter(torch.randn(s[0])) for s in shapes * n]
        return mats, vecs

    def step(mats, vecs, batched, found=None, steps=2):
        opt = Muon([{"params": mats}, {"params": vecs, "use_muon": False}], lr=0.02, batched=batched)
        for _ in range(steps):
            for p in mats + vecs:
                p.grad = p.detach().sin()
            if found is not None:
                opt.found_inf = found
            with (count := Count()):
                opt.step()
        return count.n  # the last step's (the first also makes the state)

    (a, av), (b, bv) = model(1), model(1)
    for p, q in zip(a + av, b + bv, strict=True):
        q.data.copy_(p)
    step(a, av, batched=True)
    step(b, bv, batched=False)
    for p, q in zip(a + av, b + bv, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    (c, cv) = model(1)
    before = [p.detach().clone() for p in c + cv]
    step(c, cv, batched=True, found=torch.ones(()))
    assert all(torch.equal(p, q) for p, q in zip(c + cv, before, strict=True))  # skipped, on the device
    two, four, per_param = step(*model(2), True), step(*model(4), True), step(*model(4), False)
    assert four == two < per_param / 4, (two, four, per_param)


def test_fp8_is_refused_before_any_work(tiny_cfg, monkeypatch):
    cfg = tiny_cfg("train.precision=fp8", "train.max_steps=2")
    assert cfg.train.precision == "fp8"
    assert tiny_cfg("train.precision=fp8-rowwise").train.precision == "fp8-rowwise"
    with pytest.raises(ConfigError, match=r"train.precision=fp8.*CUDA GPU.*cpu"):
        Trainer(cfg)
    assert not (Path(cfg.run.out_dir) / cfg.run.name).exists()  # refused before the run directory
    with pytest.raises(ConfigError, match="compute capability 8.9"):
        check_fp8(cfg.train, torch.device("cuda"), capability=(8, 0))
    with pytest.raises(ConfigError, match="not with FSDP, train.qat"):
        qat = tiny_cfg("train.precision=fp8", "train.qat=int8-weight").train
        check_fp8(qat, torch.device("cuda"), ("FSDP",), (9, 0))
    with pytest.raises(ConfigError, match=r"3 × 30 tokens: make train.seq_len \(or train.micro_batch\)"):
        check_fp8(tiny_cfg("train.precision=fp8", "train.micro_batch=3", "train.seq_len=30").train,
                  torch.device("cuda"), capability=(9, 0))  # fmt: skip
    monkeypatch.setitem(sys.modules, "torchao", None)  # not installed
    with pytest.raises(ConfigError, match=r"pip install 'ember\[quant\]'"):
        check_fp8(cfg.train, torch.device("cuda"), capability=(9, 0))
    check_fp8(tiny_cfg().train, torch.device("cpu"))  # the other precisions pass untouched
    with pytest.raises(ConfigError, match=r"fp8_linears=mlp .* trains in fp32: set train.precision=fp8"):
        check_fp8(tiny_cfg("train.fp8_linears=mlp").train, torch.device("cpu"))
    with pytest.raises(ConfigError, match="not with train.kernels=triton's fused head"):
        fused = tiny_cfg("train.precision=fp8", "train.fp8_linears=all", "train.kernels=triton").train
        check_fp8(fused, torch.device("cuda"), capability=(9, 0))


def test_fp8_converts_only_block_linears():
    from dataclasses import replace

    from ember.model.gpt import GPT

    model = GPT.build(replace(load_config("tiny").model, vocab_size=512), device="cpu")
    chosen = {name for name, m in model.named_modules() if fp8_filter(m, name)}
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert chosen and chosen < linears
    assert all(name.startswith("layers.") for name in chosen)  # not the head by default
    mlp = {name for name, m in model.named_modules() if fp8_filter(m, name, "mlp")}
    assert mlp == {name for name in chosen if ".mlp." in name} and len(mlp) == 3 * len(model.layers)  # SwiGLU
    assert {name for name, m in model.named_modules() if fp8_filter(m, name, "all")} == chosen | {"output"}


def test_fp8_training_follows_bf16_through_torchao(tiny_cfg, monkeypatch):
    """The fp8 path itself, on a CPU: PyTorch emulates float8 matmuls there (slowly), so with the
    CUDA check lifted the trainer converts the block linears to torchao's Float8Linear (names and
    checkpoint keys unchanged) and trains; each recipe's losses over 6 steps stay within 2% of
    bf16's on the same seed (the GPU's bar is 1% after 300 steps: benchmarks/gpu.sh train)."""
    pytest.importorskip("torchao.float8", reason="torchao is the fp8 path: pip install 'ember[quant]'")
    from torchao.float8.float8_linear import Float8Linear

    monkeypatch.setattr(trainer_module, "check_fp8", lambda *a, **k: None)
    bf16 = _losses(_train(tiny_cfg, "adamw-fused", "train.precision=bf16", name="bf16"))
    for recipe in ("fp8", "fp8-rowwise"):
        run = _train(tiny_cfg, "adamw-fused", f"train.precision={recipe}", name=recipe)
        converted = {n for n, m in run.model.named_modules() if isinstance(m, Float8Linear)}
        assert converted == {n for n, m in run.model.named_modules() if fp8_filter(m, n)}, recipe
        assert run.model.state_dict().keys() == Trainer(tiny_cfg("run.name=plain")).model.state_dict().keys()
        assert _losses(run) == pytest.approx(bf16, rel=2e-2), recipe
        assert _losses(run) != bf16  # the float8 casts did happen
    run = _train(tiny_cfg, "adamw-fused", "train.precision=fp8", "train.fp8_linears=all", name="fp8-all")
    assert isinstance(run.model.output, Float8Linear)
    assert run.model.output.weight is run.model.tok_embeddings.weight  # the tie holds through training
    assert _losses(run) == pytest.approx(bf16, rel=2e-2)


def _losses(trainer) -> list[float]:
    return [r["loss"] for r in _steps(trainer)]


@pytest.mark.slow
def test_whole_step_compile_matches_eager(tiny_cfg):
    """``train.compile_scope=model``: the task's forward and loss in one dynamo graph (no break,
    no compiled blocks), losses within 1e-4 of eager; ``compile_mode=reduce-overhead`` takes the
    same path (its CUDA graphs are inductor's to skip on a CPU), with one micro-batch a step.
    Refused: on two ranks, for a task whose loss reads the host, and reduce-overhead with
    accumulation (a replay would overwrite the gradients of the micro-batch before)."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch._dynamo.utils import counters

    one = "train.micro_batch=8"  # tiny's 256 tokens a step: 8 rows of 32
    eager = _train(tiny_cfg, "adamw-fused", one, name="eager")
    torch._dynamo.reset()
    counters.clear()
    whole = ("train.compile=true", "train.compile_scope=model", "train.compile_mode=reduce-overhead")
    compiled = _train(tiny_cfg, "adamw-fused", *whole, one, name="whole")
    assert not any(isinstance(b, OptimizedModule) for b in compiled.model.layers.values())
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)
    assert _losses(compiled) == pytest.approx(_losses(eager), rel=1e-4)
    with pytest.raises(ConfigError, match="compile_scope=model compiles the whole step on one device"):
        check_layout(tiny_cfg(*whole, one), world_size=2)
    with pytest.raises(ConfigError, match="train.task=mlm's reads values on the host"):
        mlm = ("train.task=mlm", "model.causal=false", "model.head=mlm")
        check_layout(tiny_cfg(*whole[:2], *mlm), world_size=1)
    # the fix it names fits the device: one micro-batch a step (its rows kept), not a step's rows at once
    with pytest.raises(ConfigError, match=r"with 2 micro-batches a step they would be lost; make a step one "
                       r"micro-batch, train\.batch_tokens=128 \(4 rows\)"):  # fmt: skip
        check_layout(tiny_cfg(*whole), world_size=1)
    check_layout(tiny_cfg(*whole, "train.batch_tokens=128"), world_size=1)
    check_layout(tiny_cfg(*whole[:2]), world_size=1)  # accumulation is fine without CUDA graphs


@pytest.mark.parametrize(
    "overrides, device, ranks, scope",
    [
        ((), "cuda", 1, "model"),  # the H200's +24%: the default on one GPU
        ((), "cpu", 1, "block"),  # a CPU: the whole graph's longer compile buys nothing there
        ((), "cuda", 2, "block"),  # ranks: each block
        (("train.activation_checkpointing=true",), "cuda", 1, "block"),
        (("train.task=mlm", "model.causal=false", "model.head=mlm"), "cuda", 1, "block"),  # a host read
        (("train.compile_scope=block",), "cuda", 1, "block"),
        (("train.compile_scope=model",), "cpu", 1, "model"),
        (("train.compile=false",), "cuda", 1, ""),
    ],
)
def test_compile_scope_auto_compiles_the_whole_step_on_one_gpu(tiny_cfg, overrides, device, ranks, scope):
    """``train.compile_scope=auto`` (the default) resolved: the task's forward and loss in one
    graph on one CUDA device when its loss traces whole, each block everywhere else."""
    assert compile_scope(tiny_cfg("train.compile=true", *overrides).train, device, ranks) == scope


def test_sdpa_backend_is_chosen_and_refused_where_it_cannot_run(tiny_cfg):
    """``train.sdpa``: math and flash (PyTorch has both on a CPU) train the same losses as auto
    within 1e-5 in fp32; in a step's forward the math backend alone is enabled, and the
    evaluation's forwards keep every backend; cudnn and efficient are CUDA's, refused before
    any work, as is any choice beside ember's own kernels."""
    seen = {True: [], False: []}  # grad enabled (a training step) or not (the evaluation at the end)
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **k):
        b = torch.backends.cuda
        others = (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled())
        seen[torch.is_grad_enabled()].append((b.math_sdp_enabled(), *others))
        return real(*a, **k)

    auto = _losses(_train(tiny_cfg, "adamw-fused", name="auto"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        math_losses = _losses(_train(tiny_cfg, "adamw-fused", "train.sdpa=math", name="math"))
    assert seen[True] and set(seen[True]) == {(True, False, False, False)}, set(seen[True])
    assert seen[False] and set(seen[False]) == {(True, True, True, True)}, set(seen[False])
    assert math_losses == pytest.approx(auto, rel=1e-5)
    flash = _losses(_train(tiny_cfg, "adamw-fused", "train.sdpa=flash", name="flash"))
    assert flash == pytest.approx(auto, rel=1e-5)
    for bad in ("train.sdpa=cudnn", "train.sdpa=efficient"):
        with pytest.raises(ConfigError, match=r"train.sdpa=\w+ picks a backend of PyTorch's attention: CUDA"):
            Trainer(tiny_cfg(bad, "run.name=refused"))
    with pytest.raises(ConfigError, match="train.kernels=torch only"):
        Trainer(tiny_cfg("train.sdpa=math", "train.kernels=triton", "run.name=refused"))
    assert not (Path(tiny_cfg().run.out_dir) / "refused").exists()
