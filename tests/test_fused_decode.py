"""ember's fused decode step (``Engine(..., kernels="triton")``, ember/infer/fused.py) against the
model's own: each kernel against its reference, then the whole step's logits and cache writes
(fp32, 1e-4) over several tokens, with GQA, RMSNorm, no biases, the Llama layout (RoPE, SwiGLU)
and left-padded rows, and the greedy completions of ``generate``. On a CPU the kernels run under
Triton's interpreter; tests/test_kernels_ptx.py compiles them for a GPU."""

from __future__ import annotations

import pytest
import torch

from ember.config import ModelConfig
from ember.errors import EmberError
from ember.infer.engine import Engine, StaticKVCache
from ember.infer.sampling import Sampling
from ember.kernels import triton_ready
from ember.model.gpt import GPT

pytestmark = pytest.mark.skipif(not triton_ready("cpu")[0] and not torch.cuda.is_available(),
                                reason=triton_ready("cpu")[1])  # fmt: skip
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPT2 = {"pos": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True}
LAYOUTS = {
    "gpt2": GPT2,
    "gqa-rms-nobias": {**GPT2, "n_kv_head": 2, "norm": "rmsnorm", "bias": False},
    "no-positions": {**GPT2, "pos": "none"},
    "llama": {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "n_kv_head": 2},
}


@pytest.fixture(params=["dot", "fma"])
def gemv(request, monkeypatch):
    """The products' two kinds of tuning config: tl.dot on rows padded to 16 (the interpreter's
    one config) and one row a program on the CUDA cores, which the GPU's tuner may pick."""
    import triton

    from ember.kernels import decode

    if request.param.startswith("fma"):  # fma4: tiles of 4 outputs (N = 37 in 10 programs)
        n = 4 if request.param == "fma4" else 16
        fma = triton.Config({"BLOCK_M": 1, "DOT": False, "BLOCK_N": n, "BLOCK_K": 32})
        monkeypatch.setattr(decode._linear_kernel, "configs", [fma])
        monkeypatch.setattr(decode._linear_kernel, "cache", {})  # (its choices, by shape: none yet)
    return request.param


def tiny(**layout) -> GPT:
    cfg = ModelConfig(vocab_size=320, n_layer=2, n_head=4, d_model=64, max_seq_len=64, init_std=0.1, **layout)
    return GPT.build(cfg, device=DEVICE, seed=0).eval()


@pytest.mark.parametrize("gemv", ["dot", "fma", "fma4"], indirect=True)
@pytest.mark.parametrize("pdl", [False, True])
def test_linear_kernel_matches_its_reference(pdl, gemv):
    """Both roads (each weight tile loaded where it is used; with pdl the first before anything
    else), with both kinds of config."""
    from ember.kernels.decode import ACTS, NORMS, decode_linear, decode_linear_ref

    g = torch.Generator().manual_seed(0)
    x, w, r = (torch.randn(*s, generator=g).to(DEVICE) for s in ((3, 40), (37, 40), (3, 37)))
    gain, beta, bias = (torch.randn(n, generator=g).to(DEVICE) for n in (40, 40, 37))
    cases = [
        (x, w, bias, gain, beta, None, 1e-5, NORMS["layer"], ACTS["gelu"], None),
        (x, w, None, gain, None, None, 1e-6, NORMS["rms"], ACTS["none"], torch.float64),
        (x, w, bias, None, None, r, 0.0, NORMS["none"], ACTS["none"], None),  # ragged N = 37, K = 40
        (x[:, :24], w[:, :24], bias, gain[:24], beta[:24], None, 1e-5, NORMS["layer"], ACTS["gelu"],
         None),  # K = 24: the rows in one tile (read once for the statistics and the product)
        (x, torch.cat([w, w.flip(0)]), torch.cat([bias, bias]), gain, None, None, 1e-6, NORMS["rms"],
         ACTS["swiglu"], None),  # gate's rows, then up's
    ]
    for args in cases:
        torch.testing.assert_close(decode_linear(*args, pdl), decode_linear_ref(*args), rtol=1e-5, atol=1e-5)


def assert_steps_match(model, step, ids, slots: int, pad: list[int], prompt: int, steps: int) -> None:
    """Prefill ``prompt`` tokens of ``ids`` into two static caches, then ``steps`` tokens through
    the model's step and through ``step``: the same logits (fp32, 1e-4) and the same cache."""
    caches = [StaticKVCache(slots, pad=pad, device=DEVICE) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            model(ids[:, :prompt], cache=cache)
        for t in range(prompt, prompt + steps):
            want = model(ids[:, t : t + 1], cache=caches[0])
            torch.testing.assert_close(step(ids[:, t : t + 1], cache=caches[1]), want, rtol=1e-4, atol=1e-4)
    assert int(caches[1].pos) == int(caches[0].pos) == prompt + steps
    for kv in ("k", "v"):
        for layer in caches[0].k:
            torch.testing.assert_close(getattr(caches[1], kv)[layer], getattr(caches[0], kv)[layer])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_step_matches_the_models_step(layout):
    """Prefill, then 3 tokens: the same logits and the same keys and values in the cache, for a
    batch of two rows, the second left-padded by 3 (a mask and shifted positions)."""
    from ember.infer.fused import FusedDecode

    torch.manual_seed(0)
    model = tiny(**LAYOUTS[layout])
    ids = torch.randint(0, 320, (2, 12), device=DEVICE)
    assert_steps_match(model, FusedDecode(model), ids, slots=20, pad=[0, 3], prompt=7, steps=3)


@pytest.mark.parametrize("pdl", [False, True])
def test_fused_step_reads_many_tiles_of_slots_on_both_roads(pdl, gemv):
    """Past 64 held slots, the attention's loop walks two tiles and more, and with ``pdl`` reads
    each one a step ahead (and the weights' tiles, 128 inputs in tiles of 32): the same logits and
    cache as the model's step, and as each other."""
    from ember.infer.fused import FusedDecode

    cfg = ModelConfig(vocab_size=320, n_layer=1, n_head=4, d_model=128, max_seq_len=128, init_std=0.1,
                      **LAYOUTS["llama"])  # fmt: skip
    model = GPT.build(cfg, device=DEVICE, seed=0).eval()
    ids = torch.randint(0, 320, (2, 80), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert_steps_match(model, FusedDecode(model, pdl=pdl), ids, slots=100, pad=[0, 5], prompt=70, steps=2)


@pytest.mark.parametrize("persistent", [False, True])
def test_generate_with_the_fused_step_gives_the_same_completions(persistent):
    """Through GraphedDecode, on both roads: five launches a block, and the whole step in one
    (``FusedDecode.persistent``, ember/kernels/persistent.py); 4 tokens, each slow interpreted."""
    from ember.infer.fused import FusedDecode

    tok = _tokenizer()
    model = tiny(**GPT2)
    prompts, n = ["def f(x):", "return x +"], 4
    plain = Engine(model, tok).generate(prompts, Sampling(max_new_tokens=n, temperature=0))
    engine = Engine(model, tok, graphs=True, kernels="triton")
    assert isinstance(engine.decode.step, FusedDecode) and engine.decode.step.pdl  # through GraphedDecode
    engine.decode.step.persistent = persistent
    fused = engine.generate(prompts, Sampling(max_new_tokens=n, temperature=0))
    assert [c.token_ids for c in fused] == [c.token_ids for c in plain]


def test_what_the_fused_step_does_not_cover_is_refused_by_name():
    from ember.infer.fused import FusedDecode

    with pytest.raises(EmberError, match=r"model.mlp=relu2, model.qk_norm.*kernels=torch"):
        FusedDecode(tiny(**GPT2 | {"mlp": "relu2", "qk_norm": True}))
    with pytest.raises(EmberError, match="head dimension of 24, not a power of two"):
        FusedDecode(GPT.build(ModelConfig(vocab_size=320, n_layer=1, n_head=4, d_model=96, **GPT2), seed=0))
    with pytest.raises(EmberError, match="never compiled: drop compile"):
        Engine(tiny(**GPT2), _tokenizer(), compile=True, kernels="triton")


def _tokenizer():
    from ember.data.tokenizer import Tokenizer

    return Tokenizer.train_bpe(["def f(x):\n    return x + 1\n" * 8], 300)
