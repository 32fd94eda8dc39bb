"""The kernels compile for a Hopper GPU on a machine without one. The interpreter runs a kernel's
Python on numpy, so a construct that the real compiler rejects (a scalar of the wrong kind, a
loop-carried value whose type changes, a layout Triton cannot lower) passes there and fails on
the first GPU. Here each kernel written or changed since the last GPU lease is lowered by
Triton's own compiler to PTX and a cubin for sm_90 (``triton.compile`` with a ``GPUTarget``;
ptxas ships in Triton's wheel), in a process with the interpreter off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is the kernels' compiler: pip install 'ember[kernels]'")

SCRIPT = r"""
import os
import re
os.environ["TRITON_INTERPRET"] = "0"  # before any kernel is decorated: real JIT functions
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ember.kernels import decode, invariant, norm, paged, persistent, rope, softmax

def lower(kernel, types, consts, num_warps=4, aligned=False):
    fn = kernel
    while not isinstance(fn, triton.runtime.jit.JITFunction):  # under @triton.autotune
        fn = fn.fn
    signature = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
    # aligned: pointers, widths and strides divisible by 16, as Triton's launcher specializes them
    # at gpt2's sizes
    wide = ("N", "C", "F", "V", "skb", "skh", "sks")
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if aligned and a not in consts and (types[a].startswith("*") or a in wide)}
    compiled = triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})
    assert compiled.asm["cubin"], fn.__name__
    if consts.get("PDL"):  # waits for the kernel before, and lets the next one start, once each
        ptx = compiled.asm["ptx"]
        gdc = ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")
        assert gdc == (1, 1), (fn.__name__, gdc)
    if "TABLE" in fn.arg_names:  # the persistent step: waits acquire, counts release, one thread each
        ptx = compiled.asm["ptx"]
        assert "ld.global.gpu.acquire" in ptx and "atom.global.gpu.release.add" in ptx, fn.__name__
        # and reads the weights its table points to 16 bytes a load (a few scalar loads are left;
        # 617 when the table's pointers carried no alignment)
        scalar = len(re.findall(r"ld\.global[.a-z0-9]*\.b16 ", ptx))
        assert scalar < 32 and ptx.count("ld.global.v4") > 64, (fn.__name__, scalar)
    if consts.get("STAGES", 1) > 1 and aligned:  # the loop's loads run ahead: cp.async, not ld.global
        ptx = compiled.asm["ptx"]  # (the norm's backward also reads its weight and row statistics)
        assert "cp.async" in ptx and ("ld.global" not in ptx or "_norm" in fn.__name__), fn.__name__
    print("lowered", fn.__name__, flush=True)
    return compiled

bf, i32, i64 = "*bf16", "i32", "i64"
LIN = dict(X=bf, W=bf, BIAS=bf, G=bf, BETA=bf, R=bf, Y=bf, M=i32, N=i32, K=i32, eps="fp32")
for norm_kind, act, res in ((1, 1, False), (2, 0, False), (0, 0, True), (2, 2, False)):
    consts = dict(NORM=norm_kind, HAS_BIAS=True, HAS_BETA=norm_kind == 1, ACT=act, HAS_RES=res,
                  FP32_DOT=False, PREFETCH=True, PDL=True, BLOCK_M=16, DOT=True, BLOCK_N=32, BLOCK_K=256)
    absent = (("G", norm_kind), ("BETA", norm_kind == 1), ("R", res))
    consts.update({k: None for k, keep in absent if not keep})
    lower(decode._linear_kernel, LIN, consts)
lower(decode._linear_kernel, LIN, {**consts, "BLOCK_N": 16, "BLOCK_K": 1024}, 8)  # a 768 row, one step
FMA = {"BLOCK_M": 1, "DOT": False, "BLOCK_N": 16, "BLOCK_K": 1024}  # one row a program, CUDA cores
lower(decode._linear_kernel, LIN, {**consts, **FMA}, 8)
lower(decode._linear_kernel, LIN, {**consts, **FMA, "BLOCK_N": 4, "BLOCK_K": 4096}, 8)  # 3,072 in one step
lower(decode._linear_kernel, LIN, {**consts, "PREFETCH": False, "PDL": False})  # the road before (pdl=False)
ATT = dict(QKV=bf, KC=bf, VC=bf, POS="*i64", PAD="*i64", COS=bf, SIN=bf, O=bf, spad=i32, skb=i64,
           skh=i64, sks=i64, scale="fp32")
for slots, warps in ((64, 4), (256, 8)):  # the attention's first and widest tuning configs
    lower(decode._attention_kernel, ATT, dict(H=12, HKV=4, HD=64, ROPE=True, PREFETCH=True, PDL=True,
                                              BLOCK_S=slots), warps)
lower(decode._attention_kernel, ATT, dict(COS=None, SIN=None, H=12, HKV=12, HD=64, ROPE=False, PREFETCH=False,
                                          PDL=False, BLOCK_S=64))
lower(decode._embed_kernel, dict(IDX="*i64", WTE=bf, WPE=bf, POS="*i64", PAD="*i64", X=bf, C=i32, spad=i32),
      dict(HAS_WPE=True, BLOCK=1024))
lower(norm._norm_fwd, dict(X=bf, R=bf, W=bf, B=bf, Y=bf, H=bf, Mean="*fp32", Rstd="*fp32", M=i32, N=i32,
      eps="fp32"), dict(RMS=False, HAS_R=True, HAS_W=True, HAS_B=True, ACC=tl.float32, ROWS=4, BLOCK=1024))
BWD = dict(DY=bf, DH=bf, H=bf, W=bf, Mean="*fp32", Rstd="*fp32", DX=bf, DW="*fp32", DB="*fp32", M=i32, N=i32,
           rows_per_program=i32)  # the backward's loop pipelined (tl.range's stages: cp.async loads)
lower(norm._norm_bwd, BWD, dict(RMS=False, HAS_DH=True, HAS_W=True, HAS_B=True, ACC=tl.float32,
      STAGES=norm.BACKWARD_CONFIGS[0][1], BLOCK=1024))
lower(norm._norm_bwd, BWD, dict(RMS=False, HAS_DH=False, HAS_W=True, HAS_B=True, ACC=tl.float32, STAGES=3,
      BLOCK=1024), 1)  # the tuner's one-warp config
lower(norm._norm_fwd, dict(X=bf, R=bf, W=bf, B=bf, Y=bf, H=bf, Mean="*fp32", Rstd="*fp32", M=i32, N=i32,
      eps="fp32"), dict(RMS=True, HAS_R=False, HAS_W=True, HAS_B=False, ACC=tl.float32, ROWS=1,
      BLOCK=1024), 1)
H100 = 232448  # bytes of shared memory a block (opt-in): 32,768-wide bf16 rows with a residual fit
wide = lower(norm._norm_bwd, BWD, dict(RMS=False, HAS_DH=True, HAS_W=True, HAS_B=True, ACC=tl.float32,
             STAGES=norm.backward_stages(32768, 2, 3, H100), BLOCK=32768), 16, aligned=True)
assert wide.metadata.shared <= H100, wide.metadata.shared
lower(norm._sum_partials, dict(PW="*fp32", PB="*fp32", DW=bf, DB=bf, P=i32, N=i32),
      dict(HAS_W=True, HAS_B=True, ACC=tl.float32, BLOCK_P=64, BLOCK_N=32))
lower(rope._rope_kernel, dict(Q=bf, K=bf, QO=bf, KO=bf, COS="*fp32", SIN="*fp32", T=i32, H=i32, HK=i32,
      sqb=i64, sqh=i64, sqt=i64, skb=i64, skh=i64, skt=i64, scb=i32, sct=i32),
      dict(INVERSE=False, ACC=tl.float32, HALF=32, BLOCK_T=4, BLOCK_H=16, BLOCK_HK=4,
           BLOCK_D=32, LOADS_FIRST=True))
lower(rope._rope_kernel, dict(Q=bf, K=bf, QO=bf, KO=bf, COS="*fp32", SIN="*fp32", T=i32, H=i32, HK=i32,
      sqb=i64, sqh=i64, sqt=i64, skb=i64, skh=i64, skt=i64, scb=i32, sct=i32),
      dict(INVERSE=True, ACC=tl.float32, HALF=32, BLOCK_T=1, BLOCK_H=16, BLOCK_HK=16, BLOCK_D=32,
           LOADS_FIRST=True), 1)  # the tuner's smallest tile: one position, one warp
# a vocab row: the two-pass loops, pipelined
LONG = dict(ACC=tl.float32, BLOCK=8192, STAGES=3, AHEAD=False)
for hints in (softmax.NO_HINTS, softmax.HINTS):
    fwd = lower(softmax._softmax_fwd_long, dict(X=bf, Y=bf, R=i32, N=i32), {**LONG, **hints}, 16,
                aligned=True)
    bwd = lower(softmax._softmax_bwd_long, dict(Y=bf, DY=bf, DX=bf, R=i32, N=i32), {**LONG, **hints}, 16,
                aligned=True)
    for ptx in (fwd.asm["ptx"], bwd.asm["ptx"]):  # the hints reach the stores (3.9: the copies too), or none
        hinted = hints is softmax.HINTS
        assert ("evict_first" in ptx) == hinted and (hinted or "evict_last" not in ptx), hints
AHEAD = {**LONG, "STAGES": 1, "AHEAD": True, **softmax.HINTS}  # a block ahead by hand: plain 16-byte loads
fwd = lower(softmax._softmax_fwd_long, dict(X=bf, Y=bf, R=i32, N=i32), AHEAD, 16, aligned=True)
bwd = lower(softmax._softmax_bwd_long, dict(Y=bf, DY=bf, DX=bf, R=i32, N=i32), AHEAD, 16, aligned=True)
for ptx in (fwd.asm["ptx"], bwd.asm["ptx"]):
    assert "ld.global.L1::evict_last.L2::cache_hint.v4" in ptx and "cp.async" not in ptx
STEP = dict(IDX="*i64", WTE=bf, WPE=bf, POS="*i64", PAD="*i64", TABLE="*i64", GF=bf, BF=bf, HEAD=bf, X=bf,
            QKV=bf, O=bf, HID=bf, LOGITS="*fp32", SYNC="*i32", B=i32, C=i32, F=i32, V=i32, L=i32, eps="fp32",
            eps_f="fp32", spad=i32, skb=i64, skh=i64, sks=i64, scale="fp32")  # gpt2-small's step, one row
lower(persistent._step_kernel, STEP, dict(COS=None, SIN=None, HEAD_B=None, H=12, HKV=12, HD=64, NORM=1,
      HAS_BIAS=True, HAS_BETA=True, ACT=1, HAS_WPE=True, ROPE=False, HEAD_BIAS=False, FP32_DOT=False,
      BLOCK_M=1, DOT=False, BLOCK_N=16, BLOCK_K=1024, BLOCK_S=64, BLOCK_C=1024), 8, aligned=True)
PAGED = dict(Q=bf, K=bf, V=bf, TABLES="*i32", QPOS="*i64", TILES="*i64", O=bf, sqt=i64, sqh=i64, sks=i64,
             skh=i64, st=i64, n_tiles=i32, scale="fp32")
lower(paged._paged_kernel, PAGED, dict(BS=16, H=12, GROUP=3, HD=64, BLOCK_M=16, BLOCK_N=32, PREC="tf32",
      UPCAST=False))
f32 = "*fp32"  # the batch-invariant road serves fp32: the paged kernel and the product on FMA units, no TF32
exact = lower(paged._paged_kernel, {**PAGED, "Q": f32, "K": f32, "V": f32, "O": f32}, dict(BS=16, H=12,
              GROUP=3, HD=64, BLOCK_M=16, BLOCK_N=32, PREC="ieee", UPCAST=False))
assert "mma" not in exact.asm["ptx"]
MM = dict(A=f32, B=f32, BIAS=f32, C=f32, M=i32, N=i32, K=i32, sam=i64, sak=i64, sbk=i64, sbn=i64, scm=i64)
for dtype, prec in ((f32, "ieee"), (bf, "tf32")):
    for rows, cols in (invariant.SMALL, invariant.LARGE):
        types = {**MM, **dict.fromkeys(("A", "B", "BIAS", "C"), dtype)}
        mm = lower(invariant._matmul_kernel, types, dict(HAS_BIAS=True, BLOCK_M=rows, BLOCK_N=cols,
                   BLOCK_K=invariant.BLOCK_K, ACC=tl.float32, PREC=prec, UPCAST=False)).asm["ptx"]
        # fp32: chains of FMAs, never tensor cores; bf16: mma.sync at both sizes, never wgmma (whose
        # sums would run in another order than the other size's)
        assert ("mma" in mm) == (dtype == bf) and "wgmma" not in mm, (dtype, rows)
"""


def test_changed_kernels_lower_to_sm90_cubins():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("lowered") == 33, out.stdout
