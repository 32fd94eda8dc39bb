"""ember's own kernels: Triton (and one C++) ops registered with ``torch.library``.

    from ember.kernels import triton_ready
    ok, why = triton_ready(x.device)      # may this tensor's device run our Triton kernels?

Each kernel file holds the kernel, its ``torch.library.custom_op`` registration with a fake
(meta) implementation and an autograd formula, and the plain-PyTorch reference the tests hold
it to. ``train.kernels=triton`` swaps them into the model (``ember.model.gpt.GPT.set_kernels``);
docs/kernels.md gives each one's bytes, FLOPs and roofline bound.

On a machine without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
numpy underneath): far too slow to train with, exact enough to test every kernel on a CPU.
The variable is read when a kernel is decorated, so it is set here, before any kernel module
imports triton.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

# triton's own library (tl.sum, tl.max) is decorated when triton is imported: too late after that
LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available()
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def triton_ready(device: torch.device | str) -> tuple[bool, str]:
    """(True, "") when Triton kernels can run on ``device``, else (False, the reason)."""
    device = torch.device(device)
    if not HAS_TRITON:
        return False, "Triton is not installed (pip install 'ember[kernels]')"
    if device.type == "cpu" and LATE:
        return (
            False,
            "triton was imported before ember.kernels; set TRITON_INTERPRET=1 or import ember.kernels first",
        )
    if device.type == "cuda" or (device.type == "cpu" and INTERPRET):
        return True, ""
    return (
        False,
        f"Triton kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1 (tests); not on {device}",
    )
