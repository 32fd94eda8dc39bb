"""Muon on CUDA: what the CPU suite cannot check (bf16 Newton–Schulz), measured on a GPU.

    python benchmarks/muon_gpu.py                 # needs CUDA; prints a table, exit 1 on a miss

1. The band: singular values of NS₅(G) in bf16 on the GPU, for the shapes a model has, beside
   fp32 on the same GPU. A random square G has singular values near 0 that five steps cannot
   lift in either precision (that is NS₅, not rounding), so the check is that bf16 keeps the
   fp32 band: largest σ at most 1.3, smallest within 0.05 of fp32's.
2. The direction: cosine between the bf16 and the fp32 update, and between one Muon step on the
   GPU (bf16 NS, the default there) and the same step on the CPU (fp32 NS).
3. Against the peer: one step of ember's Muon vs ``torch.optim.Muon`` on the same GPU, both
   with bf16 Newton–Schulz, same weights, gradient and scale rule, each against the same step
   with fp32 Newton–Schulz: ember's bf16 error must be no larger than 1.25 × the peer's.

Exact resume with Muon on CUDA and a short training race are run from the shell
(benchmarks/RESULTS.md gives the command).
"""

from __future__ import annotations

import sys

import torch

from ember.train.optim import Muon, orthogonalize

SHAPES = [(128, 128), (128, 512), (512, 128), (768, 768), (768, 3072), (3072, 768)]
SIGMA_MAX, SIGMA_MIN_SLACK = 1.3, 0.05
COS_MIN = 0.99


def muon_step(w0: torch.Tensor, g: torch.Tensor, device: str, ns_dtype=None) -> torch.Tensor:
    w = torch.nn.Parameter(w0.clone().to(device))
    opt = Muon([{"params": [w], "use_muon": True, "lr": 0.02, "weight_decay": 0.0}], ns_dtype=ns_dtype)
    w.grad = g.clone().to(device)
    opt.step()
    return (w.detach() - w0.to(device)).float().cpu()


def main() -> int:
    if not torch.cuda.is_available():
        print("muon_gpu: no CUDA device; this check runs on a GPU machine")
        return 2
    torch.manual_seed(0)
    dev = "cuda"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        f"{'shape':>12} {'bf16 σ min':>10} {'bf16 σ max':>10} {'fp32 σ min':>10} {'fp32 σ max':>10} "
        f"{'cos bf16/fp32':>13} {'cos gpu/cpu step':>16}"
    )
    ok = True
    for shape in SHAPES:
        g = torch.randn(shape, device=dev)
        lo16, hi16 = _band(orthogonalize(g, dtype=torch.bfloat16))
        lo32, hi32 = _band(orthogonalize(g, dtype=torch.float32))
        cos_ns = _cos(orthogonalize(g, dtype=torch.bfloat16), orthogonalize(g, dtype=torch.float32))
        w0 = torch.randn(shape) * 0.02
        cos_step = _cos(muon_step(w0, g.cpu(), dev), muon_step(w0, g.cpu(), "cpu"))
        row_ok = (
            hi16 <= SIGMA_MAX and abs(lo16 - lo32) <= SIGMA_MIN_SLACK and min(cos_ns, cos_step) >= COS_MIN
        )
        ok &= row_ok
        print(
            f"{str(shape):>12} {lo16:10.3f} {hi16:10.3f} {lo32:10.3f} {hi32:10.3f} "
            f"{cos_ns:13.5f} {cos_step:16.5f}{'' if row_ok else '   MISS'}"
        )
    if hasattr(torch.optim, "Muon"):
        w0, g = torch.randn(768, 768) * 0.02, torch.randn(768, 768)
        exact = muon_step(w0, g, dev, ns_dtype=torch.float32)
        ours = muon_step(w0, g, dev)
        w = torch.nn.Parameter(w0.clone().to(dev))
        peer = torch.optim.Muon(
            [w], lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True, adjust_lr_fn="original"
        )
        w.grad = g.clone().to(dev)
        peer.step()
        theirs = w.detach().cpu() - w0
        err_ours = ((ours - exact).norm() / exact.norm()).item()
        err_peer = ((theirs - exact).norm() / exact.norm()).item()
        ok &= err_ours <= 1.25 * err_peer
        print(
            f"one step, 768x768, bf16 NS vs fp32 NS on the GPU: ember {err_ours:.2e}, "
            f"torch.optim.Muon {err_peer:.2e} (ember's may be at most 1.25x the peer's)"
        )
    print(
        f"σ max <= {SIGMA_MAX}, σ min within {SIGMA_MIN_SLACK} of fp32, cosine >= {COS_MIN}: "
        f"{'all hold' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


def _band(x: torch.Tensor) -> tuple[float, float]:
    s = torch.linalg.svdvals(x.float())
    return s.min().item(), s.max().item()


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().flatten().cpu(), b.float().flatten().cpu()
    return (a @ b / (a.norm() * b.norm())).item()


if __name__ == "__main__":
    sys.exit(main())
