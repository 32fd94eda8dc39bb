"""Curvature of the loss: the top Hessian eigenvalues and the trace, on a fixed batch.

    op = HessianOperator(model, loss_fn)          # v -> H v, double backward, H never formed
    eigenvalues = lanczos(op, k=3, iters=30)      # the largest k, by Lanczos on H v products
    trace, stderr = hutchinson(op, samples=20)    # E[v^T H v] over Rademacher v

The Hessian of a model with n parameters has n² entries, so it is only ever applied to a vector:
H v = d/dθ (∇L(θ) · v), a second backward pass through the first (Pearlmutter 1994). Lanczos
(with full reorthogonalisation, so the basis stays orthogonal in floating point) builds an
m-dimensional Krylov basis from m products; the eigenvalues of the small tridiagonal matrix it
yields (Ritz values) converge to H's extreme eigenvalues first, and with m = n they are exact.
Hutchinson's estimator tr(H) = E[vᵀ H v] holds for any v with E[v vᵀ] = I; Rademacher entries
(±1) give the lowest variance among such choices. Sharpness (λ_max) against 2/lr is the
edge-of-stability view (Cohen et al. 2021): gradient descent on a quadratic diverges along a
direction whose curvature exceeds 2/lr, and full-batch training tends to hover there.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from ember.analysis import load_for_analysis, windows, write_results
from ember.errors import EmberError
from ember.report.report import plot_series as plot
from ember.run import checkpoint_step, read_metrics


class HessianOperator:
    """H v for the loss of ``model`` on a fixed batch ``(x, y)``, over the parameters that train,
    flattened to one vector of ``n`` entries."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.n = sum(p.numel() for p in self.params)
        self.dtype = self.params[0].dtype
        self.loss = F.cross_entropy(model(x).flatten(0, 1).to(self.dtype), y.flatten())
        self.grads = torch.autograd.grad(self.loss, self.params, create_graph=True)
        self.calls = 0

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        chunks = torch.split(v.to(self.dtype), [p.numel() for p in self.params])
        dot = sum((g * c.view_as(g)).sum() for g, c in zip(self.grads, chunks, strict=True))
        hv = torch.autograd.grad(dot, self.params, retain_graph=True)
        return torch.cat([h.reshape(-1) for h in hv]).detach()


def lanczos(op, k: int = 1, iters: int = 30, seed: int = 0) -> list[float]:
    """The ``k`` largest eigenvalues of the symmetric operator ``op`` (descending), from ``iters``
    Lanczos steps with full reorthogonalisation (float64 basis)."""
    m = min(iters, op.n)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(op.n, generator=gen, dtype=torch.float64)
    basis = [q / q.norm()]
    alphas, betas = [], []
    for j in range(m):
        w = op(basis[j]).double()
        alpha = torch.dot(w, basis[j])
        w = w - alpha * basis[j] - (betas[-1] * basis[j - 1] if j else 0)
        Q = torch.stack(basis)  # (j + 1, n): take out every earlier direction again
        w = w - Q.T @ (Q @ w)
        alphas.append(alpha)
        beta = w.norm()
        if j == m - 1 or beta < 1e-10 * max(1.0, abs(alpha.item())):
            break  # the Krylov space is invariant: its Ritz values are eigenvalues
        betas.append(beta)
        basis.append(w / beta)
    T = torch.diag(torch.stack(alphas))
    if betas:
        off = torch.stack(betas[: len(alphas) - 1])
        T = T + torch.diag(off, 1) + torch.diag(off, -1)
    return sorted(torch.linalg.eigvalsh(T).tolist(), reverse=True)[:k]  # the Ritz values


def hutchinson(op, samples: int = 20, seed: int = 0) -> tuple[float, float]:
    """tr(H) ≈ mean of vᵀ H v over ``samples`` Rademacher vectors, and its standard error."""
    gen = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(samples):
        v = torch.randint(0, 2, (op.n,), generator=gen, dtype=torch.float64) * 2 - 1
        values.append(torch.dot(v, op(v).double()).item())
    t = torch.tensor(values, dtype=torch.float64)
    return t.mean().item(), (t.std().item() / math.sqrt(samples) if samples > 1 else math.nan)


def analyze(run_dir, ckpts: list[str], batch: int, k: int, iters: int, samples: int, seed: int) -> dict:
    """``ember analyze RUN hessian``: for each checkpoint, λ_1..λ_k, the trace and, where the run
    logged it, the learning rate at that step and 2/lr."""
    if k > iters:
        raise EmberError(f"--k {k} eigenvalues need at least as many Lanczos steps; got --iters {iters}")
    started = time.perf_counter()
    lr_at_step = {r["step"]: r["lr"] for r in read_metrics(run_dir) if "lr" in r}
    rows = []
    for ckpt in ckpts:
        model, cfg = load_for_analysis(run_dir, ckpt)
        x, y = windows(cfg, batch, seed)
        op = HessianOperator(model, x, y)
        top = lanczos(op, k, iters, seed)
        trace, stderr = hutchinson(op, samples, seed) if samples else (math.nan, math.nan)
        step = checkpoint_step(run_dir, ckpt)
        lr = lr_at_step.get(step)
        rows.append({"ckpt": ckpt, "step": step, "loss": op.loss.item(), "eigenvalues": top, "trace": trace,
                     "trace_stderr": stderr, "lr": lr, "two_over_lr": 2 / lr if lr else None,
                     "hvp_calls": op.calls})  # fmt: skip
    settings = {"batch": batch, "seed": seed, "iters": iters, "samples": samples}
    out = write_results(run_dir, "hessian", {**settings, "rows": rows}, started)
    if len(rows) > 1:
        steps = [r["step"] for r in rows]
        series = [("λ_max (Lanczos)", steps, [r["eigenvalues"][0] for r in rows], {"marker": "o"})]
        if all(r["two_over_lr"] for r in rows):
            series.append(("2 / lr", steps, [r["two_over_lr"] for r in rows], {"linestyle": "--"}))
        title = "sharpness across the run (edge of stability: λ_max = 2 / lr)"
        plot(out / "sharpness.png", series, title, "step", "curvature", "log")
    return {"rows": rows, "out": str(out)}


def summary(r: dict) -> str:
    """What ``ember analyze RUN hessian`` prints: a line per checkpoint."""
    lines = []
    for row in r["rows"]:
        lr = f"; lr {row['lr']:.2e}, 2/lr {row['two_over_lr']:.3g}" if row["lr"] else ""
        lines.append(f"{row['ckpt']} (step {row['step']}): loss {row['loss']:.4f}; top eigenvalues "
                     + ", ".join(f"{e:.4g}" for e in row["eigenvalues"])
                     + f"; trace {row['trace']:.4g} ± {row['trace_stderr']:.2g}{lr} ({row['hvp_calls']} H·v products)")  # fmt: skip # noqa: E501
    return "\n".join(lines)
