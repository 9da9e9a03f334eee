"""Host wall-clock timing of device work, synchronised before and after: the time a caller waits."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()``'s result and its wall-clock milliseconds, its device work included."""
    sync(device)
    started = time.perf_counter()
    result = fn()
    sync(device)
    return result, 1000.0 * (time.perf_counter() - started)
