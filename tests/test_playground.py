"""The playground at `ember serve`'s ``/`` in a real browser: headless Chromium, driven over the
DevTools protocol, streams the same greedy text as the API, shows one coloured element per
generated token with its probability and top-5 alternatives (on a real hover), holds a chat of
two turns, and offers completion only where the run has no chat template.

    EMBER_SCREENSHOT=1 pytest tests/test_playground.py    # also writes docs/img/playground.png
    EMBER_SCREENSHOT=runs/cpu-quick pytest tests/test_playground.py    # ... of that run's model

The browser is the system's (Debian: ``apt-get install chromium``); without one the browser
tests skip and say so. The protocol goes over a websocket with the ``websockets`` package that
uvicorn[standard] brings, so no browser-automation library is needed.
"""

from __future__ import annotations

import base64
import colorsys
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import tomllib
from importlib import resources
from pathlib import Path

import httpx
import openai
import pytest

from ember.errors import EmberError
from ember.infer.engine import Engine
from tests.test_server import KEY, server, start, tiny_engine  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


@pytest.fixture(scope="module")
def engine() -> Engine:
    """tests/test_server.py's tiny engine; ``EMBER_SCREENSHOT=RUN`` serves RUN's model instead,
    for the guide's picture (a trained model's text reads better than an untrained one's)."""
    run = os.environ.get("EMBER_SCREENSHOT", "")
    return Engine.from_run(run) if run not in ("", "1") else tiny_engine()


class Tab:
    """One browser tab over the Chrome DevTools protocol
    (https://chromedevtools.github.io/devtools-protocol/): ``call`` sends a command and returns
    its result, skipping the events that arrive meanwhile."""

    def __init__(self, ws):
        self.ws, self.last_id = ws, 0

    def call(self, method: str, timeout: float = 30, **params) -> dict:
        self.last_id += 1
        self.ws.send(json.dumps({"id": self.last_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            if message.get("id") == self.last_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def js(self, expression: str):
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        out = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in out:
            raise AssertionError(f"{expression!r} threw: {out['exceptionDetails']}")
        return out["result"].get("value")

    def wait_state(self, *states: str, timeout: float = 60) -> str:
        """Wait until the page's ``body[data-state]`` is one of ``states``; return it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.js("document.body?.dataset.state")
            if state in states:
                return state
            time.sleep(0.05)
        raise AssertionError(f"the page stayed {state!r}: {self.js('document.body?.innerText')!r}")

    def open(self, url: str) -> str:
        self.call("Page.navigate", url=url)
        time.sleep(0.1)  # (the old document may still answer for a moment)
        return self.wait_state("needs-key", "idle", "error", timeout=20)

    def set(self, selector: str, value) -> None:
        """Type a value into a control as a user would: the page hears the change."""
        self.js(f"""(() => {{ const el = document.querySelector({json.dumps(selector)});
            el.value = {json.dumps(str(value))}; el.dispatchEvent(new Event("change")); }})()""")

    def hover(self, selector: str) -> None:
        """Move the real mouse pointer to the middle of the element's first box (a token that
        ends a line wraps: its bounding box's middle may lie on another token)."""
        box = self.js(f"(() => {{ const r = document.querySelector({json.dumps(selector)}); r.scrollIntoView({{block: 'center'}}); const b = r.getClientRects()[0]; return [b.x + b.width / 2, b.y + b.height / 2]; }})()")  # fmt: skip # noqa: E501
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=box[0], y=box[1])


@pytest.fixture(scope="module")
def tab(tmp_path_factory):
    """A headless Chromium of the system's (its whole process group killed at the end)."""
    exe = next(filter(None, map(shutil.which, BROWSERS)), None)
    if exe is None:
        pytest.skip("no Chromium to drive: install Debian's `chromium` package (apt-get install chromium)")
    client = pytest.importorskip("websockets.sync.client", reason="needs websockets (pip install 'uvicorn[standard]')")  # fmt: skip # noqa: E501
    profile = tmp_path_factory.mktemp("chromium")
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"]  # fmt: skip
    browser = subprocess.Popen([exe, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)  # fmt: skip
    try:
        port_file = profile / "DevToolsActivePort"  # Chromium writes "PORT\n/devtools/browser/ID" here
        for _ in range(300):
            if browser.poll() is not None:
                raise AssertionError(f"{exe} exited with {browser.returncode} before it listened")
            if port_file.exists() and len(port_file.read_text().split()) == 2:
                break
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        page = next(t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page")
        with client.connect(page["webSocketDebuggerUrl"], max_size=2**26, open_timeout=10) as ws:
            tab = Tab(ws)
            tab.call("Emulation.setDeviceMetricsOverride", width=1100, height=540, deviceScaleFactor=1, mobile=False)  # fmt: skip # noqa: E501
            yield tab
    finally:
        os.killpg(browser.pid, signal.SIGKILL)  # the group this fixture started: renderer and helpers too
        browser.wait(10)


def page_tokens(tab: Tab) -> list[dict]:
    return tab.js("""[...document.querySelectorAll("#tokens .tok")].map((s) => ({token: s.dataset.token,
        p: Number(s.dataset.p), top: JSON.parse(s.dataset.top), colour: getComputedStyle(s).backgroundColor}))""")  # fmt: skip # noqa: E501


def legend_colour(p: float) -> tuple[int, ...]:
    """The colour the page's legend gives probability p: hsl(120 t, 70%, 80%), t = 1 + log10(p) / 3."""
    t = min(1.0, max(0.0, 1 + math.log10(p) / 3))
    return tuple(round(255 * c) for c in colorsys.hls_to_rgb(round(120 * t) / 360, 0.8, 0.7))


Tokens = list[tuple[str, float, list[tuple[str, float]]]]  # (token, logprob, [(alternative, logprob)])


def check_tokens(tab: Tab, want: Tokens, greedy: bool = True) -> None:
    """The page's token view against the API's tokens of an answer: one element per token, its
    probability, its colour, its top 5, likeliest first, and a tooltip on hover."""
    shown = page_tokens(tab)
    assert len(shown) == len(want) > 0
    for s, (token, logprob, top) in zip(shown, want, strict=True):
        assert s["token"] == token and 0 < s["p"] <= 1
        assert s["p"] == pytest.approx(math.exp(logprob), rel=1e-5)
        top = sorted(top, key=lambda a: -a[1])
        assert [a for a, _ in s["top"]] == [a for a, _ in top] and 1 <= len(top) <= 5
        # (the page's request and the API's are two computations: a prefix-cache hit or another
        # batch rounds fp32 differently, by a few ulps of a trained model's logprobs)
        assert [lp for _, lp in s["top"]] == pytest.approx([lp for _, lp in top], abs=1e-5)
        assert logprob >= top[0][1] - 1e-5 or not greedy  # the likeliest (two ids may print alike: "�")
        rgb = tuple(int(c) for c in re.findall(r"\d+", s["colour"])[:3])
        assert max(abs(a - b) for a, b in zip(rgb, legend_colour(s["p"]), strict=True)) <= 1, (s, rgb)
    # a real hover shows the tooltip: the token's probability and its alternatives
    tab.hover("#tokens .tok")
    tip = tab.js("""(() => { const t = document.querySelector("#tip"); return {shown: t.style.display,
        rows: [...t.querySelectorAll("tr")].map((r) => r.cells[0].textContent), text: t.innerText}; })()""")  # fmt: skip # noqa: E501
    assert tip["shown"] == "block"
    assert tip["rows"] == [json.dumps(a, ensure_ascii=False) for a, _ in shown[0]["top"]]
    assert f"p = {shown[0]['p']:.4f}" in tip["text"]


def completion_tokens(answer) -> Tokens:
    lp = answer.choices[0].logprobs
    return [(t, v, list(top.items())) for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)]  # fmt: skip # noqa: E501


def send(tab: Tab, prompt: str) -> str:
    tab.set("#prompt", prompt)
    tab.js("document.querySelector('#send').click()")
    assert tab.wait_state("done", "error") == "done", tab.js("document.querySelector('#status').textContent")
    return tab.js("[...document.querySelectorAll('.reply')].at(-1).textContent")


def test_the_page_ships_in_the_package_and_is_served_without_the_key(server):  # noqa: F811
    page = resources.files("ember.infer").joinpath("playground.html").read_text(encoding="utf-8")
    r = httpx.get(f"{server}/")
    assert r.status_code == 200 and r.text == page and r.headers["content-type"].startswith("text/html")
    assert httpx.get(f"{server}/v1/models").status_code == 401  # while the API keeps its key
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing from elsewhere: no CDN
    # a wheel carries the files setuptools' package-data names: every file of infer/ that is not Python
    shipped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = {p.name for p in (ROOT / "ember/infer").iterdir() if p.is_file() and p.suffix != ".py"}
    assert data == set(shipped["ember.infer"]) == {"playground.html"}


@pytest.mark.slow
def test_playground_streams_the_greedy_answer_and_colours_each_token(server, tab):  # noqa: F811
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    tab.open(f"{server}/")
    tab.js("localStorage.clear()")
    assert tab.open(f"{server}/") == "needs-key"  # /v1/models refused: the page asks for the key
    tab.set("#key", KEY)
    assert tab.wait_state("idle") == "idle"
    has_chat = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["chat"]  # fmt: skip # noqa: E501
    assert tab.js("document.querySelector('#mode-chat').disabled") is not has_chat
    assert tab.js("document.querySelector('#no-chat').checkVisibility()") is not has_chat

    # completion mode: the streamed text is the API's greedy completion, token by token
    tab.js("document.querySelector('#mode-completion').click()")
    for control, value in {"#temperature": 0, "#seed": 7, "#max_tokens": 12}.items():
        tab.set(control, value)
    prompt = "The quick brown fox"
    want = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=5)
    assert send(tab, prompt) == want.choices[0].text
    check_tokens(tab, completion_tokens(want))
    assert len(page_tokens(tab)) == want.usage.completion_tokens

    # chat mode, two turns: the page sends the whole conversation, as the API's client would
    assert has_chat  # (the tiny tokenizer has the chat tokens; the next test covers one without)
    tab.js("document.querySelector('#mode-chat').click()")
    messages = []
    for question in ("What is 2 + 2?", "And 3 + 3?"):
        messages.append({"role": "user", "content": question})
        want = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                              logprobs=True, top_logprobs=5)  # fmt: skip
        answer = want.choices[0].message.content
        assert send(tab, question) == answer
        messages.append({"role": "assistant", "content": answer})
        content = want.choices[0].logprobs.content
        check_tokens(tab, [(c.token, c.logprob, [(a.token, a.logprob) for a in c.top_logprobs]) for c in content])  # fmt: skip # noqa: E501
    assert tab.js("[...document.querySelectorAll('#transcript .msg')].map((m) => m.textContent)") == [
        m["content"] for m in messages
    ]

    # sampled with a seed: the controls reach the API, and the colours spread over the scale
    tab.js("document.querySelector('#mode-completion').click()")
    for control, value in {"#temperature": 1, "#top_p": 0.95, "#seed": 7, "#max_tokens": 40}.items():
        tab.set(control, value)
    prompt = "def main():\n    return"
    want = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=1, top_p=0.95,
                                     seed=7, logprobs=5)  # fmt: skip
    assert send(tab, prompt) == want.choices[0].text
    check_tokens(tab, completion_tokens(want), greedy=False)
    if os.environ.get("EMBER_SCREENSHOT"):  # the guide's picture (docs/serve.md), with a tooltip open
        tab.hover("#tokens .tok:nth-child(6)")
        png = base64.b64decode(tab.call("Page.captureScreenshot", format="png")["data"])
        (ROOT / "docs/img/playground.png").write_bytes(png)


@pytest.mark.slow
def test_without_a_chat_template_the_page_offers_completion_only(engine, tab, monkeypatch):  # noqa: F811
    def no_chat(tokenizer):
        raise EmberError("no chat tokens")

    monkeypatch.setattr("ember.data.chat.chat_ids", no_chat)
    url, srv, thread = start(engine)
    try:
        assert tab.open(f"{url}/") == "needs-key"  # (another port: another origin, no stored key)
        tab.set("#key", KEY)
        assert tab.wait_state("idle") == "idle"
        state = tab.js("""({chat: document.querySelector('#mode-chat').disabled,
            completion: document.querySelector('#mode-completion').checked,
            note: document.querySelector('#no-chat').checkVisibility()})""")
        assert state == {"chat": True, "completion": True, "note": True}
    finally:
        srv.should_exit = True
        thread.join(10)
