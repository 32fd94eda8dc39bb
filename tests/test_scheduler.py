"""Continuous batching against the batch-1 engine: 200 seeded requests arriving over time, some
sharing prefixes, with a roomy pool and with one small enough to force preemptions; seeded
sampling independent of the batch; cancellation; every block free at the end."""

from __future__ import annotations

import random

import pytest
import torch

from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.infer.engine import Engine, Row
from ember.infer.sampling import Sampling
from ember.infer.scheduler import Scheduler
from tests.test_engine import LLAMA, TEXT, tiny_model


@pytest.fixture(scope="module")
def engine() -> Engine:
    tok = Tokenizer.train_bpe(TEXT, 300)
    return Engine(tiny_model(320, **LLAMA, n_kv_head=2, max_seq_len=320), tok)


def workload(seed: int, n: int = 200) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt ids, max new tokens): prompts of 1-200 tokens, 1-100 new tokens,
    a third of them starting with one of three shared 40-token prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 300) for _ in range(40)] for _ in range(3)]
    out = []
    for _ in range(n):
        length = rng.randint(1, 200)
        prompt = [rng.randrange(3, 300) for _ in range(length)]  # (ids 0-2 are special: no eos)
        if rng.random() < 1 / 3:
            prompt = (rng.choice(prefixes) + prompt)[: max(length, 41)]
        out.append((rng.randint(0, 60), prompt, rng.randint(1, 100)))
    return out


def serve(scheduler: Scheduler, requests, sampling) -> list:
    """Add each request at its arrival step; step until all are done; check the pool is clean."""
    pending = sorted(enumerate(requests), key=lambda x: x[1][0])
    handles, step = {}, 0
    while pending or not scheduler.idle:
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, new) = pending.pop(0)
            [handles[i]] = scheduler.add(prompt, sampling(i, new))
        scheduler.step()
        step += 1
    assert scheduler.blocks.num_free == scheduler.blocks.num_blocks and sum(scheduler.blocks.ref) == 0
    return [handles[i].completion() for i in range(len(requests))]


@pytest.fixture(scope="module")
def greedy_alone(engine) -> list:
    """workload(0)'s answers from the batch-1 engine, each request alone (once for both pools)."""
    return [engine.generate([prompt], Sampling(new, temperature=0))[0] for _, prompt, new in workload(0)]


@pytest.mark.parametrize("async_steps", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("num_blocks", [2000, 40], ids=["roomy", "preempting"])
def test_greedy_answers_equal_the_batch1_engine(engine, greedy_alone, num_blocks, async_steps):
    requests = workload(0)
    scheduler = Scheduler(engine, num_blocks=num_blocks, block_size=16, max_batch_tokens=256, max_seqs=32,
                          async_steps=async_steps)  # fmt: skip
    got = serve(scheduler, requests, lambda i, new: Sampling(new, temperature=0))
    for answer, alone in zip(got, greedy_alone, strict=True):
        assert answer.token_ids == alone.token_ids and answer.finish_reason == alone.finish_reason
    if num_blocks == 40:
        assert scheduler.preemptions > 0
    assert scheduler.blocks.hits > 0  # the shared prefixes were found


@pytest.mark.parametrize("async_steps", [False, True], ids=["sync", "async"])
def test_seeded_sampling_does_not_depend_on_the_batch(engine, async_steps):
    requests = workload(1, n=24)

    def sampling(i, new):  # half greedy: two groups of settings drawn apart in each step
        return Sampling(new, temperature=0.9 if i % 2 else 0.0, top_k=50, seed=1000 + i)

    together = serve(Scheduler(engine, num_blocks=2000, max_batch_tokens=128, async_steps=async_steps),
                     requests, sampling)  # fmt: skip
    for i, (_, prompt, new) in enumerate(requests):
        alone = serve(Scheduler(engine, num_blocks=2000, max_batch_tokens=128), [(0, prompt, new)],
                      lambda _, new, i=i: sampling(i, new))  # fmt: skip
        assert together[i].token_ids == alone[0].token_ids


@pytest.mark.parametrize("async_steps", [False, True], ids=["sync", "async"])
def test_n_answers_fork_seeds_and_prefix_cache_hits_give_the_same_tokens(engine, async_steps):
    prompt = list(range(3, 70))
    s = Scheduler(engine, num_blocks=200, async_steps=async_steps)
    first = s.add(prompt, Sampling(20, temperature=0))
    s.run()
    again = s.add(prompt, Sampling(20, temperature=0))  # its first 4 blocks come from the cache
    s.run()
    assert again[0].seq.cached_tokens == 64
    assert again[0].completion().token_ids == first[0].completion().token_ids
    answers = s.add(prompt, Sampling(12, temperature=1.0, seed=5), n=3)
    s.run()  # the three share the prompt's blocks; two copy its partly filled last one on their first write
    assert s.blocks.cow == 2
    seeds = [engine.generate([prompt], Sampling(12, temperature=1.0, seed=5 + i))[0] for i in range(3)]
    assert [a.completion().token_ids for a in answers] == [c.token_ids for c in seeds]


def test_cancel_frees_blocks_and_bad_requests_are_clear(engine):
    s = Scheduler(engine, num_blocks=30, max_batch_tokens=64)
    a = s.add(list(range(3, 100)), Sampling(50, temperature=0))
    b = s.add([5, 6, 7], Sampling(50, temperature=0))
    s.step(), s.step()
    assert a[0].state == "running" and s.blocks.in_use > 0
    s.cancel(a[0]), s.cancel(b[0])
    assert s.idle and s.blocks.num_free == 30 and a[0].completion().finish_reason == "cancelled"
    with pytest.raises(EmberError, match="need 14 KV blocks of 16 tokens; the pool has 10"):
        Scheduler(engine, num_blocks=10).add(list(range(3, 203)), Sampling(20))
    with pytest.raises(EmberError, match="3 answer.*need 12 KV blocks"):
        Scheduler(engine, num_blocks=10).add(list(range(3, 53)), Sampling(14), n=3)
    with pytest.raises(EmberError, match="max_seq_len"):
        s.add(list(range(3, 310)), Sampling(20))
    with pytest.raises(EmberError, match="empty"):
        s.add([], Sampling(20))


def test_packed_row_longer_than_max_seq_len_is_fine(engine):
    s = Scheduler(engine, num_blocks=500, max_batch_tokens=1024, max_seqs=8)
    outs = [s.add(list(range(3, 250)), Sampling(5, temperature=0))[0] for _ in range(3)]
    s.run()
    [alone] = engine.generate([list(range(3, 250))], Sampling(5, temperature=0))
    assert all(o.completion().token_ids == alone.token_ids for o in outs)
    assert torch.get_default_dtype() == torch.float32



def test_text_is_read_under_the_next_forward_and_stop_strings_at_once(engine, monkeypatch):
    """A request without stop strings reads its text in the next step, after that step's forward
    is launched and before its logits are read (``_draw``): on a GPU that host work overlaps the
    device's. A request with stop strings reads it at once and ends at the stop. Texts, ids and
    ends equal the batch-1 engine's."""
    prompt, stop = list(range(3, 40)), "caf"  # the random model's answer at seed 5 reaches "caf"

    def sampling(**stop) -> Sampling:
        return Sampling(16, temperature=1.0, seed=5, **stop)

    [free], [stopped] = engine.generate([prompt], sampling()), engine.generate([prompt], sampling(stop=stop))
    assert stop in free.text and free.finish_reason == "length"
    assert stopped.finish_reason == "stop" and 0 < len(stopped.token_ids) < 16
    s, log = Scheduler(engine, num_blocks=100), []
    forward, draw, release = s._forward, s._draw, Row.release
    monkeypatch.setattr(s, "_forward", lambda work, drawn=None: log.append("F") or forward(work, drawn))
    monkeypatch.setattr(s, "_draw", lambda answers: log.append("D") or draw(answers))
    monkeypatch.setattr(Row, "release", lambda row, *a: log.append("s" if row is b.row else "t") or release(row, *a))  # fmt: skip # noqa: E501
    [a], [b] = s.add(prompt, sampling()), s.add(prompt, sampling(stop=stop))
    texts, steps = {a: "", b: ""}, []
    while not s.idle:
        log.clear()
        for request, piece in s.step():
            texts[request] += piece
        steps.append("".join(log))
    assert texts[a] == a.completion().text == free.text and a.completion().token_ids == free.token_ids
    assert texts[b] == b.completion().text == stopped.text and b.completion().token_ids == stopped.token_ids
    assert b.completion().finish_reason == "stop" and a.completion().finish_reason == "length"
    # F: a forward, D: its logits read (the draw), t: the free one's text, s: the stop one's
    assert steps[0] == "FDs" and steps[-1] == "t", steps  # the free one's last text: no forward left
    assert steps[1:-1] == ["FtDs"] * (len(stopped.token_ids) - 1) + ["FtD"] * (16 - len(stopped.token_ids)), steps  # fmt: skip # noqa: E501


@pytest.mark.parametrize("on_read", [False, True], ids=["returned", "on_read"])
def test_text_read_before_a_failing_draw_is_not_lost_and_cancel_reads_it(engine, on_read):
    """A request that ended by its ids has its text read in the next step, before that step's
    draw: if the draw fails (a GPU's error surfaces when the logits are read), its final event
    still comes (to ``on_read`` at once, or from the next step). An event covers the ids its
    text was read from (``Request.read``), not the newest one. A request cancelled before its
    text is read keeps a completion whose text is its ids' text."""
    s, got = Scheduler(engine, num_blocks=100), []
    if on_read:
        s.on_read = got.extend
    [long] = s.add(list(range(3, 40)), Sampling(50, temperature=0, ignore_eos=True), logprobs=1)
    [short] = s.add(list(range(5, 30)), Sampling(1, temperature=0, ignore_eos=True))
    got += s.step()  # both prompts; the short one takes its one id and ends, its text unread
    assert short.row.finish_reason == "length" and not short.done and short in s.unread
    assert long.read == (0, 0) and len(long.row.ids) == 1  # the long one's first id is not read yet
    draw = s._draw
    s._draw = lambda answers: (_ for _ in ()).throw(RuntimeError("device-side assert at .tolist()"))
    with pytest.raises(RuntimeError, match="device-side"):
        s.step()
    s._draw = draw
    for request in [long, *s.unread]:  # what the server's loop does after a failed step
        s.cancel(request)
    got += s.step()
    assert short.done and [(r, p) for r, p in got if r is short] == [(short, short.row.text)]
    assert short.row.text == engine.tokenizer.decode(short.row.ids) and short.read == (1, 0)
    assert long.completion().finish_reason == "cancelled" and long.read == (1, 1)
    assert long.row.text == engine.tokenizer.decode(long.row.ids) and s.idle
    again = Scheduler(engine, num_blocks=100)
    [alone] = again.add(list(range(5, 30)), Sampling(1, temperature=0, ignore_eos=True))
    again.step()
    again.cancel(alone)  # ended by its id, its text unread: the completion holds it all the same
    assert alone.completion().finish_reason == "length" and alone.completion().text == short.row.text != ""


def test_async_steps_launch_before_reading_back_and_end_as_the_engine_does(engine, monkeypatch):
    """``async_steps``: each step's forward is launched before the last step's ids are read back
    (on a GPU the host's planning then runs under the device's work). A request that ends by its
    ids' count is not fed past its end; one that a stop string ends is fed one id past it, whose
    work is dropped. Texts, ids and ends equal the batch-1 engine's."""
    prompt, stop = list(range(3, 40)), "caf"

    def sampling(**stop) -> Sampling:
        return Sampling(16, temperature=1.0, seed=5, **stop)

    [free], [stopped] = engine.generate([prompt], sampling()), engine.generate([prompt], sampling(stop=stop))
    s, log, fed = Scheduler(engine, num_blocks=100, async_steps=True), [], {}
    forward, take = s._forward, s._take_drawn

    def recorded(work, drawn=None):
        log.append("F")
        for r, _ in work:
            fed[r] = fed.get(r, 0) + 1
        return forward(work, drawn)

    monkeypatch.setattr(s, "_forward", recorded)
    monkeypatch.setattr(s, "_take_drawn", lambda: log.append("R") or take())
    [a], [b] = s.add(prompt, sampling()), s.add(prompt, sampling(stop=stop))
    steps = []
    while not s.idle:
        log.clear()
        s.step()
        steps.append("".join(log))
    assert a.completion().token_ids == free.token_ids and a.completion().text == free.text
    assert b.completion().token_ids == stopped.token_ids and b.completion().text == stopped.text
    assert b.completion().finish_reason == "stop" and a.completion().finish_reason == "length"
    assert fed[a] == 16 and fed[b] == len(stopped.token_ids) + 1  # the prompt, then each id fed
    assert steps[0] == "F" and all(step == "FR" for step in steps[1:16]), steps  # launched, then read back
    assert steps[16:] == ["R", ""], steps  # the 16th id read back; then its text alone


def test_a_request_preempted_while_its_last_id_is_pending_still_ends(engine):
    """``async_steps``: a request with stop strings whose pending id is its last, preempted before
    that id is read back, ends by length when it is (its text decides, being stop-bound) and
    leaves the queue it waits in; the pool comes back whole."""
    for async_steps in (False, True):
        s = Scheduler(engine, num_blocks=6, block_size=2, max_seqs=4, async_steps=async_steps)
        [a] = s.add(list(range(10, 13)), Sampling(8, temperature=0, ignore_eos=True))
        [b] = s.add(list(range(20, 23)), Sampling(4, temperature=0, ignore_eos=True, stop=["\x00never"]))
        for _ in range(40):
            if s.idle:
                break
            s.step()
        assert s.idle and a.row.finish_reason == b.row.finish_reason == "length" and b.done
        assert s.blocks.num_free == s.blocks.num_blocks and s.preemptions == int(async_steps)
