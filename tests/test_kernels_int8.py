"""ember's int8-weight decode ops against their reference: the Triton kernel (under
TRITON_INTERPRET=1 here; on a CUDA machine, on the GPU) and the C++ one, and QuantLinear's int8
CPU path with them."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ember.kernels  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
from ember.model.quant import FAST_ROWS, QuantLinear, QuantSpec, quantize_int8

pytest.importorskip("triton")
from ember.kernels.int8 import int8_linear, int8_linear_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernel's; the C++ op's is the CPU


def _operands(m, k, n, dtype=torch.float32, seed=0, device=DEVICE):
    torch.manual_seed(seed)
    q, s = quantize_int8(torch.randn(n, k))
    return torch.randn(m, k).to(device, dtype), q.to(device), s.to(device)


def _rel(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("k,n", [(40, 37), (100, 16)])  # K not a multiple of BLOCK_K (32), N ragged
def test_triton_int8_linear_fp32(m, k, n):
    x, q, s = _operands(m, k, n)
    y = int8_linear(x, q, s)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, int8_linear_ref(x, q, s), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_int8_linear_half(m, dtype):
    """fp32 accumulation, one rounding of the output: within 1% relative (the interpreter
    truncates fp32 → bf16, up to one bf16 ulp = 0.8%; a GPU rounds to nearest)."""
    x, q, s = _operands(m, 72, 45, dtype)
    y = int8_linear(x, q, s)
    assert y.dtype == dtype and _rel(y, int8_linear_ref(x.float(), q, s)) < 1e-2


def test_triton_int8_linear_fake_and_compile():
    x, q, s = _operands(3, 40, 37)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.ember.int8_linear.default, (x, q, s), test_utils=checks)
    xg = x.clone().requires_grad_()  # inference op, but x's gradient is defined
    int8_linear(xg, q, s).sum().backward()
    torch.testing.assert_close(xg.grad, (s[:, None] * q.float()).sum(0).expand(3, -1), rtol=1e-5, atol=1e-6)
    f = torch.compile(lambda x: torch.relu(int8_linear(x, q, s)) + 1, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(x), torch.relu(int8_linear_ref(x, q, s)) + 1, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def cpp():
    from ember.kernels.cpu import cpp_ready

    ok, why = cpp_ready()  # the first build takes about a minute; later runs load the cached one
    if not ok:
        print(f"C++ int8 op skipped: {why}")
        pytest.skip(why)


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 2, 3, FAST_ROWS])
@pytest.mark.parametrize("k,n", [(40, 37), (100, 16), (768, 130)])
def test_cpp_int8_linear(cpp, m, k, n):
    from ember.kernels.cpu import int8_linear_cpu

    x, q, s = _operands(m, k, n, device="cpu")
    y = int8_linear_cpu(x, q, s)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert _rel(y, int8_linear_ref(x.double(), q, s.double())) < 1e-5  # the whole output, 1e-5 relative


@pytest.mark.slow
def test_quantlinear_int8_cpu_path_with_the_cpp_op(cpp):
    """With the C++ op built, QuantLinear's int8 decode rows take it (no bf16 rounding)."""
    torch.manual_seed(0)
    linear = nn.Linear(128, 96)
    m = QuantLinear.from_linear(linear, QuantSpec("int8-weight"))
    for rows in (1, FAST_ROWS):
        x = torch.randn(rows, 128)
        ref = F.linear(x, m.dequantize(), m.bias)
        assert _rel(m(x), ref) < 1e-5  # tests/test_quantize.py allows 1e-2 for the bf16 kernels
        assert m(x.bfloat16()).dtype == torch.bfloat16
    f = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(x), m(x))


def test_reading_a_run_does_not_import_dynamo():
    """Every process that reads a run imports ember.model.quant: it stays clear of torch._dynamo
    (1-2 s of CPU), marking the int8 dispatch constant as ``torch.compiler.assume_constant_result``
    does (the fullgraph compile above holds it to that), without calling it."""
    import subprocess
    import sys

    from ember.model import quant

    code = "import sys, ember.run, ember.train.trainer; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"

    def constant():
        return 0

    assert vars(torch.compiler.assume_constant_result(constant)) == vars(quant._own_int8)
