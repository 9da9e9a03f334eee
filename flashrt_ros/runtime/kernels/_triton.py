"""Triton, when it can be imported. It is optional: without it the reference kernels run everywhere.

On a machine without CUDA, tests set ``TRITON_INTERPRET=1`` before this import, so the Triton kernels run on CPU
tensors through Triton's interpreter (slowly, for correctness only).
"""
from __future__ import annotations

import os

# Triton builds a kernel for its interpreter or for the compiler when the kernel is decorated (at import), so flags
# that pick interpreter workarounds are read here, once, at the same moment.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

try:
    import triton
    import triton.language as tl
    IMPORT_ERROR = ""
except Exception as err:  # noqa: BLE001 - any failure (not installed, broken install) means "not available"
    triton = tl = None
    IMPORT_ERROR = f"{type(err).__name__}: {err}"


def jit(fn):
    """``triton.jit`` when Triton is importable; otherwise the plain function (never launched)."""
    return triton.jit(fn) if triton is not None else fn

# Under the interpreter tl.dot is numpy's matmul, whose BLAS rounds a row by its place in the tile (OpenBLAS on an
# AVX2 EPYC: row r of a [16, K] product differs from the same row placed first), so a speculative verify's row would
# not equal a decode step's. The kernels' products take :func:`row_ordered_dot` there instead.
ROW_ORDERED_DOT = tl.constexpr(INTERPRETED) if tl is not None else INTERPRETED


@jit
def row_ordered_dot(a, b):
    """a @ b in fp32 as a broadcast product summed over K in order: every row rounds alike wherever it sits (the
    interpreter's exact product; a compiled kernel takes tl.dot)."""
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
