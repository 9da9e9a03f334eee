"""Device-side checksum of byte buffers: verifies a capsule where it lives, without copying it to the host.

checksum = (sum of w_i * c_i, sum of w_i) mod 2**64 over the buffer's int32 words w_i, with c_i an odd 24-bit
multiplier derived from i, so a change to any word (or a swap of two words) changes it. Integer sums are
order-independent, so CPU, torch-CUDA and the optional CuPy kernel (one fused pass, no temporaries) agree exactly.
"""
from __future__ import annotations

import torch

_CHUNK_WORDS = 1 << 24
_MASK64 = (1 << 64) - 1

try:
    import cupy

    _cupy_kernel = cupy.ReductionKernel(
        "int32 w", "uint64 s1, uint64 s2",
        "make_pair((unsigned long long)(long long)w * (unsigned long long)((((unsigned long long)_j * 2654435761ULL)"
        " & 0xFFFFFFULL) | 1ULL), (unsigned long long)(long long)w)",
        "make_pair(a.first + b.first, a.second + b.second)", "s1 = a.first; s2 = a.second",
        "make_pair((unsigned long long)0, (unsigned long long)0)", "flashrt_checksum",
        reduce_type="thrust::pair<unsigned long long, unsigned long long>") if cupy.cuda.is_available() else None
except Exception:  # noqa: BLE001 - cupy is optional
    _cupy_kernel = None


def _multipliers(start: int, count: int, device) -> torch.Tensor:
    idx = torch.arange(start, start + count, dtype=torch.int64, device=device)
    return ((idx * 2654435761) & 0xFFFFFF) | 1


def checksum_torch(data: torch.Tensor) -> str:
    words = _as_words(data)
    s1 = torch.zeros((), dtype=torch.int64, device=words.device)
    s2 = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start:start + _CHUNK_WORDS].to(torch.int64)
        s1 += (chunk * _multipliers(start, chunk.numel(), words.device)).sum()
        s2 += chunk.sum()
    return f"{int(s1) & _MASK64:016x}{int(s2) & _MASK64:016x}"


def checksum_cupy(data: torch.Tensor) -> str:
    words = cupy.from_dlpack(_as_words(data))
    s1, s2 = _cupy_kernel(words)
    return f"{int(s1):016x}{int(s2):016x}"


def checksum(data: torch.Tensor) -> str:
    """Checksum of a uint8 tensor (any device)."""
    if _cupy_kernel is not None and data.is_cuda:
        return checksum_cupy(data)
    return checksum_torch(data)


def _as_words(data: torch.Tensor) -> torch.Tensor:
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    return data.view(torch.int32)
