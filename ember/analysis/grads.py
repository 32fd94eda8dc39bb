"""Per-example gradients, and what they tell: their norms per layer, the gradient noise scale,
and which training windows a text's gradient agrees with.

    g = per_example_grads(model, x, y)       # name -> (B, *shape): one gradient per window
    norms = grad_norms(g)                    # per window: total and per layer
    b_simple = noise_scale(g)                # tr(Σ) / |G|², McCandlish et al. 2018

``torch.func`` computes all B gradients in one pass: ``grad`` of one window's loss, through
``functional_call`` (the model with its parameters passed in), vectorised over the batch by
``vmap`` — the per-example gradients that a loop of B backward passes would give, without the
loop (Opacus and DP-SGD need the same quantity).

**Gradient noise scale** (McCandlish et al. 2018, "An empirical model of large-batch training"):
with per-example gradients g_i of mean G, the per-example covariance Σ has trace
tr(Σ) = Σ_i |g_i − G|² / (B − 1), and |G|² over-counts the true squared gradient by tr(Σ)/B, so
|𝒢|² ≈ |G|² − tr(Σ)/B. B_simple = tr(Σ)/|𝒢|² estimates the critical batch size: below it a
larger batch speeds training almost linearly, above it returns diminish.

**Influence** (TracIn, Pruthi et al. 2020, at one checkpoint): the dot product of a training
window's gradient with a text's gradient is the first-order change of the text's loss when a
step is taken on that window (−lr × the dot): the most aligned windows are those whose step
would lower the text's loss most; the least aligned would raise it.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from ember.analysis import load_for_analysis, windows, write_results
from ember.errors import EmberError
from ember.model.gpt import layer_of
from ember.report.report import plot_series as plot
from ember.run import checkpoint_step, load_run


def per_example_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """name -> (B, *shape): the gradient of each window's mean next-token loss (a tied
    parameter once, under its first name)."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss_one(params, x, y):  # one window: (T,)
        logits = functional_call(model, (params, buffers), (x.unsqueeze(0),))
        return F.cross_entropy(logits[0].to(y.device), y)

    return vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)


def grad_norms(grads: dict[str, torch.Tensor]) -> dict:
    """Per window, the L2 norm of its whole gradient and of each layer's part."""
    squares: dict[str, torch.Tensor] = {}
    for name, g in grads.items():
        s = g.flatten(1).double().pow(2).sum(1)
        squares[layer_of(name)] = squares.get(layer_of(name), 0) + s
    total = sum(squares.values())
    return {"total": total.sqrt().tolist(), "layers": {k: v.sqrt().tolist() for k, v in squares.items()}}


def noise_scale(grads: dict[str, torch.Tensor]) -> dict:
    """tr(Σ), |G|² (biased and unbiased) and B_simple from B per-example gradients."""
    flat = torch.cat([g.flatten(1).double() for g in grads.values()], dim=1)  # (B, n)
    B = flat.size(0)
    if B < 2:
        raise ValueError("the gradient noise scale needs at least 2 examples")
    mean = flat.mean(0)
    trace = (flat - mean).pow(2).sum().item() / (B - 1)
    g2 = mean.pow(2).sum().item()
    true_g2 = g2 - trace / B
    return {"batch": B, "trace_sigma": trace, "g2": g2, "g2_unbiased": true_g2,
            "b_simple": trace / true_g2 if true_g2 > 0 else float("inf")}  # fmt: skip


def flat_grad(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of the mean loss over ``(x, y)`` as one vector (the parameters' order)."""
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).detach()


def analyze(run_dir, ckpts: list[str], batch: int, seed: int, text: str | None, top: int) -> dict:
    """``ember analyze RUN grads``: per checkpoint, per-window gradient norms (total and per
    layer) and the noise scale; with ``text``, the training windows most and least aligned with
    its gradient at the last checkpoint."""
    if batch < 2:
        raise EmberError(f"--batch {batch}: the gradient noise scale needs at least 2 windows")
    started = time.perf_counter()
    rows, influence = [], None
    for ckpt in ckpts:
        model, cfg = load_for_analysis(run_dir, ckpt)
        if cfg.model.mlp == "moe":  # vmap cannot batch the expert loop's data-dependent row counts
            raise EmberError(f"{run_dir}: per-example gradients (vmap) do not run through model.mlp=moe yet")
        x, y = windows(cfg, batch, seed)
        g = per_example_grads(model, x, y)
        step = checkpoint_step(run_dir, ckpt)
        rows.append(
            {"ckpt": ckpt, "step": step, "seq_len": x.size(1), "norms": grad_norms(g), **noise_scale(g)}
        )
    if text:
        _, tokenizer = load_run(run_dir, ckpt=ckpts[-1])
        ids = torch.tensor(tokenizer.encode(text))[: cfg.train.seq_len + 1]
        if len(ids) < 2:
            raise EmberError(f"--text {text!r} is shorter than two tokens")
        target = flat_grad(model, ids[None, :-1], ids[None, 1:])
        flat = torch.cat([t.flatten(1) for t in g.values()], dim=1)  # named_parameters' order
        scores = (flat.double() @ target.double()).tolist()
        order = sorted(range(len(scores)), key=scores.__getitem__)

        def show(i: int) -> dict:
            return {"window": i, "dot": scores[i], "text": tokenizer.decode(x[i].tolist())[:200]}

        influence = {"text": text, "most_aligned": [show(i) for i in order[::-1][:top]],
                     "least_aligned": [show(i) for i in order[:top]]}  # fmt: skip
    results = {"batch": batch, "seed": seed, "rows": rows, "influence": influence}
    out = write_results(run_dir, "grads", results, started)
    layers = rows[-1]["norms"]["layers"]
    means = [sum(v) / len(v) for v in layers.values()]
    series = [("mean over windows", list(range(len(layers))), means, {"marker": "o"})]
    title = f"per-window gradient norm by layer ({rows[-1]['ckpt']})"
    plot(out / "grad-norms.png", series, title, " | ".join(layers), "L2 norm")
    if len(rows) > 1 and all(r["step"] is not None for r in rows):
        steps = [r["step"] for r in rows]
        series = [("B_simple (tokens)", steps, [r["b_simple"] * r["seq_len"] for r in rows], {"marker": "o"})]
        plot(out / "noise-scale.png", series, "gradient noise scale across the run", "step", "tokens", "log")
    return {"rows": rows, "influence": influence, "out": str(out)}


def summary(r: dict) -> str:
    """What ``ember analyze RUN grads`` prints: per checkpoint the norms and the noise scale, the
    last one's norms per layer, and the most and least aligned windows."""
    lines = []
    for row in r["rows"]:
        norms, b = row["norms"]["total"], row["b_simple"]
        lines.append(f"{row['ckpt']} (step {row['step']}): gradient norm per window "
                     f"{min(norms):.3g}–{max(norms):.3g}; tr(Σ) {row['trace_sigma']:.4g}, "
                     f"|G|² {row['g2_unbiased']:.4g} (unbiased); "
                     f"B_simple {b:.4g} windows = {b * row['seq_len']:,.0f} tokens")  # fmt: skip
    last = r["rows"][-1]
    lines.append(
        f"  {'layer':<16} {'mean':>9} {'min':>9} {'max':>9}   gradient norm per window, {last['ckpt']}"
    )
    for name, norms in last["norms"]["layers"].items():
        lines.append(f"  {name:<16} {sum(norms) / len(norms):>9.4g} {min(norms):>9.4g} {max(norms):>9.4g}")
    for key in ("most_aligned", "least_aligned") if r["influence"] else ():
        lines.append(f"{key.replace('_', ' ')} with {r['influence']['text']!r}:")
        for item in r["influence"][key]:
            lines.append(f"  {item['dot']:+.4g}  window {item['window']}: {item['text'][:100]!r}")
    return "\n".join(lines)
