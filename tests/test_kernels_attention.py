"""The FlashAttention kernel against its reference, forward and backward, under Triton's
interpreter on the CPU (blocks of 32 x 16, so T = 37 leaves ragged blocks everywhere).

Tolerances, as max |kernel - reference| / max |reference| per tensor: fp32 and fp64 1e-5 (the
interpreter's dots are numpy's, so only the order of summation differs); bf16 2e-2 and fp16 2e-3
against the fp32 reference on the same rounded inputs (P and dS are rounded to the input dtype
before their dots, as on a GPU)."""

import pytest
import torch

import ember.kernels  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA: before anything imports triton)

pytest.importorskip("triton", reason="the Triton kernels need triton (pip install 'ember[kernels]')")

from ember.kernels.attention import flash_attention, flash_attention_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float64: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _check(q, k, v, causal, scale=None):
    """Output and (q, k, v) gradients against the reference run in fp32 on the same inputs."""
    tol = TOL[q.dtype]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = flash_attention(q, k, v, causal=causal, scale=scale)
    assert o.shape == q.shape and o.dtype == q.dtype
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    up = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = flash_attention_ref(*up, causal=causal, scale=scale)
    ref_grads = torch.autograd.grad(ref, up, do.double())
    assert _err(o, ref) < tol
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert g.shape == r.shape and g.stride() == torch.empty_like(g).stride()
        assert _err(g, r) < tol, name


@pytest.mark.parametrize(
    "B, H, Hkv, T, hd, causal",
    [
        (1, 2, 2, 37, 16, True),  # the tiny model's head dim, ragged T
        (1, 4, 2, 37, 16, False),  # GQA, no mask
        (1, 4, 2, 37, 64, True),  # GQA, gpt2's head dim
        (1, 2, 1, 21, 128, True),  # llama's head dim, GQA 2:1
        (2, 2, 2, 5, 32, True),  # T under one block
    ],
)
def test_matches_reference_fp32(B, H, Hkv, T, hd, causal):
    torch.manual_seed(T + hd)
    q = torch.randn(B, H, T, hd, device=DEVICE)
    k, v = torch.randn(2, B, Hkv, T, hd, device=DEVICE).unbind(0)
    _check(q, k, v, causal, scale=0.3 if not causal else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_strided_inputs(dtype):
    """q, k, v as the model makes them: views of (B, T, heads, hd) transposed; k and v slices of
    one tensor, so they have gaps and their gradients come back dense."""
    torch.manual_seed(1)
    B, T, H, Hkv, hd = 2, 37, 4, 2, 64
    q = torch.randn(B, T, H * hd, device=DEVICE, dtype=dtype).view(B, T, H, hd).transpose(1, 2)
    kv = torch.randn(B, T, 2, Hkv, hd, device=DEVICE, dtype=dtype)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    _check(q, k, v, causal=True)


def test_gradcheck_fp64():
    torch.manual_seed(2)
    q = torch.randn(1, 2, 7, 16, dtype=torch.float64, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(1, 1, 7, 16, dtype=torch.float64, device=DEVICE).requires_grad_() for _ in range(2))
    assert torch.autograd.gradcheck(flash_attention, (q, k, v), fast_mode=True)


def test_compiles_without_graph_break():
    """A block's attention under torch.compile(fullgraph=True): the op and its backward trace
    through their fake implementations, and the compiled step equals eager."""
    torch.manual_seed(3)
    x = torch.randn(2, 20, 32, device=DEVICE)
    w = torch.randn(32, 96, device=DEVICE, requires_grad=True)

    def step(x, w):
        B, T, C = x.shape
        q, k, v = (x @ w).view(B, T, 3, 2, 16).unbind(2)
        o = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return o.transpose(1, 2).reshape(B, T, C).square().sum()

    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(x, w)
    (grad,) = torch.autograd.grad(loss, w)
    eager = step(x, w)
    (eager_grad,) = torch.autograd.grad(eager, w)
    torch.testing.assert_close(loss, eager)
    torch.testing.assert_close(grad, eager_grad)


def test_rejects_bad_shapes():
    q = torch.randn(1, 3, 8, 16)
    with pytest.raises(ValueError, match="H % Hkv"):
        flash_attention(q, torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16))
    with pytest.raises(ValueError, match="head dims"):
        flash_attention(torch.randn(1, 2, 8, 24), torch.randn(1, 2, 8, 24), torch.randn(1, 2, 8, 24))
