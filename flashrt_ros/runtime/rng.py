"""A counter-based random number generator in plain integer tensor ops.

The same (seed, stream, index) gives the same numbers on every device and machine, with no hidden generator state:
the sampler's whole RNG state is two int64 slots of the arena (seed, counter), and preset weights are reproducible
bit for bit on CPU and GPU. All arithmetic stays below 2**63, so int64 never overflows.
"""
from __future__ import annotations

import zlib

import torch

MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, const: int) -> torch.Tensor:
    """(x * const) mod 2**32 for x < 2**32, split so no intermediate reaches 2**63."""
    lo, hi = const & 0xFFFF, const >> 16
    return ((x * lo) + (((x * hi) & 0xFFFF) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_key(name: str) -> int:
    return zlib.crc32(name.encode())


def uniform(seed: torch.Tensor | int, stream: torch.Tensor | int, index: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in (0, 1) for each int64 ``index``; ``seed``/``stream`` may be 0-d device tensors."""
    key = hash32((torch.as_tensor(seed, device=index.device) & MASK32) ^ hash32(
        torch.as_tensor(stream, device=index.device) & MASK32))
    bits = hash32(hash32((index + key) & MASK32) ^ key)
    return ((bits >> 9).float() + 0.5) * (1.0 / 8_388_608.0)   # 23 bits: the +0.5 is exact, so never 0 or 1
