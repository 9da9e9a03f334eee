"""Device-side checksum of byte buffers: verifies a capsule where it lives, without copying it to the host.

checksum = (sum of w_i * c_i, sum of w_i) mod 2**64 over the buffer's int32 words w_i, with c_i an odd 24-bit
multiplier derived from i, so a change to any word (or a swap of two words) changes it. Integer sums are
order-independent, so CPU, torch-CUDA and the optional CuPy kernel (one fused pass, no temporaries) agree exactly.
"""
from __future__ import annotations

import torch

_CHUNK_WORDS = 1 << 24
_MASK64 = (1 << 64) - 1

_CUDA_SOURCE = r"""
extern "C" __global__ void flashrt_checksum(const int* words, unsigned long long n, unsigned long long* out) {
    unsigned long long s1 = 0, s2 = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long w = (unsigned long long)(long long)words[i];
        s1 += w * (((i * 2654435761ULL) & 0xFFFFFFULL) | 1ULL);
        s2 += w;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        s1 += __shfl_down_sync(0xffffffffu, s1, offset);
        s2 += __shfl_down_sync(0xffffffffu, s2, offset);
    }
    if ((threadIdx.x & 31) == 0) { atomicAdd(out, s1); atomicAdd(out + 1, s2); }
}
"""

try:
    import cupy

    _cupy_kernel = cupy.RawKernel(_CUDA_SOURCE, "flashrt_checksum") if cupy.cuda.is_available() else None
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
    """One fused pass on the GPU (grid-stride loop, warp reduction, two atomics): no int64 temporaries."""
    with cupy.cuda.ExternalStream(torch.cuda.current_stream(data.device).cuda_stream):
        words = cupy.from_dlpack(_as_words(data))
        out = cupy.zeros(2, dtype=cupy.uint64)
        blocks = max(1, min(-(-words.size // 256), 4096))
        _cupy_kernel((blocks,), (256,), (words, cupy.uint64(words.size), out))
        s1, s2 = (int(x) for x in out.get())
    return f"{s1:016x}{s2:016x}"


def checksum(data: torch.Tensor) -> str:
    """Checksum of a uint8 tensor (any device)."""
    global _cupy_kernel
    if _cupy_kernel is not None and data.is_cuda:
        try:
            return checksum_cupy(data)
        except Exception:  # noqa: BLE001 - e.g. no NVRTC: fall back to torch, which gives the same value
            _cupy_kernel = None
    return checksum_torch(data)


def _as_words(data: torch.Tensor) -> torch.Tensor:
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    return data.view(torch.int32)
