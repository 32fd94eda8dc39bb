"""`ember serve` over HTTP: the official openai client (completions and chat, streamed and not)
against the engine's own answers, httpx for the error statuses, a dropped stream that frees
its blocks, the queue limit, and /metrics."""

from __future__ import annotations

import functools
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from ember.config import ServeConfig
from ember.data.chat import render
from ember.data.tokenizer import Tokenizer
from ember.infer.engine import Engine
from ember.infer.sampling import Sampling
from tests.test_engine import LLAMA, TEXT, tiny_model

KEY = "sekrit"


def start(engine: Engine, **serve) -> tuple[str, object, object]:
    from ember.infer.server import create_app

    app = create_app(engine, "tiny", ServeConfig(**{"kv_memory": 2**22, **serve}), api_key=KEY)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread


@pytest.fixture(scope="module")
def engine() -> Engine:
    return tiny_engine()


def tiny_engine() -> Engine:
    tok = Tokenizer.train_bpe(TEXT, 300)
    return Engine(tiny_model(320, **LLAMA, n_kv_head=2, max_seq_len=128), tok)


@pytest.fixture(scope="module")
def server(engine):
    url, srv, thread = start(engine)
    yield url
    srv.should_exit = True
    thread.join(10)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {k: float(v) for k, v in (line.split() for line in text.splitlines() if not line.startswith("#"))}


def test_openai_client_completions_equal_the_engine(server, engine):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    prompt = "The quick brown fox"
    [alone] = engine.generate([prompt], Sampling(12, temperature=0))
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == alone.text
    assert out.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert out.usage.completion_tokens == len(alone.token_ids)
    pieces, usage = [], None
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    for chunk in stream:
        pieces += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == alone.text and usage.completion_tokens == len(alone.token_ids)
    # n answers with a seed: answer i is the engine's row with seed + i
    rows = engine.generate([prompt, prompt], Sampling(10, temperature=1.0, top_k=40, seed=7))
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=1.0, n=2,
                                    seed=7, extra_body={"top_k": 40})  # fmt: skip
    assert [c.text for c in out.choices] == [r.text for r in rows]
    # two prompts in one call, and a stop string
    out = client.completions.create(model="tiny", prompt=[prompt, "def main("], max_tokens=8, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    stop = alone.text[3:5]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].text == alone.text[: alone.text.find(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_echo_logprobs_equal_the_model(server, engine):
    """What lm-evaluation-harness asks for a loglikelihood: echo, logprobs, max_tokens 0."""
    ids = engine.tokenizer.encode("def main():\n    return sum(x * x for x in range(10))")
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2}
    r = httpx.post(f"{server}/v1/completions", headers=auth, json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    with torch.inference_mode():
        want = engine.model(torch.tensor([ids]))[0, :-1, : engine.n_valid].log_softmax(-1)
    want = want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert lp["token_logprobs"][0] is None
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), want, atol=1e-4)
    for lp_t, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert 0 < len(top) <= 2 and max(top.values()) >= lp_t - 1e-6  # (two ids may print alike)
    # and sampled tokens' logprobs: greedy picks the top alternative
    body = {"model": "tiny", "prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 1}
    r = httpx.post(f"{server}/v1/completions", headers=auth, json=body)
    lp = r.json()["choices"][0]["logprobs"]
    for lp_t, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert lp_t == pytest.approx(max(top.values()), abs=1e-6)


def test_openai_client_chat(server, engine):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = render(engine.tokenizer, messages, add_generation_prompt=True)[0]
    [alone] = engine.generate([ids], Sampling(10, temperature=0))
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.content == alone.text and out.choices[0].message.role == "assistant"
    text = ""
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True)  # fmt: skip
    for chunk in stream:
        text += "".join(c.delta.content or "" for c in chunk.choices)
    assert text == alone.text
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_errors_have_openai_shape_and_status(server):
    auth = {"Authorization": f"Bearer {KEY}"}

    def post(body, path="/v1/completions", headers=auth, raw=None):
        headers = {**headers, "Content-Type": "application/json"}
        content = raw if raw is not None else json.dumps(body)
        r = httpx.post(f"{server}{path}", headers=headers, content=content)
        if r.status_code != 200:
            assert set(r.json()["error"]) >= {"message", "type"}
        return r.status_code, r.text

    ok = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    assert post(ok)[0] == 200
    assert post(ok, headers={})[0] == 401
    assert post(ok, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert post({**ok, "model": "gpt-4"})[0] == 404
    assert post({**ok, "max_tokens": -1})[0] == 400
    status, text = post({**ok, "max_tokens": 10**6})
    assert status == 400 and "context" in text
    assert post({**ok, "temperature": "hot"})[0] == 400
    assert post({**ok, "prompt": ""})[0] == 400
    assert post({**ok, "prompt": "word " * 300})[0] == 400  # beyond the 128-token context
    assert post(None, raw=b"{not json")[0] == 400
    assert post({**ok, "n": 10**6})[0] == 400
    assert post({**ok, "prompt": [10**6]})[0] == 400
    assert post({**ok, "max_tokens": 0})[0] == 400  # without echo
    assert post({"model": "tiny", "messages": []}, path="/v1/chat/completions")[0] == 400
    assert post({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, path="/v1/chat/completions")[0] == 400  # fmt: skip # noqa: E501
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


class Slow(torch.nn.Module):
    """A model whose every forward takes 20 ms more, so a request is still running when the
    test looks."""

    def __init__(self, model):
        super().__init__()
        self.model, self.cfg = model, model.cfg

    def forward(self, *args, **kwargs):
        time.sleep(0.02)
        return self.model(*args, **kwargs)


def test_dropped_stream_frees_its_blocks_and_the_queue_is_bounded(engine):
    prompt = "The quick"
    [alone] = engine.generate([prompt], Sampling(100, temperature=0))
    assert len(alone.token_ids) == 100  # no end of text before 2 s of Slow steps
    url, srv, thread = start(Engine(Slow(engine.model), engine.tokenizer), max_seqs=1, max_waiting=1)
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 100, "temperature": 0}
    try:
        with httpx.Client(timeout=30) as client:
            streamed = {**body, "stream": True}
            with client.stream("POST", f"{url}/v1/completions", json=streamed, headers=auth) as r:
                lines = r.iter_lines()  # (kept: a dropped iterator closes the response)
                next(lines)  # the first event arrived: it runs
                assert metrics(url)["ember_requests_running"] == 1
                # one running (max_seqs=1), so a second waits and a third finds the queue full
                waiter = threading.Thread(target=lambda: httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60))  # fmt: skip # noqa: E501
                waiter.start()
                for _ in range(100):
                    if metrics(url)["ember_requests_waiting"] == 1:
                        break
                    time.sleep(0.02)
                r3 = client.post(f"{url}/v1/completions", json=body, headers=auth)
                assert r3.status_code == 429 and r3.json()["error"]["type"] == "rate_limit_error"
            # the stream is closed here, 100 tokens unfinished
            waiter.join(60)
        for _ in range(100):
            m = metrics(url)
            if m["ember_requests_running"] == 0 and m["ember_kv_blocks_in_use"] == 0:
                break
            time.sleep(0.05)
        assert m["ember_requests_running"] == 0 and m["ember_kv_blocks_in_use"] == 0
        assert m["ember_generation_tokens_total"] > 0 and "ember_prefix_cache_hit_rate" in m
    finally:
        srv.should_exit = True
        thread.join(10)


LM_EVAL_TASKS = {
    "mc": """task: ember_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""",
    "gen": """task: ember_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


def test_lm_evaluation_harness_against_the_server(server, engine, tmp_path, monkeypatch):
    """lm-eval's `local-completions` model (its remote tokenizer reads /tokenize) runs a
    loglikelihood task and a generation task from local files: each loglikelihood equals the
    model's own summed log-probabilities of the continuation, each generation the engine's."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    mc = [("The quick brown", [" fox", " dog", " cat"], 0), ("def main", ["():", " x"], 1)]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in mc))  # fmt: skip # noqa: E501
    gen = ["The quick", "def main"]
    (tmp_path / "gen.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": "x"}) + "\n" for q in gen)
    )  # noqa: E501
    for name, text in LM_EVAL_TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(text.format(dir=tmp_path))
    args = f"model=tiny,base_url={server}/v1/completions,tokenizer_backend=remote,num_concurrent=1"
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)  # (indexing lm-eval's own: 13 s)
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["ember_mc", "ember_gen"],
                                  task_manager=tasks, log_samples=True)  # fmt: skip
    tok, checked = engine.tokenizer, 0
    for sample in out["samples"]["ember_mc"]:
        for (context, continuation), [(loglik, _)] in zip(sample["arguments"], sample["resps"], strict=True):
            whole, ctx = tok.encode(context + continuation), tok.encode(context)  # as lm-eval splits a pair
            with torch.inference_mode():
                logp = engine.model(torch.tensor([whole]))[0, :-1, : engine.n_valid].log_softmax(-1)
            mine = logp[torch.arange(len(ctx) - 1, len(whole) - 1), torch.tensor(whole[len(ctx) :])].sum()
            assert loglik == pytest.approx(mine.item(), abs=1e-4)
            checked += 1
    assert checked == 5
    for sample in out["samples"]["ember_gen"]:
        [alone] = engine.generate([sample["arguments"][0][0]], Sampling(8, temperature=0, stop=("\n",)))
        assert sample["resps"][0][0] == alone.text


def test_faults_leave_the_server_serving(engine):
    """Special-token prompts, n × max_tokens beyond the pool, and a client that opens many
    streams and vanishes: each gets its status or is cleaned up, and the next request is served."""
    slow = Engine(Slow(engine.model), engine.tokenizer)
    url, srv, thread = start(slow, max_seqs=4, kv_memory=2**19, block_size=16)  # 64 blocks of 16 tokens, 8 KiB each  # fmt: skip # noqa: E501
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "The quick", "max_tokens": 60, "temperature": 0}
    try:
        post = functools.partial(httpx.post, f"{url}/v1/completions", headers=auth, timeout=30)
        r = post(json={**body, "prompt": [1, 5, 1], "max_tokens": 3})  # <|eos|> <|user|> <|eos|>
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
        for stream in (False, True):  # a stream fails before it starts
            r = post(json={**body, "max_tokens": 100, "n": 16, "stream": stream})  # 16 × 7 blocks > 64
            assert r.status_code == 400 and "KV blocks" in r.json()["error"]["message"]
        with httpx.Client(timeout=30) as client:
            streamed = {**body, "stream": True}
            streams = [
                client.stream("POST", f"{url}/v1/completions", json=streamed, headers=auth) for _ in range(6)
            ]
            for s in streams:
                response = s.__enter__()
                assert response.status_code == 200
            client.close()  # every connection dropped mid-stream
        for _ in range(200):
            m = metrics(url)
            if m["ember_requests_running"] + m["ember_requests_waiting"] + m["ember_kv_blocks_in_use"] == 0:
                break
            time.sleep(0.05)
        assert m["ember_requests_running"] + m["ember_requests_waiting"] + m["ember_kv_blocks_in_use"] == 0
        assert m["ember_generation_tokens_total"] < 6 * 60  # cancelled, not run to the end
        r = post(json={**body, "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        srv.should_exit = True
        thread.join(10)
