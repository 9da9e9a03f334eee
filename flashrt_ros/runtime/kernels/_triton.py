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


def pdl_unsupported(device) -> str | None:
    """Why the Triton kernels cannot be launched with programmatic dependent launch (PDL) on ``device``, or None.
    PDL needs a compiled kernel (not the interpreter) on an sm_90 or newer GPU: Hopper, Thor."""
    if triton is None:
        return f"triton is not importable ({IMPORT_ERROR})"
    if INTERPRETED or device.type != "cuda":
        return "programmatic dependent launch needs compiled kernels on a CUDA device"
    import torch
    major, minor = torch.cuda.get_device_capability(device)
    return None if major >= 9 else f"programmatic dependent launch needs sm_90 or newer, the GPU is sm_{major}{minor}"


def pdl_launch(pdl: bool) -> dict:
    """The launch keywords of a kernel that calls :func:`await_inputs`: its ``PDL`` constexpr and, with PDL, the
    launch attribute that lets it start while the kernel before it is still running."""
    if pdl and INTERPRETED:
        raise RuntimeError("programmatic dependent launch needs compiled kernels, not Triton's interpreter")
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


@jit
def await_inputs(PDL: "tl.constexpr"):
    """With programmatic dependent launch: wait until the kernel before has finished and its writes are visible,
    then let the kernel after start launching (it runs up to its own wait). A kernel launched with PDL calls this
    before it reads or writes any buffer another kernel of the step touches (only constant weights may be read
    before), so the stream's order holds for every byte; without PDL it is nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@jit
def prefetch_rows_l2(base, rows, row_ok, row_stride, begin, end, STEP: tl.constexpr, LINE: tl.constexpr):
    """Start moving elements [begin, end) of ``rows`` (``row_stride`` elements apart) into L2, one address per
    128-byte line of LINE elements, STEP elements of a row per iteration: no registers hold them and nothing waits
    for them. A kernel launched with PDL prefetches its weights so while the kernel before it still runs
    (compiled kernels only: the interpreter has no inline assembly)."""
    for start in range(begin, end, STEP):
        cols = start + tl.arange(0, STEP // LINE) * LINE
        inside = row_ok[:, None] & (cols < end)[None, :]
        ptrs = tl.where(inside, base + rows[:, None] * row_stride + cols[None, :], base)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.b32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)
