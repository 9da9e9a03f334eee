"""Host wall-clock timing of device work, synchronised before and after: the time a caller waits; and freeing an
engine's device memory between the engines of one benchmark."""
from __future__ import annotations

import gc
import time
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_engine_memory(device: torch.device) -> None:
    """After ``del engine``: collect it now (an engine sits in reference cycles, so dropping the name frees nothing
    until the garbage collector runs) and hand its device memory back, so the next engine of a benchmark fits."""
    gc.collect()
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()


def timed(device: torch.device, fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()``'s result and its wall-clock milliseconds, its device work included."""
    sync(device)
    started = time.perf_counter()
    result = fn()
    sync(device)
    return result, 1000.0 * (time.perf_counter() - started)


def timed_split(device: torch.device, fn: Callable[[], T]) -> tuple[T, dict]:
    """``fn()``'s result and its milliseconds three ways: ``wall`` (as :func:`timed`), ``host`` (until ``fn``
    returns: on CUDA its device work may still be queued) and ``device`` (CUDA events on the current stream around
    it; on the CPU, where work is synchronous, the host time). ``host`` above ``device``: the device waits on the
    host (Python, launches)."""
    cuda = device.type == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
    sync(device)
    started = time.perf_counter()
    if cuda:
        events[0].record()
    result = fn()
    if cuda:
        events[1].record()
    host = 1000.0 * (time.perf_counter() - started)
    sync(device)
    wall = 1000.0 * (time.perf_counter() - started)
    return result, {"wall": wall, "host": host, "device": events[0].elapsed_time(events[1]) if cuda else host}
