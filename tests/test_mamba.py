"""Mamba: the chunked scan against the sequential one (forward and backward), the init anchors,
hybrids, recurrent decoding in the engine against the full forward, HF ``MambaForCausalLM``
parity both ways, the refusals of what is not supported, and a hybrid's exact resume."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ember.config import ModelConfig
from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.infer.engine import Engine, KVCache
from ember.infer.sampling import Sampling
from ember.model.gpt import GPT, layer_mixers
from ember.model.mamba import Mamba, chunked_scan, dt_rank, sequential_scan, set_scan

MAMBA = dict(mixer="mamba", pos="none", mlp="none", norm="rmsnorm", bias=False)
HYBRID = dict(pattern="MA", pos="rope", mlp="swiglu", norm="rmsnorm", bias=False)
TEXT = ["The quick brown fox jumps over the lazy dog. " * 4, "def main():\n    return 1\n" * 4]


def tiny(**overrides) -> ModelConfig:
    # init_std 0.2: logits of a few units, so the bounds below mean something
    base = dict(vocab_size=96, n_layer=2, n_head=4, d_model=32, max_seq_len=64, init_std=0.2)
    return ModelConfig(**{**base, **overrides})


def scan_inputs(T: int, batch: int = 2, d_inner: int = 6, d_state: int = 4, seed: int = 0):
    """Inputs as a Mamba layer makes them: Δ > 0 of a size that decays the state over a few steps
    to a few tens (so both a long memory and a near-total forgetting are exercised)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(batch, T, d_inner, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(batch, T, d_inner, generator=g) - 1)
    A = -torch.exp(torch.randn(d_inner, d_state, generator=g))
    B, C = torch.randn(batch, T, d_state, generator=g), torch.randn(batch, T, d_state, generator=g)
    h0 = torch.randn(batch, d_inner, d_state, generator=g)
    return [t.requires_grad_() for t in (u, dt, A, B, C, h0)]


@pytest.mark.parametrize("T", [1, 7, 16, 33, 64])
@pytest.mark.parametrize("chunk", [4, 16])
def test_chunked_scan_equals_the_sequential_scan_forward_and_backward(T, chunk):
    inputs = scan_inputs(T)
    y_ref, h_ref = sequential_scan(*inputs)
    y, h = chunked_scan(*inputs, chunk=chunk)
    assert y_ref.abs().max() > 1 and (y - y_ref).abs().max() <= 1e-5 and (h - h_ref).abs().max() <= 1e-5
    g = torch.Generator().manual_seed(1)
    wy, wh = torch.randn(y.shape, generator=g), torch.randn(h.shape, generator=g)
    ref = torch.autograd.grad((y_ref * wy).sum() + (h_ref * wh).sum(), inputs)
    got = torch.autograd.grad((y * wy).sum() + (h * wh).sum(), inputs)
    for name, a, b in zip(("u", "dt", "A", "B", "C", "h0"), got, ref, strict=True):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item()), name


def test_model_gradients_equal_under_both_scans():
    model = GPT.build(tiny(**MAMBA), seed=0)
    idx = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(0))
    grads = {}
    for kind in ("sequential", "chunked"):
        model.zero_grad()
        logits = set_scan(model, kind)(idx)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten()).backward()
        grads[kind] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (la, ga), (lb, gb) = grads["sequential"], grads["chunked"]
    assert (la - lb).abs().max() <= 1e-5
    for name in ga:
        assert (ga[name] - gb[name]).abs().max() <= 1e-5, name


def test_init_anchors_and_names():
    cfg = tiny(**MAMBA, d_model=64)
    model = GPT.build(cfg, seed=0)
    mixer = model.layers["0"].attention
    assert isinstance(mixer, Mamba) and dt_rank(64) == 4 == mixer.rank
    assert torch.equal(mixer.A_log, torch.log(torch.arange(1.0, 17.0)).expand(128, -1))
    assert torch.equal(mixer.D, torch.ones(128))
    dt = torch.nn.functional.softplus(mixer.dt_proj.bias)  # the bias is softplus^-1 of dt
    assert dt.min() >= 1e-3 - 1e-7 and dt.max() <= 1e-1 + 1e-6
    assert mixer.out_proj.weight.std() < mixer.in_proj.weight.std() / 1.5  # residual projection scaled
    names = {n.removeprefix("layers.0.") for n, _ in model.named_parameters() if n.startswith("layers.0.")}
    mixer_names = {"in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
                   "dt_proj.bias", "A_log", "D", "out_proj.weight"}  # fmt: skip
    assert names == {"attention_norm.weight"} | {f"attention.{n}" for n in mixer_names}
    assert model.flops_per_token(64) > 6 * model.num_params(non_embedding=True)


def test_hybrid_pattern_builds_each_mixer():
    cfg = tiny(**HYBRID, n_layer=3)
    assert layer_mixers(cfg) == ["mamba", "attention", "mamba"]
    model = GPT.build(cfg, seed=0)
    kinds = [type(layer.attention).__name__ for layer in model.layers.values()]
    assert kinds == ["Mamba", "Attention", "Mamba"]
    assert model(torch.randint(0, 96, (2, 16))).shape == (2, 16, 96)


# ------------------------------------------------------------------ decoding with the state


@pytest.mark.parametrize("layout", [MAMBA, HYBRID], ids=["mamba", "hybrid"])
def test_prefill_then_recurrent_steps_equal_the_full_forward(layout):
    model = GPT.build(tiny(**layout), seed=0).eval()
    idx = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(30)
        steps = [model(idx[:, :20], cache=cache)]  # a prefill of 20 (one chunk and a part), then steps
        steps += [model(idx[:, t : t + 1], cache=cache) for t in range(20, 30)]
    assert full.abs().max() > 1 and (torch.cat(steps, 1) - full).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train_bpe(TEXT, 300)


def greedy_without_cache(model: GPT, ids: list[int], n: int, n_valid: int) -> list[int]:
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq)[0, -1, :n_valid].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    return seq[0, len(ids) :].tolist()


@pytest.mark.parametrize("layout", [MAMBA, HYBRID], ids=["mamba", "hybrid"])
def test_engine_greedy_equals_the_full_forward_for_ragged_batches(tok, layout):
    """Left-padded rows of different lengths: each row's greedy tokens are the full forward's argmax
    over that row alone, so the pads never reach the recurrent state."""
    model = GPT.build(tiny(**layout, vocab_size=320), seed=0).eval()
    engine = Engine(model, tok)
    prompts = ["The quick brown", "def", "fox jumps over the lazy", "The"]
    out = engine.generate(prompts, Sampling(max_new_tokens=12, temperature=0, ignore_eos=True))
    for prompt, got in zip(prompts, out, strict=True):
        assert got.token_ids == greedy_without_cache(model, tok.encode(prompt), 12, tok.vocab_size)
    many = engine.generate(["The quick"] * 3, Sampling(max_new_tokens=8, temperature=0, ignore_eos=True))
    assert many[0].token_ids == many[2].token_ids == greedy_without_cache(model, tok.encode("The quick"), 8,
                                                                           tok.vocab_size)  # fmt: skip


def test_engine_refuses_compile_and_graphs_for_mamba(tok):
    model = GPT.build(tiny(**HYBRID, vocab_size=320), seed=0)
    for kwargs in ({"compile": True}, {"graphs": True}, {"batch_invariant": True}):
        with pytest.raises(EmberError, match="Mamba"):
            Engine(model, tok, **kwargs)


# ------------------------------------------------------------------ serving: the paged scheduler


def serve_greedy(scheduler, requests) -> list:
    """Add each (arrival step, prompt ids, new tokens) at its step, greedy; step until all finish;
    every block and state slot is free at the end."""
    pending, handles, step = sorted(enumerate(requests), key=lambda r: r[1][0]), {}, 0
    while pending or not scheduler.idle:
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, new) = pending.pop(0)
            [handles[i]] = scheduler.add(prompt, Sampling(new, temperature=0, ignore_eos=True))
        scheduler.step()
        step += 1
    blocks = scheduler.blocks
    assert blocks.num_free == blocks.num_blocks
    assert sorted(blocks.free_states) == list(range(blocks.num_states))
    return [handles[i].completion().token_ids for i in range(len(requests))]


@pytest.mark.parametrize("num_blocks", [200, 12], ids=["roomy", "preempting"])
@pytest.mark.parametrize("layout", [MAMBA, HYBRID], ids=["mamba", "hybrid"])
def test_scheduler_greedy_equals_the_batch1_engine(tok, layout, num_blocks):
    """Prompts of 1-50 tokens joining at steps 0-6, two sharing a 24-token prefix, fed 32 tokens a
    step (prompt chunks carry the state across steps) to 4 sequences at most (slots are reused):
    each greedy answer is the batch-1 engine's, which equals the full forward (above). The small
    pool preempts, and a preempted sequence reads its tokens again from a zeroed slot."""
    from ember.infer.scheduler import Scheduler

    engine = Engine(GPT.build(tiny(**layout, vocab_size=320, max_seq_len=128), seed=0).eval(), tok)
    rng = random.Random(0)
    requests = [(rng.randint(0, 6), [rng.randrange(3, 300) for _ in range(rng.randint(1, 50))],
                 rng.randint(1, 20)) for _ in range(10)]  # fmt: skip
    prefix = [rng.randrange(3, 300) for _ in range(24)]
    requests += [(3, prefix + [7, 8], 10), (9, prefix + [9], 10)]  # the second would hit the prefix cache
    scheduler = Scheduler(engine, num_blocks=num_blocks, block_size=8, max_batch_tokens=32, max_seqs=4)
    assert not scheduler.blocks.prefix_caching and scheduler.blocks.num_states == 4
    got = serve_greedy(scheduler, requests)
    for (_, prompt, new), answer in zip(requests, got, strict=True):
        [alone] = engine.generate([prompt], Sampling(new, temperature=0, ignore_eos=True))
        assert answer == alone.token_ids
    assert (scheduler.preemptions > 0) == (num_blocks == 12) and scheduler.blocks.hits == 0


def test_scheduler_n_answers_and_cancel_free_their_state_slots(tok):
    from ember.infer.scheduler import Scheduler

    engine = Engine(GPT.build(tiny(**HYBRID, vocab_size=320, max_seq_len=128), seed=0).eval(), tok)
    s = Scheduler(engine, num_blocks=60, block_size=8, max_batch_tokens=16, max_seqs=4)
    a, b = s.add(list(range(3, 40)), Sampling(30, temperature=0))[0], s.add([5, 6], Sampling(30))[0]
    prompt = list(range(3, 30))
    answers = s.add(prompt, Sampling(10, temperature=1.0, seed=5), n=3)  # three sequences, not forks
    for _ in range(3):
        s.step()
    assert a.state == b.state == answers[0].state == "running" and s.blocks.free_states == [3]
    slot = a.seq.state
    s.cancel(a)
    assert a.seq.state is None and s.blocks.free_states == [3, slot]
    assert a.completion().finish_reason == "cancelled"
    s.run()
    assert b.done and len(s.blocks.free_states) == 4 and s.blocks.num_free == 60
    seeded = [engine.generate([prompt], Sampling(10, temperature=1.0, seed=5 + i))[0] for i in range(3)]
    assert [r.completion().token_ids for r in answers] == [c.token_ids for c in seeded]
    with pytest.raises(EmberError, match="paged_attention=gather"):
        Scheduler(engine, num_blocks=8, paged_attention="flex")
    with pytest.raises(EmberError, match="serve.async_steps=false"):  # a state would run past an end
        Scheduler(engine, num_blocks=8, async_steps=True)


def test_server_answers_completions_from_a_hybrid(tok):
    pytest.importorskip("uvicorn")
    import httpx

    from tests.test_server import KEY, start

    engine = Engine(GPT.build(tiny(**HYBRID, vocab_size=320, max_seq_len=128), seed=0).eval(), tok)
    url, server, thread = start(engine)
    try:
        auth, prompts = {"Authorization": f"Bearer {KEY}"}, ["The quick brown", "def main():\n"]
        body = {"model": "tiny", "prompt": prompts, "max_tokens": 12, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=30)
        assert r.status_code == 200
        texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        assert texts == [c.text for c in engine.generate(prompts, Sampling(12, temperature=0))]
    finally:
        server.should_exit = True
        thread.join(10)


def test_dt_rank_is_ceil_d_model_over_16():
    assert [dt_rank(d) for d in (16, 17, 768)] == [1, 2, 48] and math.ceil(768 / 16) == 48


# ------------------------------------------------------------------ HF MambaForCausalLM

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("extra", [{}, {"tie_embeddings": False, "bias": True, "d_conv": 3, "d_state": 8}],
                         ids=["tied", "untied-bias"])  # fmt: skip
def test_hf_mamba_parity_both_ways(extra):
    from ember.model.hf import from_hf, to_hf

    model = GPT.build(tiny(**{**MAMBA, **extra}), seed=0).eval()
    hf = to_hf(model).eval()
    assert type(hf).__name__ == "MambaForCausalLM" and hf.config.time_step_rank == dt_rank(32)
    idx = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    assert ours.abs().max() > 1 and (ours - theirs).abs().max() <= 1e-4
    # a checkpoint made by transformers, with its own init, read back into ember
    config = transformers.MambaConfig(vocab_size=96, hidden_size=32, state_size=8, num_hidden_layers=2,
                                      conv_kernel=3, expand=2, initializer_range=0.2)  # fmt: skip
    stock = transformers.MambaForCausalLM(config).eval()
    back = from_hf(stock).eval()
    assert back.cfg.mixer == "mamba" and back.cfg.d_state == 8 and back.cfg.d_conv == 3
    with torch.no_grad():
        assert (back(idx) - stock(idx).logits).abs().max() <= 1e-4


def test_hf_refuses_a_hybrid_and_a_mamba_with_an_mlp():
    from ember.errors import ConfigError
    from ember.model.hf import to_hf

    with pytest.raises(ConfigError, match="mixes attention and Mamba"):
        to_hf(GPT.build(tiny(**HYBRID), seed=0))
    with pytest.raises(ConfigError, match="mlp=swiglu"):
        to_hf(GPT.build(tiny(**{**MAMBA, "mlp": "swiglu"}), seed=0))


# ------------------------------------------------------------------ runs: export, resume, refusals

MAMBA_RUN = ["model.mixer=mamba", "model.pos=none", "model.mlp=none"]
HYBRID_RUN = ["model.pattern=MA"]
DET = ["train.deterministic=true", "train.precision=fp32"]


def test_export_and_import_a_mamba_run(tiny_cfg, tmp_path, capsys):
    from ember.cli import main
    from ember.run import load_run
    from ember.train.trainer import train

    train(tiny_cfg(*MAMBA_RUN, "train.max_steps=3", "train.eval_every=0"))
    run, hf_dir, back = tmp_path / "runs" / "tiny", tmp_path / "hf", tmp_path / "runs" / "back"
    assert main(["export", str(run), "--to", "hf", str(hf_dir)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    model, tokenizer = load_run(run)
    ids = torch.tensor([tokenizer.encode("def f(x):\n    return x + 1\n")])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() <= 1e-4
    assert main(["import", "hf", str(hf_dir), "--out", str(back)]) == 0
    model2, _ = load_run(back)
    for name, value in model.state_dict().items():
        assert torch.equal(model2.state_dict()[name], value), name
    capsys.readouterr()
    assert (
        main(["generate", str(back), "--prompt", "def ", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    )
    for target in ("onnx-decode", "pt2"):  # refused after reading the run, before anything is written
        assert main(["export", str(run), "--to", target, str(tmp_path / f"g.{target}")]) == 2
        assert "Mamba" in capsys.readouterr().err and not (tmp_path / f"g.{target}").exists()


def test_hybrid_training_resumes_bitwise(tiny_cfg):
    import json
    import shutil
    from pathlib import Path

    from ember.run import read_metrics
    from ember.train.trainer import train

    args = [*DET, *HYBRID_RUN, "model.dropout=0.1", "train.max_steps=6", "train.ckpt_every=3",
            "train.keep_last=3", "train.eval_every=0"]  # fmt: skip
    cfg = tiny_cfg(*args)
    train(cfg)
    rd = Path(cfg.run.out_dir) / cfg.run.name
    full = {r["step"]: r["loss"] for r in read_metrics(rd) if "loss" in r}
    assert sorted(full) == list(range(1, 7))
    shutil.rmtree(rd / "checkpoints" / "step-000006")
    lines = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    (rd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines if r["step"] <= 3))
    train(tiny_cfg(*args, "train.resume=auto"))
    assert {r["step"]: r["loss"] for r in read_metrics(rd) if "loss" in r} == full  # bitwise


@pytest.mark.parametrize("parallel", ["parallel.tp=2", "parallel.pp=2"])
def test_tensor_and_pipeline_parallel_refuse_mamba_before_launch(tiny_cfg, parallel):
    from ember.errors import ConfigError
    from ember.train.layout import check_layout

    extra = ["model.tie_embeddings=false"] if parallel.endswith("pp=2") else []
    with pytest.raises(ConfigError, match="Mamba layers") as e:
        check_layout(tiny_cfg(*HYBRID_RUN, parallel, *extra), world_size=2)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides", [MAMBA_RUN, HYBRID_RUN])
def test_the_size_estimate_counts_mamba_parameters(overrides):
    from ember.analysis.plan import estimated_params
    from ember.config import load_config

    cfg = load_config("tiny", ["model.vocab_size=512", *overrides]).model
    n = sum(p.numel() for p in GPT(cfg).parameters())
    assert 0.97 * n <= estimated_params(cfg) <= n  # norms and biases left out


def test_dynamics_observe_only_the_attention_layers_of_a_hybrid(tiny_cfg):
    from pathlib import Path

    from ember.run import read_metrics
    from ember.train.trainer import train

    cfg = tiny_cfg(*HYBRID_RUN, "train.max_steps=2", "train.log_dynamics=2", "train.eval_every=0")
    train(cfg)
    [row] = [r for r in read_metrics(Path(cfg.run.out_dir) / cfg.run.name) if "dyn/logit_max" in r]
    entropy = {k.split("/")[2] for k in row if k.startswith("dyn/attn_entropy/")}
    assert entropy == {"layers.1"} and "dyn/act_rms/layers.0" in row  # layer 0 is Mamba


@pytest.mark.slow
def test_a_hybrid_on_two_fsdp_ranks_matches_one_process(tiny_cfg, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from ember.run import read_metrics
    from ember.train.trainer import train

    args = [*DET, *HYBRID_RUN, "train.max_steps=4", "train.eval_every=0"]
    single = tiny_cfg(*args, "run.name=single")
    train(single)
    want = {r["step"]: r["loss"] for r in read_metrics(Path(single.run.out_dir) / "single") if "loss" in r}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    cmd = [sys.executable, "-m", "ember", "train", "tiny", "--nproc", "2", f"data.dir={single.data.dir}",
           "data.val_fraction=0.1", f"run.out_dir={tmp_path}", "run.name=fsdp", "train.device=cpu",
           "parallel.data=fsdp", "train.report=false", *args]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "fsdp") if "loss" in r}
    assert sorted(got) == [1, 2, 3, 4] and all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)
