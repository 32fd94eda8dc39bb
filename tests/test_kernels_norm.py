"""The norm, softmax and RoPE kernels against their torch references, forward and backward, on
ragged shapes, under Triton's interpreter on a CPU; on a CUDA machine the same tests run the real
kernels on the GPU (``bash benchmarks/gpu.sh kernels``).

Tolerances: fp32 within 1e-5 relative (atol 1e-6 of the reference's largest value); bf16 within
2e-2, one bf16 step: the interpreter casts fp32 to bf16 by truncation, a GPU rounds to nearest.
"""

import ast

import pytest
import torch
from torch import nn

import ember.kernels  # noqa: F401  (first: sets TRITON_INTERPRET=1 without CUDA, before triton loads)

pytest.importorskip("triton", reason="ember's kernels are Triton: pip install 'ember[kernels]'")

from ember.kernels import softmax as softmax_module  # noqa: E402
from ember.kernels.norm import (  # noqa: E402
    LayerNorm,
    RMSNorm,
    add_layer_norm,
    add_rms_norm,
    layer_norm,
    layer_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from ember.kernels.rope import rope_qk, rope_qk_ref  # noqa: E402
from ember.kernels.softmax import softmax, softmax_ref  # noqa: E402
from ember.model.gpt import RotaryPositions, apply_rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_near(got, want):
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
            continue
        scale = (b.detach().abs().max().item() if b.numel() else 0.0) or 1.0
        rtol, atol = (2e-2, 2e-2) if b.dtype == torch.bfloat16 else (1e-5, 1e-6)
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * scale)


def outputs_and_grads(fn, inputs):
    """fn(*inputs) -> its outputs and the gradients of a random projection of them."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(1)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outs)
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(loss, wanted, allow_unused=True)
    return [o.detach() for o in outs] + list(grads)


def leaves(dtype, *shapes):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=gen) + 0.5).to(DEVICE, dtype).requires_grad_() for s in shapes]


NORMS = {  # name -> (kernel, reference, whether it takes a bias, a residual)
    "rms": (rms_norm, rms_norm_ref, False, False),
    "layer": (layer_norm, layer_norm_ref, True, False),
    "add_rms": (add_rms_norm, lambda x, r, w, eps: (rms_norm_ref(x + r, w, eps), x + r), False, True),
    "add_layer": (add_layer_norm, lambda x, r, w, b, e: (layer_norm_ref(x + r, w, b, e), x + r), True, True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (37, 20): 3 programs; (50, 200): the forward's tiles of 16 rows, the last ragged, and 7 rows a
# backward program (pipelined); 200 wide, not 700: the interpreter sums LayerNorm's joint reduction
# value by value in Python, and 700 took 10-28 s a case
@pytest.mark.parametrize("shape", [(3, 37), (5, 130), (2, 3, 20), (37, 20), (50, 200)])
@pytest.mark.parametrize("name", list(NORMS))
def test_norm_matches_reference(name, shape, dtype):
    kernel, ref, has_bias, has_res = NORMS[name]
    x, r = leaves(dtype, shape, shape)
    w, b = leaves(dtype, shape[-1:], shape[-1:])
    inputs = [x] + [r] * has_res + [w] + [b] * has_bias + [1e-5]
    assert_near(outputs_and_grads(kernel, inputs), outputs_and_grads(ref, inputs))


def test_norm_configs_match_reference(monkeypatch):
    """Every config the forward's and the backward's tuners may pick gives the reference's outputs
    and gradients (warps and stages, which the interpreter ignores; rows a program 1-8 forward, a
    last program of 1-5 of the 37 rows)."""
    from ember.kernels import norm

    configs = norm.forward_configs(32)
    assert configs[0] == (norm.rows_per_program(32), 4) and len(configs) == 1 + len(norm.FORWARD_CONFIGS)
    assert norm.forward_configs(4096) == [(1, 8)]  # wide rows: the first alone
    assert norm.backward_configs(1024, 4) == norm.BACKWARD_CONFIGS  # fewer warps: at most 32 values a thread
    assert norm.backward_configs(2048, 4) == [c for c in norm.BACKWARD_CONFIGS if c[2] != 0.25]
    kernel, ref, _, _ = NORMS["add_layer"]
    x, r = leaves(torch.float32, (37, 20), (37, 20))
    w, b = leaves(torch.float32, (20,), (20,))
    want = outputs_and_grads(ref, [x, r, w, b, 1e-5])
    for config in configs:
        monkeypatch.setattr(norm, "FORWARD", config)
        assert_near(outputs_and_grads(kernel, [x, r, w, b, 1e-5]), want)
    for config in norm.BACKWARD_CONFIGS:  # 8-32 programs (2 "SMs" here), each summing its rows' dw, db
        monkeypatch.setattr(norm, "BACKWARD", config)
        assert_near(outputs_and_grads(kernel, [x, r, w, b, 1e-5]), want)


def test_norm_without_weight_and_default_eps():
    (x,) = leaves(torch.float32, (4, 33))
    assert_near(outputs_and_grads(rms_norm, [x, None]), outputs_and_grads(rms_norm_ref, [x, None]))
    inputs = [x, None, None]
    assert_near(outputs_and_grads(layer_norm, inputs), outputs_and_grads(layer_norm_ref, inputs))


@pytest.mark.parametrize("used", [0, 1])
def test_norm_with_an_output_unused_and_with_no_rows(used):
    """The backward gets no gradient for an unused output (nor for mean and rstd, never filled
    with zeros): only y's, or only h's, flows back. A batch of no rows runs no kernel."""
    x, r = leaves(torch.float32, (6, 20), (6, 20))
    w, b = leaves(torch.float32, (20,), (20,))
    ours, ref = (lambda *a, f=f: f(*a)[used] for f in (add_layer_norm, NORMS["add_layer"][1]))
    inputs = [x, r, w, b, 1e-5]
    want = outputs_and_grads(ref, inputs)  # (h alone: no gradient reaches w and b, which ours gives as zeros)
    want[3:] = [torch.zeros_like(t) if g is None else g for t, g in zip((w, b), want[3:], strict=True)]
    assert_near(outputs_and_grads(ours, inputs), want)
    empty = [t[:0].detach().requires_grad_() for t in (x, r)] + [w, b, 1e-5]
    assert_near(outputs_and_grads(add_layer_norm, empty), outputs_and_grads(NORMS["add_layer"][1], empty))


@pytest.mark.parametrize(
    "ours,theirs,kwargs",
    [(RMSNorm, nn.RMSNorm, {}), (LayerNorm, nn.LayerNorm, {"bias": False}), (LayerNorm, nn.LayerNorm, {})],
)
def test_norm_modules_swap_in(ours, theirs, kwargs):
    torch.manual_seed(0)
    stock = theirs(24, **kwargs).to(DEVICE)
    nn.init.normal_(stock.weight)  # not all ones, so a dropped weight would show
    mine = ours(24, **kwargs).to(DEVICE)
    mine.load_state_dict(stock.state_dict())
    assert mine.state_dict().keys() == stock.state_dict().keys()
    x = torch.randn(2, 3, 24, device=DEVICE)
    torch.testing.assert_close(mine(x), stock(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_backward_sums_its_partials_in_one_launch(dtype):
    """dw and db from the backward's per-program partial rows: 130 rows (three blocks of 64, the
    last ragged) by 37 columns (two blocks of 32), summed in fp32 and cast once to the output's
    dtype, as torch's sum and then its cast."""
    import triton.language as tl

    from ember.kernels import norm

    g = torch.Generator().manual_seed(0)
    pw, pb = (torch.randn(130, 37, generator=g).to(DEVICE) for _ in range(2))
    dw, db = (torch.empty(37, dtype=dtype, device=DEVICE) for _ in range(2))
    norm._sum_partials[(2,)](pw, pb, dw, db, 130, 37, HAS_W=True, HAS_B=True, ACC=tl.float32, BLOCK_P=64,
                             BLOCK_N=32)  # fmt: skip
    assert_near((dw, db), (pw.sum(0).to(dtype), pb.sum(0).to(dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 37), (5, 130), (2, 50_304)])
def test_softmax_matches_reference(shape, dtype):
    (x,) = leaves(dtype, shape)
    assert_near(outputs_and_grads(softmax, [x]), outputs_and_grads(softmax_ref, [x]))


@pytest.mark.parametrize("long", [(16, 1, 1, 1, False), (16, 1, 3, 0, True), (32, 1, 2, 2, True),
                                  (16, 1, 0, 1, True), (32, 1, 0, 2, False)])
def test_softmax_long_rows_loop(monkeypatch, long):
    """Rows longer than a block go by the two-pass loop: a block of 16 makes 37 columns three
    blocks, the last ragged (32: two); a row with -inf (masked) entries keeps finite outputs.
    Programs walk the rows: 2 "SMs" x 1 program for 3 rows (one program takes rows 0 and 2), one
    program a row, and 2 x 2 programs for 3 rows (one idle); with and without L2 hints; and each
    pass loading its next block itself (stages 0: the last prefetch past the row's end, the
    backwards pass's before its start, masked)."""
    monkeypatch.setattr(softmax_module, "_MAX_BLOCK", 16)
    monkeypatch.setattr(softmax_module, "LONG", long)
    (x,) = leaves(torch.float32, (3, 37))
    x.data[1, :20] = float("-inf")
    assert_near(outputs_and_grads(softmax, [x]), outputs_and_grads(softmax_ref, [x]))
    x64 = torch.randn(2, 37, dtype=torch.float64, device=DEVICE, requires_grad=True)
    assert torch.autograd.gradcheck(softmax, (x64,), fast_mode=True)


def rope_inputs(dtype, per_row: bool):
    """q, k as gpt.py makes them, transposes of (B, T, heads, hd) views; its cos/sin tables."""
    B, T, H, HK, hd = 2, 5, 3, 1, 12  # ragged: 3 and 1 heads, hd/2 = 6 in a block of 8
    positions = torch.arange(B * T).view(B, T) + 3 if per_row else torch.arange(T)
    _, (cos, sin) = RotaryPositions(hd, 16, 10_000.0)(None, positions)  # (B, 1, T, 6) or (1, T, 6)
    q, k = leaves(dtype, (B, T, H * hd), (B, T, HK * hd))
    q, k = q.view(B, T, H, hd).transpose(1, 2), k.view(B, T, HK, hd).transpose(1, 2)
    return [q, k, cos.to(DEVICE, dtype), sin.to(DEVICE, dtype)]


# rope.CONFIG, rope.LOADS_FIRST
ROADS = {"tile": ((2048, 4), True), "one-position": ((32, 1), True), "before": ((4096, 4), False)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("road", ROADS.values(), ids=ROADS.keys())
def test_rope_matches_reference(dtype, per_row, road, monkeypatch):
    """Each road: tiles of every position (T = 5), one position a program (q's and k's loads
    first), and the H200 lease's (k's loads after q's stores: kernels.py's "ember as before")."""
    from ember.kernels import rope

    monkeypatch.setattr(rope, "CONFIG", road[0])
    monkeypatch.setattr(rope, "LOADS_FIRST", road[1])
    inputs = rope_inputs(dtype, per_row)
    assert not inputs[0].is_contiguous()
    q, _, cos, sin = (t.detach().float() for t in inputs)
    torch.testing.assert_close(rope_qk_ref(q, q, cos, sin)[0], apply_rotary(q, (cos, sin)))  # gpt.py
    assert_near(outputs_and_grads(rope_qk, inputs), outputs_and_grads(rope_qk_ref, inputs))
    # in the linears' layout, out and back: transposes of (B, T, heads, hd), so the gradients reach
    # the (B, T, C) leaves as they are (a contiguous (B, H, T, hd) output cost the backward a copy)
    q_rot, k_rot = rope_qk(*inputs)
    assert q_rot.transpose(1, 2).is_contiguous() and k_rot.transpose(1, 2).is_contiguous()
    dq, dk = torch.autograd.grad((q_rot.float().sum(), k_rot.float().sum()), inputs[:2])
    assert dq.transpose(1, 2).is_contiguous() and dk.transpose(1, 2).is_contiguous()


def test_fastest_times_each_config_once_and_passes_over_one_that_cannot_launch(monkeypatch):
    """ember.kernels.fastest (the norm backward's tuner): on CUDA each config is timed once for a
    key, one that cannot launch is passed over however fast, and the winner is remembered; on a
    CPU, with one config, while a CUDA graph is captured, or in deterministic mode, the first
    config runs untimed.
    (do_bench and the capture check are stood in for: this machine has no CUDA.)"""
    import triton.runtime.errors as errors
    import triton.testing
    from triton.compiler.errors import CompilationError

    import ember.kernels as kernels

    cost, timed = {"a": 3.0, "b": 1.0, "c": 0.5}, []

    def run(config):
        if config == "c":
            raise errors.OutOfResources(300_000, 232_448, "shared memory")
        if config == "d":
            raise CompilationError(None, ast.parse("x").body[0], "a config this Triton rejects")
        timed.append(config)

    def bench(fn, **_):
        fn()
        return cost[timed[-1]]

    monkeypatch.setattr(triton.testing, "do_bench", bench)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(kernels, "PICKS", {})
    cuda, configs = torch.device("cuda"), ["a", "b", "c"]
    assert kernels.fastest(("k", 1), configs, run, torch.device("cpu")) == "a" and timed == []
    capturing[0] = True
    assert kernels.fastest(("k", 1), configs, run, cuda) == "a" and timed == []  # not remembered
    capturing[0] = False
    assert kernels.fastest(("k", 1), configs, run, cuda) == "b" and timed == ["a", "b"]
    assert kernels.fastest(("k", 1), configs, run, cuda) == "b" and timed == ["a", "b"]  # remembered
    assert kernels.fastest(("k", 3), ["c"], run, cuda) == "c"  # one config: nothing to time
    assert kernels.fastest(("k", 2), configs, run, cuda) == "b" and timed == ["a", "b"] * 2
    # one that does not compile is passed over, with a warning, unless it is the first (the road held)
    with pytest.warns(UserWarning, match="does not compile here"):
        assert kernels.fastest(("k", 5), ["a", "d", "b"], run, cuda) == "b" and timed == ["a", "b"] * 3
    with pytest.raises(CompilationError):
        kernels.fastest(("k", 6), ["d", "a"], run, cuda)
    # the picks may sum in other orders: not where runs must repeat bit for bit
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert kernels.fastest(("k", 4), configs, run, cuda) == "a" and timed == ["a", "b"] * 3


def test_gradcheck_fp64():
    """fast_mode: one random direction per input, since each call is a slow interpreted launch."""
    x, r = leaves(torch.float64, (3, 7), (3, 7))
    w, b = leaves(torch.float64, (7,), (7,))
    q, k, cos, sin = rope_inputs(torch.float64, per_row=True)
    cases = [(add_rms_norm, (x, r, w, 1e-5)), (add_layer_norm, (x, r, w, b, 1e-5))]
    cases += [(layer_norm, (x, w, b, 1e-5)), (softmax, (x,)), (rope_qk, (q, k, cos, sin))]
    for fn, inputs in cases:
        assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


def test_compile_fullgraph_matches_eager():
    """The ops trace into one graph (fake impls, autograd formulas): no graph break."""

    def block(x, r, w, b, q, k, cos, sin):
        y, h = add_rms_norm(x, r, w, 1e-5)
        q, k = rope_qk(q, k, cos, sin)
        att = softmax(q @ k.transpose(-1, -2))  # (B, H, T, T)
        return layer_norm(y, w, b) + h, att @ k

    def run(fn):
        x, r, w, b = leaves(torch.float32, (2, 5, 16), (2, 5, 16), (16,), (16,))
        inputs = [x, r, w, b] + rope_inputs(torch.float32, False)
        return outputs_and_grads(fn, inputs)

    assert_near(run(torch.compile(block, fullgraph=True)), run(block))


def test_eager_calls_skip_the_dispatcher_and_equal_the_registered_op():
    """On plain tensors outside compile each op runs under its own autograd.Function (kernel_op: the
    dispatcher's road costs the host ~0.1 ms a call); its outputs and gradients are the registered
    op's, bit for bit (the same launches), and the registered op is what compile and fakes get."""
    from ember.kernels.attention import _attention
    from ember.kernels.cross_entropy import _lce
    from ember.kernels.int8 import int8_linear
    from ember.kernels.norm import _norm
    from ember.kernels.rope import _rope
    from ember.kernels.softmax import _softmax

    x, r, w, b = leaves(torch.float32, (3, 37), (3, 37), (37,), (37,))
    q, k, cos, sin = rope_inputs(torch.float32, per_row=False)
    qa, ka, va = leaves(torch.float32, (1, 2, 5, 16), (1, 1, 5, 16), (1, 1, 5, 16))
    head, = leaves(torch.float32, (11, 37))
    target = torch.tensor([1, 4, 10], device=DEVICE)
    q8, s8 = torch.randint(-127, 128, (9, 37), dtype=torch.int8, device=DEVICE), torch.rand(9, device=DEVICE)
    cases = [(_norm, (x, r, w, b, 1e-5, False)), (_norm, (x, None, w, None, 1e-6, True)),
             (_rope, (q, k, cos, sin, False)), (_softmax, (x,)),
             (_attention, (qa, ka, va, True, 0.25)),
             (_lce, (x, head, target, 0.0, 0.0, -100, 2, True, True)),
             (int8_linear, (x, q8, s8))]  # fmt: skip
    for call, inputs in cases:
        ours = call(*inputs)
        first = ours[0] if isinstance(ours, tuple) else ours
        assert not type(first.grad_fn).__name__.startswith("GeneratedBackwardFor"), call.op
        theirs = call.op(*inputs)
        first = theirs[0] if isinstance(theirs, tuple) else theirs
        assert type(first.grad_fn).__name__.startswith("GeneratedBackwardFor"), call.op
        for a, b_ in zip(outputs_and_grads(call, inputs), outputs_and_grads(call.op, inputs), strict=True):
            assert (a is None and b_ is None) or torch.equal(a, b_), call.op
    with torch.no_grad():  # no graph to record: the launch alone, the same numbers
        for call, inputs in cases:
            ours, theirs = call(*inputs), call.op(*inputs)
            for a, b_ in zip(*(o if isinstance(o, tuple) else (o,) for o in (ours, theirs)), strict=True):
                assert a.grad_fn is None and torch.equal(a, b_), call.op
    g, = torch.autograd.grad(rms_norm(x, w).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):  # not a silently wrong second derivative
        g.sum().backward()
    with torch.device("meta"):  # fakes and meta tensors take the registered op (and its fake)
        assert _softmax(torch.empty(2, 3)).is_meta
