"""`ember analyze`: each instrument against a slow exact computation on a tiny model: Lanczos'
top eigenvalues against the eigenvalues of the dense Hessian (a 300-parameter model, float64),
Hutchinson's trace against the dense trace; per-example gradients against a loop of backward
passes, their norms, the noise scale written out, influence dot products; the CLI on a run,
the memory timeline agreeing with the tracker's peak."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from ember.analysis import curvature, grads
from ember.cli import main
from ember.config import ModelConfig
from ember.errors import EmberError
from ember.model.gpt import GPT
from ember.train.trainer import train
from tests.test_trainer import DET, _child_env

SMALL = dict(vocab_size=8, n_layer=1, n_head=2, d_model=4, max_seq_len=8, init_std=0.5)


def _small(**layout):
    model = GPT.build(ModelConfig(**SMALL, **layout), seed=0).set_attention("reference").double()
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, SMALL["vocab_size"], (4, 7), generator=gen)
    return model, idx[:, :-1], idx[:, 1:]


def _dense_hessian(model, x, y) -> torch.Tensor:
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(flat):
        parts = torch.split(flat, [s.numel() for s in shapes])
        params = {n: t.view(s) for n, t, s in zip(names, parts, shapes, strict=True)}
        return F.cross_entropy(functional_call(model, params, (x,)).flatten(0, 1), y.flatten())

    return torch.autograd.functional.hessian(loss, flat)


LLAMA = {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "mlp_hidden": 12, "tie_embeddings": False}


@pytest.mark.parametrize("layout", [{}, LLAMA], ids=["gpt2", "llama"])
def test_lanczos_and_hutchinson_equal_the_dense_hessian(layout):
    model, x, y = _small(**layout)
    op = curvature.HessianOperator(model, x, y)
    assert 100 <= op.n <= 400  # a few hundred parameters: the dense Hessian is cheap
    dense = torch.linalg.eigvalsh(_dense_hessian(model, x, y)).flip(0)
    top = curvature.lanczos(op, k=3, iters=40)
    assert torch.allclose(torch.tensor(top, dtype=torch.float64), dense[:3], atol=1e-4), (top, dense[:3])
    exact = torch.linalg.eigvalsh(_dense_hessian(model, x, y)).sum().item()  # the trace
    trace, stderr = curvature.hutchinson(op, samples=400)
    assert abs(trace - exact) <= 4 * stderr, (trace, stderr, exact)
    hv = op(torch.ones(op.n, dtype=torch.float64))  # one product, against the dense matrix (the
    ones = torch.ones(op.n, dtype=torch.float64)  # model's logits are fp32 by design: ~1e-8)
    assert torch.allclose(hv, _dense_hessian(model, x, y) @ ones, atol=1e-6)


def test_per_example_gradients_norms_noise_scale_and_influence_equal_a_loop():
    model, x, y = _small()
    g = grads.per_example_grads(model, x, y)
    loop = []
    for i in range(x.size(0)):
        loop.append(grads.flat_grad(model, x[i : i + 1], y[i : i + 1]))
    loop = torch.stack(loop)  # (B, n)
    flat = torch.cat([t.flatten(1) for t in g.values()], dim=1)
    assert torch.allclose(flat, loop, atol=1e-7)
    norms = grads.grad_norms(g)
    assert torch.allclose(torch.tensor(norms["total"], dtype=torch.float64), loop.norm(dim=1))
    emb = [n for n in g if n.startswith("tok_embeddings")][0]
    assert torch.allclose(
        torch.tensor(norms["layers"]["tok_embeddings"], dtype=torch.float64), g[emb].flatten(1).norm(dim=1)
    )
    # the noise scale written out: tr(Σ) from the deviations, |G|² less its bias tr(Σ)/B
    B, mean = loop.size(0), loop.mean(0)
    trace = sum(((row - mean) ** 2).sum().item() for row in loop) / (B - 1)
    scale = grads.noise_scale(g)
    assert scale["trace_sigma"] == pytest.approx(trace, rel=1e-9)
    assert scale["b_simple"] == pytest.approx(trace / (mean.pow(2).sum().item() - trace / B), rel=1e-9)
    # influence: a text's gradient dotted with each window's, as the instrument ranks them
    target = grads.flat_grad(model, x[:1, :3], y[:1, :3])
    assert torch.allclose(flat @ target, torch.stack([row @ target for row in loop]), atol=1e-7)


def test_cli_writes_results_for_every_checkpoint(tiny_cfg, tmp_path, capsys):
    """``ember analyze`` in-process (``ember.cli.main``; the failing case at the end runs
    ``python -m ember`` itself): a torch import per instrument was most of the test's cost."""
    cfg = tiny_cfg(*DET, "train.max_steps=4", "train.ckpt_every=2", "train.eval_every=0",
                   f"run.out_dir={tmp_path}", "run.name=r")  # fmt: skip
    train(cfg)
    run = tmp_path / "r"
    for args in (["grads", "--batch", "4", "--text", "def main():", "--top", "2"], ["hessian", "--batch", "2", "--iters", "8"]):  # fmt: skip # noqa: E501
        assert main(["analyze", str(run), *args, "--ckpt", "all"]) == 0
        results = json.loads((run / "analysis" / args[0] / "results.json").read_text())
        assert [row["step"] for row in results["rows"]] == [2, 4] and results["seconds"] > 0
    assert (run / "analysis" / "hessian" / "sharpness.png").is_file()
    assert len(results["rows"][0]["eigenvalues"]) == 3 and results["rows"][0]["two_over_lr"] > 0
    assert main(["analyze", str(run), "memory"]) == 0
    memory = json.loads((run / "analysis" / "memory" / "results.json").read_text())
    line = memory["timeline"]
    assert memory["every"] == 1 and len(line["params"]) == memory["operations"] > 100
    totals = [sum(parts) for parts in zip(*line.values(), strict=True)]
    assert max(totals) == memory["peak"]  # the timeline and the tracker's peak agree, byte for byte
    assert max(line["grads"]) == memory["grads"] == memory["params"]  # gradients grow to the weights' size
    assert (run / "analysis" / "memory" / "memory.png").is_file()
    capsys.readouterr()
    assert main(["analyze", str(run), "lens", "--text", "def main(): return 0"]) == 0
    assert "block 1" in capsys.readouterr().out
    lens = json.loads((run / "analysis" / "lens" / "results.json").read_text())
    assert [row["layer"] for row in lens["layers"]] == ["embedding", "block 0", "block 1"]
    assert lens["layers"][-1]["agrees_with_final"] == 1.0
    assert main(["analyze", str(run), "profile", "--steps", "2"]) == 0
    prof = json.loads((run / "analysis" / "profile" / "results.json").read_text())
    trace = json.loads((run / "analysis" / "profile" / "trace.json").read_text())
    assert any(e.get("name") == "ember/backward" for e in trace["traceEvents"])
    split = prof["split_s"]
    assert min(split["forward"], split["backward"], split["optimizer"]) > 0 and split["communication"] == 0
    phases = split["data"] + split["forward"] + split["backward"] + split["optimizer"]
    assert 0.6 * prof["step_s"] <= phases <= 1.01 * prof["step_s"]  # the labelled phases are the step
    model = GPT.build(ModelConfig(**json.loads((run / "model" / "model_config.json").read_text())))
    assert prof["flops_per_step"] == model.flops_per_token(cfg.train.seq_len) * cfg.train.batch_tokens
    assert prof["achieved_flops"] == pytest.approx(prof["flops_per_step"] / prof["step_s"])
    assert prof["top_ops"][0]["self_ms"] >= prof["top_ops"][-1]["self_ms"] > 0
    assert (run / "analysis" / "grads" / "noise-scale.png").is_file()
    from ember.report.report import write_report

    report = write_report([run]).read_text()
    section = report.split("## Instruments (`ember analyze`)")[1]
    for name in ("profile", "grads", "hessian", "memory", "lens"):
        assert f"**{name}**" in section
    assert "(analysis/hessian/sharpness.png)" in section
    bad = subprocess.run([sys.executable, "-m", "ember", "analyze", str(tmp_path / "nope"), "grads"],
                         env=_child_env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr


def _nan_at(module_name: str, backward: bool):
    """A fault for the replayed step: NaN in the output of ``module_name`` (forward), or infinity
    in the gradient arriving there (backward)."""

    def inject(trainer):
        module = trainer.model.get_submodule(module_name)

        def hook(mod, args, out):
            if backward:
                out.register_hook(lambda g: g + float("inf"))
                return out
            out = out.clone()
            out[0, 0, 0] = float("nan")
            return out

        module.register_forward_hook(hook)

    return inject


def test_nonfinite_names_the_module_where_a_step_first_goes_wrong(tiny_cfg, tmp_path):
    from ember.analysis.replay import nonfinite

    cfg = tiny_cfg(*DET, "train.max_steps=4", "train.ckpt_every=2", "train.eval_every=0",
                   f"run.out_dir={tmp_path}", "run.name=r")  # fmt: skip
    train(cfg)
    run = tmp_path / "r"
    clean = nonfinite(run, 3)
    assert clean["from"] == "step-000002" and clean["first_nonfinite"] is None
    first = nonfinite(run, 3, inject=_nan_at("layers.0.attention.wo", backward=False))["first_nonfinite"]
    assert (first["phase"], first["name"]) == ("forward", "layers.0.attention.wo")
    assert first["tensor"]["nonfinite"] == 1 and first["before"]["nonfinite"] == 0  # its input was fine
    first = nonfinite(run, 3, inject=_nan_at("layers.1.mlp", backward=True))["first_nonfinite"]
    assert (first["phase"], first["name"]) == ("backward", "layers.1.mlp")
    assert (run / "analysis" / "nonfinite" / "results.json").is_file()


def test_determinism_finds_no_difference_or_the_first_one(tiny_cfg):
    import math

    from ember.analysis.replay import _same_bits, determinism

    cfg = tiny_cfg(*DET, "train.max_steps=2")
    same = determinism(cfg, steps=2)
    assert same["identical"] and same["tensors_compared"] > 300

    def perturb(trainer):  # the second run's MLP output in layer 1 moves by 1e-6
        trainer.model.get_submodule("layers.1.mlp").register_forward_hook(lambda m, a, out: out + 1e-6)

    nan = torch.tensor([1.0, math.nan])
    assert _same_bits(nan, nan.clone()) and not torch.equal(nan, nan.clone())  # skipped steps: no difference
    assert not _same_bits(nan, torch.tensor([1.0 + 1e-7, math.nan]))
    differ = determinism(cfg, steps=2, perturb=perturb)
    assert not differ["identical"] and differ["step"] == 1
    assert (differ["phase"], differ["name"]) == ("forward", "layers.1.mlp")
    assert differ["max_difference"] == pytest.approx(1e-6, rel=0.1)


@pytest.mark.slow
def test_determinism_across_world_sizes(tiny_cfg):
    """One process against two ranks (gloo), micro-batches of 4 rows: each micro-batch's forward
    is the same computation on the same rows at either world size. With two micro-batches a step
    the averaged gradient is g0/2 + g1/2 either way (halving is exact), and the clipping norm is
    taken row by row, which FSDP2's row shards do not change: identical, under FSDP2. With four
    (DDP), one process adds the quarters in sequence, ((g0 + g1) + g2) + g3, and two ranks as
    (g0 + g1) + (g2 + g3): the runs part first at step 1's averaged gradient, by rounding."""
    from ember.analysis.replay import determinism
    from ember.train.recorder import Recorder

    cfg = tiny_cfg(*DET, "train.micro_batch=4", "train.seq_len=32")
    model = GPT.build(replace(cfg.model, vocab_size=512), seed=0)
    with Recorder(model, keep=True, backward=False) as rec:  # the module outputs of one forward
        model(torch.zeros(4, 32, dtype=torch.long))
    outputs, params = len(rec.events), len(list(model.parameters()))
    two_micro = replace(cfg.train, batch_tokens=256)
    fsdp = replace(cfg, train=two_micro, parallel=replace(cfg.parallel, data="fsdp"))
    same = determinism(fsdp, steps=2, worlds=(1, 2))
    assert same["identical"] and same["worlds"] == [1, 2], same
    assert same["tensors_compared"] == 2 * (2 * outputs + 2 * params + 1)  # outputs, grads, norm, params
    parted = determinism(replace(cfg, train=replace(cfg.train, batch_tokens=512)), steps=2, worlds=(1, 2))
    assert not parted["identical"] and parted["step"] == 1
    assert parted["phase"] == "parameter gradient (averaged)"
    assert parted["tensors_compared"] == 4 * outputs + 1  # every forward of step 1 agreed first
    assert 0 < parted["max_difference"] < 1e-6
    assert 0 < parted["parameters_apart_at_end"] < 1e-4
    with pytest.raises(EmberError, match="data-parallel layouts"):
        determinism(tiny_cfg(*DET, "parallel.tp=2"), steps=1, worlds=(1, 2))


@pytest.mark.parametrize("layout", [{}, LLAMA], ids=["gpt2", "llama"])
def test_logit_lens_equals_the_model_cut_after_each_layer(layout):
    import copy

    from ember.analysis.lens import lens

    cfg = ModelConfig(**{**SMALL, "n_layer": 3, "max_seq_len": 16}, **layout)
    model = GPT.build(cfg, seed=0).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (12,), generator=torch.Generator().manual_seed(1))
    readings = lens(model, ids)
    assert len(readings) == 4
    for n in range(4):  # the model with only its first n blocks, whole otherwise
        cut = copy.deepcopy(model)
        for name in [str(i) for i in range(n, 3)]:
            del cut.layers[name]
        assert torch.equal(readings[n], cut(ids[None])[0]), n


def test_training_dynamics_equal_direct_computation():
    """Uniform attention (q = 0) has the entropy ln(t + 1) at query t, exactly; the rest against
    the same quantities computed by hand from the tensors."""
    import math

    import scipy.stats

    from ember.train.dynamics import Dynamics

    model = GPT.build(ModelConfig(**{**SMALL, "n_layer": 2, "max_seq_len": 16}, **LLAMA), seed=0)
    torch.nn.init.zeros_(model.layers["0"].attention.wq.weight)  # layer 0 attends uniformly
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, SMALL["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(0))
    seen = {}

    def keep(name):  # (a forward hook that returns nothing leaves the output alone)
        return lambda m, a, out: seen.__setitem__(name, out.detach()) if name not in seen else None

    model.layers["1"].register_forward_hook(keep("block1"))
    model.output.register_forward_hook(keep("logits"))
    original = model.layers["0"].attention.attend
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    dyn = Dynamics(model)
    dyn.begin()
    F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    values = dyn.end()
    assert model.layers["0"].attention.attend is original  # restored
    uniform = sum(math.log(t + 1) for t in range(11)) / 11
    for h in range(SMALL["n_head"]):
        assert values[f"dyn/attn_entropy/layers.0/h{h}"] == pytest.approx(uniform, abs=1e-5)
        assert values[f"dyn/attn_entropy/layers.1/h{h}"] < uniform  # q ≠ 0: less than uniform
    out = seen["block1"]
    assert values["dyn/act_rms/layers.1"] == pytest.approx(out.pow(2).mean().sqrt().item(), rel=1e-5)
    kurt = scipy.stats.kurtosis(out.flatten().double().numpy(), fisher=False, bias=True)  # m4 / m2²
    assert values["dyn/act_kurtosis/layers.1"] == pytest.approx(kurt, rel=1e-3)
    assert values["dyn/logit_max"] == pytest.approx(seen["logits"].max().item())
    names = [n for n in before if n.startswith("layers.1.")]
    update = torch.cat([(dict(model.named_parameters())[n].detach() - before[n]).flatten() for n in names])
    weight = torch.cat([dict(model.named_parameters())[n].detach().flatten() for n in names])
    ratio = update.pow(2).mean().sqrt() / weight.pow(2).mean().sqrt()
    assert values["dyn/update_ratio/layers.1"] == pytest.approx(ratio.item(), rel=1e-5)
    torch.nn.init.zeros_(model.layers["0"].attention.wq.weight)  # (the step moved it)
    dyn.begin()  # under fp16 autocast (train.precision=fp16) the entropy is still taken in fp32
    with torch.autocast("cpu", torch.float16):
        model(x[:, :-1])
    half = dyn.end()
    assert half["dyn/attn_entropy/layers.0/h0"] == pytest.approx(uniform, abs=1e-5)  # was NaN: 0·log 0


def test_trainer_logs_dynamics_every_n_steps_and_the_report_plots_them(tiny_cfg):
    from ember.report.report import write_report

    cfg = tiny_cfg("train.max_steps=4", "train.log_dynamics=2", "train.eval_every=0")
    train(cfg)
    run = Path(cfg.run.out_dir) / cfg.run.name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "dyn/logit_max" in r] == [2, 4]
    last = max(i for i, r in enumerate(rows) if "dyn/logit_max" in r)
    rows[last] = {**rows[last], "dyn/attn_entropy/layers.0/h0": "nan"}  # as metrics.jsonl writes a NaN
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_report([run])
    assert (run / "plots" / "dyn_attn_entropy.png").is_file() and "dyn_update_ratio.png" in (
        run / "report.md"
    ).read_text()


def test_the_trainer_names_a_gradient_that_goes_non_finite_in_the_backward(tiny_cfg):
    from ember.train.trainer import NonFiniteError, Trainer

    trainer = Trainer(tiny_cfg("train.max_steps=3", "train.eval_every=0"))
    _nan_at("layers.1.mlp", backward=True)(trainer)
    with pytest.raises(
        NonFiniteError, match=r"step 1: .*in the backward, the gradient at the output of layers\.1\.mlp"
    ):
        trainer.run()
