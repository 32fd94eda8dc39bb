"""Decode speed: ember's ``Engine.generate`` against transformers' ``generate``, same weights.

    .venv/bin/python benchmarks/decode.py [--model NAME ...] [--new-tokens N] [--reps N]
                                          [--threads N] [--device cpu|cuda] [--dtype fp32|bf16]
                                          [--no-graphs] [--peak-bandwidth GB/s] [--anatomy]
                                          [--variants compiled graphs compiled-graphs tuned-graphs
                                                      fused-graphs fused-graphs-no-pdl
                                                      fused-graphs-persistent fused-graphs-persistent-n8]

Both generate ``--new-tokens`` (256) tokens greedily after a 64-token prompt, at batch 1,
at batch 8 (8 different prompts), and at batch 8 with prompts of 64 down to about 22
tokens ("8 ragged": ember left-pads in one cache, HF gets left padding and an attention
mask), fp32, in ``torch.inference_mode``, random weights
(seed 0, std 0.1). The models (``--model``, repeatable; default ``cpu-quick`` and
``gpt2-mini``):

- ``cpu-quick``: the quickstart's model (configs/cpu-quick.yaml: d_model 128, 4 layers,
  2 heads, RoPE, RMSNorm, SwiGLU), against ``LlamaForCausalLM``; what ``ember generate``
  decodes after ``ember quickstart`` on this CPU. ``max_seq_len`` 512 (RoPE has no
  position weights, so the parameters are the preset's).
- ``gpt2-mini``: the shape of benchmarks/train_step.py (d_model 384, 6 layers, 6 heads,
  GPT-2 layout), against ``GPT2LMHeadModel``.
- ``llama-mini``: the same size in the Llama layout with 2 key/value heads (GQA).
- ``gpt2-small``: GPT-2 small (d_model 768, 12 layers, 12 heads), for a GPU.
- ``gpt2-large``: GPT-2 large (d_model 1280, 36 layers, 20 heads, ~0.7B parameters here), for
  a GPU: matrices of 3-13 MB, whose GEMVs read at a fair share of the bandwidth, where
  gpt2-small's 1-5 MB ones are bound by each kernel's latency. The same code at two widths
  separates what the step's kernel count costs from what its bytes cost.
- ``gpt2-tiny``: 2 layers of 64, to dry-run the rows on a CPU (the fused step's kernels run
  under Triton's interpreter there, a few seconds a token at gpt2-mini's size).

The vocabulary is the benchmark tokenizer's 4096 in every case. For each model it first
checks parity in fp32 at batch 1, whatever ``--dtype``: how many leading greedy ids ember
shares with HF and the graphed engine with the plain one (exit 1 below 32: the weight mapping
or the graphed path would be broken), and the largest |diff| of the prompt's logits. In bf16
both sides drift from fp32 (issue 29: ember's cached greedy agreed with its own full forward
on 123/128 ids, HF's on 117/128), so bf16 ids are compared and printed, not required. Then
one table of tokens/s (batch * new tokens / median seconds) and ember/HF, and whether ember
reaches 3x HF at batch 1. The rows of the other batches are compared with HF's too (leading
ids that agree), printed only.

It also prints the memory-bandwidth bound of batch-1 decoding: every new token reads all
the weights and the keys and values held so far, so bytes per token / copy bandwidth
(measured here by copying a 256 MiB tensor into another, read + write) is the least time
a token can take, and tokens/s * bytes per token / bandwidth is the fraction of that bound
reached. On a CPU a model whose weights fit in the last-level cache (``cpu-quick``: 5.5 MB)
is not held to the DRAM figure and can pass 100%. On a GPU the fraction of the nominal HBM
bandwidth is printed too (``PEAK_BANDWIDTH`` by device name, or ``--peak-bandwidth``).

Design choices:

- Same weights (``to_hf`` copies ours) and the same prompt ids: HF gets
  ``tokenizer.encode_batch(prompts)`` as ``input_ids``, left-padded with ``<|pad|>`` to the
  longest, with an attention mask of ones on the real tokens.
- The 8 prompts of "8" encode to the same number of tokens, so neither side pads: both take
  the plain causal path with no attention mask; "8 ragged" takes the masked path. Each
  prompt is the first 64 tokens of a standard-library file, decoded to text, kept only if
  it encodes back to exactly those 64 ids (the ragged ones: a shorter prefix, likewise).
- Weights are drawn with std 0.1, not the 0.02 of training: at 0.02 the tied head makes a
  random model repeat its last token, so the greedy ids would agree even with positions
  mapped wrong; at 0.1 a row of 128 ids has 80-125 distinct ones. The values of the
  weights do not change the work, so the timings are those of the trained shape.
- ember is timed through ``Engine.generate``, the public path: prompt encoding, the
  per-step incremental text decode and the stop/eos bookkeeping are included. HF is timed
  through ``model.generate`` with its default (dynamic) KV cache; its output ids are not
  decoded to text, which only favours HF.
- Every row makes exactly ``--new-tokens`` tokens: ember with ``ignore_eos=True``, HF with
  ``min_new_tokens`` and no eos id in its config. Both counts are checked after warm-up.
- The tokenizer is a byte-level BPE (vocab 4096) trained in-process on the first 1.5 M
  characters of the standard library (under a second), and the model's vocabulary is the
  tokenizer's, so ember's engine masks no logits that HF would keep.
- At batch 1 ember is also timed as ``Engine(model, tokenizer, compile=True)``: a
  ``StaticKVCache`` (position in a tensor, attention over all 319 slots under a mask) and
  the one-token decode step under ``torch.compile(fullgraph=True)``, without dynamo's guards
  on the model (the prefill stays eager; see ``_compiled_step`` in ember/infer/engine.py).
  Its first call, which compiles, is timed apart and printed; its greedy ids are compared
  with eager ember's.
- "graphs" rows: ``Engine(..., graphs=True)``, the static-cache decode step (eager, or compiled)
  captured once in a CUDA graph and replayed per token (``GraphedDecode`` in the engine). On a
  CPU there are no CUDA graphs and the same wrapper runs the step as is, so there these rows
  time the wrapper, not graphs. ``--no-graphs`` drops them.
- Quantized batch-1 rows (``--quant``, default ``int8-weight`` and ``int4-weight`` group 32):
  a copy of the same model through ``ember.model.quant.quantize``, eager, compiled and compiled
  in a graph, same prompt (on CUDA int8-weight's linears are ember's Triton GEMV at batch 1); its
  greedy ids are compared with fp32 ember's (quantization changes the numbers, so
  they may part), and its bound counts the bytes it reads (int8/int4 values, scales, zeros,
  the int8 head, one row of the fp32 embedding). One table lists every batch-1 row: tokens/s, x HF, the
  bound and the fraction of it reached, and the first (compiling) call.
- ``--dtype bf16`` casts both models to bf16 after the fp32 parity check (for a GPU:
  ``--device cuda --model gpt2-small --dtype bf16`` prints batch-1 tokens/s, x HF and the
  fraction of the bandwidth bound for bf16, int8 and int4, and issue 29's targets: >= 25% of
  the bound and >= 8x HF, int8-weight faster than unquantized).
- One warm-up call of each (every batch), then ``--reps`` timed calls in turns (ember,
  HF, ember, HF, ... per batch size) so that noise from the machine falls on both alike;
  the median is reported.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import transformers
from printing import cpu_model, print_table
from profiling import costliest, profiled

from ember.config import ModelConfig
from ember.data.sources import open_source
from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.infer.engine import TUNED, Engine, cuda_graph
from ember.infer.sampling import Sampling
from ember.model.gpt import GPT
from ember.model.hf import to_hf
from ember.model.quant import SCHEMES, QuantLinear, QuantSpec, quantize, weight_bytes

VOCAB, MAX_SEQ_LEN, PROMPT_TOKENS = 4096, 512, 64
GPT2 = dict(pos="learned", norm="layernorm", mlp="gelu", bias=True)
LLAMA = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
MODELS = {  # name -> ModelConfig fields besides the vocabulary
    "cpu-quick": dict(n_layer=4, n_head=2, d_model=128, **LLAMA),
    "gpt2-mini": dict(n_layer=6, n_head=6, d_model=384, **GPT2),
    "llama-mini": dict(n_layer=6, n_head=6, n_kv_head=2, d_model=384, **LLAMA),
    "gpt2-small": dict(n_layer=12, n_head=12, d_model=768, **GPT2),
    "gpt2-large": dict(n_layer=36, n_head=20, d_model=1280, **GPT2),
    "gpt2-tiny": dict(n_layer=2, n_head=4, d_model=64, **GPT2),  # a CPU dry run of the fused rows
}
RAGGED_STEP = 6  # "8 ragged": prompt i keeps about PROMPT_TOKENS - RAGGED_STEP * i tokens
SEED = 0
INIT_STD = 0.1  # see the module docstring
TOKENIZER_TRAIN_BYTES = 1_500_000
MIN_AGREE = 32  # fewer leading greedy ids in common than this means the mapping is broken
TARGET = 3.0  # ember tokens/s over HF's at batch 1
GPU_TARGET, GPU_BOUND_TARGET = 8.0, 0.25  # issue 29 (bf16 gpt2-small on an H100/H200): x HF, of the bound
PEAK_BANDWIDTH = {  # bytes/s, the vendors' figures, by a piece of torch.cuda.get_device_name()
    "H100 PCIe": 2.0e12,
    "H100 NVL": 3.9e12,
    "H100": 3.35e12,  # SXM, HBM3
    "H200": 4.8e12,
    "A100-SXM4-80GB": 2.04e12,
    "A100": 1.56e12,
}

Generate = Callable[[], list[list[int]]]


def model_config(name: str, vocab_size: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size, max_seq_len=MAX_SEQ_LEN, init_std=INIT_STD, dropout=0.0, **MODELS[name]
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, mib: int = 256, reps: int = 5, copies: int = 10) -> float:
    """Bytes per second moved by copying a ``mib`` MiB tensor into another (read + write), best of
    ``reps`` rounds of ``copies`` back to back (one copy alone took its launch and the sync with
    it, ~10 µs of ~160 on an H100: a bound ~6% low); both are touched first, so no page faults
    are timed."""
    x = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.zeros_like(x)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        for _ in range(copies):
            y.copy_(x)
        sync(device)
        best = min(best, (time.perf_counter() - start) / copies)
    return 2 * x.numel() * 4 / best


def bytes_per_token(cfg: ModelConfig, model: torch.nn.Module, context: float) -> float:
    """Bytes batch-1 decoding reads per new token: every saved tensor once (a tied matrix once;
    a quantized layer's int8/int4 values, scales and zeros) except a lookup table that is not
    also the head, of which one row is read (the token embedding beside a quantized head, GPT-2's
    learned positions), and the keys and values of ``context`` held positions in every layer,
    in the model's dtype."""
    kv_heads = cfg.n_kv_head or cfg.n_head
    itemsize = next(model.parameters()).element_size()
    kv = 2 * cfg.n_layer * kv_heads * (cfg.d_model // cfg.n_head) * context * itemsize
    head = getattr(model.output, "weight", None)
    tables = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.weight is not head]
    unread = sum((t.size(0) - 1) * t[0].numel() * t.element_size() for t in tables)
    return weight_bytes(model) - unread + kv


def linear_floor(model: torch.nn.Module, device: torch.device, reps: int = 50) -> float:
    """Seconds per token spent in the linear layers alone at batch 1 (every block linear and the
    head, each called on one row of its input width, best of ``reps`` per layer): the least a
    decode step can take with these kernels, whatever runs around them."""
    total = 0.0
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantLinear))]
    with torch.inference_mode():
        for layer in layers:
            x = torch.randn(1, layer.in_features, device=device, dtype=next(model.parameters()).dtype)
            layer(x)
            best = float("inf")
            for _ in range(reps):
                sync(device)
                start = time.perf_counter()
                layer(x)
                sync(device)
                best = min(best, time.perf_counter() - start)
            total += best
    return total


def linear_pass(model: torch.nn.Module, device: torch.device, passes: int = 20) -> float:
    """Seconds per token for every linear layer called once, in model order, on one row: the
    weights stream from memory as in decoding (no layer's weights are cache-hot when it runs
    again), median of ``passes``. The least a decode step with these kernels can take when the
    model does not fit in cache; on CPUs whose GEMV reads slower than a copy, the true ceiling.
    On CUDA the pass is replayed from a CUDA graph, as the graphed decode step runs its kernels:
    launched from Python, each GEMV would time the host instead."""
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantLinear))]
    dtype = next(model.parameters()).dtype
    inputs = [torch.randn(1, layer.in_features, device=device, dtype=dtype) for layer in layers]

    def once() -> torch.Tensor:
        return [layer(x) for layer, x in zip(layers, inputs, strict=True)][-1]

    seconds = []
    with torch.inference_mode():
        run = cuda_graph(once, 2, device)[0].replay if device.type == "cuda" else once
        for i in range(passes + 2):
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            if i >= 2:  # two warm-up passes
                seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def peak_bandwidth(device: torch.device) -> float | None:
    """The nominal memory bandwidth of a known GPU (first matching name piece), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for piece, bw in PEAK_BANDWIDTH.items() if piece in name), None)


def train_tokenizer() -> tuple[Tokenizer, list[str]]:
    """A BPE tokenizer trained on the first standard-library files, and the texts of the
    files after those (prompt material the tokenizer has not seen)."""
    train, rest, size = [], [], 0
    for doc in open_source("embedded:python-stdlib").documents():
        if size < TOKENIZER_TRAIN_BYTES:
            train.append(doc.text)
            size += len(doc.text)
        elif len(rest) < 64:
            rest.append(doc.text)
        else:
            break
    return Tokenizer.train_bpe(train, vocab_size=VOCAB), rest


def pick_prompts(tokenizer: Tokenizer, texts: list[str], n: int) -> list[str]:
    """``n`` prompts of exactly PROMPT_TOKENS tokens each, from different files."""
    prompts = []
    for text in texts:
        ids = tokenizer.encode(text[: PROMPT_TOKENS * 16])[:PROMPT_TOKENS]
        prompt = tokenizer.decode(ids)
        if len(ids) == PROMPT_TOKENS and tokenizer.encode(prompt) == ids:
            prompts.append(prompt)
        if len(prompts) == n:
            return prompts
    raise SystemExit(f"found only {len(prompts)} of {n} prompts that encode to {PROMPT_TOKENS} tokens")


def shorten(tokenizer: Tokenizer, prompts: list[str]) -> list[str]:
    """Prompt i cut to about PROMPT_TOKENS - RAGGED_STEP * i tokens, at a length whose text
    encodes back to the same ids."""
    out = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        n = PROMPT_TOKENS - RAGGED_STEP * i
        while tokenizer.encode(tokenizer.decode(ids[:n])) != ids[:n]:
            n -= 1
        out.append(tokenizer.decode(ids[:n]))
    return out


def ember_generate(engine: Engine, prompts: list[str], new_tokens: int) -> Generate:
    def generate() -> list[list[int]]:
        with torch.inference_mode():
            completions = engine.generate(prompts, Sampling(new_tokens, temperature=0.0, ignore_eos=True))
        return [c.token_ids for c in completions]

    return generate


def hf_generate(
    model: torch.nn.Module, rows: list[list[int]], new_tokens: int, pad_id: int, device: torch.device
) -> Generate:
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)  # (B, width)
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)

    def generate() -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )  # (B, width + new_tokens)
        return out[:, input_ids.size(1) :].tolist()

    return generate


def timed(generate: Generate, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    generate()
    sync(device)
    return time.perf_counter() - start


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def check_parity(
    ours: GPT, hf: torch.nn.Module, tokenizer: Tokenizer, prompt: str, args: argparse.Namespace, device
) -> list[int]:
    """fp32, batch 1: ember's greedy ids against HF's (the weight mapping) and the graphed engine's
    against the plain one's (the graphed path), and the prompt's logits; exit 1 where fewer than
    MIN_AGREE leading ids agree. With fused-graphs among the variants, the fused step's ids too:
    below MIN_AGREE its row is dropped (the other rows still mean what they say). Returns ember's
    fp32 ids."""
    [ids] = tokenizer.encode_batch([prompt])
    ember = ember_generate(Engine(ours, tokenizer), [prompt], args.new_tokens)()[0]
    theirs = hf_generate(hf, [ids], args.new_tokens, tokenizer.pad_id, device)()[0]
    graphed = ember_generate(Engine(ours, tokenizer, graphs=True), [prompt], args.new_tokens)()[0]
    with torch.inference_mode():
        x = torch.tensor([ids], device=device)
        diff = (ours(x) - hf(x).logits.float()).abs().max().item()  # (1, T, V)
    need = min(MIN_AGREE, args.new_tokens)
    agree, same = leading_agreement(ember, theirs), leading_agreement(graphed, ember)
    print(
        f"fp32 parity at batch 1, leading greedy ids that agree (of {args.new_tokens}, need {need}): "
        f"ember vs HF {agree}, ember graphs vs ember {same}; prompt logits max |ember - HF| {diff:.1e}"
    )
    if min(agree, same) < need:
        print(f"ember  {ember[:16]}\nHF     {theirs[:16]}\ngraphs {graphed[:16]}")
        print("they part early: the weight mapping or the graphed path is broken; timings would mean nothing")
        raise SystemExit(1)
    for variant in [v for v in FUSED if v in args.variants]:  # ember's own step (kernels="triton"), each road
        try:
            engine = Engine(ours, tokenizer, graphs=True, kernels="triton")
        except EmberError as e:
            print(f"fused step: not for this model: {e}")
            return ember
        for name, value in FUSED[variant].items():
            setattr(engine.decode.step, name, value)
        try:  # a road that fails on this GPU (its launches or their capture) loses its row, not the run
            fused = ember_generate(engine, [prompt], args.new_tokens)()[0]
        except Exception as e:  # noqa: BLE001  (whatever it is, it is printed)
            print(f"ember {variant}: failed ({type(e).__name__}: {e}); its row is dropped")
            args.variants = [v for v in args.variants if v != variant]
            continue
        same = leading_agreement(fused, ember)
        print(f"fp32 parity: ember {variant} vs ember {same} leading greedy ids (of {args.new_tokens})")
        if same < need:  # broken: its row's timing would mean nothing
            print(f"fused  {fused[:16]}\nember  {ember[:16]}\nthe fused step parts early: its row is dropped")
            args.variants = [v for v in args.variants if v != variant]
    return ember


def run_model(
    name: str, tokenizer: Tokenizer, prompts: list[str], args: argparse.Namespace, device: torch.device
) -> dict[int, tuple[float, float]]:
    """Time one model shape; print its parity line and table; return {case: (ember, HF) tokens/s}."""
    cfg = model_config(name, tokenizer.vocab_size)
    ours = GPT.build(cfg, device=device, seed=SEED).eval()
    hf = to_hf(ours).to(device).eval()
    print(
        f"\n== {name}: {type(hf).__name__}, d_model {cfg.d_model}, {cfg.n_layer} layers, {cfg.n_head} heads "
        f"({cfg.n_kv_head or cfg.n_head} kv), vocab {cfg.vocab_size}, {args.dtype}, "
        f"{ours.num_params():,} params, "
        f"HF attn_implementation = {hf.config._attn_implementation}"
    )
    fp32_ids = check_parity(ours, hf, tokenizer, prompts[0], args, device)
    if args.dtype == "bf16":
        ours, hf = ours.to(torch.bfloat16), hf.to(torch.bfloat16)
    engine = Engine(ours, tokenizer)

    cases = {"1": prompts[:1], "8": prompts, "8 ragged": shorten(tokenizer, prompts)}
    calls: dict[tuple[str, str], Generate] = {}
    for case, texts in cases.items():
        ids = tokenizer.encode_batch(texts)
        calls[case, "ember"] = ember_generate(engine, texts, args.new_tokens)
        calls[case, "HF"] = hf_generate(hf, ids, args.new_tokens, tokenizer.pad_id, device)
    # batch-1 rows: who -> (model, compile, graphs); compiled: StaticKVCache, step under torch.compile
    modes = [("", False, False), (" compiled", True, False)]
    graphed = [(" graphs", False, True), (" compiled graphs", True, True)] if args.graphs else []
    graphed += [(" tuned graphs", TUNED, True)] if args.graphs else []  # frozen weights, max-autotune
    graphed += [(" fused graphs", "triton", True)] if args.graphs else []  # ember's own step (kernels)
    graphed += [(" fused graphs, no PDL", "triton-no-pdl", True)] if args.graphs else []  # its road before
    persistent = [f" {v.replace('-', ' ')}" for v in FUSED if "persistent" in v]  # the step in one launch
    graphed += [(mode, "triton-persistent", True) for mode in persistent] if args.graphs else []
    keep = lambda m: not m or variant_of(m) in args.variants  # noqa: E731  (eager: the base row)
    variants = {f"ember{m}": (ours, c, g) for m, c, g in modes + graphed if keep(m)}
    for spec in args.quant:
        quantized = quantize(copy.deepcopy(ours), spec)  # (the fused step: plain nn.Linear alone)
        roads = [(m, c, g) for m, c, g in modes + graphed[1:] if keep(m) and "triton" not in str(c)]
        variants |= {f"ember {spec.label}{m}": (quantized, c, g) for m, c, g in roads}
    if args.graphs and keep(" compiled graphs"):  # Engine.lookahead's lever: each token read back first
        variants["ember compiled graphs, lookahead 1"] = (ours, True, True)
    compile_seconds = {}  # the first call compiles and captures
    for who, (model, compile, graphs) in list(variants.items())[1:]:
        options = compile if isinstance(compile, dict) else None
        kernels = "triton" if "triton" in str(compile) else "torch"
        try:
            one = Engine(model, tokenizer, compile=bool(compile) and kernels == "torch", graphs=graphs,
                         compile_options=options, kernels=kernels)  # fmt: skip
        except EmberError as e:  # the fused step covers the GPT-2 layout alone: a row, not the run
            print(f"{who}: not run: {e}", flush=True)
            del variants[who]
            continue
        one.lookahead = 1 if who.endswith("lookahead 1") else one.lookahead
        for name, value in FUSED.get(variant_of(who.removeprefix("ember")), {}).items():
            setattr(one.decode.step, name, value)  # the fused step's road
        calls["1", who] = ember_generate(one, prompts[:1], args.new_tokens)
        if compile or graphs:
            try:  # the first call compiles, tunes and captures: a road that fails there loses its row alone
                compile_seconds[who] = timed(calls["1", who], device)
            except Exception as e:  # noqa: BLE001
                print(f"{who}: failed at its first call: {str(e).splitlines()[0][:120]}", flush=True)
                del calls["1", who], variants[who]
                continue
            print(f"{who}: first call (compile, tuning, capture) {compile_seconds[who]:.1f} s", flush=True)

    warmup = {key: generate() for key, generate in calls.items()}  # also the parity check
    for (case, who), rows in warmup.items():
        lengths = {len(r) for r in rows}
        if lengths != {args.new_tokens}:
            raise SystemExit(
                f"{who} at batch {case} made {sorted(lengths)} tokens per row, not {args.new_tokens} "
                "(an eos ended a row early?); tokens/s would be wrong"
            )
    agree = leading_agreement(warmup["1", "ember"][0], warmup["1", "HF"][0])
    others = []
    for case in list(cases)[1:]:
        pairs = zip(warmup[case, "ember"], warmup[case, "HF"], strict=True)
        row_agree = [leading_agreement(a, b) for a, b in pairs]
        others.append(f"batch {case} rows {min(row_agree)}..{max(row_agree)}")
    print(
        f"{args.dtype}: leading greedy ids that agree with HF (of {args.new_tokens}): batch 1 {agree}; "
        f"{'; '.join(others)} (printed only; prompt tokens in 8 ragged: "
        f"{[len(r) for r in tokenizer.encode_batch(cases['8 ragged'])]})"
    )

    times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for rep in range(args.reps):
        for (case, who), generate in calls.items():
            times[case, who].append(timed(generate, device))
            if rep == 0:  # as each row ends, so a run stopped at a time limit still reports
                tps = len(cases[case]) * args.new_tokens / times[case, who][0]
                print(f"timed: batch {case}, {who}: {tps:,.0f} tok/s", flush=True)

    rows, result, spread = [], {}, []
    for case, texts in cases.items():
        ours_range, hf_range = (
            f"{min(times[case, n]):.2f}-{max(times[case, n]):.2f}" for n in ("ember", "HF")
        )
        spread.append(f"batch {case}: ember {ours_range}, HF {hf_range}")
        ours_tps = len(texts) * args.new_tokens / statistics.median(times[case, "ember"])
        hf_tps = len(texts) * args.new_tokens / statistics.median(times[case, "HF"])
        result[case] = (ours_tps, hf_tps)
        rows.append([case, f"{ours_tps:,.0f}", f"{hf_tps:,.0f}", f"{ours_tps / hf_tps:.2f}x"])
    print(f"{args.reps} timed calls per model and batch size (after 1 warm-up), tokens/s of the median")
    print_table(["batch", "ember tok/s", "HF tok/s", "ember/HF"], rows)
    print(f"seconds per call, min-max: {'; '.join(spread)}")

    context = PROMPT_TOKENS + args.new_tokens / 2  # mean context
    hf_tps = result["1"][1]
    rows, floors, of_bound = [], {}, {}
    for who, (model, _, _) in variants.items():
        per_token = bytes_per_token(cfg, model, context)
        bound = args.bandwidth / per_token
        tps = tps_of(times["1", who], args)
        result[f"1 {who}"], of_bound[who] = (tps, hf_tps), tps / bound
        peak = f"{tps * per_token / args.peak:.0%}" if args.peak else "-"
        first = f"{compile_seconds[who]:.1f} s" if who in compile_seconds else "-"
        agree = leading_agreement(warmup["1", who][0], fp32_ids)
        if id(model) not in floors:
            floors[id(model)] = 1 / linear_floor(model, device), 1 / linear_pass(model, device)
        floor, stream = floors[id(model)]
        rows.append(
            [who, f"{tps:,.0f}", f"{tps / hf_tps:.2f}x", f"{per_token / 2**20:.1f}", f"{bound:,.0f}",
             f"{tps / bound:.0%}", peak, f"{floor:,.0f} ({floor / hf_tps:.2f}x)",
             f"{stream:,.0f} ({stream / bound:.0%})", f"{agree}/{args.new_tokens}", first]
        )  # fmt: skip
    print(f"batch 1, every ember variant against HF ({hf_tps:,.0f} tok/s), median of {args.reps} calls:")
    print_table(
        [
            "ember",
            "tok/s",
            "x HF",
            "MiB/token",
            "bound tok/s",
            "of bound",
            "of peak",
            "linear floor tok/s (x HF)",
            "linears in order tok/s (of bound)",
            "same ids as fp32 ember",
            "first call",
        ],
        rows,
    )
    print(
        f"bound: bytes read per token (weights as stored + keys/values at the mean context {context:.0f}) "
        f"at the copy bandwidth {args.bandwidth / 1e9:.1f} GB/s; "
        + (f"'of peak': the same bytes at the nominal {args.peak / 1e9:,.0f} GB/s; " if args.peak else "")
        + "'compiled': StaticKVCache and the decode "
        "step under torch.compile(fullgraph=True) ('tuned': with Engine's TUNED options, frozen weights and "
        "max-autotune); 'fused': ember's own step instead (ember/infer/fused.py, five launches a block, not "
        "compiled); 'graphs': that step replayed from a CUDA graph (on a CPU: "
        "run as is); 'first call' includes the compile and capture; every row's greedy ids are compared with "
        "fp32 ember's (leading ids that agree); 'linear floor': 1 / the summed "
        "time of every linear layer (blocks and head) called alone on one row, best of 50 each: no decode "
        "step with these kernels can be faster; 'linears in order': every linear once, in model order, "
        "median of 20 passes (on CUDA replayed from one CUDA graph, as the graphed step runs them): the "
        "weights stream as in decoding, so this is those kernels' ceiling when the model does not stay in "
        "cache"
    )
    best = max(variants, key=lambda w: result[f"1 {w}"][0])
    best_tps = result[f"1 {best}"][0]
    verdict = "met" if best_tps >= TARGET * hf_tps else "not met"
    print(f"target: batch-1 decode >= {TARGET:.0f}x HF: {verdict} by {best} ({best_tps / hf_tps:.2f}x)")
    plain = [w for w in variants if variants[w][0] is ours]  # unquantized rows
    best_plain = max(plain, key=lambda w: result[f"1 {w}"][0])
    fp32_best = result[f"1 {best_plain}"][0]
    fp32_bound = args.bandwidth / bytes_per_token(cfg, ours, context)
    fp32_stream = floors[id(ours)][1]
    print(
        f"target: {args.dtype} decode within 2x of the bandwidth bound (>= 50% of it): "
        f"{'met' if fp32_best >= fp32_bound / 2 else 'not met'} ({fp32_best / fp32_bound:.0%}; its "
        f"linear layers alone, in order, reach {fp32_stream / fp32_bound:.0%}, and the step "
        f"{fp32_best / fp32_stream:.0%} of them)"
    )
    x_hf, reached = fp32_best / hf_tps, of_bound[best_plain]
    met = x_hf >= GPU_TARGET and reached >= GPU_BOUND_TARGET
    print(
        f"target (issue 29, {args.dtype}): >= {GPU_BOUND_TARGET:.0%} of the bound, >= {GPU_TARGET:.0f}x HF: "
        f"{'met' if met else 'not met'} by {best_plain} ({reached:.0%}, {x_hf:.2f}x)"
    )
    int8 = [w for w in variants if w.startswith("ember int8-weight")]
    if int8:
        fast = max(int8, key=lambda w: result[f"1 {w}"][0])
        verdict = "met" if result[f"1 {fast}"][0] > fp32_best else "not met"
        print(
            f"target (issue 29): int8-weight faster than {args.dtype} at batch 1: {verdict} "
            f"({fast} {result[f'1 {fast}'][0]:,.0f} tok/s vs {best_plain} {fp32_best:,.0f})"
        )
    if args.anatomy:
        anatomy(best_plain, calls["1", best_plain], args.new_tokens, device)
    return result


def anatomy(who: str, generate: Generate, new_tokens: int, device: torch.device) -> None:
    """One call of ``generate`` under torch.profiler: per token, the kernels the device ran and
    their summed time against the wall time, and the costliest kernels. A device busy for most
    of the wall is bound by its kernels (their count times the shortest a kernel takes, and
    their bytes); a device idle for most of it waits on the host. On a CPU, the aten ops."""
    cuda = device.type == "cuda"
    kernels, wall, busy = profiled(generate, cuda)
    summed = sum(t for _, t in kernels)  # (more than busy where PDL's kernels overlap, waiting)
    short = statistics.median(t for _, t in kernels) if kernels else 0.0
    print(
        f"anatomy of {who}, one call of {new_tokens} tokens: {len(kernels) / new_tokens:.0f} "
        f"{'kernels' if cuda else 'top-level aten ops'} a token, busy {busy / new_tokens:.0f} µs a token "
        f"(their times summed {summed / new_tokens:.0f}, median {short:.1f} µs each) in "
        f"{wall * 1e6 / new_tokens:.0f} µs of wall: the device busy {busy * 1e-6 / wall:.0%} of the time"
    )
    costliest(kernels, new_tokens, "a token")


VARIANTS = ("compiled", "graphs", "compiled-graphs", "tuned-graphs", "fused-graphs", "fused-graphs-no-pdl",
            "fused-graphs-persistent", "fused-graphs-persistent-n8")
FUSED = {  # the fused step's roads, as FusedDecode's settings
    "fused-graphs": {"pdl": True},
    "fused-graphs-no-pdl": {"pdl": False},
    "fused-graphs-persistent": {"persistent": True},  # the whole step in one launch, 16 x 1024 a task
    "fused-graphs-persistent-n8": {"persistent": True, "tile": (8, 1024)},  # 96 tasks for 768 outputs, not 48
}


def variant_of(mode: str) -> str:
    """A row's mode as --variants names it: ' fused graphs, no PDL' -> 'fused-graphs-no-pdl'."""
    return mode.strip().replace(", ", " ").replace(" ", "-").lower()


def tps_of(seconds: list[float], args: argparse.Namespace) -> float:
    return args.new_tokens / statistics.median(seconds)


def spec_of(text: str) -> QuantSpec:
    """``int4-weight-g64`` -> QuantSpec("int4-weight", 64); a plain scheme name as it is."""
    scheme, _, group = text.partition("-g")
    return QuantSpec(scheme, int(group)) if group else QuantSpec(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        action="append",
        choices=list(MODELS),
        help="model shape (repeatable; default cpu-quick and gpt2-mini)",
    )
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per row")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per model and batch size")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="weights (bf16: GPUs)")
    parser.add_argument(
        "--quant",
        action="append",
        metavar="SCHEME",
        help=f"batch-1 rows for a quantized copy ({', '.join(SCHEMES)}, int4-weight-gN; repeatable; "
        "default int8-weight and int4-weight; 'none' for none)",
    )
    parser.add_argument(
        "--no-graphs", dest="graphs", action="store_false", help="no graph-captured (Engine graphs=True) rows"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(VARIANTS[:3]),
        help="the batch-1 rows besides eager (default the first three; tuned-graphs: Engine(compile_options="
        "TUNED), frozen weights and max-autotune, a long compile; fused-graphs: Engine(kernels='triton'), "
        "ember's own five-launch block, graphed, its kernels launched as programmatic dependents on Hopper "
        "(each reads its first weights before waiting for the kernel before); fused-graphs-no-pdl: the same "
        "step without (FusedDecode.pdl=False); fused-graphs-persistent: the whole step in one persistent "
        "kernel (FusedDecode.persistent), -n8 with 8 outputs a task (FusedDecode.tile); a GPU lease's short "
        "run: compiled-graphs fused-graphs "
        "fused-graphs-no-pdl)",
    )
    parser.add_argument(
        "--anatomy",
        action="store_true",
        help="profile the fastest unquantized batch-1 row: kernels a token, their time against the wall, "
        "the costliest (where the time goes)",
    )
    parser.add_argument(
        "--peak-bandwidth", type=float, metavar="GB/s", help="nominal GPU memory bandwidth (default by name)"
    )
    args = parser.parse_args()
    if not 1 <= args.new_tokens <= MAX_SEQ_LEN - PROMPT_TOKENS:
        parser.error(f"--new-tokens must be in 1..{MAX_SEQ_LEN - PROMPT_TOKENS}")
    quant = args.quant or ["int8-weight", "int4-weight"]
    args.quant = [] if quant == ["none"] else [spec_of(q) for q in quant]
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64  # one compiled decode step per model and variant
    transformers.logging.set_verbosity_error()
    device = torch.device(args.device)

    start = time.perf_counter()
    tokenizer, texts = train_tokenizer()
    tokenizer_seconds = time.perf_counter() - start
    prompts = pick_prompts(tokenizer, texts, 8)
    args.bandwidth = copy_bandwidth(device)
    args.peak = args.peak_bandwidth * 1e9 if args.peak_bandwidth else peak_bandwidth(device)

    where = cpu_model() if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(
        f"device: {where} ({platform.machine()}, {os.cpu_count()} cores), "
        f"torch.get_num_threads() = {torch.get_num_threads()}, 1-min load average {os.getloadavg()[0]:.2f}"
    )
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(
        f"prompt {PROMPT_TOKENS} tokens, {args.new_tokens} new tokens, greedy; tokenizer: BPE trained on "
        f"{TOKENIZER_TRAIN_BYTES:,} chars of stdlib in {tokenizer_seconds:.1f} s; "
        f"copy bandwidth {args.bandwidth / 1e9:.1f} GB/s"
        + (f", nominal {args.peak / 1e9:,.0f} GB/s" if args.peak else "")
    )
    for name in args.model or ["cpu-quick", "gpt2-mini"]:
        run_model(name, tokenizer, prompts, args, device)
    print(f"\ntotal {time.perf_counter() - start:.0f} s, 1-min load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
