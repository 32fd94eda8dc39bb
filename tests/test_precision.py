"""fp16 training with the gradient scaler: autocast really computes in fp16, the scaler is
live (its scale is not 1), training stays close to fp32, and an overflow skips the step and
halves the scale instead of stopping the run or corrupting the weights. Runs on the CPU
(torch.amp.GradScaler("cpu")), so it is checked on every machine."""

import torch

from ember.parallel.parallelize import unwrap
from ember.run import read_metrics
from ember.train.trainer import Trainer

STEPS = ["train.max_steps=3", "train.eval_every=0"]


def record_output_dtypes(trainer) -> set:
    """The dtypes coming out of the first block's query projection while the trainer runs."""
    seen = set()
    block = unwrap(trainer.model).layers["0"]
    block = getattr(block, "_checkpoint_wrapped_module", block)
    block.attention.wq.register_forward_hook(lambda mod, args, out: seen.add(out.dtype))
    return seen


def losses(trainer) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(trainer.run_dir) if "loss" in r}


def test_fp16_autocast_with_a_live_scaler_trains_close_to_fp32(tiny_cfg):
    fp32 = Trainer(tiny_cfg("run.name=fp32", *STEPS))
    fp16 = Trainer(tiny_cfg("run.name=fp16", *STEPS, "train.precision=fp16"))
    seen32, seen16 = record_output_dtypes(fp32), record_output_dtypes(fp16)
    fp32.run(), fp16.run()
    assert seen32 == {torch.float32} and seen16 == {torch.float16}
    assert fp16.scaler.is_enabled() and not fp32.scaler.is_enabled()
    assert fp16.scaler.get_scale() == 2.0**16  # torch's initial scale, no overflow to back off from
    a, b = losses(fp32), losses(fp16)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    diffs = [abs(a[s] - b[s]) for s in a]
    assert max(diffs) < 0.05, (a, b)  # fp16 rounding, not a different run
    assert max(diffs) > 0, "fp16 gave fp32's losses bit for bit: autocast did nothing"


def test_fp16_overflow_skips_the_update_and_backs_off_the_scale(tiny_cfg):
    """A scale of 2^100 makes every fp16 gradient overflow: the scaler skips each of the 3
    updates and halves the scale each time; the non-finite guard leaves that to it."""
    trainer = Trainer(tiny_cfg(*STEPS, "train.precision=fp16"))
    state = trainer.scaler.state_dict()
    trainer.scaler.load_state_dict({**state, "scale": 2.0**100})
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.run()  # no NonFiniteError: an fp16 overflow is the scaler's business
    assert result["step"] == 3 and torch.isfinite(torch.tensor(result["loss"]))
    assert trainer.scaler.get_scale() == 2.0**97
    for p, q in zip(trainer.model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), q), "an overflowing step changed the weights"
