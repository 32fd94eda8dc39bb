"""Quantization-aware training (train.qat) and fine-tuning from a run (train.init_from)."""

import shutil

import pytest
import torch
from safetensors import safe_open

from ember.cli import main
from ember.errors import ConfigError
from ember.export.quantize import quantize_run
from ember.model.quant import (
    QATLinear,
    QuantSpec,
    dequantize_int4,
    fake_quantize,
    quantize_int4,
    quantize_int8,
)
from ember.run import load_run, read_metrics
from ember.train.trainer import Trainer, train

FAST = ["train.eval_every=0", "train.keep_best=false"]


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def _keys(run_dir) -> list[str]:
    with safe_open(str(run_dir / "model" / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def _block_linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]


SPECS = [QuantSpec("int4-weight", 32), QuantSpec("int4-weight", 64), QuantSpec("int8-weight")]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label.replace(" ", "-"))
def test_fake_quantize_is_the_stored_grid_forward_and_the_identity_backward(spec):
    torch.manual_seed(0)
    w = (torch.randn(48, 128) * 0.05).requires_grad_()
    if spec.scheme == "int4-weight":
        stored = dequantize_int4(*quantize_int4(w, spec.group_size))
    else:
        q, scale = quantize_int8(w)
        stored = q.float() * scale[:, None]
    out = fake_quantize(w, spec)
    assert torch.equal(out, stored)  # bit for bit what `ember quantize` stores
    assert (out != w).float().mean() > 0.9  # and it did round
    upstream = torch.randn_like(w)
    out.backward(upstream)
    assert torch.equal(w.grad, upstream)  # straight-through: rounding passes the gradient unchanged


def test_qat_run_trains_and_ember_quantize_stores_what_it_saw(tiny_cfg, tmp_path):
    plain_cfg = tiny_cfg("run.name=plain", "train.max_steps=8", *FAST)
    train(plain_cfg)
    cfg = tiny_cfg("run.name=qat", "train.qat=int4-weight", "train.max_steps=8", *FAST)
    trainer = Trainer(cfg)
    linears = _block_linears(trainer.model)
    assert len(linears) == 2 * 7 and all(type(m) is QATLinear for m in linears)  # wq wk wv wo w1 w2 w3
    trainer.run()
    ls = _losses(trainer.run_dir)
    assert sorted(ls) == list(range(1, 9)) and all(torch.isfinite(torch.tensor(list(ls.values()))))
    assert ls[8] < ls[1]
    # the exported weights are float, under the plain run's names
    assert _keys(trainer.run_dir) == _keys(tmp_path / "runs" / "plain")
    float_model, _ = load_run(trainer.run_dir)
    assert all(type(m) is torch.nn.Linear for m in _block_linears(float_model))

    # ember quantize of the QAT run gives the model training saw: a batch of 4 x 16 = 64 rows
    # takes QuantLinear's dequantize path (more than FAST_ROWS)
    out = quantize_run(trainer.run_dir, QuantSpec("int4-weight", 32), tmp_path / "qat-int4")
    quantized, _ = load_run(out)
    x = torch.randint(0, 500, (4, 16))
    with torch.no_grad():
        seen = trainer.model.eval()(x)
        stored = quantized(x)
        unrounded = float_model(x)
    assert (seen - stored).abs().max() < 1e-5
    assert (seen - unrounded).abs().max() > 1e-3  # the fake quantization was on in training


def test_init_from_starts_from_the_source_weights_and_resume_wins(tiny_cfg, tmp_path):
    src = tmp_path / "runs" / "src"
    train(tiny_cfg("run.name=src", "train.max_steps=6", *FAST))
    source, _ = load_run(src)
    start = source.state_dict()

    ft = Trainer(tiny_cfg("run.name=ft", f"train.init_from={src}", "train.max_steps=2", *FAST))
    fresh = Trainer(tiny_cfg("run.name=fresh", "train.max_steps=2", *FAST))
    ours = ft.model.state_dict()
    assert ours.keys() == start.keys() and all(torch.equal(ours[k], start[k]) for k in start)
    wq = "layers.0.attention.wq.weight"
    assert not torch.equal(fresh.model.state_dict()[wq], start[wq])
    # its first step's loss is the source model's on that batch (two micro-batches of 4 rows)
    x, y = ft.loader.batch(0)
    with torch.no_grad():
        expected = sum(ft.task.loss(source, (x[r], y[r]))[0].item() for r in (slice(0, 4), slice(4, 8))) / 2
    ft.run()
    fresh.run()
    first_step, fresh_first_step = _losses(ft.run_dir)[1], _losses(fresh.run_dir)[1]
    assert abs(first_step - expected) < 1e-5 and abs(fresh_first_step - expected) > 0.1

    # resuming: the checkpoint's weights are loaded, the source's are not applied again
    after, _ = load_run(ft.run_dir)
    resumed = Trainer(
        tiny_cfg(
            "run.name=ft",
            f"train.init_from={src}",
            "train.max_steps=4",
            "train.resume=auto",
            "train.resume_allow_changes=true",
            *FAST,
        )
    )
    assert resumed.step == 2
    now = resumed.model.state_dict()
    assert all(torch.equal(now[k], after.state_dict()[k]) for k in now)
    assert not torch.equal(now[wq], start[wq])


def test_init_from_refuses_what_cannot_start_this_model(tiny_cfg, tmp_path):
    src = tmp_path / "runs" / "src"
    train(tiny_cfg("run.name=src", "train.max_steps=2", *FAST))

    def refused(match, *overrides):
        with pytest.raises(ConfigError, match=match):
            Trainer(tiny_cfg("run.name=ft", "train.max_steps=2", *overrides))
        assert not (tmp_path / "runs" / "ft").exists()  # nothing written

    refused(r"model\.n_layer=2 there but 3 here", f"train.init_from={src}", "model.n_layer=3")
    refused(r"model\.d_model=64 there but 128 here", f"train.init_from={src}", "model.d_model=128")
    quantize_run(src, QuantSpec("int8-weight"), tmp_path / "src-int8")
    refused(r"quantized \(int8-weight\)", f"train.init_from={tmp_path / 'src-int8'}")
    refused("no final weights", f"train.init_from={tmp_path / 'nowhere'}")
    other = tmp_path / "other-tokenizer"
    shutil.copytree(src, other)
    for path in (other / "tokenizer.json", other / "model" / "tokenizer.json"):
        path.write_text(path.read_text().replace('"model"', '"model" ', 1))
    refused("differs from the data dir's tokenizer", f"train.init_from={other}")


def test_bad_qat_settings_are_refused(tiny_cfg, capsys):
    assert main(["train", "tiny", "train.qat=int3", "train.max_steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1 and "train.qat must be one of 'none', 'int8-weight', 'int4-weight'" in err
    )
    with pytest.raises(ConfigError, match="train.qat_group_size must be one of 32, 64, 128; got 48"):
        tiny_cfg("train.qat=int4-weight", "train.qat_group_size=48")
    # 128 is a valid group size, but the tiny MLP's 192 inputs do not split into it
    with pytest.raises(ConfigError, match=r"qat_group_size=128 does not divide .*\[64, 192\]"):
        Trainer(tiny_cfg("train.qat=int4-weight", "train.qat_group_size=128"))
