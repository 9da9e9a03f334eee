"""Triton, when it can be imported. It is optional: without it the reference kernels run everywhere.

On a machine without CUDA, tests set ``TRITON_INTERPRET=1`` before this import, so the Triton kernels run on CPU
tensors through Triton's interpreter (slowly, for correctness only).
"""
from __future__ import annotations

import functools
import os

import torch

# Triton builds a kernel for its interpreter or for the compiler when the kernel is decorated (at import), so flags
# that pick interpreter workarounds are read here, once, at the same moment.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    IMPORT_ERROR = ""
except Exception as err:  # noqa: BLE001 - any failure (not installed, broken install) means "not available"
    triton = tl = gdc_launch_dependents = gdc_wait = None
    IMPORT_ERROR = f"{type(err).__name__}: {err}"


def jit(fn):
    """``triton.jit`` when Triton is importable; otherwise the plain function (never launched)."""
    return triton.jit(fn) if triton is not None else fn


PDL_SWITCH = "FLASHRT_PDL"          # "0" turns programmatic dependent launch off (for A/B benchmarks and bisecting)


@functools.cache
def _device_has_pdl(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _pdl_on(device: torch.device) -> bool:
    return not INTERPRETED and os.environ.get(PDL_SWITCH) != "0" and _device_has_pdl(device)


def pdl_launch(device: torch.device) -> dict:
    """The launch options of every runtime kernel: ``PDL`` (the kernel's constexpr) and Triton's ``launch_pdl``.

    Programmatic dependent launch (sm_90+): a kernel may be launched while the one before it on the stream still
    runs, and waits in :func:`wait_for_inputs` until that one has finished, so results are those of plain launches
    while a kernel's launch, and a decode GEMV's first weight loads, overlap the kernel before. CUDA graphs keep the
    dependency (stream capture turns it into a programmatic edge)."""
    on = _pdl_on(device)
    return {"PDL": on, "launch_pdl": on}


@jit
def wait_for_inputs(PDL: tl.constexpr):
    """With PDL: wait until the kernel before this one has finished and its writes are visible, then let the next
    kernel launch. Call before the first load of anything an earlier kernel writes (weights, written once at load,
    may be read before).

    Waiting first bounds the overlap to one kernel: were the next one let in at once, a small kernel would let a
    GEMV launch while the GEMV before it still runs, and the new GEMV's programs would pile onto the SMs that free
    up first instead of spreading evenly over all of them."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
