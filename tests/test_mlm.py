"""Masked language modelling: bidirectional attention, the masking rule, the loss, BERT parity,
a tiny run that learns, resumes bitwise and is scored by `ember eval`, and the refusals."""

import contextlib
import io
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ember.cli import main
from ember.config import ModelConfig
from ember.data.masking import IGNORE, mask_tokens, seeded
from ember.errors import ConfigError, EmberError
from ember.infer.engine import Engine
from ember.model.gpt import GPT, full_attention
from ember.run import load_run, read_metrics
from ember.train.tasks.mlm import MLMTask
from ember.train.trainer import train

transformers = pytest.importorskip("transformers")

BERT = [
    "train.task=mlm",
    "model.causal=false",
    "model.head=mlm",
    "model.norm_position=post",
    "model.gelu=erf",
    "model.pos=learned",
    "model.norm=layernorm",
    "model.mlp=gelu",
    "model.bias=true",
    "model.n_kv_head=0",
]
DET = ["train.deterministic=true", "train.precision=fp32"]


def bert_cfg(**overrides) -> ModelConfig:
    fields = dict(
        vocab_size=100,
        n_layer=2,
        n_head=2,
        d_model=32,
        max_seq_len=64,
        mlp_hidden=64,
        causal=False,
        head="mlm",
        norm_position="post",
        gelu="erf",
        norm_eps=1e-12,
    )
    return ModelConfig(**{**fields, **overrides})


def ember(*args):
    """``ember ARGS`` in-process (``ember.cli.main``; a torch import per call was most of its
    cost): its exit code and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


# ------------------------------------------------------------------ the model


def test_bidirectional_attention_is_the_formula_without_a_mask():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    want = torch.softmax(q @ k.transpose(-2, -1) / 4.0, dim=-1) @ v  # every query sees every key
    torch.testing.assert_close(full_attention(q, k, v, 0.0), want, atol=1e-5, rtol=0)


def test_a_bidirectional_model_reads_the_future_and_matches_the_reference():
    model = GPT.build(bert_cfg(), seed=0).eval()
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    later = x.clone()
    later[:, -1] = (x[:, -1] + 1) % 100
    sdpa = model(x)
    assert (model(later)[:, 0] - sdpa[:, 0]).abs().max() > 1e-4  # position 0 sees the last token
    torch.testing.assert_close(model.set_attention("reference")(x), sdpa, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.set_kernels("torch")(x), sdpa, atol=1e-5, rtol=0)  # stays bidirectional
    causal = GPT.build(bert_cfg(causal=True), seed=0).eval()  # the same weights, causal: blind to it
    causal.load_state_dict(model.state_dict())
    assert (causal(later)[:, :-1] - causal(x)[:, :-1]).abs().max() == 0


def test_the_mlm_head_is_tied_with_a_bias_and_the_keep_path_equals_the_full_forward():
    model = GPT.build(bert_cfg(), seed=0).eval()
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.bias is not None and model.output.bias.abs().max() == 0  # initialised to zero
    with torch.no_grad():
        model.output.bias.normal_()
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    keep = torch.rand(2, 16, generator=torch.Generator().manual_seed(3)) < 0.3
    torch.testing.assert_close(model(x, keep=keep), model(x)[keep], atol=1e-6, rtol=0)


# ------------------------------------------------------------------ the masking rule


def test_masking_is_80_10_10_on_text_tokens_only_and_seeded():
    text = torch.ones(300, dtype=torch.bool)
    text[:16] = False  # the special ids
    x = torch.randint(0, 300, (256, 512), generator=torch.Generator().manual_seed(0))
    inputs, targets = mask_tokens(x, seeded(7, 3), 0.15, 8, text)
    chosen = targets != IGNORE
    assert not chosen[~text[x]].any()  # specials are never chosen, nor predicted
    rate = chosen.sum() / text[x].sum()
    assert abs(rate - 0.15) < 0.003  # ~19,000 chosen of ~125,000 text tokens: std 0.001
    assert (targets[chosen] == x[chosen]).all() and (inputs[~chosen] == x[~chosen]).all()
    n = chosen.sum()
    masked = (inputs[chosen] == 8).sum() / n
    kept = (inputs[chosen] == x[chosen]).sum() / n
    replaced = ((inputs[chosen] != 8) & (inputs[chosen] != x[chosen])).sum() / n
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1 - 0.1 / 284) < 0.008 and abs(replaced - 0.1) < 0.008
    assert text[inputs[chosen]].logical_or(inputs[chosen] == 8).all()  # random tokens are text tokens
    again = mask_tokens(x, seeded(7, 3), 0.15, 8, text)
    assert torch.equal(again[0], inputs) and torch.equal(again[1], targets)
    assert not torch.equal(mask_tokens(x, seeded(7, 4), 0.15, 8, text)[1], targets)
    assert not torch.equal(mask_tokens(x, seeded(7, 3, 1), 0.15, 8, text)[1], targets)
    assert not torch.equal(mask_tokens(x, seeded(7, 3, 0, "eval"), 0.15, 8, text)[1], targets)


def test_the_loss_is_the_cross_entropy_on_masked_positions_only():
    model = GPT.build(bert_cfg(), seed=0)
    text = torch.arange(100) >= 16
    x = torch.randint(16, 100, (3, 20), generator=torch.Generator().manual_seed(4))
    inputs, targets = mask_tokens(x, seeded(0, 0), 0.3, 8, text)
    task = MLMTask(0.3, 8, text.long(), seed=0)
    loss, metrics = task.loss(model, (inputs, targets))
    logp = model(inputs).log_softmax(-1)  # every position, by hand
    rows, cols = (targets != IGNORE).nonzero(as_tuple=True)
    picked = [-logp[r, c, targets[r, c]] for r, c in zip(rows.tolist(), cols.tolist(), strict=True)]
    torch.testing.assert_close(loss, torch.stack(picked).mean(), atol=1e-5, rtol=0)
    hits = [
        (logp[r, c].argmax() == targets[r, c]).float()
        for r, c in zip(rows.tolist(), cols.tolist(), strict=True)
    ]  # noqa: E501
    torch.testing.assert_close(metrics["mlm_accuracy"], torch.stack(hits).mean())
    nothing = torch.full_like(targets, IGNORE)
    assert task.loss(model, (inputs, nothing))[0] == 0  # no NaN from an empty micro-batch


# ------------------------------------------------------------------ HF parity


def random_bert() -> "transformers.BertForMaskedLM":
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    hf = transformers.BertForMaskedLM(config).eval()
    with torch.no_grad():  # nonzero biases, norms and token types, so that every mapping matters
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf


def test_from_hf_bert_same_logits_and_back():
    from ember.model.hf import from_hf, to_hf

    hf = random_bert()
    model = from_hf(hf).eval()
    assert not model.cfg.causal and model.cfg.norm_position == "post" and model.cfg.head == "mlm"
    x = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(5))
    want = hf(input_ids=x).logits  # no attention_mask: HF attends everywhere, token type 0
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=0)
    back = to_hf(model).eval()
    assert isinstance(back, transformers.BertForMaskedLM)
    torch.testing.assert_close(back(input_ids=x).logits, want, atol=1e-5, rtol=0)
    assert back.bert.embeddings.token_type_embeddings.weight.abs().max() == 0  # folded into positions


def test_to_hf_of_an_ember_encoder_and_what_bert_cannot_hold():
    from ember.model.hf import to_hf

    model = GPT.build(bert_cfg(norm_eps=1e-5), seed=0).eval()
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(to_hf(model).eval()(input_ids=x).logits, model(x), atol=1e-5, rtol=0)
    for bad, named in (
        (dict(pos="rope"), "model.pos=rope"),
        (dict(gelu="tanh"), "model.gelu=tanh"),
        (dict(head="lm"), "model.head=lm"),
        (dict(norm_position="pre"), "model.norm_position=pre"),
    ):
        with pytest.raises(ConfigError, match=named):
            to_hf(GPT.build(bert_cfg(**bad), seed=0))
    with pytest.raises(ConfigError, match="norm_position=pre"):  # a post-norm decoder has no HF layout
        to_hf(GPT.build(ModelConfig(vocab_size=100, n_layer=1, n_head=2, d_model=32, norm_position="post")))


# ------------------------------------------------------------------ training and eval


@pytest.mark.slow
def test_mlm_run_learns_resumes_bitwise_and_is_scored_by_ember_eval(tiny_cfg, tmp_path):
    args = [
        *BERT,
        *DET,
        "model.dropout=0.1",
        "train.max_steps=16",
        "train.ckpt_every=8",
        "train.eval_every=8",
        "train.keep_last=3",
    ]
    cfg = tiny_cfg(*args)
    train(cfg)
    rd = Path(cfg.run.out_dir) / cfg.run.name
    records = read_metrics(rd)
    full = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(full) == list(range(1, 17))
    assert sum(full[s] for s in (14, 15, 16)) < sum(full[s] for s in (1, 2, 3)) - 0.3  # it learns
    vals = [r for r in records if "val_masked_accuracy" in r]
    assert [r["step"] for r in vals] == [8, 16] and vals[1]["val_loss"] < vals[0]["val_loss"]
    assert 0 < vals[1]["val_bpb"] < 10 and "mlm_accuracy" in next(r for r in records if "loss" in r)
    # resume from step 8: the losses after it, which depend on the restored RNG and masks, bitwise
    shutil.rmtree(rd / "checkpoints" / "step-000016")
    lines = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    (rd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines if r["step"] <= 8))
    train(tiny_cfg(*args, "train.resume=auto"))
    assert {r["step"]: r["loss"] for r in read_metrics(rd) if "loss" in r} == full

    r = ember("eval", str(rd), "--split", "test")
    assert r.returncode == 0, r.stderr
    assert "test: masked-token accuracy" in r.stdout and "bits/byte" in r.stdout
    result = json.loads((rd / "eval.json").read_text())["results"]["test"]
    assert 0 <= result["masked_accuracy"] <= 1 and result["tokens"] > 1000 and result["bpb"] > 0
    nats = result["loss"] * result["tokens"]
    assert math.isclose(result["bpb"], nats / math.log(2) / result["bytes"], rel_tol=1e-9)

    # the refusals, each one line, exit 2, nothing written
    model, tokenizer = load_run(rd)
    with pytest.raises(EmberError, match="bidirectional"):
        Engine(model, tokenizer)
    for argv in (
        ["generate", str(rd), "--prompt", "def"],
        ["export", str(rd), "--to", "onnx-decode", str(tmp_path / "m.onnx")],
    ):
        r = ember(*argv)
        assert r.returncode == 2 and "bidirectional" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "m.onnx").exists()
    out = tmp_path / "hf"  # and the export BERT can hold: transformers reads it with the same logits
    assert ember("export", str(rd), "--to", "hf", str(out)).returncode == 0
    hf = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    x = torch.randint(16, 512, (1, 32), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(hf(input_ids=x).logits, model.eval()(x), atol=1e-5, rtol=0)
    assert transformers.AutoTokenizer.from_pretrained(out).mask_token == "<|reserved_0|>"
    r = ember("import", "hf", str(out), "--out", str(tmp_path / "back"))  # and back: a run ember eval reads
    assert r.returncode == 0, r.stderr
    back, _ = load_run(tmp_path / "back")
    assert not back.cfg.causal and torch.equal(back.eval()(x), model(x))


@pytest.mark.parametrize(
    "args",
    [["train.task=mlm"], ["model.causal=false"], ["model.head=mlm"]],
    ids=["mlm-causal", "lm-bidirectional", "lm-mlm-head"],
)
def test_bad_combinations_are_refused_before_any_work(tmp_path, args):
    r = ember("train", "tiny", f"run.out_dir={tmp_path / 'runs'}", *args)
    assert r.returncode == 2 and "train.task=mlm needs causal=false" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("post", [False, True], ids=["gpt", "bert"])
def test_pipeline_stages_hold_the_embedding_norm_and_the_head_transform(post):
    """A pipeline stage is built by naming what it keeps (ember.parallel.pipeline.stage_model):
    the first keeps ``embed_norm``, the last ``transform``; chained, they equal the whole model."""
    from ember.parallel.pipeline import stage_model

    cfg = bert_cfg() if post else ModelConfig(vocab_size=100, n_layer=2, n_head=2, d_model=32, max_seq_len=64)
    model = GPT.build(cfg, seed=0).eval()
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(8))
    first, last = stage_model(model, [0], True, False), stage_model(model, [1], False, True)
    torch.testing.assert_close(last(first(x)), model(x), atol=0, rtol=0)
