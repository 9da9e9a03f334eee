"""Rounding an fp32 value to a narrower model dtype inside a Triton kernel, identically on the GPU and in Triton's
interpreter (whose fp32 -> bf16 cast truncates instead of rounding to nearest even, triton 3.9.0), so the CPU tests
check the same bytes the GPU computes."""
from __future__ import annotations

from ._triton import jit, tl


@jit
def round_like(x, ptr):
    """fp32 ``x`` rounded to nearest even in the element type of ``ptr`` (bf16, fp16 or fp32), returned as fp32;
    the following cast to that type is then exact everywhere. (One return: see quant_gemv._accumulate.)"""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN stays NaN
    elif ptr.dtype.element_ty == tl.float16:
        x = x.to(tl.float16).to(tl.float32)
    return x
