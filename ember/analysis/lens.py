"""The logit lens (nostalgebraist 2020): read each layer's residual stream through the model's
own final norm and head, as if the network ended there.

    ember analyze RUN lens --text "def fibonacci(n):"

For the text's tokens, the stream after the embedding and after each block goes through
``norm`` and ``output`` (and the logit soft-cap, if any); for each of those L + 1 readings the
instrument reports the mean next-token loss on the text, how often its top token is the model's
final top token, and the top token at every position. In a trained model the loss falls and the
agreement rises with depth: the prediction is built up layer by layer in the one basis the head
reads. (A tied head reads the embedding's basis, so layer 0 already predicts the input token.)
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ember.analysis import load_for_analysis, write_results
from ember.errors import EmberError
from ember.report.report import plot_series as plot
from ember.run import load_run


@torch.no_grad()
def lens(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits (T, vocab) read after the embedding and after each block, for one sequence."""
    streams = []
    hooks = [b.register_forward_hook(lambda m, a, out: streams.append(out)) for b in model.layers.values()]
    try:
        model(ids[None])  # (the last reading is the model's own output: tests/test_analysis.py)
    finally:
        for h in hooks:
            h.remove()
    x = model.tok_embeddings(ids[None])
    x, _ = model.pos(x, torch.arange(ids.numel()))
    return [model.softcap(model.output(model.norm(h)).float())[0] for h in [x, *streams]]


def analyze(run_dir, text: str, ckpt: str = "last") -> dict:
    if not text:
        raise EmberError("lens reads a text through every layer: give --text '...'")
    started = time.perf_counter()
    model, _ = load_for_analysis(run_dir, ckpt)
    _, tokenizer = load_run(run_dir, ckpt=ckpt)
    ids = torch.tensor(tokenizer.encode(text)[: model.cfg.max_seq_len])
    if ids.numel() < 2:
        raise EmberError(f"--text {text!r} is shorter than two tokens")
    readings = lens(model, ids)
    final_top = readings[-1].argmax(-1)
    layers = []
    for i, logits in enumerate(readings):
        top = logits.argmax(-1)
        layers.append({
            "layer": "embedding" if i == 0 else f"block {i - 1}",
            "loss": F.cross_entropy(logits[:-1], ids[1:]).item(),
            "agrees_with_final": (top == final_top).float().mean().item(),
            "top_tokens": [tokenizer.decode([t]) for t in top.tolist()],
        })  # fmt: skip
    tokens = [tokenizer.decode([t]) for t in ids.tolist()]
    out = write_results(run_dir, "lens", {"text": text, "tokens": tokens, "layers": layers}, started)
    xs = list(range(len(layers)))
    series = [("next-token loss on the text", xs, [r["loss"] for r in layers], {"marker": "o"})]
    title = "logit lens: each layer read through the final norm and head"
    plot(out / "lens.png", series, title, "layer (0: embedding)", "nats")
    return {"tokens": tokens, "layers": layers, "out": str(out)}


def summary(r: dict) -> str:
    """What ``ember analyze RUN lens`` prints: per layer, the loss, the agreement with the final
    top token, and the top tokens."""
    lines = [f"{'layer':<11} {'loss':>7} {'= final':>8}  top token at each position of {r['tokens']!r}"]
    for row in r["layers"]:
        tops = " ".join(repr(t)[1:-1] or "·" for t in row["top_tokens"])
        lines.append(f"{row['layer']:<11} {row['loss']:>7.3f} {row['agrees_with_final']:>8.0%}  {tops[:80]}")
    return "\n".join(lines)
