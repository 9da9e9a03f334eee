"""Argument checks shared by the Triton wrappers: a layout a kernel does not handle is refused with a clear error
(naming the operation and the argument) instead of being computed into garbage."""
from __future__ import annotations

import os

import torch

from ._triton import IMPORT_ERROR, triton

MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class LayoutError(ValueError):
    """A tensor's shape, dtype, device or strides are outside what a fused kernel supports."""


def require(condition: bool, op: str, what: str) -> None:
    if not condition:
        raise LayoutError(f"{op}: {what}")


def require_launchable(op: str, *tensors: torch.Tensor) -> torch.device:
    """Triton is importable and every tensor is on one device it can run on (CUDA, or the CPU when
    ``TRITON_INTERPRET=1``). Returns that device."""
    if triton is None:
        raise RuntimeError(f"{op}: Triton is not available ({IMPORT_ERROR})")
    device = tensors[0].device
    require(all(t.device == device for t in tensors), op, "all tensors must be on one device, got "
            + ", ".join(str(t.device) for t in tensors))
    require(device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1", op,
            f"tensors on {device} need CUDA (or TRITON_INTERPRET=1 for the CPU interpreter)")
    return device


def require_rows(op: str, name: str, t: torch.Tensor, ndim: int, dtype: torch.dtype | None = None) -> None:
    """``t`` has ``ndim`` dimensions, unit stride in its last one (other strides are free), and ``dtype``."""
    require(t.dim() == ndim, op, f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    require(t.shape[-1] <= 1 or t.stride(-1) == 1, op,
            f"{name} must have unit stride in its last dimension, got strides {t.stride()}")
    if dtype is not None:
        require(t.dtype == dtype, op, f"{name} must be {dtype}, got {t.dtype}")


def require_model_dtype(op: str, t: torch.Tensor) -> None:
    require(t.dtype in MODEL_DTYPES, op, f"dtype must be one of {MODEL_DTYPES}, got {t.dtype}")


def require_count(op: str, count: torch.Tensor | None, device: torch.device) -> None:
    """``count`` is None or a 0-d int64 tensor on ``device`` (its value, 1 <= count <= L, is the caller's promise:
    reading it here would be a host sync)."""
    if count is not None:
        require(isinstance(count, torch.Tensor) and count.dim() == 0 and count.dtype == torch.int64
                and count.device == device, op, "count must be None or a 0-d int64 tensor on the inputs' device")


def num_warps_for(block: int) -> int:
    """Warps for a program that handles ``block`` elements: about 256 elements per warp, 1..16."""
    return max(1, min(16, block // 256))
