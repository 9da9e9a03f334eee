"""Peak memory of a call, for the load benchmark and the tests that bound it: on CUDA the caching allocator's peak
(reset before), on the CPU the peak of live bytes from the profiler's allocation events (every tensor allocation
and free, in order), and the process's peak resident set (VmHWM, reset before the call where the kernel allows)."""
from __future__ import annotations

from pathlib import Path

import torch


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")   # resets VmHWM to the current RSS
    except OSError:
        pass


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def measure(fn, device: torch.device):
    """``(fn(), peak allocated bytes on device, peak RSS bytes, RSS bytes before)``: peak allocated counts what the
    call allocated above what was live before it; :func:`retained` what it left allocated."""
    _reset_peak_rss()
    rss_before = _status_bytes("VmRSS")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - base, _status_bytes("VmHWM"), rss_before
    out, live = _host_allocations(fn)
    return out, max(live, default=0), _status_bytes("VmHWM"), rss_before


def _host_allocations(fn) -> tuple[object, list[int]]:
    """``fn()`` and the bytes live (allocated by it, not yet freed) after each CPU allocation or free it made."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live, total = [], 0
    for _, nbytes in events:
        total += nbytes
        live.append(total)
    return out, live


def retained(fn) -> tuple[object, int, int]:
    """``(fn(), peak, bytes still allocated after it)`` on the CPU: what a call that failed left behind."""
    out, live = _host_allocations(fn)
    return out, max(live, default=0), live[-1] if live else 0
