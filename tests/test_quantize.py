"""``ember quantize``: the rounding is within half a step, the CPU kernels agree with the plain
dequantize path, a quantized run is an ordinary run directory (eval, generate, exact reload), the
report measures what it says, and bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ember.cli import main
from ember.config import ModelConfig
from ember.errors import EmberError
from ember.infer.engine import Engine
from ember.infer.sampling import Sampling
from ember.model.gpt import GPT
from ember.model.quant import (
    FAST_ROWS,
    QuantLinear,
    QuantSpec,
    dequantize_int4,
    pack_int4,
    quantize,
    quantize_int4,
    quantize_int8,
    unpack_int4,
    weight_bytes,
)
from ember.run import load_run, read_spec
from ember.train.trainer import train

SPECS = [QuantSpec("int8-weight"), QuantSpec("int8-dynamic"), QuantSpec("int4-weight", 32)]
SPECS += [QuantSpec("int4-weight", 64)]
GPT2 = ["model.pos=learned", "model.norm=layernorm", "model.mlp=gelu", "model.bias=true", "model.n_kv_head=0"]


def _weight(n=96, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3] *= 40  # one row far larger than the rest: per-row scales must keep the others fine
    return w


def test_int8_rounding_is_within_half_a_step_per_row():
    w = _weight()
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (w - q.float() * scale[:, None]).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()
    assert q.abs().amax(dim=1).eq(127).all()  # each row uses the whole range


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_rounding_is_within_half_a_step_per_group(group):
    w = _weight()
    q, scale, zero = quantize_int4(w, group)
    assert q.max() <= 15 and scale.shape == (96, 128 // group)
    back = dequantize_int4(q, scale, zero)
    step = scale.repeat_interleave(group, dim=1)
    assert ((w - back).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    assert pack_int4(q).shape == (96, 64)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_path_matches_the_plain_path(spec, bias):
    """Decode-sized inputs (<= FAST_ROWS rows) take PyTorch's int8/int4 CPU kernels with bf16
    activations; wider ones dequantize to fp32. Both compute the same product."""
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=bias)
    m = QuantLinear.from_linear(linear, spec)
    plain = lambda x: F.linear(x, m.dequantize(), m.bias)  # noqa: E731
    for rows in (1, FAST_ROWS):
        x = torch.randn(rows, 128)
        y, ref = m(x), plain(x)
        if spec.scheme == "int8-dynamic":  # activations rounded to int8 on purpose
            assert (y - ref).norm() / ref.norm() < 2e-2
        else:  # bf16 activations: ~0.2% relative
            assert (y - ref).norm() / ref.norm() < 1e-2
    x = torch.randn(2, FAST_ROWS, 128)  # 16 rows: the plain path itself
    if spec.scheme != "int8-dynamic":
        torch.testing.assert_close(m(x), plain(x), rtol=1e-5, atol=1e-5)  # int8: scale after the sum
    # the whole layer stays close to the float one it came from
    ref = linear(x)
    bound = 0.02 if spec.scheme.startswith("int8") else 0.12
    assert (m(x) - ref).norm() / ref.norm() < bound
    for rows in (1, 2 * FAST_ROWS):  # a bf16 model's activations stay bf16 on either path
        assert m(torch.randn(rows, 128, dtype=torch.bfloat16)).dtype == torch.bfloat16, rows


def test_int8_dynamic_equals_its_definition_in_float64():
    torch.manual_seed(1)
    linear = nn.Linear(128, 96, bias=False)
    m = QuantLinear.from_linear(linear, QuantSpec("int8-dynamic"))
    x = torch.randn(5, 128)
    xs = x.double().abs().amax(dim=1, keepdim=True) / 127
    xq = torch.round(x.double() / xs).clamp(-127, 127)
    ref = (xq @ m.weight_q.double().t()) * xs * m.weight_scale.double()
    torch.testing.assert_close(m(x).double(), ref, rtol=1e-6, atol=1e-6)


def _cfg(**kw):
    base = dict(vocab_size=512, n_layer=2, n_head=4, d_model=64, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("spec", SPECS + [QuantSpec("int4-weight", 32, head=False)], ids=lambda s: s.label)
def test_quantized_model_swaps_the_block_linears_and_the_head_and_stays_close(spec):
    model = GPT.build(_cfg(mlp="swiglu"), seed=0).eval()
    idx = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = model(idx)
    embedding = model.tok_embeddings.weight.detach().clone()
    quantize(model, spec)
    swapped = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(swapped) == 2 * 7 + spec.head  # wq wk wv wo w1 w2 w3 per block, and the head
    assert not any(isinstance(m, nn.Linear) for m in model.layers.modules())
    assert torch.equal(model.tok_embeddings.weight, embedding)  # the lookup table stays fp32
    if spec.head:  # its own int8 copy of the tied matrix, per row
        assert model.output.spec.scheme == "int8-weight" and model.output.weight_q.shape == (512, 64)
        step = embedding.abs().amax(dim=1, keepdim=True) / 127  # each row's int8 step
        assert ((model.output.dequantize() - embedding).abs() <= step / 2 + 1e-7).all()
    else:
        assert isinstance(model.output, nn.Linear) and model.output.weight is model.tok_embeddings.weight
    out = model(idx)
    bound = 0.02 if spec.scheme.startswith("int8") else 0.12
    assert (out - ref).norm() / ref.norm() < bound


def test_cached_decode_of_a_quantized_model_matches_the_full_forward():
    """Engine (KV cache, one token a step: the kernel path) against the full forward of the
    same quantized model (the plain path) on the text it generated."""
    from ember.data.tokenizer import Tokenizer

    tok = Tokenizer.train_bpe(["def f(x):\n    return x + 1\n" * 50, "class A:\n    pass\n" * 50], 300)
    model = quantize(GPT.build(_cfg(vocab_size=tok.vocab_size, max_seq_len=96), seed=0).eval(), SPECS[2])
    [c] = Engine(model, tok).generate(["def f("], Sampling(24, temperature=0.0, ignore_eos=True))
    ids = torch.tensor([tok.encode("def f(") + c.token_ids])
    with torch.no_grad():
        logits = model(ids)[0, -25:-1]  # the full forward's next-token logits at each generated step
    agree = (logits.argmax(-1) == torch.tensor(c.token_ids)).float().mean().item()
    assert agree >= 0.9, agree  # bf16 activations may flip a near-tie, not the sequence


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def run(request, tiny_data, tmp_path_factory):
    from ember.config import load_config

    out = tmp_path_factory.mktemp("runs")
    layout = GPT2 if request.param == "gpt2" else []
    overrides = [f"data.dir={tiny_data}", "data.val_fraction=0.1", f"run.out_dir={out}", "train.device=cpu"]
    train(load_config("tiny", [*overrides, "train.max_steps=12", *layout]))
    return out / "tiny"


@pytest.mark.parametrize("scheme", ["int8-weight", "int4-weight"])
def test_a_quantized_run_is_an_ordinary_run(run, tmp_path, scheme, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(run), "--scheme", scheme, "--out", str(out)]) == 0
    assert json.loads((out / "model" / "quant.json").read_text())["scheme"] == scheme
    before = (run / "model" / "model.safetensors").stat().st_size
    after = (out / "model" / "model.safetensors").stat().st_size
    assert after < 0.7 * before
    # reloading gives the model quantized in memory, bit for bit
    float_model, _ = load_run(run)
    float_bytes = weight_bytes(float_model)
    ref_model = quantize(float_model, QuantSpec(scheme))  # in place
    model, tokenizer = load_run(out)
    idx = torch.tensor([tokenizer.encode("def main():\n    return 1\n")] * 2)
    with torch.no_grad():
        assert torch.equal(model(idx), ref_model(idx))
        assert torch.equal(model(idx[:1, :1]), ref_model(idx[:1, :1]))  # kernel path too
    assert weight_bytes(model) < 0.7 * float_bytes
    capsys.readouterr()
    assert main(["eval", str(out), "--split", "test"]) == 0
    assert json.loads((out / "eval.json").read_text())["results"]["test"]["bpb"] > 0
    argv = ["generate", str(out), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0"]
    assert main(argv) == 0
    assert capsys.readouterr().out.count("def ") >= 1
    with pytest.raises(EmberError, match="holds only `last`"):
        load_run(out, "best")


def test_float_head_and_records_from_before_the_int8_head(run, tmp_path):
    out = tmp_path / "q"
    assert main(["quantize", str(run), "--scheme", "int8-weight", "--float-head", "--out", str(out)]) == 0
    assert json.loads((out / "model" / "quant.json").read_text())["head"] is False
    model, _ = load_run(out)
    assert isinstance(model.output, nn.Linear) and model.output.weight is model.tok_embeddings.weight
    # a quant.json written before heads were quantized has no "head": it reads as an fp32 head
    (out / "model" / "quant.json").write_text(json.dumps({"scheme": "int8-weight", "group_size": 32}))
    assert read_spec(out / "model") == QuantSpec("int8-weight", head=False)
    model, _ = load_run(out)
    assert isinstance(model.output, nn.Linear)


def test_report_measures_fp32_and_each_scheme(run, capsys):
    args = ["quantize", str(run), "--report", "--scheme", "int8-weight", "--scheme", "int4-weight"]
    assert main([*args, "--max-windows", "6"]) == 0  # int4's default sweep: groups of 32, 64 and 128
    text = capsys.readouterr().out
    assert "int8-weight" in text and "int4-weight g32" in text and "greedy agreement" in text
    assert "int4-weight g128: left out (int4-weight: 64 input features" in text  # tiny is 64 wide
    record = json.loads((run / "quantize.json").read_text())
    rows = record["rows"]
    assert list(rows) == ["fp32", "int8-weight", "int4-weight g32", "int4-weight g64"]
    assert rows["fp32"]["agree"] == 1.0 and rows["fp32"]["bpb_change"] == 0.0
    assert rows["int8-weight"]["bytes"] < 0.6 * rows["fp32"]["bytes"]
    assert rows["int4-weight g32"]["bytes"] < rows["int8-weight"]["bytes"]
    assert 0 < rows["int8-weight"]["agree"] <= 1 and rows["int8-weight"]["tok_s"] > 0
    assert abs(rows["int8-weight"]["bpb_change"]) < abs(rows["int4-weight g32"]["bpb_change"]) + 0.01
    assert "documents" in record["measured_on"] and "tokens" in record["measured_on"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scheme", "int3", "--out", "{tmp}/q"], "unknown scheme"),
        (["--scheme", "int4-weight", "--group-size", "48", "--out", "{tmp}/q"], "group"),
        (["--scheme", "int4-weight", "--group-size", "128", "--out", "{tmp}/q"], "groups of 128"),
        (["--scheme", "int8-weight"], "--out"),
        (["--scheme", "int8-weight", "--out", "{run}"], "is the source"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(run, tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path, run=run) for a in argv]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["quantize", str(run), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no q/, no staging folder


def test_quantizing_a_quantized_run_or_refusing_force_is_clear(run, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(run), "--scheme", "int8-weight", "--out", str(out)]) == 0
    assert main(["quantize", str(out), "--scheme", "int4-weight", "--out", str(tmp_path / "q2")]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert main(["quantize", str(run), "--scheme", "int4-weight", "--out", str(out)]) == 2
    assert json.loads((out / "model" / "quant.json").read_text())["scheme"] == "int8-weight"  # untouched
    assert main(["quantize", str(run), "--scheme", "int4-weight", "--out", str(out), "--force"]) == 0
    assert json.loads((out / "model" / "quant.json").read_text())["scheme"] == "int4-weight"
