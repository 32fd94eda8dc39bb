"""Weight quantization: int8 and int4 linear layers swapped in from outside the model, and
fake quantization for quantization-aware training (QAT).

    quantize(model, QuantSpec("int4-weight", group_size=32))   # swaps the blocks' nn.Linear
    apply_qat(model, QuantSpec("int4-weight"))                  # train.qat: fake-quantize in forward

Schemes (every ``nn.Linear`` inside ``model.layers``):

- ``int8-weight``: per-output-channel symmetric int8, ``w ≈ q · s`` with ``s = max|w_row| / 127``.
- ``int8-dynamic``: the same int8 weights, and each activation row quantized the same way when it
  arrives (``x ≈ q_x · s_x``); the product is summed in integers and scaled by ``s_x · s``.
- ``int4-weight``: group-wise asymmetric 4-bit along the input dimension (groups of 32, 64 or 128):
  ``w ≈ lo + q · s`` with ``s = (max - min) / 15`` per group, stored as ``(q - 8) · s + zero``
  (``zero = lo + 8 s``), the convention of PyTorch's int4 kernels; two values per byte on disk.

Why written here and not with torchao (DESIGN names it for ``quant``): on this project's CPU
(2-core AVX2, no bf16 units; torch 2.13) the library paths are not fast. Measured on a
(1, 384) × (1536, 384) product, 2 threads: fp32 ``linear`` 65–94 µs. torchao 0.18's int8
weight-only linear is ``mm(x, Q.to(fp32)) · s`` (read from its ``Int8Tensor``): 340 µs eager,
550–630 µs under ``torch.compile`` (inductor does not vectorise the int8 → fp32 load here); its
int8 dynamic path calls ``torch._int_mm``: 327 µs; ``torch._weight_int8pack_mm`` with fp32
activations: 335–459 µs. The ATen kernels *are* fast with bf16 activations: int8 54–73 µs, int4
(group 32, ``torch._weight_int4pack_mm_for_cpu``, the kernel torchao's CPU int4 layout calls) 80–83
µs. So the decode path (at most ``FAST_ROWS`` rows: a token per sequence) rounds the activations
to bf16, calls those kernels directly and applies the int8 scale in fp32 after (relative error
of the product 0.22% against the fp32 product of the same quantized weights). Wider inputs
(prefill, evaluation) dequantize to fp32 and call ``linear``: at 2048 rows that is 20 ms against
45–54 ms in the kernels. The plain path is also what runs on other devices (the int8 form
``linear(x, Q) · s`` is the one ``torch.compile`` fuses on GPUs); ``tests/test_quantize.py``
holds the two paths together. ember's own int8-weight decode ops come first where present: the
Triton kernel on CUDA, the C++ one (3× ``_kernel``) on a CPU once built (``ember.kernels.int8``,
``.cpu``). ``int8-dynamic`` has no fast CPU kernel; it is the scheme for GPUs with int8 tensor
cores, where ``torch._int_mm`` is used for more than 16 rows.

The output head is quantized too, int8 per row in every scheme (``QuantSpec(head=False)``, the
CLI's ``--float-head``, keeps it fp32): it is the largest matrix a decode step reads (vocab ×
d_model; 0.6–0.8 ms of a 4 ms gpt2-mini step in fp32), and int8 costs it little (docs/quantize.md
has the table). llama.cpp's formats likewise keep the output matrix at more bits than the blocks.
When the head is tied to the embedding, the embedding stays fp32 (its lookups read one row) and
the head gets its own int8 copy. QAT fake-quantizes the head the same way.

A quantized run is an ordinary run directory: ``model/quant.json`` names the scheme, and
``load_run`` (``ember.run``) swaps the modules in before loading ``model.safetensors``;
``ember quantize`` (``ember.export.quantize``) writes such a run and measures the schemes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.errors import EmberError
from ember.model.gpt import block_linears

SCHEMES = ("int8-weight", "int8-dynamic", "int4-weight")
GROUP_SIZES = (32, 64, 128)
HEAD_SCHEME = "int8-weight"  # the output head's scheme when QuantSpec.head
FAST_ROWS = 8  # inputs with at most this many rows take the CPU kernels (decode); wider ones dequantize


@dataclass(frozen=True)
class QuantSpec:
    """A scheme, for int4 its group size (input features per scale and zero point), and whether
    the output head is quantized too (int8 per row, ``HEAD_SCHEME``, whatever the scheme)."""

    scheme: str
    group_size: int = 32
    head: bool = True

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise EmberError(f"--scheme {self.scheme!r}: unknown scheme; choose one of {', '.join(SCHEMES)}")
        if self.scheme == "int4-weight" and self.group_size not in GROUP_SIZES:
            raise EmberError(
                f"--group-size {self.group_size}: int4-weight groups are {', '.join(map(str, GROUP_SIZES))}"
            )

    @property
    def label(self) -> str:
        return self.layer_label + ("" if self.head else ", fp32 head")

    @property
    def layer_label(self) -> str:
        """The scheme of the block linears alone."""
        return f"{self.scheme} g{self.group_size}" if self.scheme == "int4-weight" else self.scheme


# ------------------------------------------------------------------ the arithmetic


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row symmetric int8: (q int8 (N, K), scale fp32 (N,)) with w ≈ q * scale[:, None]."""
    scale = w.detach().abs().amax(dim=-1).float().clamp(min=1e-12) / 127
    q = torch.round(w.detach().float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def _groups(in_features: int, group_size: int) -> int:
    """Groups per row of ``in_features`` inputs, or an EmberError if they do not split evenly."""
    if in_features % group_size:
        raise EmberError(
            f"int4-weight: {in_features} input features do not split into groups of {group_size}; "
            "choose a group size that divides them (`ember quantize --group-size`, train.qat_group_size)"
        )
    return in_features // group_size


def quantize_int4(w: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Group-wise asymmetric 4-bit: (q uint8 in 0..15 (N, K), scale (N, K/g), zero (N, K/g)) with
    w ≈ (q - 8) * scale + zero within each group of ``group_size`` input features."""
    n, k = w.shape
    wg = w.detach().float().reshape(n, _groups(k, group_size), group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, lo + 8 * scale


def dequantize_int4(q: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    n, k = q.shape
    groups = scale.size(-1)
    wg = (q.reshape(n, groups, k // groups).float() - 8) * scale[..., None] + zero[..., None]
    return wg.reshape(n, k)


def pack_int4(q: Tensor) -> Tensor:
    """(N, K) values 0..15 -> (N, K/2) bytes, element 2j in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: Tensor) -> Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.size(0), -1)


def fake_quantize(w: Tensor, spec: QuantSpec) -> Tensor:
    """``w`` rounded as ``spec`` would store it, with the straight-through gradient (QAT):
    the forward sees the quantized values, the backward treats rounding as the identity."""
    if spec.scheme == "int4-weight":
        wq = dequantize_int4(*quantize_int4(w, spec.group_size))
    else:
        q, scale = quantize_int8(w)
        wq = q.float() * scale[:, None]
    # wq + (w - w.detach()) rather than w + (wq - w).detach(): the same gradient, and a forward
    # that is wq bit for bit (the other form rounds twice and can miss it by an ulp)
    return wq.to(w.dtype) + (w - w.detach())


# ------------------------------------------------------------------ modules


def _own_int8(device_type: str) -> bool:
    """Whether ember's own int8-weight decode op serves this device: the Triton kernel on CUDA
    (``ember.kernels.int8``), the C++ one on a CPU once built (``ember.kernels.cpu``)."""
    if device_type == "cuda":
        from ember.kernels import triton_ready

        ok = triton_ready("cuda")[0]
        if ok:
            import ember.kernels.int8  # noqa: F401  (registers torch.ops.ember.int8_linear, int8_linear)
        return ok
    if device_type == "cpu":
        from ember.kernels.cpu import cpp_ready

        return cpp_ready(build=False)[0]
    return False


# A constant to torch.compile: what ``torch.compiler.assume_constant_result`` sets, set directly,
# since calling it imports torch._dynamo (1-2 s of CPU in every process that loads a run;
# tests/test_quantize.py checks that the decorator still sets no more than this).
_own_int8._dynamo_marked_constant = True  # type: ignore[attr-defined]


class QuantLinear(nn.Module):
    """``y = x Wᵀ + b`` with W stored as ``spec`` says (buffers ``weight_q``, ``weight_scale``
    and, for int4, ``weight_zero``). Call ``pack()`` after loading new values into the buffers:
    it prepares the CPU kernels' layouts, which are derived and never saved."""

    def __init__(self, in_features: int, out_features: int, bias: bool, spec: QuantSpec, device=None):
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        n, k = out_features, in_features
        if spec.scheme == "int4-weight":
            g = _groups(k, spec.group_size)
            self.register_buffer("weight_q", torch.zeros(n, k // 2, dtype=torch.uint8, device=device))
            self.register_buffer("weight_scale", torch.ones(n, g, device=device))
            self.register_buffer("weight_zero", torch.zeros(n, g, device=device))
        else:
            self.register_buffer("weight_q", torch.zeros(n, k, dtype=torch.int8, device=device))
            self.register_buffer("weight_scale", torch.ones(n, device=device))
        self.bias = nn.Parameter(torch.zeros(n, device=device)) if bias else None
        self._packed: tuple[Tensor, ...] | None = None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, spec: QuantSpec) -> QuantLinear:
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, spec, device=w.device)
        if spec.scheme == "int4-weight":
            q, scale, zero = quantize_int4(w, spec.group_size)
            m.weight_q.copy_(pack_int4(q))
            m.weight_zero.copy_(zero)
        else:
            q, scale = quantize_int8(w)
            m.weight_q.copy_(q)
        m.weight_scale.copy_(scale)
        if linear.bias is not None:
            m.bias.copy_(linear.bias.detach())
        return m.pack()

    def dequantize(self) -> Tensor:
        """The fp32 weight (N, K) these buffers stand for."""
        if self.spec.scheme == "int4-weight":
            return dequantize_int4(unpack_int4(self.weight_q), self.weight_scale, self.weight_zero)
        return self.weight_q.float() * self.weight_scale[:, None]

    @torch.no_grad()
    def pack(self) -> QuantLinear:
        """Derive the CPU kernels' weight layouts from the buffers (none elsewhere)."""
        self._packed = None
        if self.weight_q.device.type != "cpu" or self.spec.scheme == "int8-dynamic":
            return self
        if self.spec.scheme == "int4-weight":
            q = unpack_int4(self.weight_q).to(torch.int32)
            scales_zeros = torch.stack([self.weight_scale.t(), self.weight_zero.t()], dim=-1)  # (K/g, N, 2)
            self._packed = (
                torch._convert_weight_to_int4pack_for_cpu(q, 1),
                scales_zeros.to(torch.bfloat16).contiguous(),
            )
        else:
            self._packed = (torch.ones(self.out_features, dtype=torch.bfloat16),)
        return self

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.spec.scheme == "int8-dynamic":
            y = self._dynamic(x2)
        elif self.spec.scheme == "int8-weight" and x2.size(0) <= FAST_ROWS and _own_int8(x2.device.type):
            if x2.is_cuda:  # (the call skips the dispatcher in eager: ember.kernels.kernel_op)
                from ember.kernels.int8 import int8_linear as op
            else:
                op = torch.ops.ember_cpu.int8_linear
            y = op(x2, self.weight_q, self.weight_scale).to(x2.dtype)
        elif self._packed is not None and x2.size(0) <= FAST_ROWS and x2.device.type == "cpu":
            y = self._kernel(x2)
        elif self.spec.scheme == "int4-weight":
            y = F.linear(x2, self.dequantize().to(x2.dtype))
        else:  # the scale after the product: the form torch.compile fuses into one kernel on GPUs
            y = F.linear(x2, self.weight_q.to(x2.dtype)) * self.weight_scale.to(x2.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _kernel(self, x2: Tensor) -> Tensor:
        """The fast CPU path: bf16 activations into PyTorch's int8/int4 weight kernels."""
        xb = x2.to(torch.bfloat16)
        if self.spec.scheme == "int4-weight":
            packed, scales_zeros = self._packed
            y = torch._weight_int4pack_mm_for_cpu(xb, packed, self.spec.group_size, scales_zeros)
            return y.to(x2.dtype)
        (ones,) = self._packed
        y = torch._weight_int8pack_mm(xb, self.weight_q, ones).to(x2.dtype)
        return y * self.weight_scale.to(x2.dtype)  # (in the activations' dtype: a bf16 model stays bf16)

    def _dynamic(self, x2: Tensor) -> Tensor:
        """int8 activations (per row) times int8 weights, summed exactly, then rescaled."""
        x_scale = x2.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 127
        xq = torch.round(x2.float() / x_scale).clamp(-127, 127)
        if x2.is_cuda and x2.size(0) > 16:
            acc = torch._int_mm(xq.to(torch.int8), self.weight_q.t()).float()
        else:  # integer products summed in fp32: exact while |sum| < 2^24 (K * 127^2 < 2^24 for K <= 1040)
            acc = F.linear(xq, self.weight_q.float())
        return (acc * x_scale * self.weight_scale).to(x2.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.spec.layer_label}"


class QATLinear(nn.Linear):
    """An ``nn.Linear`` whose forward sees its weight fake-quantized (``fake_quantize``); the
    parameters and their names are the Linear's, so checkpoints and optimizers are unchanged."""

    spec: QuantSpec

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, fake_quantize(self.weight, self.spec), self.bias)


def _targets(model: nn.Module, spec: QuantSpec) -> list[tuple[nn.Module, str, nn.Linear, QuantSpec]]:
    """(parent, attribute, module, its spec) for every nn.Linear inside ``model.layers``, and
    ``model.output`` at ``HEAD_SCHEME`` when ``spec.head``."""
    found = [
        (parent, name, child, spec) for parent, name, child in block_linears(model, (nn.Linear, QATLinear))
    ]
    if spec.head and type(model.output) in (nn.Linear, QATLinear):
        found.append((model, "output", model.output, QuantSpec(HEAD_SCHEME, head=False)))
    return found


def quantize(model: nn.Module, spec: QuantSpec, empty: bool = False) -> nn.Module:
    """Swap every nn.Linear in the blocks (and the head if ``spec.head``) for a ``QuantLinear``
    holding its weight quantized (``empty``: zeros, to be filled by loading a quantized
    ``model.safetensors``). In place."""
    for parent, name, linear, layer_spec in _targets(model, spec):
        if empty:
            bias, device = linear.bias is not None, linear.weight.device
            new = QuantLinear(linear.in_features, linear.out_features, bias, layer_spec, device)
        else:
            new = QuantLinear.from_linear(linear, layer_spec)
        setattr(parent, name, new)
    return model


def apply_qat(model: nn.Module, spec: QuantSpec) -> nn.Module:
    """Make every linear ``quantize`` would swap a ``QATLinear`` (same parameters). In place."""
    for _, _, linear, layer_spec in _targets(model, spec):
        linear.__class__ = QATLinear
        linear.spec = layer_spec
    return model


def pack(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.pack()
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's saved tensors (parameters and persistent buffers), a tied one once."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
