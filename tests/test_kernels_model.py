"""train.kernels=triton: ember's kernels swapped into the model and the loss, against PyTorch's.

The kernels run under Triton's interpreter here (ember.kernels sets TRITON_INTERPRET=1 on a
machine without CUDA), so shapes are tiny; each kernel's own tests are tests/test_kernels_*.py.
"""

import pytest
import torch

import ember.kernels  # noqa: F401  (before triton: the interpreter must be chosen first)
from ember.config import ModelConfig
from ember.errors import ConfigError
from ember.model.gpt import GPT, Attention
from ember.run import read_metrics
from ember.train.trainer import train

pytest.importorskip("triton", reason="Triton is not installed: the torch path runs, the kernels are untested")

LLAMA = dict(vocab_size=97, n_layer=2, n_head=4, n_kv_head=2, d_model=64, max_seq_len=32)
GPT2 = dict(vocab_size=97, n_layer=1, n_head=2, d_model=32, max_seq_len=32, pos="learned", norm="layernorm",
            mlp="gelu", bias=True, logit_softcap=15.0)  # fmt: skip


@pytest.mark.parametrize("shape", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_triton_model_equals_torch_model(shape):
    """Logits and every gradient of the same weights, norms + RoPE + attention on the kernels."""
    torch.manual_seed(0)
    ref = GPT.build(ModelConfig(**shape), seed=0)
    fast = GPT.build(ModelConfig(**shape), seed=0).set_kernels("triton")
    assert type(fast.norm).__module__ == "ember.kernels.norm"
    idx = torch.randint(0, 97, (2, 19))  # 19: not a multiple of any block
    outs = []
    for model in (ref, fast):
        logits = model(idx)
        logits.square().mean().backward()
        outs.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    fast.set_kernels("torch")  # and back: PyTorch's modules and functions again
    assert type(fast.norm) is torch.nn.RMSNorm or type(fast.norm) is torch.nn.LayerNorm
    torch.testing.assert_close(fast(idx), outs[0][0])


def test_compiled_block_traces_through_the_kernels():
    """fullgraph=True: a graph break (an op dynamo cannot trace) would raise."""
    model = GPT.build(ModelConfig(**LLAMA), seed=0).set_kernels("triton")
    block = model.layers["0"]
    x = torch.randn(2, 16, 64, requires_grad=True)
    rope = model.pos(x, torch.arange(16))[1]
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, rope), block(x, rope))
    assert any(isinstance(m, Attention) for m in block.modules())


def test_tiny_training_with_triton_kernels_matches_torch(tiny_cfg):
    """20 steps of `ember train tiny`: the loss with train.kernels=triton (norms, RoPE,
    attention, fused linear + cross-entropy with z-loss) within 1e-4 of train.kernels=torch,
    eager, and over 6 steps with the whole step compiled."""
    # the interpreter spends milliseconds on each program: a one-layer tiny on 2 rows of 8 tokens
    common = ["train.precision=fp32", "train.deterministic=true", "train.max_steps=20", "train.eval_every=0",
              "train.z_loss=1e-4", "train.seq_len=8", "train.batch_tokens=16", "train.micro_batch=2",
              "train.eval_windows=2", "model.n_layer=1"]  # fmt: skip
    # and the kernels inside one compiled graph of forward and loss: what train.compile_scope=auto
    # gives train.kernels=triton on one GPU (dynamo traces the custom ops, inductor calls them)
    # (6 steps: a compile, then interpreted kernels called from inductor's code)
    whole = ("train.kernels=triton", "train.compile=true", "train.compile_scope=model", "train.max_steps=6")
    legs = {"torch": ("train.kernels=torch",), "triton": ("train.kernels=triton",)}
    legs |= {"torch6": ("train.kernels=torch", "train.max_steps=6"), "whole6": whole}
    curves = {}
    for name, kind in legs.items():
        cfg = tiny_cfg(*common, f"run.name={name}", *kind)
        train(cfg)
        rows = read_metrics(f"{cfg.run.out_dir}/{name}")
        curves[name] = {r["step"]: r["loss"] for r in rows if "loss" in r}
    for a, b in (("torch", "triton"), ("torch6", "whole6")):
        assert sorted(curves[a]) == sorted(curves[b]) and len(curves[a]) >= 4
        assert all(abs(curves[a][s] - curves[b][s]) < 1e-4 for s in curves[a]), (curves[a], curves[b])


def test_triton_kernels_refuse_layouts_they_cannot_serve(tiny_cfg):
    from ember.train.layout import check_layout

    with pytest.raises(ConfigError, match="train.kernels=triton runs on one device or under DDP"):
        check_layout(tiny_cfg("train.kernels=triton", "parallel.tp=2"), 2)
    with pytest.raises(ConfigError, match="without train.qat"):
        check_layout(tiny_cfg("train.kernels=triton", "train.qat=int8-weight"), 1)


def test_the_cli_chooses_the_interpreter_before_torch_imports_triton():
    """``ember train tiny train.kernels=triton`` on a CPU with no TRITON_INTERPRET set: a model
    module's torch imports pull in triton (torch.utils.flop_counter), so ember.model imports
    ember.kernels first, which sets it; before, the run stopped with "triton was imported
    before ember.kernels"."""
    import os
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("with CUDA the kernels run compiled: there is no interpreter to choose")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import ember.model.vision, sys; from ember.kernels import triton_ready; print('triton' in sys.modules, triton_ready('cpu'))"  # fmt: skip # noqa: E501
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True (True, '')", out.stdout + out.stderr
