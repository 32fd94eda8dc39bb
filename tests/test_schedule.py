"""The learning-rate schedule: warmup, cosine, linear, WSD and constant against torch's own
schedulers (or, for WSD, which torch lacks, its formula), and the rate the trainer applies.

With a step budget of N steps, step s (0-based) runs at ``lr_at(s, (s + 1) / N)``: the
trainer sets a step's rate from where the budget stands when that step ends. So step s
after warmup matches a torch scheduler that has been stepped s + 1 times with T = N, and
warmup step s matches ``LinearLR(1/W → 1 over W - 1 steps)`` stepped s times."""

import math

import pytest
import torch

from ember.config import TrainConfig
from ember.run import read_metrics
from ember.train.optim import lr_at
from ember.train.trainer import Trainer

PEAK, RATIO, W, N = 3e-3, 0.1, 5, 40
FLOOR = PEAK * RATIO


def ours(schedule: str, **kw) -> list[float]:
    t = TrainConfig(lr=PEAK, min_lr_ratio=RATIO, warmup_steps=W, schedule=schedule, **kw)
    return [lr_at(s, (s + 1) / N, t) for s in range(N)]


def torch_lrs(make_scheduler, steps: int) -> list[float]:
    """The rate of a torch scheduler after 0, 1, ..., steps - 1 calls of ``step()``."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=PEAK)
    sched = make_scheduler(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd", "constant"])
def test_warmup_is_torch_linear_lr(schedule):
    want = torch_lrs(lambda o: torch.optim.lr_scheduler.LinearLR(o, 1 / W, 1.0, total_iters=W - 1), W)
    got = ours(schedule)[:W]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[0] == pytest.approx(PEAK / W, rel=1e-12) and got[W - 1] == pytest.approx(PEAK, rel=1e-12)


def test_cosine_is_torch_cosine_annealing_and_ends_at_the_floor():
    want = torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=N, eta_min=FLOOR), N + 1)
    got = ours("cosine")
    assert got[W:] == pytest.approx(want[W + 1 :], rel=1e-9)
    assert got[-1] == pytest.approx(FLOOR, rel=1e-12)  # the last step runs at the final rate
    assert got[N // 2 - 1] == pytest.approx((PEAK + FLOOR) / 2, rel=1e-12)  # half-way: the mean


def test_linear_is_torch_linear_lr_and_ends_at_the_floor():
    want = torch_lrs(lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, RATIO, total_iters=N), N + 1)
    got = ours("linear")
    assert got[W:] == pytest.approx(want[W + 1 :], rel=1e-9)
    assert got[-1] == pytest.approx(FLOOR, rel=1e-12)


@pytest.mark.parametrize("decay_fraction", [0.2, 0.5, 1.0])
def test_wsd_holds_the_peak_then_decays_linearly_to_the_floor(decay_fraction):
    """Warmup-Stable-Decay (Hu et al. 2024, MiniCPM): the peak until the last
    ``decay_fraction`` of the budget, then a straight line to the floor."""
    got = ours("wsd", decay_fraction=decay_fraction)
    stable_end = round(N * (1 - decay_fraction))  # the step count at which decay starts
    for s in range(W, N):
        done = s + 1
        if done <= stable_end:
            want = PEAK
        else:
            want = PEAK + (FLOOR - PEAK) * (done - stable_end) / (N - stable_end)
        assert got[s] == pytest.approx(want, rel=1e-9), s
    assert got[-1] == pytest.approx(FLOOR, rel=1e-12)
    if stable_end > W:
        assert got[stable_end - 1] == pytest.approx(PEAK, rel=1e-12)  # last stable step: the peak


def test_constant_stays_at_the_peak():
    assert ours("constant")[W:] == [PEAK] * (N - W)


def test_floor_ratio_and_peak_are_used():
    """A floor of 0 ends at 0; a different peak scales the whole curve."""
    t = TrainConfig(lr=PEAK, min_lr_ratio=0.0, warmup_steps=0, schedule="cosine")
    assert lr_at(N - 1, 1.0, t) == pytest.approx(0.0, abs=1e-18)
    assert lr_at(0, 0.25, t, peak=1.0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)), rel=1e-12)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
def test_trainer_applies_the_schedule_from_warmup_to_the_floor(tiny_cfg, schedule):
    """What the loop logs and leaves in the optimizer: 1/W of the peak at step 1, the peak at
    the end of warmup, the floor at the last step."""
    steps, warmup = 6, 2
    trainer = Trainer(
        tiny_cfg(
            f"run.name={schedule}",
            f"train.max_steps={steps}",
            f"train.warmup_steps={warmup}",
            f"train.schedule={schedule}",
            "train.decay_fraction=0.5",
            "train.min_lr_ratio=0.1",
            "train.eval_every=0",
        )
    )
    trainer.run()
    peak = trainer.cfg.train.lr
    logged = [r["lr"] for r in read_metrics(trainer.run_dir) if "loss" in r]
    assert len(logged) == steps
    assert logged[0] == pytest.approx(peak / warmup, rel=1e-12)
    assert logged[warmup - 1] == pytest.approx(peak, rel=1e-12)
    assert logged[-1] == pytest.approx(0.1 * peak, rel=1e-12)
    assert all(a >= b for a, b in zip(logged[warmup - 1 :], logged[warmup:], strict=False))  # never rises
    for group in trainer.optimizer.param_groups:  # the optimizer ran its last step at the floor
        assert group["lr"] == pytest.approx(0.1 * group["peak_lr"], rel=1e-12)
