"""LoRA and QLoRA: adapters on frozen linears, merging, PEFT's format, the NF4 code book."""

import json

import pytest
import torch
import torch.nn.functional as F

from ember.config import ModelConfig
from ember.errors import EmberError
from ember.export.peft import save_peft
from ember.model.gpt import GPT
from ember.model.lora import (
    NF4_CODE,
    LoRALinear,
    NF4Linear,
    adapters_disabled,
    apply_lora,
    load_lora_state_dict,
    lora_counts,
    lora_state_dict,
    lora_summary,
    merge_lora,
    nf4_code_book,
)

LLAMA = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2)
GPT2 = dict(pos="learned", norm="layernorm", mlp="gelu", bias=True)


def _model(**layout) -> GPT:
    cfg = ModelConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, max_seq_len=64, **(layout or LLAMA))
    return GPT.build(cfg, seed=0).eval()


def _randomize_b(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)


IDX = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))

# QLoRA (Dettmers et al. 2023) appendix E, as bitsandbytes ships it (functional.py, NF4 lookup table).
PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
]  # fmt: skip


@pytest.mark.parametrize("layout", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_lora_starts_at_the_base_trains_only_adapters_and_merges_exactly(layout):
    model = _model(**layout)
    with torch.no_grad():
        base = model(IDX)
    apply_lora(model, rank=4, alpha=8)
    with torch.no_grad():
        assert torch.equal(model(IDX), base)  # B = 0: the base model exactly
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert "trainable of" in lora_summary(model) and "r=4" in lora_summary(model)
    _randomize_b(model)
    with torch.no_grad():
        adapted = model(IDX)
        assert (adapted - base).abs().max() > 1e-3
        with adapters_disabled(model):
            torch.testing.assert_close(model(IDX), base, rtol=0, atol=0)
        state = {k: v.clone() for k, v in lora_state_dict(model).items()}
        merge_lora(model)
        assert not any(isinstance(m, LoRALinear) for m in model.modules())
        torch.testing.assert_close(model(IDX), adapted, rtol=0, atol=1e-5)
    fresh = apply_lora(_model(**layout), rank=4, alpha=8)
    load_lora_state_dict(fresh, state)
    with torch.no_grad():
        torch.testing.assert_close(fresh(IDX), adapted, rtol=0, atol=0)


def test_gradients_reach_only_the_adapters():
    model = apply_lora(_model(), rank=2, alpha=4, targets=("wq", "wv"))
    _randomize_b(model)
    model.train()
    model(IDX).logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (".lora_" in name), name


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_lora_plus_gives_the_b_matrices_their_own_rate(optimizer):
    from ember.config import TrainConfig
    from ember.train.optim import param_groups

    model = apply_lora(_model(), rank=2, alpha=4, targets=("wq", "wv"))
    names = {id(p): n for n, p in model.named_parameters()}
    for ratio, roles in ((1.0, {"vector+lora_b": 5e-3}), (16.0, {"vector": 5e-3, "lora_b": 8e-2})):
        groups = param_groups(model, TrainConfig(lr=5e-3, lora_plus=ratio, optimizer=optimizer))
        assert {g["role"].removeprefix("embed+"): g["peak_lr"] for g in groups} == pytest.approx(roles)
        for g in groups:  # B matrices (zero at the start) in lora_b, A matrices in vector; no decay
            assert g["weight_decay"] == 0 and not g.get("use_muon")
            assert {".lora_B" in names[id(p)] for p in g["params"]} == ({True} if g["role"] == "lora_b" else
                    {True, False} if "lora_b" in g["role"] else {False})  # fmt: skip


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("layout", [LLAMA, GPT2], ids=["llama", "gpt2-bias"])
def test_the_written_out_backward_equals_autograds(layout, autocast):
    """LoRALinear's fast path (``_FrozenLoRA``: one buffer for x's two gradients) against the
    plain autograd path it replaces (forced by a dropout module that is a no-op: p = 0); also
    under bf16 autocast, as train.precision=bf16 runs it (the backward is outside autocast's
    reach: it must cast its own operands), to bf16's precision."""
    fast = apply_lora(_model(**layout), rank=4, alpha=8).train()
    plain = apply_lora(_model(**layout), rank=4, alpha=8).train()
    _randomize_b(fast)
    plain.load_state_dict(fast.state_dict())  # the same A (drawn from the global generator) and B
    for m in plain.modules():
        if isinstance(m, LoRALinear):
            m.dropout = torch.nn.Dropout(0.0)  # not Identity: the plain path
    for model in (fast, plain):
        model.tok_embeddings.weight.requires_grad_(True)  # so that x's gradient is needed too
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = model(IDX)
        out.float().logsumexp(-1).mean().backward()
    for (name, p), q in zip(fast.named_parameters(), plain.parameters(), strict=True):
        if p.requires_grad:
            assert p.grad.dtype == p.dtype, name
            if autocast:  # bf16: 8 bits of mantissa, summed in different orders
                assert (p.grad - q.grad).norm() <= 1e-2 * q.grad.norm() + 1e-6, name
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_targets_that_match_nothing_list_the_names():
    with pytest.raises(EmberError, match=r"\['q_proj'\].*wk, wo, wq, wv") as e:
        apply_lora(_model(), targets=("q_proj",))
    assert "w1" in str(e.value)


ROWS = [4, 5, 6, 7]  # the chat tokens' ids in an ember tokenizer


@pytest.mark.parametrize(
    "layout,targets,rows",
    [(LLAMA, None, ()), (GPT2, None, ()), (GPT2, ("wq", "wv", "w2"), ()), (LLAMA, None, ROWS),
     ({**LLAMA, "tie_embeddings": False}, None, ROWS), (GPT2, None, ROWS)],
    ids=["llama", "gpt2", "gpt2-partial-qkv", "llama-rows", "llama-untied-rows", "gpt2-rows"],
)  # fmt: skip
def test_peft_loads_embers_adapters_on_the_exported_base(tmp_path, layout, targets, rows):
    """The acceptance point: PEFT's own loader, on the base ember exports, gives ember's adapted
    logits. GPT-2's partial case puts adapters on q and v only (zero k block of the fused c_attn)
    and on mlp.c_proj but not attn.c_proj, which share a name. With ``rows``, embedding (and an
    untied head's) rows trained too: PEFT's trainable tokens."""
    import peft

    from ember.model.hf import to_hf

    model = _model(**layout)
    hf = to_hf(model).eval()  # the base, exported before the adapters are applied
    apply_lora(model, rank=4, alpha=8, dropout=0.1, **({"targets": targets} if targets else {}))
    _randomize_b(model)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in model.modules():  # A as well, so that a transposed or misplaced block shows
            if isinstance(m, LoRALinear):
                m.lora_A.mul_(3.0)
        for table in {model.tok_embeddings.weight, model.output.weight} if rows else ():
            table[rows] = 0.1 * torch.randn(len(rows), table.size(1), generator=g)
    model.eval()
    save_peft(model, tmp_path / "adapter", token_rows=rows)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert config["fan_in_fan_out"] == (layout["mlp"] == "gelu")
    if layout["mlp"] == "swiglu":  # Llama
        assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                   "up_proj", "down_proj"])  # fmt: skip
    elif targets is None:
        assert config["target_modules"] == ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
        assert config["rank_pattern"] == {"c_attn": 12} and config["alpha_pattern"] == {"c_attn": 24}
    else:
        assert config["target_modules"] == ["attn.c_attn", "mlp.c_proj"]
        assert config["rank_pattern"] == {"c_attn": 8} and config["alpha_pattern"] == {"c_attn": 16}
    idx = IDX.clone()
    idx[:, 1 : 1 + len(rows)] = torch.tensor(rows, dtype=idx.dtype)
    untied = not layout.get("tie_embeddings", True)
    assert config["trainable_token_indices"] == (
        None if not rows else {"embed_tokens": ROWS, "lm_head": ROWS} if untied else ROWS
    )
    with torch.no_grad():
        base = hf(idx).logits
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()  # adapts hf in place
    theirs_keys = set(peft.get_peft_model_state_dict(peft_model))
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "adapter" / "adapter_model.safetensors")) == theirs_keys
    with torch.no_grad():
        ours, theirs = model(idx), peft_model(idx).logits
        assert (ours - base).abs().max() > 1e-3  # the adapters matter
        if rows:  # and so do the rows: without them, PEFT's logits differ
            assert (ours[:, :, rows] - base[:, :, rows]).abs().max() > 1e-2
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_save_peft_refuses_a_model_without_adapters_or_hf_counterpart(tmp_path):
    with pytest.raises(EmberError, match="no LoRA adapters"):
        save_peft(_model(), tmp_path / "none")
    save_peft(apply_lora(_model(), rank=2, alpha=2), tmp_path / "named", "runs/base/model")
    config = json.loads((tmp_path / "named" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "runs/base/model"
    relu2 = apply_lora(_model(**{**GPT2, "mlp": "relu2"}), rank=2, alpha=2)
    with pytest.raises(EmberError, match="mlp=relu2"):
        save_peft(relu2, tmp_path / "relu2")


def test_the_nf4_code_book_is_the_published_one():
    published = torch.tensor(PUBLISHED_NF4)
    assert torch.equal(torch.tensor(NF4_CODE), published)  # the table the layers use
    torch.testing.assert_close(nf4_code_book(), published, rtol=0, atol=1e-4)  # rebuilt from N(0,1) quantiles
    assert nf4_code_book()[7] == 0 and (nf4_code_book() > 0).sum() == 8  # exact zero, 8 positive, 7 negative


@pytest.mark.parametrize("double_quant", [True, False])
def test_nf4_round_trip_nearest_level_and_bytes(double_quant):
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    layer = NF4Linear(w, None, block=64, double_quant=double_quant)
    deq = layer.dequantize()
    absmax = w.reshape(-1, 64).abs().amax(1, keepdim=True)
    code = torch.tensor(NF4_CODE)
    nearest = code[(w.reshape(-1, 64) / absmax)[..., None].sub(code).abs().argmin(-1)] * absmax
    tolerance = 0.0 if not double_quant else absmax.max().item() * 2e-3  # int8 block maxima
    assert (deq.reshape(-1, 64) - nearest).abs().max() <= tolerance + 1e-7
    assert (deq - w).abs().max() <= absmax.max() * (1 - NF4_CODE[-2]) / 2 + tolerance + 1e-7  # widest gap
    ratio = layer.storage_bytes() / (w.numel() * 4)
    print(f"NF4 bytes / fp32 bytes: {ratio:.3f} (double quantization {double_quant})")
    assert ratio <= (0.135 if double_quant else 0.145) and ratio <= 0.3


def test_qlora_forward_is_the_dequantized_linear_plus_the_adapter():
    model = apply_lora(_model(), rank=4, alpha=8, nf4=True)
    _randomize_b(model)
    layer = model.layers["0"].attention.wq
    assert isinstance(layer.base, NF4Linear)
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = (
            F.linear(x, layer.base.dequantize())
            + F.linear(F.linear(x, layer.lora_A), layer.lora_B) * layer.scale
        )
        assert torch.equal(layer(x), want)
        adapted = model(IDX)
        merge_lora(model)
        torch.testing.assert_close(model(IDX), adapted, rtol=0, atol=1e-5)


def test_lora_sft_run_resumes_bitwise_saves_adapters_only_and_exports_merged(tiny_cfg, tmp_path):
    import json
    import shutil
    from pathlib import Path

    from torch.distributed.checkpoint import FileSystemReader

    from ember.run import load_run, read_metrics
    from ember.train.trainer import train

    base_cfg = tiny_cfg("run.name=base", "train.max_steps=3", "train.eval_every=0")
    train(base_cfg)
    base = Path(base_cfg.run.out_dir) / "base"
    args = ["run.name=lora", "train.task=sft", "sft.data=add-2", "sft.examples=60", f"train.init_from={base}",
            "train.lora_rank=4", "train.deterministic=true", "train.max_steps=6", "train.ckpt_every=3",
            "train.keep_last=3", "train.lora_dropout=0.1", "train.lora_chat_tokens=false"]  # fmt: skip
    train(tiny_cfg(*args))
    run = base.parent / "lora"
    full = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}
    saved = FileSystemReader(str(run / "checkpoints" / "step-000003")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)  # the frozen base is not in it
    shutil.rmtree(run / "checkpoints" / "step-000006")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines if r["step"] <= 3))
    train(tiny_cfg(*args, "train.resume=auto"))
    assert {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r} == full
    merged, _ = load_run(run)  # an ordinary run: the adapters merged into plain weights
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert (run / "adapter" / "adapter_config.json").is_file()
    base_model, _ = load_run(base)
    idx = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (merged(idx) - base_model(idx)).abs().max() > 0  # the adapters moved it


def test_with_chat_tokens_only_their_embedding_rows_move(tiny_cfg, tmp_path):
    """... and the run's adapter/ holds them as PEFT's trainable tokens: PEFT on the exported
    base gives the run's merged logits."""
    from pathlib import Path

    import peft
    import transformers

    from ember.cli import main
    from ember.data.chat import chat_ids, render
    from ember.run import load_run
    from ember.train.trainer import train

    base_cfg = tiny_cfg("run.name=base", "train.max_steps=2", "train.eval_every=0")
    train(base_cfg)
    base = Path(base_cfg.run.out_dir) / "base"
    args = ["run.name=rows", "train.task=sft", "sft.data=add-2", "sft.examples=40", f"train.init_from={base}"]
    train(tiny_cfg(*args, "train.lora_rank=2", "train.max_steps=4", "train.eval_every=0"))
    before, tokenizer = load_run(base)
    after, _ = load_run(base.parent / "rows")
    moved = (
        (after.tok_embeddings.weight != before.tok_embeddings.weight).any(dim=1).nonzero().flatten().tolist()
    )
    assert moved and set(moved) <= set(chat_ids(tokenizer).values())
    config = json.loads((base.parent / "rows" / "adapter" / "adapter_config.json").read_text())
    assert config["trainable_token_indices"] == sorted(chat_ids(tokenizer).values())
    assert main(["export", str(base), "--to", "hf", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    peft_model = peft.PeftModel.from_pretrained(hf, base.parent / "rows" / "adapter").eval()
    ids = render(
        tokenizer, [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    )[0]
    with torch.no_grad():
        x = torch.tensor([ids])
        torch.testing.assert_close(peft_model(x).logits, after(x), rtol=0, atol=1e-5)


def test_counts_and_summary_are_the_adapter_sizes():
    model = _model()  # Llama: d 64, k/v 32 wide (2 kv heads of 16), SwiGLU hidden 192
    total = sum(p.numel() for p in model.parameters())
    apply_lora(model, rank=4, alpha=8)
    per_block = 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 192))
    assert lora_counts(model) == (2 * per_block, total + 2 * per_block)
    assert lora_summary(model) == (
        f"LoRA r=4: {2 * per_block:,} trainable of {total + 2 * per_block:,} parameters "
        f"({2 * per_block / (total + 2 * per_block):.2%})"
    )
    qlora = apply_lora(_model(), rank=4, alpha=8, nf4=True)  # NF4 weights count as what they stand for
    assert lora_counts(qlora) == lora_counts(model)


@pytest.mark.parametrize("nf4", [False, True], ids=["lora", "qlora"])
def test_a_meta_built_model_is_wrapped_then_materialised(nf4):
    """DESIGN rule 1: build on meta, transform, ``to_empty`` + ``init_weights``."""
    cfg = ModelConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, max_seq_len=64, **LLAMA)
    with torch.device("meta"):
        model = GPT(cfg)
    apply_lora(model, rank=4, alpha=8, nf4=nf4)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(layers) == 14
    for m in layers:
        assert torch.equal(m.lora_B, torch.zeros_like(m.lora_B))
        assert 0 < m.lora_A.abs().max() <= 1 / m.in_features**0.5  # Kaiming-uniform, a = sqrt(5)
        w = m.base.dequantize() if nf4 else m.base.weight
        assert w.isfinite().all() and 0.5 * cfg.init_std / 2 < w.std() < 1.5 * cfg.init_std
    with torch.no_grad():
        logits = model.eval()(IDX)
        with adapters_disabled(model):
            assert torch.equal(model(IDX), logits)  # B = 0


def test_bad_rank_and_nf4_block_are_user_errors():
    with pytest.raises(EmberError, match="rank 0"):
        apply_lora(_model(), rank=0)
    with pytest.raises(EmberError, match="blocks of 48"):
        NF4Linear(torch.randn(64, 40), None, block=48)
    with pytest.raises(EmberError, match="do not fit"):
        load_lora_state_dict(apply_lora(_model(), rank=2), {"layers.0.attention.wq.lora_X": torch.zeros(1)})
