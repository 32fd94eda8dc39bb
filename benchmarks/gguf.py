"""llama.cpp against ember on the same weights (issue 31, point 2): greedy continuations and
batch-1 decode speed on this CPU.

    .venv/bin/pip install -e '.[llama]'       # llama-cpp-python: builds llama.cpp from source (minutes)
    .venv/bin/python benchmarks/gguf.py RUN [--new-tokens 128] [--reps 3] [--threads 2]

RUN is a trained ember run in the GPT-2 or Llama layout (the quickstart's ``runs/quickstart``,
``runs/cpu-quick``). ``ember export --to gguf`` writes it as f32, f16 and q8_0 files, which
llama.cpp (through llama-cpp-python) loads.

**Greedy parity.** For each of 5 prompts (code, prose, a Unicode-heavy line), ember's tokenizer
gives the prompt's ids and both sides continue those ids greedily for 32 tokens (llama.cpp's
own tokenization of the text is compared with ember's too, and printed). At f32 the 32 ids must
be ember's (exit 1 otherwise); at f16 and q8_0 the leading ids that agree are printed, since a
rounded weight may flip a near-tie.

**Decode speed.** Batch 1, ``--new-tokens`` tokens after a 64-token prompt, end of text ignored;
tokens/s counts the tokens after the first, (n - 1) / (time of n tokens - time of 1), each time
the median of ``--reps`` (so the prompt's prefill is left out), every side on ``--threads``
threads: ember's engine in fp32 and with its linears int8 weight-only (``ember.model.quant``, as
``ember quantize --scheme int8-weight`` stores them) and compiled (``Engine(compile=True)``: a
static KV cache under ``torch.compile``, as ``ember generate --compile``), llama.cpp at f32,
f16 and q8_0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# run as a script, this file's folder leads sys.path, and its name would shadow the gguf package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from ember.export.gguf import export_gguf  # noqa: E402
from ember.infer.engine import Engine  # noqa: E402
from ember.infer.sampling import Sampling  # noqa: E402
from ember.model.quant import QuantSpec, quantize  # noqa: E402

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\nclass Config:\n    def __init__(self, path):\n",
    "The tokenizer splits the text into",
    "for i, line in enumerate(open(path)):\n    if",
    "# naïve café — Grüße, 你好世界, привет мир 😀 ∑x² ≤ ∞\nprint(",
]
TYPES = ("f32", "f16", "q8_0")
PARITY_TOKENS = 32


def llama_greedy(llm, ids: list[int], n: int) -> list[int]:
    llm.reset()
    out = []
    for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(t)
        if len(out) == n:
            break
    return out


def ember_greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    [done] = engine.generate([ids], Sampling(max_new_tokens=n, temperature=0, ignore_eos=True))
    return done.token_ids


def leading(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def decode_rate(generate, n: int, reps: int) -> float:
    """Tokens/s of ``generate(k)`` (k new tokens after the prompt) past its first token: the
    median time of n tokens less that of 1 (the prompt's prefill and the first token), after one
    untimed call."""

    generate(n)  # warm: a first call compiles (torch.compile, the int8 C++ op) or pages in

    def median_s(k: int) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            generate(k)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return (n - 1) / (median_s(n) - median_s(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed: pip install -e '.[llama]' (builds llama.cpp, minutes)")
        return 2
    torch.set_num_threads(args.threads)
    engine = Engine.from_run(args.run)
    tok, max_len = engine.tokenizer, engine.model.cfg.max_seq_len
    print(f"run {args.run}: {sum(p.numel() for p in engine.model.parameters()):,} parameters, "
          f"llama-cpp-python {llama_cpp.__version__}, {args.threads} threads")  # fmt: skip
    tmp = Path(tempfile.mkdtemp())
    llms = {}
    for kind in TYPES:
        path = export_gguf(args.run, tmp / f"model-{kind}.gguf", kind=kind)
        llms[kind] = llama_cpp.Llama(str(path), n_ctx=max_len, n_batch=max_len, n_threads=args.threads,
                                     n_threads_batch=args.threads, verbose=False)  # fmt: skip

    print(f"\ngreedy parity, {PARITY_TOKENS} tokens after each prompt (leading ids equal to ember's)")
    print(f"{'prompt':44} {'tokens same':>11} " + " ".join(f"{k:>5}" for k in TYPES))
    exit_code = 0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        same_tok = llms["f32"].tokenize(prompt.encode(), add_bos=False, special=False) == ids
        want = ember_greedy(engine, ids, PARITY_TOKENS)
        agree = [leading(llama_greedy(llms[k], ids, PARITY_TOKENS), want) for k in TYPES]
        exit_code |= agree[0] < PARITY_TOKENS
        print(f"{prompt[:30]!r:44} {str(same_tok):>11} " + " ".join(f"{a:>5}" for a in agree))

    prompt = (tok.encode("\n".join(PROMPTS)) * 8)[:64]
    n = min(args.new_tokens, max_len - len(prompt))
    int8 = Engine(quantize(Engine.from_run(args.run).model, QuantSpec("int8-weight", head=True)), tok)
    compiled = Engine(Engine.from_run(args.run).model, tok, compile=True)  # static cache, torch.compile
    sides = {"ember fp32": lambda k: ember_greedy(engine, prompt, k),
             "ember fp32 compiled": lambda k: ember_greedy(compiled, prompt, k),
             "ember int8-weight": lambda k: ember_greedy(int8, prompt, k)}  # fmt: skip
    for kind in TYPES:
        sides[f"llama.cpp {kind}"] = lambda k, llm=llms[kind]: llama_greedy(llm, prompt, k)
    print(f"\nbatch-1 decode, {n} tokens after a {len(prompt)}-token prompt, median of {args.reps}")
    rates = {name: decode_rate(generate, n, args.reps) for name, generate in sides.items()}
    base = rates["ember fp32"]
    for name, rate in rates.items():
        print(f"{name:20} {rate:9.1f} tok/s   {rate / base:5.2f}x ember fp32")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
