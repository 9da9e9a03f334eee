"""The two time-to-first-token figures every benchmark reports, each defined once here.

* **Cold TTFT** (:func:`cold_ttft`): from an empty stream (``reset``) to the greedy first token after a prompt,
  prefilled in the engine's own ``prefill_chunk`` pieces; one untimed run first (allocator, kernel caches), then
  the median over ``repeats``. The figure depends on ``prefill_chunk`` (each piece of a long prefill is one eager
  model pass: on a GPU each costs its launches), so every result records it beside the figure; the benchmarks
  default to :data:`BENCH_PREFILL_CHUNK`, a whole 16k prompt in one pass.
* **Capsule TTFT** (:func:`capsule_ttft`): from an empty stream to the greedy first token after restoring a capsule
  and prefilling a suffix, broken down into restore, suffix prefill and first token (CUDA events on the device's
  timeline on CUDA, ``perf_counter`` on the CPU, where work is synchronous) and the host overhead: the wall time
  outside the device's span (Python before the first launch, the final synchronisation). On CUDA, ``*_host_ms`` is
  the host's time to issue each phase: where it exceeds the phase's device time, the device waits on the host.
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from flashrt_ros.runtime.engine import Engine

from .timing import sync, timed

BENCH_PREFILL_CHUNK = 16384
PHASES = ("restore", "suffix_prefill", "first_token")


def cold_ttft(engine: Engine, prompt: Sequence[int], repeats: int) -> dict:
    """``cold_ttft_ms`` (median), its first token, the prompt length and the ``prefill_chunk`` it ran with."""
    def cold():
        engine.reset()
        engine.ingest(prompt)
        return engine.peek_token()

    token = cold()                                             # untimed: the first run pays one-off costs
    times = [timed(engine.device, cold)[1] for _ in range(repeats)]
    return {"cold_ttft_ms": statistics.median(times), "cold_prompt_tokens": len(prompt),
            "prefill_chunk": engine.config.prefill_chunk, "cold_first_token": token}


def _capsule_ttft_once(engine: Engine, capsule_id: str, suffix: Sequence[int]) -> tuple[int, dict]:
    """One capsule TTFT from an empty stream: the token and the phase times (ms)."""
    device = engine.device
    cuda = device.type == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)] if cuda else []
    engine.reset()
    sync(device)
    stamps = [time.perf_counter()]
    if cuda:
        events[0].record()
    for i, phase in enumerate((lambda: engine.restore(capsule_id), lambda: engine.ingest(suffix),
                               engine.peek_token)):
        token = phase()
        if cuda:
            events[i + 1].record()
        stamps.append(time.perf_counter())
    sync(device)
    wall = 1000.0 * (time.perf_counter() - stamps[0])
    host = [1000.0 * (b - a) for a, b in zip(stamps, stamps[1:])]
    spans = [a.elapsed_time(b) for a, b in zip(events, events[1:])] if cuda else host
    times = {f"{p}_ms": s for p, s in zip(PHASES, spans)}
    if cuda:
        times.update({f"{p}_host_ms": h for p, h in zip(PHASES, host)})
    times["host_overhead_ms"] = max(0.0, wall - sum(spans))
    times["total_ms"] = wall
    return token, times


def capsule_ttft(engine: Engine, capsule_id: str, suffix: Sequence[int], repeats: int) -> dict:
    """``capsule_ttft_ms`` (median wall time) and its breakdown (per-phase medians, keys ``capsule_ttft_<phase>_ms``
    and ``capsule_ttft_host_overhead_ms``), and the first token. Leaves the stream at the capsule plus the suffix."""
    token, _ = _capsule_ttft_once(engine, capsule_id, suffix)    # untimed, as for cold TTFT
    runs = [_capsule_ttft_once(engine, capsule_id, suffix)[1] for _ in range(repeats)]
    out = {f"capsule_ttft_{key.removesuffix('_ms')}_ms" if key != "total_ms" else "capsule_ttft_ms":
           statistics.median(r[key] for r in runs) for key in runs[0]}
    out["capsule_first_token"] = token
    return out
