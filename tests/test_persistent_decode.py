"""The whole decode step in one persistent kernel (``FusedDecode(model, persistent=True)``,
ember/kernels/persistent.py) against the model's own step: logits and cache writes (fp32, 1e-4)
over several tokens for each layout, one row on the CUDA cores' road and two (one left-padded) on
tl.dot's, past several tiles of held slots (tests/test_fused_decode.py runs ``generate`` through
the graphed engine on it). Under Triton's interpreter one program walks every task in order;
tests/test_kernels_ptx.py compiles the kernel for sm_90, where one program an SM walks them."""

from __future__ import annotations

import gc

import pytest
import torch
from test_fused_decode import DEVICE, GPT2, LAYOUTS, assert_steps_match, tiny

from ember.config import ModelConfig
from ember.errors import EmberError
from ember.kernels import triton_ready
from ember.model.gpt import GPT

pytestmark = pytest.mark.skipif(not triton_ready("cpu")[0] and not torch.cuda.is_available(),
                                reason=triton_ready("cpu")[1])  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_persistent_step_matches_the_models_step(layout):
    """Two rows, the second left-padded by 3 (tl.dot's road); for GPT-2 and Llama also one row
    (the CUDA cores')."""
    from ember.infer.fused import FusedDecode

    torch.manual_seed(0)
    model = tiny(**LAYOUTS[layout])
    ids = torch.randint(0, 320, (2, 12), device=DEVICE)
    step = FusedDecode(model, persistent=True)
    assert_steps_match(model, step, ids, slots=20, pad=[0, 3], prompt=7, steps=2)
    if layout in ("gpt2", "llama"):
        assert_steps_match(model, step, ids[:1], slots=20, pad=[0], prompt=5, steps=2)


def test_persistent_step_reads_many_tiles_of_slots():
    """Past 64 held slots the attention task walks two tiles, each read a step ahead, and the
    products' inputs span tiles (128 inputs in blocks of 32)."""
    from ember.infer.fused import FusedDecode

    cfg = ModelConfig(vocab_size=320, n_layer=1, n_head=4, d_model=128, max_seq_len=128, init_std=0.1,
                      **LAYOUTS["llama"])  # fmt: skip
    model = GPT.build(cfg, device=DEVICE, seed=0).eval()
    ids = torch.randint(0, 320, (2, 80), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    step = FusedDecode(model, persistent=True)
    step.tile = (8, 32)  # one row: 8 outputs a task; two rows: tl.dot's 16
    assert_steps_match(model, step, ids, slots=100, pad=[0, 5], prompt=70, steps=1)
    assert_steps_match(model, step, ids[:1], slots=100, pad=[0], prompt=70, steps=1)
    gc.collect()
    assert len(step.tables) == 0  # each cache's pointer table went with its cache


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's waits alone run as Python, to be watched")
def test_each_task_waits_for_the_whole_stage_before(monkeypatch):
    """On a GPU a task that counted the stage before wrongly would read unfinished outputs (too
    few) or wait forever (too many), where the interpreter's single program, walking the tasks in
    order, shows neither. So every wait is watched: with one program, the stage before must have
    counted exactly the tasks the waiting task asks for, and each stage waits once."""
    import triton.language as tl

    from ember.infer.fused import FusedDecode
    from ember.kernels import decode

    seen, wait = [], decode._wait

    def watched(WAIT, SYNC, stage, need):  # the interpreter calls it with its tensors
        value = lambda t: int(t.handle.data.reshape(-1)[0])  # noqa: E731
        if WAIT == 2 and value(need) > 0:
            seen.append((value(stage), value(need), value(tl.load(SYNC + stage - 1))))
        return wait(WAIT, SYNC, stage, need)

    monkeypatch.setattr(decode, "_wait", watched)
    model = tiny(**GPT2)  # 2 blocks: stages 0 (embedding), 1-10, 11 (the head)
    ids = torch.randint(0, 320, (2, 6), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    step = FusedDecode(model, persistent=True)
    assert_steps_match(model, step, ids, slots=8, pad=[0, 1], prompt=5, steps=1)
    assert [stage for stage, _, _ in seen] == list(range(1, 12))
    assert all(need == counted for _, need, counted in seen), seen
    # q|k|v 192 outputs in 12 tiles of 16, attention 2 rows x 4 heads, o 4 tiles, up 16, down 4
    assert [need for _, need, _ in seen[:6]] == [1, 12, 8, 4, 16, 4]


def test_the_persistent_step_refuses_what_it_cannot_take():
    from ember.infer.fused import FusedDecode

    step = FusedDecode(tiny(**GPT2), persistent=True)
    with pytest.raises(EmberError, match="at most 16 rows a step"):
        step(torch.zeros(17, 1, dtype=torch.long, device=DEVICE), cache=None)
    model = tiny(**GPT2)
    step, (_, cache) = FusedDecode(model, persistent=True), _prefilled(model)
    wo = model.layers["1"].attention.wo.weight
    wo.data = torch.cat([wo.new_zeros(1), wo.detach().reshape(-1)])[1:].view(wo.shape)  # 4 bytes off
    with pytest.raises(EmberError, match="one of 1's is not 16-byte aligned"):
        step(torch.zeros(1, 1, dtype=torch.long, device=DEVICE), cache=cache)
    model = tiny(**GPT2)
    model.layers["1"].mlp_norm.eps = 1e-3  # one block's norm unlike the rest
    with pytest.raises(EmberError, match="one kind of norm and one eps"):
        step = FusedDecode(model, persistent=True)
        _, cache = _prefilled(model)
        step(torch.zeros(1, 1, dtype=torch.long, device=DEVICE), cache=cache)


def _prefilled(model):
    from ember.infer.engine import StaticKVCache

    cache = StaticKVCache(8, device=DEVICE)
    with torch.inference_mode():
        return model(torch.zeros(1, 2, dtype=torch.long, device=DEVICE), cache=cache), cache
