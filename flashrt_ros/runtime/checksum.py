"""Device-side checksum of byte buffers: verifies a capsule where it lives, without copying it to the host.

For in-memory integrity only (bit rot, a stray write, a bug that edits a stored capsule): it is NOT cryptographic,
and someone who may choose the bytes can find collisions. Files are authenticated by capsule/file.py instead.

Each int32 word w_i (sign-extended) and its index i are mixed into a pseudo-random 64-bit value

    h_i = xs29(xs32((i * G + w_i) * M1) * M2),    xs_k(z) = z ^ (z >> k) (logical shift), M1, M2 odd

(multiply-xorshift rounds as in SplitMix64/Murmur3; each step is a bijection of 64-bit values), and the checksum
is the 128-bit pair (sum of h_i, sum of h_i**2 + byte length) mod 2**64.

Unlike a linear sum (sum of c_i * w_i), whose edits cancel when the attacker solves one linear equation per sum
(3 chosen words suffice), an edit of any number of words changes the sums by differences of pseudo-random 64-bit
values. Wrapping integer sums are order-independent, so CPU, torch-CUDA and the optional CuPy kernel (one fused
pass, no temporaries) agree exactly. Because each word's hash depends only on its value and its index, a buffer
given as several parts (a capsule's shared blocks, the live arena's byte ranges) is checksummed in place, each part
at its word offset: no concatenated copy.
"""
from __future__ import annotations

import torch

_CHUNK_WORDS = 1 << 22
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

_CUDA_SOURCE = r"""
extern "C" __global__ void flashrt_checksum(const int* words, unsigned long long n, unsigned long long base,
                                             unsigned long long* out) {
    unsigned long long s1 = 0, s2 = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long h = ((base + i) * 0x9E3779B97F4A7C15ULL + (unsigned long long)(long long)words[i])
                               * 0xBF58476D1CE4E5B9ULL;
        h = (h ^ (h >> 32)) * 0x94D049BB133111EBULL;
        h ^= h >> 29;
        s1 += h;
        s2 += h * h;
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


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 (which wraps like uint64 under + and *)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _xorshift_(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z ^= z >> bits in place, the shift logical on int64 values seen as uint64 (torch's >> is arithmetic)."""
    return z.bitwise_xor_((z >> bits).bitwise_and_((1 << (64 - bits)) - 1))


def _mix(words: torch.Tensor, start: int) -> torch.Tensor:
    z = torch.arange(start, start + words.numel(), dtype=torch.int64, device=words.device)
    z.mul_(_signed(_GOLDEN)).add_(words).mul_(_signed(_MIX1))
    return _xorshift_(_xorshift_(z, 32).mul_(_signed(_MIX2)), 29)


def _format(s1: int, s2: int, nbytes: int) -> str:
    return f"{s1 & _MASK64:016x}{(s2 + nbytes) & _MASK64:016x}"


def checksum_torch(data) -> str:
    parts = _words_at(data)
    s1 = torch.zeros((), dtype=torch.int64, device=parts[0][0].device if parts else "cpu")
    s2 = torch.zeros_like(s1)
    for words, base in parts:
        for start in range(0, words.numel(), _CHUNK_WORDS):
            h = _mix(words[start:start + _CHUNK_WORDS], base + start)
            s1 += h.sum()
            s2 += h.mul_(h).sum()
    return _format(int(s1), int(s2), _nbytes(data))


def checksum_cupy(data) -> str:
    """One fused pass per part on the GPU (grid-stride loop, warp reduction, two atomics): no int64 temporaries."""
    parts = _words_at(data)
    with cupy.cuda.ExternalStream(torch.cuda.current_stream(parts[0][0].device).cuda_stream):
        out = cupy.zeros(2, dtype=cupy.uint64)
        for words, base in parts:
            words = cupy.from_dlpack(words)
            blocks = max(1, min(-(-words.size // 256), 4096))
            _cupy_kernel((blocks,), (256,), (words, cupy.uint64(words.size), cupy.uint64(base), out))
        s1, s2 = (int(x) for x in out.get())
    return _format(s1, s2, _nbytes(data))


def checksum(data) -> str:
    """Checksum of a uint8 tensor, or of the concatenation of a sequence of uint8 tensors on one device."""
    global _cupy_kernel
    parts = _parts(data)
    if not parts:
        return _format(0, 0, 0)
    if _cupy_kernel is not None and parts[0].is_cuda:
        try:
            return checksum_cupy(parts)
        except Exception:  # noqa: BLE001 - e.g. no NVRTC: fall back to torch, which gives the same value
            _cupy_kernel = None
    return checksum_torch(parts)


def _parts(data) -> list[torch.Tensor]:
    return [p for p in ([data] if isinstance(data, torch.Tensor) else data) if p.numel()]


def _nbytes(data) -> int:
    return sum(p.numel() for p in _parts(data))


def _words_at(data) -> list[tuple[torch.Tensor, int]]:
    """int32 words of each part and the index of its first word in the concatenation. A part whose length is not a
    multiple of 4 joins the next (a copy, only then), so every word is the one the concatenation has there."""
    out, base, carry = [], 0, None
    for part in _parts(data):
        if carry is not None:
            part = torch.cat([carry, part.to(carry.device)])
            carry = None
        whole = part.numel() // 4 * 4
        if whole:
            words = part[:whole] if part.storage_offset() % 4 == 0 else part[:whole].clone()
            out.append((words.view(torch.int32), base))
            base += whole // 4
        if whole < part.numel():
            carry = part[whole:]
    if carry is not None:
        out.append((_as_words(carry), base))
    return out


def _as_words(data: torch.Tensor) -> torch.Tensor:
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    return data.view(torch.int32)
