"""``ember serve RUN``: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

    ember serve runs/add2-sft --port 8000 [--api-key KEY] [serve.max_seqs=32 ...]
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "add2-sft", "prompt": "def main(", "max_tokens": 32}'

    from openai import OpenAI
    client = OpenAI(base_url="http://localhost:8000/v1", api_key="KEY")
    client.chat.completions.create(model="add2-sft", messages=[{"role": "user", "content": "2+2"}])

Endpoints: ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed as Server-Sent Events
with ``"stream": true``, ending with ``data: [DONE]``; with ``stream_options: {"include_usage":
true}`` every chunk has ``"usage": null`` and a last one, with ``"choices": []``, the usage, as
OpenAI's), ``GET /v1/models``, ``/health``, ``/metrics`` in Prometheus' text format, and at ``/``
a playground (``playground.html`` beside this file: chat or completion, each token coloured by
its probability; not behind the key, which the page asks for). Errors
have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad parameter
or body, 401 without the key when one is set (checked before the body is read), 404 for another
model's name, 413 for a body over 16 MiB, 429 when ``serve.max_waiting`` requests already wait.

**Any body.** A handler reads the body itself, not through FastAPI, so that every fault is one
of those 400s naming its parameter: bytes that are not UTF-8, JSON that does not parse (its line
and column), a wrong type (strict: ``true`` is no integer, ``"yes"`` no boolean), NaN or
infinity, a lone surrogate (``"\\ud800"``, which the tokenizer cannot encode). Parsing runs on a
worker thread and a prompt longer in bytes than the context could hold (``max_seq_len`` times
the longest token's bytes) is refused before it is tokenized, so a 10 MB prompt stalls no one.

**Threads.** FastAPI's handlers run on uvicorn's event loop; the model runs on one engine
thread that owns the scheduler. A handler never touches the scheduler: it puts a command
(add, cancel, score) on a queue and awaits an ``asyncio.Queue`` the engine thread feeds with
``call_soon_threadsafe``. Between two steps the engine thread applies every queued command,
so a request joins or leaves at the next step; when nothing runs it sleeps on the queue.
A client that goes away (its stream closed, or a non-streamed request whose connection
drops) sends a cancel, and its blocks are free after the current step.

Parameters follow OpenAI's (vLLM's extras: ``top_k``). ``seed`` defaults to a fresh one per
request; answer i of ``n`` samples with ``seed + i``, so a fixed seed gives the same text
whatever else the server is doing. ``echo`` puts the prompt before the text and, with
``logprobs``, its tokens' log-probabilities too (the first token has none): with
``max_tokens: 0`` that is how lm-evaluation-harness scores a continuation. Log-probabilities
are those of the model's distribution before temperature and filters, as OpenAI's and vLLM's.
"""

import asyncio
import contextlib
import errno
import json
import os
import queue
import re
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, ClassVar

import torch

from ember.config import ServeConfig
from ember.errors import EmberError
from ember.infer.engine import Engine
from ember.infer.sampling import Sampling
from ember.infer.scheduler import Request, Scheduler, top_logprobs

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}
MAX_BODY = 16 * 2**20  # bytes of a request body; a 16k-token context of 1 KiB tokens fits


class ApiError(Exception):
    """An error answered as OpenAI's JSON error body with an HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):  # fmt: skip # noqa: E501
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass
class Job:
    """One HTTP request's answers as the engine thread reports them to its handler."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    requests: list[Request] = field(default_factory=list)
    logprobs: int | None = None
    sent: list[list[int]] = field(default_factory=list)  # per answer: [ids, logprobs] reported so far

    def report(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class EngineLoop:
    """The scheduler on its own thread (module docstring); thread-safe ``submit`` and ``cancel``."""

    def __init__(self, scheduler: Scheduler, max_waiting: int):
        self.scheduler, self.max_waiting = scheduler, max_waiting
        self.commands: queue.Queue = queue.Queue()
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens generated) of recent steps
        self.errors = 0
        scheduler.on_read = self._report  # the last step's text, reported before this step's logits are read
        self.thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
        self.stopping = False
        self.thread.start()

    def submit(self, job: Job, prompt: list[int], sampling: Sampling, n: int) -> None:
        waiting = self.commands.qsize() + len(self.scheduler.waiting)  # read from another thread: approximate
        if waiting >= self.max_waiting:
            raise ApiError(429, f"the server is busy: {waiting} requests wait (serve.max_waiting)", "rate_limit_error")  # fmt: skip # noqa: E501
        self.commands.put(("add", job, prompt, sampling, n))

    def score(self, job: Job, prompt: list[int], top: int) -> None:
        self.commands.put(("score", job, prompt, top))

    def cancel(self, job: Job) -> None:
        self.commands.put(("cancel", job))

    def stop(self) -> None:
        self.stopping = True
        self.commands.put(("stop",))
        self.thread.join(timeout=10)

    def _apply(self, command: tuple) -> None:
        kind, s = command[0], self.scheduler
        if kind == "add":
            _, job, prompt, sampling, n = command
            try:
                job.requests = s.add(prompt, sampling, n, logprobs=job.logprobs)
            except EmberError as e:
                job.report(ApiError(400, str(e)))
                return
            job.sent = [[0, 0] for _ in range(n)]
            for request in job.requests:
                request.job = job
        elif kind == "cancel":
            for request in command[1].requests:
                if not request.done:
                    s.cancel(request)
        elif kind == "score":
            _, job, prompt, top = command
            job.report(prompt_logprobs(s.engine, prompt, top))

    def _run(self) -> None:
        while not self.stopping:
            idle = self.scheduler.idle
            try:
                command = self.commands.get(block=idle, timeout=None if idle else 0)
                while True:
                    if command[0] == "stop":
                        return
                    self._apply(command)
                    command = self.commands.get_nowait()
            except queue.Empty:
                pass
            try:
                before = self.scheduler.tokens_generated
                events = self.scheduler.step()
            except Exception as e:  # a bug must not hang every client: fail what ran, go on
                self.errors += 1
                s = self.scheduler
                for request in dict.fromkeys([*s.running, *s.waiting, *s.unread]):  # (unread ones may run)
                    s.cancel(request)
                    request.job.report(ApiError(500, f"the engine failed: {e!r}", "server_error"))
                continue
            now = time.monotonic()
            self.recent.append((now, self.scheduler.tokens_generated - before))
            while self.recent and self.recent[0][0] < now - 10:
                self.recent.popleft()
            self._report(events)

    def _report(self, events: list) -> None:
        """Hand each event to its job's event loop: the text piece, the ids and logprobs it covers
        (``Request.read``: a request's newest id may not be read yet), and the finish."""
        reports: dict[asyncio.AbstractEventLoop, list] = {}
        for request, piece in events:
            job, ids, lps = request.job, request.row.ids, request.logprobs
            i = job.requests.index(request)
            (n_ids, n_lps), job.sent[i] = job.sent[i], list(request.read)
            finish = request.row.finish_reason if request.done else None
            item = (i, piece, ids[n_ids : request.read[0]], lps[n_lps : request.read[1]] if job.logprobs is not None else None, finish)  # fmt: skip # noqa: E501
            reports.setdefault(job.loop, []).append((job.events, item))
        for loop, items in reports.items():  # one wake-up of the event loop per step, not per request
            loop.call_soon_threadsafe(_deliver, items)

    def tokens_per_s(self) -> float:
        if not self.recent:
            return 0.0
        span = max(time.monotonic() - self.recent[0][0], 1e-3)
        return sum(n for _, n in self.recent) / span


def _deliver(items: list) -> None:
    for events, item in items:
        events.put_nowait(item)


def prompt_logprobs(engine: Engine, ids: list[int], top: int) -> list:
    """[(id, logprob or None, {id: logprob} of the top alternatives)] for each prompt token: the
    model's distribution at the position before it (the first token has none)."""
    with torch.inference_mode():
        logits = engine.model(torch.tensor([ids], device=engine.device))[0].float()
    logp = logits[:, : engine.n_valid].log_softmax(-1)
    rest = [(t, row[t].item(), top_logprobs(row, top)) for t, row in zip(ids[1:], logp[:-1], strict=True)]
    return [(ids[0], None, {}), *rest]


def _bodies():
    """The request bodies as pydantic models (imported here: the `serve` extra is optional)."""
    from pydantic import AfterValidator, BaseModel, ConfigDict, Field

    Text = Annotated[str, AfterValidator(_unicode)]
    Stop = Annotated[Text, AfterValidator(_nonempty)]

    class Body(BaseModel):  # clients send fields ember does not use (user, ...): ignored
        model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
        fields: ClassVar[set[str]] = set()  # every body's field names, to tell them from union tags in errors

    class StreamOptions(Body):
        include_usage: bool = False

    class Common(Body):
        model: Text
        max_tokens: int | None = Field(None, ge=0)
        temperature: float = Field(1.0, ge=0, le=100)
        top_p: float = Field(1.0, gt=0, le=1)
        top_k: int = Field(0, ge=-1)  # vLLM's: 0 or -1 = all
        seed: int | None = None
        stop: Stop | list[Stop] | None = None
        n: int = Field(1, ge=1, le=64)
        stream: bool = False
        stream_options: StreamOptions | None = None
        ignore_eos: bool = False  # vLLM's: decode to max_tokens (benchmarks)

    class CompletionBody(Common):
        prompt: Text | list[Text] | list[int] | list[list[int]]
        echo: bool = False
        logprobs: int | None = Field(None, ge=0, le=20)

    class Message(Body):
        role: Text
        content: Text

    class ChatBody(Common):
        messages: list[Message] = Field(min_length=1)
        max_completion_tokens: int | None = Field(None, ge=0)
        logprobs: bool = False
        top_logprobs: int | None = Field(None, ge=0, le=20)

    class TokenizeBody(Body):
        prompt: Text

    class DetokenizeBody(Body):
        tokens: list[int]

    models = (CompletionBody, ChatBody, TokenizeBody, DetokenizeBody)
    Body.fields = {name for m in (*models, Message, StreamOptions) for name in m.model_fields}
    return models


def _unicode(text: str) -> str:
    try:
        text.isascii() or text.encode()  # (isascii is O(1): no copy of a 10 MB prompt)
    except UnicodeEncodeError as e:
        raise ValueError(f"holds a lone surrogate {text[e.start]!r} at character {e.start}; send valid Unicode") from None  # fmt: skip # noqa: E501
    return text


def _nonempty(stop: str) -> str:
    if not stop:
        raise ValueError("an empty stop string would end every answer at once")
    return stop


def parse(chunks: list[bytes], body_type):
    """The body in ``chunks`` as an instance of the pydantic model ``body_type``, or an ApiError(400)
    that says why not and names the parameter at fault (``param`` None when it is not JSON)."""
    from pydantic import ValidationError
    from pydantic_core import from_json

    raw = b"".join(chunks)  # (lets go of the GIL for a large body)
    try:  # jiter: a 10 MB body in ~10 ms with the GIL let go; the stdlib's parser only to explain a
        data = from_json(raw, allow_inf_nan=True)  # failure, or to read a lone surrogate
    except ValueError:
        data = _stdlib_json(raw)
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object; got {type(data).__name__}")
    try:
        return body_type.model_validate(data)
    except ValidationError as e:
        error = max(e.errors(), key=lambda x: len(x["loc"]))  # a union's most specific error
        param = ".".join(str(k) for k in error["loc"] if isinstance(k, int) or k in body_type.fields)  # no union tags  # fmt: skip # noqa: E501
        got = error["input"]
        shown = "" if isinstance(got, dict | list | str) else f" (got {json.dumps(got)[:24]})"
        raise ApiError(400, f"{param}: {error['msg'].removeprefix('Value error, ')}{shown}", param=param) from None  # fmt: skip # noqa: E501


def _stdlib_json(raw: bytes):
    try:
        return json.loads(raw.decode())
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not UTF-8 (byte {e.start}: {raw[e.start : e.start + 1]!r}); send JSON in UTF-8") from None  # fmt: skip # noqa: E501
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the body is not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (ValueError, RecursionError) as e:  # an integer of 4,300 digits and more; nesting too deep
        raise ApiError(400, f"the body is not JSON ember can read: {e}") from None


def _error(e: ApiError):
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body, status_code=e.status)


def create_app(engine: Engine, name: str, serve: ServeConfig, api_key: str | None = None):
    """The FastAPI app serving ``engine``'s model under the model name ``name``."""
    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import HTMLResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    from ember.data.chat import chat_ids, render

    CompletionBody, ChatBody, TokenizeBody, DetokenizeBody = _bodies()
    kv = serve.kv_memory
    if kv <= 1:  # a fraction of free memory
        kv *= torch.cuda.mem_get_info()[0] if engine.device.type == "cuda" else _free_ram()
    scheduler = Scheduler(engine, kv_memory=int(kv), block_size=serve.block_size,
                          max_batch_tokens=serve.max_batch_tokens, max_seqs=serve.max_seqs,
                          prefix_caching=serve.prefix_caching, paged_attention=serve.paged_attention,
                          decode_buckets=tuple(serve.decode_buckets) or None,
                          batch_invariant=serve.batch_invariant, async_steps=serve.async_steps)  # fmt: skip
    loop_holder: dict[str, EngineLoop] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_):
        loop_holder["loop"] = EngineLoop(scheduler, serve.max_waiting)
        yield
        loop_holder["loop"].stop()

    app = FastAPI(title="ember", version="1", lifespan=lifespan)
    max_len = engine.model.cfg.max_seq_len
    # no token stands for more bytes than its own string (byte-level symbols, <0x41>, ▁ are longer)
    max_bytes = max_len * max(len(t.encode()) for t in engine.tokenizer.hf.get_vocab())
    try:
        chat_ids(engine.tokenizer)
        has_chat = True
    except EmberError:
        has_chat = False

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return _error(e)

    @app.exception_handler(HTTPException)  # Starlette's own: an unknown path, a wrong method
    async def http_error(_, e: HTTPException):
        return _error(ApiError(e.status_code, str(e.detail)))

    async def parsed(http: Request, body_type):
        """The request's body as ``body_type`` (``parse``), read up to MAX_BODY bytes and parsed on a
        worker thread: the event loop keeps serving the others meanwhile."""

        def bound(size: int) -> None:
            if size > MAX_BODY:
                raise ApiError(413, f"the body is over {MAX_BODY} bytes; send at most {MAX_BODY}")

        declared = http.headers.get("content-length", "")
        bound(int(declared) if declared.isdigit() else 0)
        chunks, total = [], 0
        async for chunk in http.stream():
            chunks.append(chunk)
            total += len(chunk)
            bound(total)
        return await asyncio.to_thread(parse, chunks, body_type)

    async def check_key(request: Request) -> None:  # a dependency of the /v1 routes, not a middleware:
        # Starlette's BaseHTTPMiddleware runs a streamed body in a task it may cancel early
        if api_key and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", "authentication_error")  # fmt: skip # noqa: E501

    v1 = [Depends(check_key)]

    def check(body) -> None:
        if body.model != name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {name!r}", "not_found_error", "model")  # fmt: skip # noqa: E501
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")

    def sampling_of(body, max_tokens: int, seed: int) -> Sampling:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            top_p = None if body.top_p == 1 else body.top_p
            sampling = Sampling(max(max_tokens, 1), body.temperature, max(body.top_k, 0) or None, top_p, seed,
                                tuple(stop), body.ignore_eos)  # fmt: skip
            sampling.check_seed(body.n)  # here, not in the scheduler: before a stream has started
            return sampling
        except EmberError as e:
            flag = re.match(r"--([\w-]+)", str(e))  # the CLI's --top-k is the API's top_k
            message = re.sub(r"--([\w-]+)", lambda m: m[1].replace("-", "_"), str(e))
            raise ApiError(400, message, param=flag and flag[1].replace("-", "_")) from None

    def too_long(texts: list[str], param: str) -> None:
        """Refuse texts too long in bytes for any tokenization to fit the context, before tokenizing."""
        size = sum(map(len, texts))  # characters: no more than bytes, and no copy of a 10 MB text
        size = size if size > max_bytes else sum(len(t.encode()) for t in texts)
        if size > max_bytes:
            raise ApiError(400, f"the {param} is {size} characters or bytes, more than the model's context of {max_len} tokens can hold ({max_bytes} bytes); shorten it", param=param)  # fmt: skip # noqa: E501

    def encode(prompt) -> list[int]:
        if isinstance(prompt, str):
            too_long([prompt], "prompt")
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty; give at least one token", param="prompt")
        if len(ids) >= max_len:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; the model's context is {max_len}", param="prompt")  # fmt: skip # noqa: E501
        if any(not 0 <= t < engine.n_valid for t in ids):
            raise ApiError(400, f"the prompt holds token ids outside [0, {engine.n_valid})", param="prompt")
        return ids

    def max_tokens_of(body, ids: list[int], default: int | None) -> int:
        room = max_len - len(ids)
        asked = body.max_tokens if body.max_tokens is not None else default
        asked = room if asked is None else asked
        if asked > room:
            raise ApiError(400, f"max_tokens {asked} with a prompt of {len(ids)} tokens is beyond the model's context of {max_len}; ask for at most {room}", param="max_tokens")  # fmt: skip # noqa: E501
        bs, pool = scheduler.blocks.block_size, scheduler.blocks.num_blocks  # (constants: safe to read here)
        need = -(-(len(ids) + asked) // bs) * body.n
        if need > pool:  # checked again by the scheduler; here so that a stream fails before it starts
            raise ApiError(400, f"n={body.n} answers of up to {len(ids) + asked} tokens need {need} KV blocks; the pool has {pool}: lower n or max_tokens", param="n")  # fmt: skip # noqa: E501
        return asked

    async def run(http: Request, ids: list[int], sampling: Sampling, n: int, logprobs: int | None):
        """Submit one prompt's n answers; yield the engine thread's reports until all finish. A
        client that disconnects (the generator closed, or noticed here) cancels them."""
        job = Job(asyncio.get_running_loop(), logprobs=logprobs)
        loop_holder["loop"].submit(job, ids, sampling, n)

        async def watch() -> None:  # notice a drop within 0.1 s: a task of its own rather than a
            while not await http.is_disconnected():  # timeout on every token's wait
                await asyncio.sleep(0.1)
            job.events.put_nowait(None)

        watcher, finished = asyncio.create_task(watch()), 0
        try:
            while finished < n:
                item = await job.events.get()
                if item is None:
                    return
                if isinstance(item, ApiError):
                    raise item
                finished += item[4] is not None
                yield item
        finally:
            watcher.cancel()
            if finished < n:
                loop_holder["loop"].cancel(job)

    async def collect(answers: AsyncIterator[tuple] | None, n: int) -> tuple[list, list, list, int]:
        """The n answers' texts, log-probabilities and finish reasons, and the tokens they made, once
        all have finished (``answers`` None: none asked for, as with echo and max_tokens 0)."""
        texts, lps, finishes, made = [""] * n, [[] for _ in range(n)], ["length"] * n, 0
        if answers is not None:
            async for i, piece, new, new_lps, finish in answers:
                texts[i] += piece
                made += len(new)
                lps[i] += new_lps or []
                finishes[i] = FINISH.get(finish, finishes[i])
        return texts, lps, finishes, made

    def token_text(t: int) -> str:
        return engine.tokenizer.decode([t])

    def completion_logprobs(entries) -> dict:
        tokens, lps, tops, offsets, offset = [], [], [], [], 0
        for t, lp, alts in entries:
            tokens.append(token_text(t))
            lps.append(lp)
            tops.append({token_text(a): v for a, v in alts.items()} if lp is not None or alts else None)
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip

    # vLLM's tokenizer endpoints: lm-evaluation-harness's `tokenizer_backend=remote` reads them
    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = engine.tokenizer
        eos, bos = tok.hf.id_to_token(tok.eos_id), tok.hf.id_to_token(tok.bos_id)
        return {"eos_token": eos, "bos_token": bos, "eos_token_id": tok.eos_id, "model_max_length": max_len,
                "vocab_size": engine.n_valid}  # fmt: skip

    @app.post("/tokenize")
    async def tokenize(http: Request):
        tokens = await asyncio.to_thread(engine.tokenizer.encode, (await parsed(http, TokenizeBody)).prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": max_len}

    @app.post("/detokenize")
    async def detokenize(http: Request):
        tokens = (await parsed(http, DetokenizeBody)).tokens
        if not all(0 <= t < engine.n_valid for t in tokens):
            raise ApiError(400, f"tokens must be a list of ids in [0, {engine.n_valid})", param="tokens")
        return {"prompt": engine.tokenizer.decode(tokens)}

    page = resources.files(__package__).joinpath("playground.html").read_text(encoding="utf-8")

    @app.get("/", include_in_schema=False)
    async def playground():
        return HTMLResponse(page)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=v1)
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "ember",
                                            "max_model_len": max_len, "chat": has_chat}]}  # fmt: skip

    @app.get("/metrics")
    async def metrics():
        s, loop = scheduler, loop_holder["loop"]
        lines = {
            "ember_requests_waiting": ("gauge", len(s.waiting) + loop.commands.qsize()),
            "ember_requests_running": ("gauge", len(s.running)),
            "ember_kv_blocks_in_use": ("gauge", s.blocks.in_use),
            "ember_kv_blocks_total": ("gauge", s.blocks.num_blocks),
            "ember_generation_tokens_per_second": ("gauge", round(loop.tokens_per_s(), 3)),
            "ember_generation_tokens_total": ("counter", s.tokens_generated),
            "ember_preemptions_total": ("counter", s.preemptions),
            "ember_prefix_cache_hit_rate": ("gauge", round(s.blocks.hits / max(s.blocks.lookups, 1), 4)),
            "ember_kv_slots_used_total": ("counter", s.slots_used),
            "ember_kv_slots_held_total": ("counter", s.slots_held),
            "ember_engine_errors_total": ("counter", loop.errors),
        }
        text = "".join(f"# TYPE {k} {kind}\n{k} {v}\n" for k, (kind, v) in lines.items())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def sse(head: dict, choices: AsyncIterator[tuple[int, dict]], prompt_tokens: int, body) -> StreamingResponse:  # fmt: skip # noqa: E501
        """Server-Sent Events: a chunk per (tokens made, choice) of ``choices``; with ``include_usage``
        each has ``"usage": null`` and a last one, with no choices, the usage. An error once the
        stream has begun is an event of OpenAI's error shape."""
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def events():
            made, extra = 0, {"usage": None} if include_usage else {}
            try:
                async for tokens, choice in choices:
                    made += tokens
                    yield f"data: {json.dumps({**head, 'choices': [choice], **extra})}\n\n"
            except ApiError as e:
                yield f"data: {json.dumps(e.body)}\n\n"
            if include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(prompt_tokens, made)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions", dependencies=v1)
    async def completions(http: Request):
        body = await parsed(http, CompletionBody)
        check(body)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ApiError(400, "the prompt list is empty", param="prompt")
        if body.stream and len(prompts) > 1:
            raise ApiError(400, "stream one prompt at a time", param="prompt")
        encoded = await asyncio.to_thread(lambda: [encode(p) for p in prompts])
        limits = [max_tokens_of(body, ids, 16) for ids in encoded]
        if any(m == 0 for m in limits) and not body.echo:
            raise ApiError(400, "max_tokens 0 is only meaningful with echo", param="max_tokens")
        seed = body.seed if body.seed is not None else secrets.randbits(48)
        samplings = [sampling_of(body, limit, seed) for limit in limits]
        rid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": name}

        async def prompt_part(prompt, ids: list[int]) -> tuple[str, list]:
            """What ``echo`` puts before each answer: the prompt's text and its tokens' log-probabilities."""
            if not body.echo:
                return "", []
            text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids)
            if body.logprobs is None:
                return text, []
            job = Job(asyncio.get_running_loop())
            loop_holder["loop"].score(job, ids, body.logprobs)
            return text, await job.events.get()

        if body.stream:
            ids, limit, sampling = encoded[0], limits[0], samplings[0]

            async def chunks():
                echo, echo_lps = await prompt_part(prompts[0], ids)
                if echo:
                    for i in range(body.n):
                        lp = completion_logprobs(echo_lps) if body.logprobs is not None else None
                        yield 0, {"index": i, "text": echo, "logprobs": lp, "finish_reason": None}
                if limit:
                    async for i, piece, new, lps, finish in run(http, ids, sampling, body.n, body.logprobs):
                        lp = completion_logprobs(lps) if lps is not None else None
                        yield len(new), {"index": i, "text": piece, "logprobs": lp, "finish_reason": FINISH.get(finish)}  # fmt: skip # noqa: E501

            return sse(head, chunks(), len(ids), body)
        choices, prompt_tokens, made = [], 0, 0
        for prompt, ids, limit, sampling in zip(prompts, encoded, limits, samplings, strict=True):
            echo, echo_lps = await prompt_part(prompt, ids)
            answers = run(http, ids, sampling, body.n, body.logprobs) if limit else None
            texts, lps, finishes, answer_tokens = await collect(answers, body.n)
            prompt_tokens, made = prompt_tokens + len(ids), made + answer_tokens
            for i in range(body.n):
                lp = completion_logprobs(echo_lps + lps[i]) if body.logprobs is not None else None
                choices.append({"index": len(choices), "text": echo + texts[i], "logprobs": lp,
                                "finish_reason": finishes[i]})  # fmt: skip
        return {**head, "choices": choices, "usage": usage(prompt_tokens, made)}

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat(http: Request):
        body = await parsed(http, ChatBody)
        check(body)
        if not has_chat:
            raise ApiError(400, f"the model {name!r} has no chat template (no chat tokens in its tokenizer); fine-tune it with train.task=sft first, or use /v1/completions")  # fmt: skip # noqa: E501
        too_long([m.content for m in body.messages], "messages")
        try:
            ids = render(engine.tokenizer, [m.model_dump() for m in body.messages], add_generation_prompt=True)[0]  # fmt: skip # noqa: E501
        except EmberError as e:
            raise ApiError(400, str(e), param="messages") from None
        ids = encode(ids)
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        limit = max_tokens_of(body, ids, None)
        if limit == 0:
            raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
        seed = body.seed if body.seed is not None else secrets.randbits(48)
        top = (body.top_logprobs or 0) if body.logprobs else None
        rid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": name}
        sampling = sampling_of(body, limit, seed)

        def chat_logprobs(entries) -> dict:
            def alternatives(alts):
                return [{"token": token_text(a), "logprob": v} for a, v in alts.items()]

            return {"content": [{"token": token_text(t), "logprob": lp, "top_logprobs": alternatives(alts)}
                                for t, lp, alts in entries]}  # fmt: skip

        if body.stream:

            async def chunks():
                for i in range(body.n):
                    yield 0, {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}  # fmt: skip # noqa: E501
                async for i, piece, new, lps, finish in run(http, ids, sampling, body.n, top):
                    yield len(new), {"index": i, "delta": {"content": piece} if piece else {},
                                     "logprobs": chat_logprobs(lps) if lps is not None else None,
                                     "finish_reason": FINISH.get(finish)}  # fmt: skip

            return sse({**head, "object": "chat.completion.chunk"}, chunks(), len(ids), body)
        texts, lps, finishes, made = await collect(run(http, ids, sampling, body.n, top), body.n)
        choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                    "finish_reason": finishes[i], "logprobs": None if top is None else chat_logprobs(lps[i])}
                   for i in range(body.n)]  # fmt: skip
        return {**head, "choices": choices, "usage": usage(len(ids), made)}

    return app


def _free_ram() -> int:
    """Bytes of memory available now (Linux: MemAvailable), for ``serve.kv_memory`` as a fraction."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def listen_socket(host: str, port: int, device: str) -> socket.socket:
    """A socket bound to ``host:port`` once ``device`` has made a tensor: a port out of range, a host
    that does not resolve or is not this machine's, a port in use or a device this machine lacks
    is an EmberError in a second, not uvicorn's error after the model has loaded. The server then
    listens on this very socket, so the port cannot be taken in between."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        raise EmberError(f"serve.device={device} is not usable here ({str(e).splitlines()[0]}); use serve.device=cpu or a device this machine has") from None  # fmt: skip # noqa: E501
    if not 1 <= port <= 65535:
        raise EmberError(f"--port {port} is not a TCP port; use one from 1 to 65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as e:
        raise EmberError(f"--host {host!r} does not resolve ({e}); use an address of this machine, such as 127.0.0.1 or 0.0.0.0") from None  # fmt: skip # noqa: E501
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        in_use = e.errno == errno.EADDRINUSE
        why = "the port is in use; stop what holds it or pick another --port" if in_use else e.strerror
        raise EmberError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


def serve(run: str, host: str, port: int, api_key: str | None, cfg: ServeConfig) -> None:
    """``ember serve``: check the address and device, load the run, serve until interrupted."""
    try:
        import uvicorn
    except ImportError:
        raise EmberError("ember serve needs the serve extra: pip install -e '.[serve]'") from None
    sock = listen_socket(host, port, cfg.device)
    if cfg.device == "cpu":  # measured: 1 thread for the engine and 1 for HTTP beat 2 for the engine 1.6x
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 2) - 1))
    engine = Engine.from_run(run, device=cfg.device)
    name = Path(run).resolve().name
    app = create_app(engine, name, cfg, api_key)
    print(f"ember serve: {name} on http://{host}:{port}/v1 ({engine.device}), playground at http://{host}:{port}/; Ctrl-C to stop", flush=True)  # fmt: skip # noqa: E501
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).run(sockets=[sock])
