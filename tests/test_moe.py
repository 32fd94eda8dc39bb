"""Mixture of experts (``model.mlp=moe``): routing against a per-token reference, the auxiliary
losses against a hand computation and HF's, Mixtral parity both ways, training (resume, DDP,
FSDP2, expert parallel), generation, and the combinations refused before any work."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ember.cli import main
from ember.config import ModelConfig
from ember.errors import ConfigError, EmberError
from ember.infer.engine import Engine
from ember.infer.sampling import Sampling
from ember.model.gpt import GPT
from ember.model.moe import MoE, moe_loss
from ember.run import load_run, read_metrics
from ember.train.trainer import train
from tests.test_engine import greedy_without_cache
from tests.test_pp import _launch_legs
from tests.test_trainer import DET, assert_refused_before_launch

MIXTRAL = {"pos": "rope", "norm": "rmsnorm", "mlp": "moe", "bias": False, "tie_embeddings": False}


def moe_cfg(**overrides) -> ModelConfig:
    # init_std 0.1: logits reach a few units, so 1e-5 is a few fp32 ulps (see tests/test_engine.py)
    base = dict(vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=32,
                n_experts=4, top_k=2, mlp_hidden=48, init_std=0.1, **MIXTRAL)  # fmt: skip
    return ModelConfig(**{**base, **overrides})


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The definition, one token at a time: softmax over all experts, the top k, renormalised,
    each chosen expert's SwiGLU weighted and summed (+ the shared expert)."""
    B, T, C = x.shape
    out = torch.zeros_like(x)
    ex = moe.experts

    def swiglu(experts, e, v):
        return (F.silu(experts.w1[e] @ v) * (experts.w3[e] @ v)) @ experts.w2[e].t()

    for b in range(B):
        for t in range(T):
            v = x[b, t]
            p = torch.softmax(moe.router.weight @ v, dim=-1)
            top = torch.topk(p, moe.top_k).indices
            for e in top.tolist():
                out[b, t] += p[e] / p[top].sum() * swiglu(ex, e, v)
            if moe.shared is not None:
                out[b, t] += swiglu(moe.shared, 0, v)
    return out


@pytest.mark.parametrize(
    "kw", [{}, {"top_k": 1}, {"top_k": 3, "shared_expert": True}, {"n_experts": 7, "top_k": 7}]
)
def test_moe_equals_the_per_token_reference(kw):
    model = GPT.build(moe_cfg(**kw), seed=0)
    moe = model.layers["0"].mlp
    x = torch.randn(3, 9, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = moe(x), reference_moe(moe, x)
    assert (got - want).abs().max().item() <= 1e-6
    load = moe.stats["load"]
    assert load.shape == (moe.n_experts,) and abs(load.sum().item() - 1) < 1e-6


def test_an_expert_no_token_chose_still_gets_a_gradient_of_zero():
    """Dropless routing with an idle expert: the forward skips it, its weights' gradient is 0."""
    model = GPT.build(moe_cfg(n_experts=4, top_k=1), seed=0)
    moe = model.layers["0"].mlp
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0  # a large positive logit for expert 2 on most inputs
    x = torch.randn(2, 5, 32).abs()  # positive: every token picks expert 2
    moe(x).sum().backward()
    grads = moe.experts.w1.grad
    assert grads[2].abs().sum() > 0 and grads[[0, 1, 3]].abs().sum() == 0


def test_aux_losses_equal_a_hand_computation_and_hf():
    model = GPT.build(moe_cfg(n_layer=1, moe_aux=0.01, moe_z=0.001), seed=0)
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    h = {}
    model.layers["0"].mlp.register_forward_pre_hook(lambda m, a: h.setdefault("x", a[0]))
    model(x)
    total, metrics = moe_loss(model)
    moe = model.layers["0"].mlp
    logits = (h["x"].reshape(-1, 32) @ moe.router.weight.t()).detach()  # (N, E)
    p = logits.softmax(-1)
    picked = F.one_hot(p.topk(2).indices, 4).sum(1).float()  # (N, E): 1 where a token picked e
    balance = 4 * (picked.mean(0) * p.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    assert torch.allclose(metrics["moe_balance.0"], balance, atol=1e-6)
    assert torch.allclose(metrics["moe_z.0"], z, atol=1e-6)
    assert torch.allclose(total, 0.01 * balance + 0.001 * z, atol=1e-7)
    load = torch.stack([metrics[f"moe_load.0.{e}"] for e in range(4)])
    assert torch.allclose(load, picked.sum(0) / picked.sum())
    assert moe_loss(model) == (0.0, {})  # collected once: the next forward fills it again
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    hf = mixtral.load_balancing_loss_func((logits,), num_experts=4, top_k=2)
    assert torch.allclose(hf, balance, atol=1e-6)


def test_an_mlp_is_chosen_at_construction():
    model = GPT.build(moe_cfg(n_layer=1, shared_expert=True), seed=0)
    moe = model.layers["0"].mlp
    assert isinstance(moe, MoE) and moe.shared is not None
    assert moe.experts.w1.shape == (4, 48, 32) and moe.experts.w2.shape == (4, 32, 48)
    dense = GPT.build(dataclasses.replace(moe_cfg(n_layer=1), mlp="swiglu"), seed=0)
    assert not any(isinstance(m, MoE) for m in dense.modules())


@pytest.mark.parametrize("kw", [{}, {"top_k": 1, "n_experts": 3, "n_kv_head": 4}])
def test_mixtral_parity_both_ways(kw):
    pytest.importorskip("transformers")
    from ember.model.hf import from_hf, to_hf

    model = GPT.build(moe_cfg(**kw), seed=0).eval()
    hf = to_hf(model).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    x = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
        assert ours.abs().max() > 1.0
        assert (ours - theirs).abs().max().item() <= 1e-5
        back = from_hf(hf).eval()
        assert back.cfg == model.cfg
        assert torch.equal(back(x), ours)
        for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
        # HF's own aux loss of the same forward: the balance of its pooled layers (eq. as ember's
        # per layer; with one layer they agree exactly, see test_aux_losses_equal_...)
        out = hf(x, output_router_logits=True)
        assert len(out.router_logits) == model.cfg.n_layer


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"shared_expert": True}, "shared_expert"),
        ({"bias": True}, "bias"),
        ({"norm": "layernorm"}, "norm"),
    ],
)
def test_layouts_mixtral_lacks_are_refused(kw, message):
    pytest.importorskip("transformers")
    from ember.model.hf import to_hf

    with pytest.raises(ConfigError, match=message):
        to_hf(GPT.build(moe_cfg(**kw), seed=0))


# ---------------------------------------------------------------------------
# training: resume, data parallel, expert parallel, refusals
# ---------------------------------------------------------------------------

MOE = ["model.mlp=moe", "model.n_experts=4", "model.top_k=2", "model.mlp_hidden=64"]
SHORT = [*DET, *MOE, "train.max_steps=6", "train.ckpt_every=3", "train.keep_last=3", "train.eval_every=3"]


@pytest.mark.slow
def test_training_logs_per_layer_router_metrics_and_resumes_bitwise(tiny_cfg):
    cfg = tiny_cfg(*SHORT, "model.dropout=0.1", "model.shared_expert=true", "train.report=true")
    train(cfg)
    rd = Path(cfg.run.out_dir) / cfg.run.name
    records = [r for r in read_metrics(rd) if "loss" in r]
    full = {r["step"]: r["loss"] for r in records}
    assert sorted(full) == list(range(1, 7))
    last = records[-1]
    for layer in range(2):
        assert last[f"moe_balance.{layer}"] > 1.0  # k=2 at an even load (module docstring)
        assert last[f"moe_z.{layer}"] > 0
        assert abs(sum(last[f"moe_load.{layer}.{e}"] for e in range(4)) - 1) < 1e-5
    if (rd / "report.md").is_file():  # matplotlib installed: the expert-load histogram is in the report
        assert (rd / "plots" / "moe_load.png").is_file() and "moe_load.png" in (rd / "report.md").read_text()
    shutil.rmtree(rd / "checkpoints" / "step-000006")
    lines = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    (rd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines if r["step"] <= 3))
    train(tiny_cfg(*SHORT, "model.dropout=0.1", "model.shared_expert=true", "train.resume=auto"))
    resumed = {r["step"]: r["loss"] for r in read_metrics(rd) if "loss" in r}
    assert resumed == full  # bitwise equal floats


LAYOUTS = {  # name -> overrides on 2 gloo ranks
    "ddp": ["parallel.data=ddp"],
    "fsdp": ["parallel.data=fsdp"],
    "ep2-ddp": ["parallel.data=ddp", "parallel.ep=2"],
    "ep2-fsdp": ["parallel.data=fsdp", "parallel.ep=2"],
}


@pytest.mark.slow
def test_two_ranks_ddp_fsdp_and_expert_parallel_match_one_process(tiny_cfg, tmp_path):
    """Every layout in one torchrun launch (tests/legs.py): losses, gradient norms, router
    metrics and validation equal one process's; expert parallel exports whole weights."""
    args = [*DET, *MOE, "train.max_steps=4", "train.eval_every=2", "train.ckpt_every=2"]
    single = tiny_cfg(*args, "run.name=single")
    train(single)
    records = read_metrics(Path(single.run.out_dir) / "single")
    want = {r["step"]: r for r in records if "loss" in r}
    want_val = [r["val_loss"] for r in records if "val_loss" in r]
    common = [f"data.dir={single.data.dir}", "data.val_fraction=0.1", f"run.out_dir={tmp_path}",
              "train.device=cpu", *args]  # fmt: skip
    legs = {**LAYOUTS, "ep2-fsdp-bf16": [*LAYOUTS["ep2-fsdp"], "train.precision=bf16"]}
    _launch_legs(tmp_path, 2, {name: [*common, f"run.name={name}", *o] for name, o in legs.items()})
    bf16 = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "ep2-fsdp-bf16") if "loss" in r}
    assert all(abs(bf16[s] - want[s]["loss"]) <= 0.05 for s in want), bf16  # FSDP2's bf16 compute
    for name in LAYOUTS:
        got = {r["step"]: r for r in read_metrics(tmp_path / name) if "loss" in r}
        assert sorted(got) == [1, 2, 3, 4], name
        for step, r in got.items():
            for key in ("loss", "grad_norm", "moe_balance.1", "moe_load.0.3"):
                assert abs(r[key] - want[step][key]) <= 1e-5, (name, step, key, r[key], want[step][key])
        val = [r["val_loss"] for r in read_metrics(tmp_path / name) if "val_loss" in r]
        assert len(val) == 2 and all(abs(a - b) <= 1e-5 for a, b in zip(val, want_val, strict=True)), name
    # the exported weights of the expert-parallel run are whole, and load on one process
    model, _ = load_run(tmp_path / "ep2-fsdp")
    ref, _ = load_run(Path(single.run.out_dir) / "single")
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-5, name
    # its step-2 checkpoint (experts as Shard(0) DTensors) resumes in one process
    rd = tmp_path / "ep2-fsdp"
    shutil.rmtree(rd / "checkpoints" / "step-000004")
    (rd / "metrics.jsonl").write_text("")
    cfg = tiny_cfg(*args, "train.resume=auto")
    cfg.run.out_dir, cfg.run.name = str(tmp_path), "ep2-fsdp"
    train(cfg)
    resumed = {r["step"]: r["loss"] for r in read_metrics(rd) if "loss" in r}
    assert sorted(resumed) == [3, 4] and all(abs(resumed[s] - want[s]["loss"]) <= 1e-5 for s in resumed)


@pytest.mark.parametrize(
    "args, message",
    [
        (["model.mlp=moe", "model.n_experts=2", "model.top_k=3"], "top_k=3 is more than model.n_experts=2"),
        (["--nproc", "2", "model.mlp=moe", "parallel.tp=2"], "model.mlp=moe does not run with parallel.tp=2"),
        (["--nproc", "2", "parallel.data=fsdp", "parallel.ep=2"], "set model.mlp=moe or parallel.ep=1"),
    ],
)
def test_bad_combinations_exit_2_before_any_work(tmp_path, args, message):
    assert_refused_before_launch(tmp_path, args, message)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["parallel.pp=2", "model.tie_embeddings=false"], 2, "does not run with parallel.pp=2"),
        (["train.compile=true"], 1, "does not run with train.compile=true"),
        (["train.task=dpo"], 1, "does not run with train.task=dpo"),
        (["parallel.ep=2", "parallel.data=fsdp"], 4, "set parallel.ep to the number of ranks (4)"),
        (["parallel.ep=3", "parallel.data=fsdp", "model.n_experts=4"], 3, "must divide model.n_experts (4)"),
    ],
)
def test_layouts_moe_does_not_run_are_config_errors(tiny_cfg, overrides, world, message):
    from ember.train.layout import check_layout

    with pytest.raises(ConfigError, match=re.escape(message)):
        check_layout(tiny_cfg(*MOE, *overrides), world)


# ---------------------------------------------------------------------------
# a trained run: generation, export to HF and back
# ---------------------------------------------------------------------------

PROMPTS = ["def ", "class Foo", "import os\n", "The "]


@pytest.mark.slow
def test_a_trained_moe_run_generates_exports_to_mixtral_and_imports_back(tiny_cfg, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_cfg(*DET, *MOE, "train.max_steps=4", "train.eval_every=0")
    train(cfg)
    run = Path(cfg.run.out_dir) / cfg.run.name
    model, tok = load_run(run)
    engine, greedy = Engine(model, tok), Sampling(max_new_tokens=12, temperature=0)
    ours = [engine.generate([p], greedy)[0] for p in PROMPTS]
    assert any(got.token_ids for got in ours)
    for prompt, got in zip(PROMPTS, ours, strict=True):  # the KV cache path equals full forwards
        assert got.token_ids == greedy_without_cache(model, tok.encode(prompt), 12, tok)
    hf_dir, back = tmp_path / "hf", tmp_path / "back"
    assert main(["export", str(run), "--to", "hf", str(hf_dir)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    ids = torch.tensor([tok.encode("def f(x):\n    return x + 1  # the sum\n")])
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
        assert diff <= 1e-5, diff
        for prompt, got in zip(PROMPTS, ours, strict=True):
            x = torch.tensor([tok.encode(prompt)])
            new = hf.generate(x, max_new_tokens=12, do_sample=False)[0, x.size(1) :].tolist()
            assert new[: len(got.token_ids)] == got.token_ids
    assert main(["import", "hf", str(hf_dir), "--out", str(back)]) == 0
    model2, _ = load_run(back)
    assert (model2.cfg.mlp, model2.cfg.n_experts, model2.cfg.top_k) == ("moe", 4, 2)
    for (name, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_graph_export_of_an_moe_run_is_refused(tiny_cfg, tmp_path):
    from ember.export.graph import export_graph

    cfg = tiny_cfg(*DET, *MOE, "train.max_steps=1", "train.eval_every=0")
    train(cfg)
    with pytest.raises(EmberError, match="use --to hf"):
        export_graph(Path(cfg.run.out_dir) / cfg.run.name, "pt2", tmp_path / "m.pt2")
    assert not (tmp_path / "m.pt2").exists()


def test_flops_count_the_active_experts_only():
    moe = GPT.build(moe_cfg(n_experts=4, top_k=2), seed=0)
    dense = GPT.build(moe_cfg(n_experts=2, top_k=2), seed=0)  # the same model with only its 2 used experts
    assert moe.num_params() > dense.num_params()
    router_extra = 2 * (4 - 2) * 32  # two layers' routers have 2 more rows of d_model each
    assert moe.flops_per_token(16) == dense.flops_per_token(16) + 6 * router_extra


def test_the_servers_scheduler_batches_moe_requests_as_the_batch1_engine_answers():
    """Continuous batching (the server's scheduler, paged KV) puts other requests' tokens through
    the same routers; each token's route is its own, so the answers equal one request at a time."""
    from ember.data.tokenizer import Tokenizer
    from ember.infer.scheduler import Scheduler
    from tests.test_engine import TEXT
    from tests.test_scheduler import serve, workload

    tok = Tokenizer.train_bpe(TEXT, 300)
    model = GPT.build(moe_cfg(vocab_size=320, max_seq_len=320), seed=0).eval()
    engine = Engine(model, tok)
    requests = workload(1, n=8)
    scheduler = Scheduler(engine, num_blocks=200, block_size=16, max_batch_tokens=256, max_seqs=8)
    got = serve(scheduler, requests, lambda i, new: Sampling(min(new, 16), temperature=0))
    for (_, prompt, new), answer in zip(requests, got, strict=True):
        [alone] = engine.generate([prompt], Sampling(min(new, 16), temperature=0))
        assert answer.token_ids == alone.token_ids


@pytest.mark.parametrize("shared", [False, True])
def test_plan_counts_every_expert(shared):
    from ember.analysis.plan import estimated_params

    cfg = moe_cfg(n_experts=8, shared_expert=shared)
    norms = cfg.n_layer * 2 * cfg.d_model + cfg.d_model  # the sliver the estimate leaves out
    assert estimated_params(cfg) + norms == GPT.build(cfg, seed=0).num_params()


def test_rows_received_by_source_are_regrouped_by_expert():
    from ember.parallel.expert import by_expert

    received = torch.tensor([[2, 0, 1], [1, 3, 0]])  # from rank 0: e0 e0 e2; from rank 1: e0 e1 e1 e1
    assert by_expert(received).tolist() == [0, 1, 3, 4, 5, 6, 2]
    assert by_expert(torch.zeros(2, 2, dtype=torch.long)).tolist() == []


def test_the_tiny_moe_preset_is_tiny_with_experts():
    from ember.config import load_config

    cfg, tiny = load_config("tiny-moe"), load_config("tiny")
    assert (cfg.model.mlp, cfg.model.n_experts, cfg.model.top_k) == ("moe", 8, 2)
    assert dataclasses.replace(cfg.model, mlp="swiglu") == tiny.model and cfg.train == tiny.train


def test_plan_refuses_to_predict_an_moe_it_cannot_trace():
    from ember.analysis import plan
    from ember.config import load_config

    cfg = load_config("tiny-moe", ["model.vocab_size=512"])
    with pytest.raises(EmberError, match="does not predict model.mlp=moe"):
        plan.predict(cfg, cfg.model, 1)


def test_peft_loads_lora_adapters_of_an_moe_on_the_exported_mixtral(tmp_path):
    """LoRA swaps the blocks' linears named by its targets: in an MoE, the attention's (the
    experts are stacked weights, the router is not a target). PEFT's loader on the exported
    MixtralForCausalLM gives ember's adapted logits."""
    peft = pytest.importorskip("peft")
    from ember.export.peft import save_peft
    from ember.model.hf import to_hf
    from ember.model.lora import LoRALinear, apply_lora

    model = GPT.build(moe_cfg(), seed=0).eval()
    hf = to_hf(model).eval()
    apply_lora(model, rank=4, alpha=8)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.copy_(0.1 * torch.randn(m.lora_B.shape, generator=g))
    model.eval()
    save_peft(model, tmp_path / "adapter")
    x = torch.randint(0, 96, (2, 12), generator=g)
    with torch.no_grad():
        base = hf(x).logits
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(x).logits
        ours = model(x)
    assert (ours - base).abs().max() > 1e-3  # the adapters change the logits
    assert (ours - theirs).abs().max().item() <= 1e-5
