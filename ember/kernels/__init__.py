"""ember's own kernels: Triton (and one C++) ops registered with ``torch.library``.

    from ember.kernels import triton_ready
    ok, why = triton_ready(x.device)      # may this tensor's device run our Triton kernels?
    norm = kernel_op("norm", launch, fake, setup_context, backward)   # how each op is registered

Each kernel file holds the kernel, its ``torch.library.custom_op`` registration with a fake
(meta) implementation and an autograd formula (``kernel_op``), and the plain-PyTorch reference
the tests hold it to. ``train.kernels=triton`` swaps them into the model
(``ember.model.gpt.GPT.set_kernels``); docs/kernels.md gives each one's bytes, FLOPs and roofline
bound.

On a machine without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
numpy underneath): far too slow to train with, exact enough to test every kernel on a CPU.
The variable is read when a kernel is decorated, so it is set here, before any kernel module
imports triton.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable

import torch

# triton's own library (tl.sum, tl.max) is decorated when triton is imported: too late after that
LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available()
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def triton_ready(device: torch.device | str) -> tuple[bool, str]:
    """(True, "") when Triton kernels can run on ``device``, else (False, the reason)."""
    return _ready(device.type if isinstance(device, torch.device) else torch.device(device).type)


@functools.cache  # every launch asks: the answer depends on the device's type alone
def _ready(kind: str) -> tuple[bool, str]:
    device = torch.device(kind)
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


def pow2(n: int) -> int:
    """The least power of two >= n: triton.next_power_of_2 without its wrapper's ~8 us of host time."""
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def sm_count(index: int) -> int:
    """The CUDA device's streaming multiprocessors (torch asks the driver's table on every call)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


PICKS: dict[tuple, object] = {}  # key -> the config ``fastest`` timed fastest for it


def fastest(key: tuple, configs: list, run: Callable, device: torch.device):
    """The one of ``configs`` under which ``run(config)``, a launch, takes least time on CUDA:
    each timed once for ``key`` (do_bench's median, on the call's own tensors) and the winner
    remembered. A config that cannot launch (too much shared memory) is passed over, as is one
    past the first that this Triton cannot compile (with a warning: the first is the road the
    tests and a GPU have held, and runs wherever timing does not). Nothing is
    timed, and the first config runs, with one config, on a CPU (the interpreter), or while a
    CUDA graph is captured (timing would break the capture; the key is timed at a later call).
    Configs may sum in other orders (the norm backward's partial sums, a program's), and a pick
    that timing makes may differ from one process to the next: where runs must repeat bit for
    bit (``torch.use_deterministic_algorithms``) or ranks agree (more than one: tensor-parallel
    norms run on every rank alike), the first runs too. So it does when the timing runs out of
    memory (do_bench flushes L2 with a 256 MB buffer), and the key is tried again later.
    ``triton.autotune`` does the same for a kernel's own arguments; this also lets a config
    change what the host allocates around the launch (a backward's partial sums a program)."""
    if key in PICKS:
        return PICKS[key]
    if len(configs) == 1 or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return configs[0]
    dist = torch.distributed
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if torch.are_deterministic_algorithms_enabled() or ranks > 1:
        return configs[0]
    import triton.compiler.errors as compiling
    import triton.runtime.errors as errors
    from triton.testing import do_bench

    failures = tuple(getattr(errors, n) for n in ("OutOfResources", "PTXASError") if hasattr(errors, n))
    times = []
    for i, config in enumerate(configs):
        try:
            times.append(do_bench(lambda c=config: run(c), warmup=5, rep=20, return_mode="median"))
        except failures:
            times.append(float("inf"))
        except compiling.CompilationError as err:
            if i == 0:
                raise
            warnings.warn(f"{key[0]}: config {config} does not compile here, passed over: {err}",
                          stacklevel=2)
            times.append(float("inf"))
        except torch.OutOfMemoryError:
            return configs[0]
    PICKS[key] = configs[times.index(min(times))]
    return PICKS[key]


def kernel_op(name: str, fn: Callable, fake: Callable, setup_context: Callable | None = None,
              backward: Callable | None = None, mutates: tuple[str, ...] = ()) -> Callable:
    """Register ``fn`` as the custom op ``ember::<name>``, with ``fake`` for tracing and, given
    ``backward``, torch.library's autograd formula (``setup_context``, ``backward``); -> the
    function to call it by, whose ``.op`` is the registered op. ``mutates``: the arguments
    ``fn`` writes into (a decode step's KV cache).

    That function calls the registered op inside torch.compile (which traces through it without
    a graph break) and on fake, meta or other subclassed tensors. On plain tensors outside
    compile it calls ``fn`` under a plain ``torch.autograd.Function`` with the same
    ``setup_context`` and ``backward`` (``fn`` alone where grad mode is off, as in a backward
    or at inference), as Liger-Kernel writes its ops: the dispatcher's road
    (schema, redispatch, the generated autograd wrapper) costs the host ~0.1 ms more per forward
    and backward (``benchmarks/kernels.py --host``), as long as a memory-bound kernel's whole
    run on a GPU at training sizes. A backward formula that calls another of these functions
    gets the same choice, by its tensors: fake while compile traces it, plain in eager."""
    op = torch.library.custom_op(f"ember::{name}", fn, mutates_args=mutates)
    op.register_fake(fake)
    plain = op  # no formula: with grad mode on (a double backward), the op says so when it is asked
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)

        def forward(ctx, *args):  # (not the setup_context style: its apply binds a signature each call)
            out = fn(*args)
            setup_context(ctx, args, out)
            return out

        methods = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
        plain = type(name, (torch.autograd.Function,), methods).apply

    def call(*args):
        x = args[0]
        if torch.compiler.is_compiling() or type(x) is not torch.Tensor or x.is_meta:
            return op(*args)
        return plain(*args) if torch.is_grad_enabled() else fn(*args)  # (no graph to record: the launch)

    call.op = op
    return call
