"""Host wall-clock timing of device work, synchronised before and after: the time a caller waits; one kernel's time
per call with its weights read from device memory, as a decode step reads them; and freeing an engine's device memory
between the engines of one benchmark."""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import torch

T = TypeVar("T")

KERNEL_CALLS_PER_SAMPLE = 20         # calls captured in one CUDA graph per timing sample (at least)
COLD_L2_MULTIPLE = 2                 # the weights cycled through in a kernel timing: this many L2 caches' worth


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


def cold_copies(device: torch.device, nbytes: int) -> int:
    """How many copies of ``nbytes`` of weights a kernel timing cycles through so that each call reads its weights
    from device memory: a decode step's projections together are far larger than the L2 cache, so none finds its
    weights there, while a kernel timed on one weight again and again does (a 7 MB projection of the 0.8B fits an
    H100's 50 MB L2) and measures a speed no decode step sees. One on the CPU."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, -(-COLD_L2_MULTIPLE * l2 // max(1, nbytes)))


def weight_copies(device: torch.device, tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """``tensors`` (one weight: a dense matrix, or a quantized one's data and scales) and as many clones of them as
    :func:`cold_copies` asks for, for a timing to take in turn."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(cold_copies(device, nbytes) - 1)]


def time_calls_us(device: torch.device, calls: Sequence[Callable[[], object]], repeats: int) -> float:
    """Median microseconds per call of ``calls`` taken in turn (one per weight copy, :func:`weight_copies`); on CUDA
    over captured graphs of at least :data:`KERNEL_CALLS_PER_SAMPLE` calls (no launch gaps)."""
    calls = list(calls)
    if device.type == "cuda":
        count = max(KERNEL_CALLS_PER_SAMPLE, len(calls))
        calls[0]()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(count):
                calls[i % len(calls)]()
        run = graph.replay
    else:
        count = len(calls)

        def run():
            for call in calls:
                call()
    run()
    samples = [timed(device, run)[1] for _ in range(repeats)]
    return 1000.0 * statistics.median(samples) / count


def sweep_arguments(doc: str, argv: list[str] | None,
                    extend: Callable[[argparse.ArgumentParser], object] = lambda parser: None
                    ) -> tuple[argparse.Namespace, torch.device, torch.dtype]:
    """The launch sweeps' command line (PRESET LENGTHS [--sweep] [--repeats N] [--out FILE], plus what ``extend``
    adds) and where they run: bf16 on CUDA, fp32 on the CPU (Triton's interpreter)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("preset", nargs="?", default="qwen3.5-0.8b")
    parser.add_argument("lengths", nargs="?", default="1,24")
    extend(parser)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--budget-s", type=float, help="seconds a length's sweep may take (the default: no limit)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return args, device, torch.bfloat16 if device.type == "cuda" else torch.float32


def sweep_launches(device: torch.device, default: tuple, candidates: Sequence[tuple],
                   output: Callable[[tuple], torch.Tensor], calls: Callable[[tuple], Sequence[Callable[[], object]]],
                   repeats: int, tolerance: float, report: Callable[[dict], object] = lambda row: None,
                   budget_s: float | None = None) -> list[dict]:
    """A kernel's launch configurations: ``default`` and then every other of ``candidates``, each one's
    ``output(launch)`` checked against the default's (largest difference <= ``tolerance`` x the largest magnitude:
    another summation order, not another result) and the correct ones timed as ``calls(launch)`` (one per copy of
    the data the kernel reads from memory, :func:`weight_copies`) with :func:`time_calls_us`. One row each: config,
    default, us (None when wrong or failed), correct, and error: why a candidate could not run (a tile that needs
    more shared memory than the GPU has, say), None where it ran. Each row goes to ``report`` as it is made (a sweep
    cut short by its time limit still shows what it timed: :func:`sweep_row_line`). Past ``budget_s`` seconds no
    further candidate is tried (the rows returned are those tried)."""
    start = time.monotonic()
    want = output(default).float()
    rows = []
    for launch in [default] + [c for c in candidates if c != default]:
        if rows and budget_s is not None and time.monotonic() - start > budget_s:
            break
        try:
            got, error = want if launch == default else output(launch).float(), None
        except Exception as err:  # noqa: BLE001 - a candidate the compiler or the GPU refuses is reported, not fatal
            got, error = None, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        correct = got is not None and bool((got - want).abs().max() <= tolerance * want.abs().max())
        us = time_calls_us(device, calls(launch), repeats) if correct else None
        rows.append({"config": list(launch), "default": launch == default, "us": us, "correct": correct,
                     "error": error})
        report(rows[-1])
    return rows


def sweep_row_line(row: dict) -> str:
    """One of :func:`sweep_launches`'s rows as a progress line."""
    result = (f"{row['us']:.2f} us" if row["us"] is not None
              else f"could not run ({row['error']})" if row.get("error") else "wrong")
    return f"    {tuple(row['config'])}{' (default)' if row['default'] else ''}: {result}"


def print_sweep_row(row: dict) -> None:
    """:func:`sweep_launches`'s ``report`` for a sweep script: each row's progress line, printed as it is made."""
    print(sweep_row_line(row), flush=True)


def fastest_line(rows: Sequence[dict], shown: int = 5) -> str:
    """The fastest of :func:`sweep_launches`'s rows, the wrong ones and the ones that could not run."""
    timed = sorted((r for r in rows if r["us"] is not None), key=lambda r: r["us"])
    wrong = [tuple(r["config"]) for r in rows if not r["correct"] and not r.get("error")]
    failed = [tuple(r["config"]) for r in rows if r.get("error")]
    return (f"  fastest of {len(timed)}: " + ", ".join(f"{tuple(r['config'])} {r['us']:.2f} us" for r in timed[:shown])
            + (f"; wrong: {wrong}" if wrong else "") + (f"; could not run: {failed}" if failed else ""))
