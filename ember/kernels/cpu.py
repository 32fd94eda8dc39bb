"""The C++ int8-weight decode product for CPUs: ``y = (x @ Qᵀ) · s`` in one AVX2+FMA pass.

    from ember.kernels.cpu import cpp_ready, int8_linear_cpu
    ok, why = cpp_ready()                 # builds once (~35-60 s), then loads from TORCH_EXTENSIONS_DIR
    y = int8_linear_cpu(x, q, s)          # x (M, K), q (N, K) int8, s (N,) -> (M, N) fp32

Fused: int8 → fp32 weight conversion, fp32 dot products, per-row scale (``csrc/int8_gemv.cpp``,
``torch.ops.ember_cpu.int8_linear``, threads split N). Reads N·K weight bytes (plus (M·K + M·N)·4)
for 2·M·N·K FLOPs: memory-bound. Median µs, M=1, 2-core AVX2, loaded shared machine (load 5-11):
(768→2304) fp32 linear 275-412, QuantLinear._kernel (bf16) 196-353, this op 97-116;
(384→1536) 65-90, 70-121, 32-45. So QuantLinear's int8-weight CPU decode (≤ FAST_ROWS rows)
calls it when ``cpp_ready(build=False)``: loaded, or its build cached. A decode step never waits
for the compile: ``int8_linear_cpu`` or ``cpp_ready()`` (the tests do) builds it once.
"""

from __future__ import annotations

import os
import platform
import shutil

import torch
from torch import Tensor

NAME = "ember_int8_gemv"
SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "int8_gemv.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
_state: tuple[bool, str] | None = None  # (loaded, why not) once decided


def _cached() -> bool:
    """Whether a build of the op already sits in TORCH_EXTENSIONS_DIR (so loading it is quick)."""
    from torch.utils.cpp_extension import _get_build_directory

    try:
        return os.path.exists(os.path.join(_get_build_directory(NAME, False), NAME + ".so"))
    except Exception:
        return False


def cpp_ready(build: bool = True) -> tuple[bool, str]:
    """(True, "") once the op is loaded, else (False, the reason). ``build=False`` loads only an
    already-compiled build and never starts the ~60 s compile."""
    global _state
    if _state is not None and (_state[0] or _state[1] != "not built yet"):
        return _state
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _state = (False, f"the C++ int8 op needs an x86-64 CPU with AVX2, not {platform.machine()}")
    elif torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        _state = (False, "the C++ int8 op needs AVX2 and FMA, which this CPU lacks")
    elif shutil.which(os.environ.get("CXX", "c++")) is None:
        _state = (False, "no C++ compiler on PATH (set CXX or install g++) to build the C++ int8 op")
    elif not build and not _cached():
        _state = (False, "not built yet")
    else:
        try:
            from torch.utils.cpp_extension import load

            load(NAME, [SOURCE], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], is_python_module=False)
            torch.library.register_fake("ember_cpu::int8_linear")(
                lambda x, q, s: x.new_empty(x.size(0), q.size(0), dtype=torch.float32)
            )
            _state = (True, "")
        except Exception as e:  # a failed build is reported, never raised at import
            _state = (False, f"building the C++ int8 op failed: {str(e).strip().splitlines()[-1][:300]}")
    return _state


def int8_linear_cpu(x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    """(x @ q.T) * s in fp32 for x (M, K) on the CPU; builds the op on first use."""
    ok, why = cpp_ready()
    if not ok:
        raise RuntimeError(why)
    return torch.ops.ember_cpu.int8_linear(x, q, s)
