"""The arena: one static allocation holding every restorable buffer of the live stream, plus its manifest.

Layout: the fixed-size state first (meta, last hidden state, conv windows, recurrent matrices), then the KV caches,
position-major, so the valid prefix of each KV buffer is one contiguous byte range. The live state at position n is
therefore a handful of byte ranges, and a capsule of it is their concatenation.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math

import torch

from .config import ModelConfig

ALIGN = 256

# Slots of the int64 ``meta`` buffer. The sampler's RNG is counter-based, so (seed, counter) is its whole state.
# ROPE_DELTA: the next text token's rotary (M-RoPE) position minus its token index; 0 until an image, whose tokens
# take fewer rotary positions than token rows, makes it negative (``vision/layout.py``). Text-only streams never
# write it, so their arena bytes are what they were before images existed.
POSITION, LAST_TOKEN, RNG_SEED, RNG_COUNTER, ROPE_DELTA = range(5)
META_SLOTS = 8


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    name: str
    kind: str                 # kv | recurrent | conv | mtp | meta
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0
    per_token: bool = False   # position-major: only the first `position` rows are live

    @functools.cached_property           # sizes are read on every capsule call: computed once
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @functools.cached_property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0]

    def live_bytes(self, position: int) -> int:
        return self.row_bytes * position if self.per_token else self.nbytes


def buffer_specs(cfg: ModelConfig, max_context: int, dtype: torch.dtype) -> list[BufferSpec]:
    """Every restorable buffer of a stream of this model, in arena order."""
    n_lin, n_attn = len(cfg.linear_layers), len(cfg.attention_layers)
    kv_row = (2, cfg.num_key_value_heads, cfg.head_dim)
    specs = [
        BufferSpec("meta", "meta", torch.int64, (META_SLOTS,)),
        BufferSpec("hidden", "mtp", dtype, (cfg.hidden_size,)),
        BufferSpec("conv", "conv", dtype, (max(n_lin, 1), cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)),
        BufferSpec("recurrent", "recurrent", torch.float32,
                   (max(n_lin, 1), cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)),
        BufferSpec("kv", "kv", dtype, (max_context, max(n_attn, 1), *kv_row), per_token=True),
    ]
    if cfg.mtp_num_hidden_layers:
        specs.append(BufferSpec("mtp_kv", "mtp", dtype, (max_context, 1, *kv_row), per_token=True))
    placed, offset = [], 0
    for spec in specs:
        placed.append(dataclasses.replace(spec, offset=offset))
        offset += -(-spec.nbytes // ALIGN) * ALIGN
    return placed


class Arena:
    """The static buffers of one live stream, as named views into one uint8 allocation."""

    def __init__(self, specs: list[BufferSpec], device: torch.device):
        self.specs = {s.name: s for s in specs}
        total = max(s.offset + s.nbytes for s in specs)
        self.storage = torch.zeros(total, dtype=torch.uint8, device=device)
        self.views = {s.name: self.storage[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in specs}
        self.fixed_bytes = sum(s.nbytes for s in specs if not s.per_token)
        self.token_bytes = sum(s.row_bytes for s in specs if s.per_token)     # one position's rows of every KV buffer

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.views[name]

    @property
    def nbytes(self) -> int:
        return self.storage.numel()

    def manifest(self) -> list[dict]:
        return [{"name": s.name, "kind": s.kind, "dtype": str(s.dtype).removeprefix("torch."), "shape": list(s.shape),
                 "offset": s.offset, "bytes": s.nbytes, "per_token": s.per_token} for s in self.specs.values()]

    def manifest_json(self) -> str:
        return json.dumps(self.manifest(), sort_keys=True)

    def position(self) -> int:
        """The live position, read from the arena itself (a device sync on CUDA)."""
        return int(self.views["meta"][POSITION])

    def live_nbytes(self, position: int) -> int:
        """The live bytes at ``position``: the fixed-size state and ``position`` rows of each KV buffer (read on every
        restore: no loop over the buffers)."""
        return self.fixed_bytes + position * self.token_bytes

    @property
    def fixed_names(self) -> tuple[str, ...]:
        """The buffers whose whole extent is live at every position (everything but the KV caches)."""
        return tuple(s.name for s in self.specs.values() if not s.per_token)

    def segments(self, position: int, names: tuple[str, ...] | None = None) -> list[tuple[int, int, int]]:
        """Live byte ranges as (arena offset, capsule offset, length), adjacent ranges merged.

        The capsule layout is the concatenation of every buffer's live bytes in arena order; ``names`` selects a
        subset of buffers (their capsule offsets stay those of the full layout).
        """
        out: list[tuple[int, int, int]] = []
        capsule_offset = 0
        for spec in self.specs.values():
            length = spec.live_bytes(position)
            if (names is None or spec.name in names) and length:
                last = out[-1] if out else None
                if last and last[0] + last[2] == spec.offset and last[1] + last[2] == capsule_offset:
                    out[-1] = (last[0], last[1], last[2] + length)
                else:
                    out.append((spec.offset, capsule_offset, length))
            capsule_offset += length
        return out

    def read_live(self, position: int, dst: torch.Tensor) -> None:
        """Copy the live bytes into ``dst`` (uint8, ``live_nbytes(position)`` long)."""
        for arena_off, capsule_off, length in self.segments(position):
            dst[capsule_off:capsule_off + length].copy_(self.storage[arena_off:arena_off + length], non_blocking=True)

    def write_live(self, position: int, src: torch.Tensor, names: tuple[str, ...] | None = None) -> None:
        """Copy capsule bytes back into the live buffers with ``copy_`` (captured graphs stay valid)."""
        for arena_off, capsule_off, length in self.segments(position, names):
            self.storage[arena_off:arena_off + length].copy_(src[capsule_off:capsule_off + length], non_blocking=True)
