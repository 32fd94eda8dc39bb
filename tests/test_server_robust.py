"""`ember serve` against bodies no client should send: each bad body a 400 in OpenAI's error
shape naming its parameter, on a connection that stays open; the key checked before the body;
a 10 MB prompt refused at once while /health answers; the usage chunk only when asked for;
a few hundred random bodies that leave the server serving with no KV block held; and
`ember serve`'s address and device checked before the model loads."""

from __future__ import annotations

import json
import random
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from ember.config import ServeConfig
from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.infer.engine import Engine
from tests.test_engine import LLAMA, TEXT, tiny_model
from tests.test_server import KEY, metrics, start

AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
OK = {"model": "tiny", "prompt": "The quick", "max_tokens": 2, "temperature": 0}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `ember serve` on 2 cores: 2 threads spin 30x slower on a loaded machine
    tok = Tokenizer.train_bpe(TEXT, 300)
    url, srv, thread = start(Engine(tiny_model(320, **LLAMA, n_kv_head=2, max_seq_len=128), tok))
    yield url
    srv.should_exit = True
    thread.join(10)
    torch.set_num_threads(threads)


def local_port(r: httpx.Response) -> int:
    """The client side's port of the connection that carried ``r``: equal for two responses when
    the connection was kept alive."""
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(r.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == {401: "authentication_error"}.get(status, "invalid_request_error")
    assert error["param"] == param and error["code"] == status
    return error["message"]


# fmt: off
CASES = {  # name: (path, body, param at fault, words the message holds)
    "surrogate_prompt": (CMPL, rb'{"model":"tiny","prompt":"a\ud800b","max_tokens":2}', "prompt", "lone surrogate"),  # noqa: E501
    "surrogate_prompt_list": (CMPL, rb'{"model":"tiny","prompt":["ok","\udc00"]}', "prompt.1", "lone surrogate"),  # noqa: E501
    "surrogate_chat": (CHAT, rb'{"model":"tiny","messages":[{"role":"user","content":"a\ud800b"}]}', "messages.0.content", "lone surrogate"),  # noqa: E501
    "surrogate_stop": (CMPL, rb'{"model":"tiny","prompt":"a","stop":"\ud800"}', "stop", "lone surrogate"),
    "invalid_utf8": (CMPL, b'{"model":"tiny","prompt":"a\xff\xfeb"}', None, "not UTF-8 (byte 27"),
    "encoded_surrogate": (CMPL, b'{"model":"tiny","prompt":"a\xed\xa0\x80"}', None, "not UTF-8"),
    "malformed_json": (CMPL, b'{"model": "tiny",\n "prompt": ', None, "line 2 column 12"),
    "not_an_object": (CMPL, b"[1, 2]", None, "JSON object"),
    "empty_body": (CMPL, b"", None, "line 1 column 1"),
    "huge_integer": (CMPL, b'{"model":"tiny","prompt":"a","seed":' + b"9" * 5000 + b"}", None, "4300 digits"),
    "deep_nesting": (CMPL, b'{"model":"tiny","prompt":' + b"[" * 100_000, None, "recursion"),
    "max_tokens_true": (CMPL, rb'{"model":"tiny","prompt":"a","max_tokens":true}', "max_tokens", "valid integer (got true)"),  # noqa: E501
    "max_tokens_float": (CMPL, rb'{"model":"tiny","prompt":"a","max_tokens":2.5}', "max_tokens", "valid integer"),  # noqa: E501
    "stream_yes": (CMPL, rb'{"model":"tiny","prompt":"a","stream":"yes"}', "stream", "valid boolean"),
    "temperature_nan": (CMPL, rb'{"model":"tiny","prompt":"a","temperature":NaN}', "temperature", "finite number (got NaN)"),  # noqa: E501
    "top_p_infinity": (CMPL, rb'{"model":"tiny","prompt":"a","top_p":Infinity}', "top_p", "finite number"),
    "temperature_overflow": (CMPL, rb'{"model":"tiny","prompt":"a","temperature":-1e999}', "temperature", "finite number"),  # noqa: E501
    "chat_temperature_nan": (CHAT, rb'{"model":"tiny","messages":[{"role":"user","content":"a"}],"temperature":NaN}', "temperature", "finite"),  # noqa: E501
    "n_string": (CMPL, rb'{"model":"tiny","prompt":"a","n":"2"}', "n", "valid integer"),
    "model_number": (CMPL, rb'{"model":7,"prompt":"a"}', "model", "valid string (got 7)"),
    "prompt_object": (CMPL, rb'{"model":"tiny","prompt":{"a":1}}', "prompt", "valid"),
    "prompt_bools": (CMPL, rb'{"model":"tiny","prompt":[true]}', "prompt.0", "valid"),
    "prompt_missing": (CMPL, rb'{"model":"tiny"}', "prompt", "required"),
    "messages_string": (CHAT, rb'{"model":"tiny","messages":"hi"}', "messages", "valid list"),
    "content_null": (CHAT, rb'{"model":"tiny","messages":[{"role":"user","content":null}]}', "messages.0.content", "valid string (got null)"),  # noqa: E501
    "seed_out_of_range": (CMPL, b'{"model":"tiny","prompt":"a","seed":%d}' % 2**70, "seed", "out of range"),
    "stop_empty_streamed": (CMPL, rb'{"model":"tiny","prompt":"a","stop":[""],"stream":true}', "stop.0", "empty stop string"),  # noqa: E501
    "stream_options_unstreamed": (CMPL, rb'{"model":"tiny","prompt":"a","stream_options":{"include_usage":true}}', "stream_options", "stream: true"),  # noqa: E501
    "include_usage_yes": (CHAT, rb'{"model":"tiny","messages":[{"role":"user","content":"a"}],"stream":true,"stream_options":{"include_usage":"yes"}}', "stream_options.include_usage", "valid boolean"),  # noqa: E501
    "tokenize_surrogate": ("/tokenize", rb'{"prompt":"\ud800"}', "prompt", "lone surrogate"),
    "detokenize_floats": ("/detokenize", rb'{"tokens":[1.5]}', "tokens.0", "valid integer"),
}
# fmt: on


@pytest.mark.parametrize("case", CASES)
def test_a_bad_body_is_a_400_naming_its_parameter_on_a_connection_kept_open(server, case):
    path, body, param, words = CASES[case]
    with httpx.Client(base_url=server, timeout=30) as client:
        r = client.post(path, content=body, headers=AUTH)
        assert words in assert_openai_error(r, 400, param)
        assert r.headers.get("connection") != "close"
        after = client.post(CMPL, json=OK, headers=AUTH)
        assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"
        assert local_port(after) == local_port(r)  # the same connection served both


def test_the_key_is_checked_before_the_body(server):
    with httpx.Client(base_url=server, timeout=30) as client:
        for body in (b"{not json", b"\xff\xfe", b'{"prompt": "\\ud800"}', b"x" * (17 * 2**20)):
            r = client.post(CMPL, content=body, headers={"Content-Type": "application/json"})
            assert_openai_error(r, 401)
        assert_openai_error(client.post(CMPL, content=b"x" * (17 * 2**20), headers=AUTH), 413)  # over 16 MiB
        assert client.post(CMPL, json=OK, headers=AUTH).status_code == 200


def test_a_10mb_prompt_is_refused_at_once_while_health_answers(server):
    """The prompt's bytes exceed what 128 tokens of the longest token could hold: 400 before the
    tokenizer sees it. Measured on the 2-core machine at a load average of 10 (client, server and
    poller in this one process): the 400 in 60-90 ms, /health at most 30-140 ms meanwhile (5-25 ms
    idle); the bounds here are generous, for a loaded machine."""
    big = {"model": "tiny", "prompt": "word " * 2_000_000, "max_tokens": 2}
    bodies = {CMPL: json.dumps(big).encode(),
              CHAT: json.dumps({"model": "tiny", "messages": [{"role": "user", "content": big["prompt"]}]}).encode()}  # fmt: skip # noqa: E501
    health: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server) as client:
            while not done.is_set():
                t0 = time.perf_counter()
                assert client.get("/health").status_code == 200
                health.append(time.perf_counter() - t0)
                time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    took, ports = {}, set()
    with httpx.Client(base_url=server, timeout=30) as client:
        client.get("/health")
        for path, body in bodies.items():
            for _ in range(3):
                t0 = time.perf_counter()
                r = client.post(path, content=body, headers=AUTH)
                took[path] = min(took.get(path, 1e9), time.perf_counter() - t0)
                ports.add(local_port(r))
                message = assert_openai_error(r, 400, "prompt" if path == CMPL else "messages")
                assert "10000000 characters or bytes" in message and "context of 128 tokens" in message
        assert client.post(CMPL, json=OK, headers=AUTH).status_code == 200
    done.set()
    poller.join()
    assert len(ports) == 1  # one connection, kept open throughout
    print(f"10 MB prompt refused in {took[CMPL] * 1e3:.0f} ms (chat {took[CHAT] * 1e3:.0f} ms); "
          f"/health during it: max {max(health) * 1e3:.1f} ms over {len(health)} calls")  # fmt: skip
    assert max(took.values()) < 1.0 and max(health) < 0.5


def test_the_usage_chunk_only_when_asked_as_openai_sends_it(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "seed": 0}
    for create, kwargs in ((client.completions.create, OK), (client.chat.completions.create, chat)):
        plain = list(create(**kwargs, stream=True))
        text = [c.choices[0] for c in plain]  # the common loop: every chunk has a choice
        assert len(text) >= 2 and all(c.usage is None for c in plain)
        asked = list(create(**kwargs, stream=True, stream_options={"include_usage": True}))
        *chunks, last = asked
        assert [c.choices for c in chunks] == [c.choices for c in plain]
        assert all(c.usage is None for c in chunks)
        assert last.choices == [] and last.usage.prompt_tokens > 0
        assert last.usage.completion_tokens == kwargs["max_tokens"]
        assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    # on the wire: "usage": null in each chunk when asked, no usage key at all when not
    for options, want in ((None, set()), ({"include_usage": True}, {None})):
        body = {**OK, "stream": True, **({"stream_options": options} if options else {})}
        with httpx.stream("POST", f"{server}{CMPL}", json=body, headers=AUTH) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        with_choices = [e for e in events if e["choices"]]
        assert {e.get("usage", "absent") for e in with_choices} == (want or {"absent"})
        assert len(events) - len(with_choices) == (1 if options else 0)


def junk(rng: random.Random, depth: int = 0):
    """A random JSON value: scalars of every type, edge numbers, odd strings, nested containers."""
    scalars = [None, True, False, 0, -1, 1, 2**63, -(2**64), 10**30, 0.5, -0.0, 1e308, float("nan"),
               float("inf"), -float("inf"), "", "tiny", "a\ud800", "\udfff", "\x00", "é" * 3, "<|eos|>",
               "x" * rng.randrange(1, 3000)]  # fmt: skip
    kind = rng.random()
    if depth > 3 or kind < 0.6:
        return rng.choice(scalars)
    if kind < 0.8:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["role", "content", "include_usage", "a"]): junk(rng, depth + 1) for _ in range(rng.randrange(3))}  # fmt: skip # noqa: E501


FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "seed", "stop", "n", "stream", "stream_options", "echo", "logprobs", "top_logprobs",
          "ignore_eos", "tokens"]  # fmt: skip


def fuzz_bodies(rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    """Random bytes, mutilated good bodies, good bodies with one field of a random value, and
    random objects, each for one of the four POST paths."""
    good = {CMPL: {**OK, "max_tokens": 3}, CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},  # fmt: skip # noqa: E501
            "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [20, 30]}}  # fmt: skip
    bodies = []
    for i in range(count):
        path = rng.choice(list(good))
        base = json.dumps(good[path]).encode()
        kind = i % 4
        if kind == 0:
            body = rng.randbytes(rng.randrange(64))
        elif kind == 1:
            cut = rng.randrange(len(base))
            body = base[:cut] + rng.randbytes(rng.randrange(4)) + base[cut + rng.randrange(3) :]
        elif kind == 2:
            body = json.dumps({**good[path], rng.choice(FIELDS): junk(rng)}).encode()
        else:
            body = json.dumps({rng.choice(FIELDS): junk(rng) for _ in range(rng.randrange(5))}).encode()
        bodies.append((path, body))
    return bodies


def test_fuzzed_bodies_leave_the_server_serving_with_no_block_held(server):
    rng, statuses = random.Random(0), {}
    with httpx.Client(base_url=server, timeout=60) as client:
        for path, body in [*fuzz_bodies(rng, 400), *((path, body) for path, body, *_ in CASES.values())]:
            with client.stream("POST", path, content=body, headers=AUTH) as r:
                text = r.read()
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400, 404), (path, body[:200], text[:300])
            if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
                assert text.endswith(b"data: [DONE]\n\n") and b'"error"' not in text
            elif r.status_code != 200:
                assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    print(f"fuzz: {sum(statuses.values())} bodies, statuses {statuses}")
    assert statuses[200] > 20 and statuses[400] > 250  # both sides of the parser were reached
    for _ in range(100):
        m = metrics(server)
        if m["ember_requests_running"] + m["ember_requests_waiting"] + m["ember_kv_blocks_in_use"] == 0:
            break
        time.sleep(0.05)
    assert m["ember_requests_running"] + m["ember_requests_waiting"] + m["ember_kv_blocks_in_use"] == 0
    assert m["ember_engine_errors_total"] == 0
    assert httpx.post(f"{server}{CMPL}", json=OK, headers=AUTH).status_code == 200


@pytest.fixture
def port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    "host, port, device, words",
    [("127.0.0.1", 70000, "cpu", "--port 70000 is not a TCP port"), ("127.0.0.1", -1, "cpu", "1 to 65535"),
     ("127.0.0.1", 0, "cpu", "1 to 65535"), ("999.1.1.1", 8000, "cpu", "--host '999.1.1.1' does not resolve"),
     ("127.0.0.1", "in use", "cpu", "the port is in use"), ("8.8.8.8", 8000, "cpu", "cannot listen on 8.8.8.8"),  # noqa: E501
     ("127.0.0.1", 8000, "tpu", "serve.device=tpu is not usable"),
     ("127.0.0.1", 8000, "cuda:99", "serve.device=cuda:99 is not usable")],
)  # fmt: skip
def test_serve_checks_address_and_device_before_loading(tmp_path, port_in_use, host, port, device, words):
    """The run folder is empty: had the model begun to load, the error would be another."""
    from ember.infer.server import serve

    port = port_in_use if port == "in use" else port
    with pytest.raises(EmberError, match=re.escape(words)):
        serve(str(tmp_path), host, port, None, ServeConfig(device=device))


def test_ember_serve_bad_device_is_a_one_line_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ember.cli", "serve", str(tmp_path), "serve.device=tpu"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr and out.stdout == ""
    assert out.stderr.startswith("ember: error: serve.device=tpu is not usable here")
    assert out.stderr.count("\n") == 1
