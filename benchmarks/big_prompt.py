"""A 10 MB prompt against a real `ember serve` process: its 400, and /health meanwhile (issue 27).

    .venv/bin/ember train tiny train.max_steps=5 run.out_dir=/tmp/r
    .venv/bin/python benchmarks/big_prompt.py /tmp/r/tiny

The prompt is refused from its byte length before the tokenizer sees it, and parsing runs off
the event loop; /health is timed while the five refusals run, and idle before them.
"""

import json
import subprocess
import sys
import threading
import time

import httpx

run = sys.argv[1]
srv = subprocess.Popen(
    [sys.executable, "-m", "ember", "serve", run, "--port", "8123"],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
)
base = "http://127.0.0.1:8123"
for _ in range(300):
    try:
        if httpx.get(base + "/health").status_code == 200:
            break
    except Exception:
        time.sleep(0.2)
name = httpx.get(base + "/v1/models").json()["data"][0]["id"]
body = json.dumps({"model": name, "prompt": "word " * 2_000_000, "max_tokens": 2}).encode()
idle = []
with httpx.Client(base_url=base) as c:
    for _ in range(50):
        t = time.perf_counter()
        c.get("/health")
        idle.append(time.perf_counter() - t)
        time.sleep(0.01)
health, done = [], threading.Event()


def poll():
    with httpx.Client(base_url=base) as c:
        while not done.is_set():
            t = time.perf_counter()
            c.get("/health")
            health.append(time.perf_counter() - t)
            time.sleep(0.005)


th = threading.Thread(target=poll)
th.start()
took = []
with httpx.Client(base_url=base, timeout=30) as c:
    for _ in range(5):
        t = time.perf_counter()
        r = c.post("/v1/completions", content=body)
        took.append(time.perf_counter() - t)
        assert r.status_code == 400, r.status_code
done.set()
th.join()
srv.terminate()
srv.wait()


def ms(xs: list[float]) -> str:
    return ", ".join(f"{1e3 * x:.0f}" for x in sorted(xs))


busy, quiet = sorted(health), sorted(idle)
print(f"10 MB prompt -> 400, ms over 5 tries: {ms(took)} (target < 100)")
print(f"/health meanwhile: {len(busy)} calls, median {1e3 * busy[len(busy) // 2]:.1f} ms, "
      f"max {1e3 * busy[-1]:.1f} ms (target < 50); "
      f"idle: median {1e3 * quiet[25]:.1f} ms, max {1e3 * quiet[-1]:.1f} ms")  # fmt: skip
