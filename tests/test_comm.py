"""`ember bench comm`: nccl-tests' bandwidth definitions on fixed times, every collective's
result checked on two gloo ranks, a wrong result caught, and bad arguments refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from ember.parallel.comm import COLLECTIVES, Row, _op, bus_factor, sizes


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bus_bandwidth_is_nccl_tests_factor_times_algorithm_bandwidth(n):
    # nccl-tests PERFORMANCE.md: all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; p2p 1
    expected = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
                "all_to_all": (n - 1) / n, "send_recv": 1.0}  # fmt: skip
    for collective in COLLECTIVES:
        row = Row(collective, bytes=2**20, ranks=n, seconds=1e-3, iters=10, wrong=0)
        assert row.algbw == pytest.approx(2**20 / 1e-3)
        assert row.busbw == pytest.approx(2**20 / 1e-3 * expected[collective])
    assert Row("all_reduce", 2**30, 8, 0.5, 1, 0).busbw / 1e9 == pytest.approx(2**30 / 0.5 * 1.75 / 1e9)
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("broadcast", n)


def test_sizes_grow_fourfold_within_the_bounds():
    assert sizes(2**10, 2**20) == [2**10, 2**12, 2**14, 2**16, 2**18, 2**20]
    assert sizes(2**10, 2**28)[-1] == 2**28 and len(sizes(2**10, 2**28)) == 10
    assert sizes(1000, 999) == []


def test_two_gloo_ranks_time_every_collective_and_get_it_right(tmp_path):
    out = tmp_path / "comm"
    cmd = [sys.executable, "-m", "ember", "bench", "comm", "--nproc", "2", "--device", "cpu",
           "--max-bytes", "16K", "--seconds", "0.01", "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "busbw GB/s" in r.stdout and "WRONG" not in r.stdout
    data = json.loads((out / "comm.json").read_text())
    assert data["ranks"] == 2 and data["backend"] == "gloo"
    rows = data["rows"]
    assert [(x["collective"], x["bytes"]) for x in rows] == [
        (c, s) for c in COLLECTIVES for s in (1024, 4096, 16384)
    ]
    for x in rows:
        assert x["wrong"] == 0 and x["seconds"] > 0 and x["iters"] >= 1
        assert x["algbw"] == pytest.approx(x["bytes"] / x["seconds"])
        assert x["busbw"] == pytest.approx(x["algbw"] * bus_factor(x["collective"], 2))


def test_a_wrong_result_is_counted(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for collective in COLLECTIVES[:-1]:  # (gloo cannot send to the sending rank itself)
            call, check = _op(collective, 64, 0, 1, torch.device("cpu"))
            call()
            assert check() == 0, collective
        call, check = _op("all_reduce", 64, 0, 1, torch.device("cpu"))
        call()
        x = next(c.cell_contents for c in call.__closure__ if isinstance(c.cell_contents, torch.Tensor))
        x[:3] = -1
        assert check() == 3
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "1"], "at least 2 ranks"),
        (["--min-bytes", "1M", "--max-bytes", "1K"], "above --max-bytes"),
        (["--max-bytes", "lots"], "not a size"),
    ],  # fmt: skip
)
def test_bad_arguments_exit_2_with_a_reason(args, message):
    r = subprocess.run(
        [sys.executable, "-m", "ember", "bench", "comm", *args], capture_output=True, text=True
    )
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
