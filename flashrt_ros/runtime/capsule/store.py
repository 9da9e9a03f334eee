"""Delta capsules: a capsule's bytes as shared, immutable row blocks, and what the live arena holds of them.

KV caches are append-only and position-major, so a capsule taken after its lineage parent repeats the parent's rows
[0, p). A capsule here is therefore a list of *segments* per buffer: (block, lo, hi) = rows [lo, hi) of an immutable
block, in row order, covering [0, position). The fixed-size state (meta, hidden, conv, recurrent) is one more buffer
of one row. Blocks are reference-counted: dropping a capsule frees only the blocks no other capsule holds, and the
budget counts every block once, so it is exactly the bytes held.

:class:`LiveRows` records, per KV buffer, which blocks the live arena's rows [0, valid) equal (by block identity, so
nothing is kept alive by it): a snapshot shares those rows instead of copying them, and a restore copies only rows
where the live arena and the capsule are backed by different blocks.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from ..arena import Arena
from .capsule import INTERRUPTED_PREFIX, Capsule, CapsuleInfo, CapsuleStore, label_nbytes
from ..errors import ErrorCode, FlashRTError

FIXED = "fixed"          # the pseudo-buffer of the fixed-size state: one row of Layout.fixed_bytes
DEVICE, HOST, DISK = "device", "host", "disk"     # tiers: the engine's device, pinned host memory, capsule_dir
_block_ids = itertools.count(1)


@dataclasses.dataclass(eq=False)
class Block:
    """Rows [start, start + rows) of one buffer; never written after it is made."""
    start: int
    row_bytes: int
    data: torch.Tensor       # uint8, rows * row_bytes
    id: int = dataclasses.field(default_factory=lambda: next(_block_ids))
    refs: int = 0            # segments of stored capsules that hold it

    @property
    def nbytes(self) -> int:
        return self.data.numel()


Segment = tuple[Block, int, int]          # block, first row, end row (absolute positions)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The capsule byte layout of an arena: the fixed-size state, then each KV buffer's rows [0, position)."""
    fixed_bytes: int
    row_bytes: dict[str, int]              # KV buffers in capsule order

    @classmethod
    def of(cls, arena: Arena) -> "Layout":
        specs = list(arena.specs.values())
        kinds = [s.per_token for s in specs]
        if kinds != sorted(kinds):
            raise ValueError("the capsule layout needs every fixed-size buffer before the KV buffers")
        return cls(arena.live_nbytes(0), {s.name: s.row_bytes for s in specs if s.per_token})

    def nbytes(self, position: int) -> int:
        return self.fixed_bytes + position * sum(self.row_bytes.values())


def segment_bytes(segment: Segment) -> torch.Tensor:
    block, lo, hi = segment
    return block.data[(lo - block.start) * block.row_bytes:(hi - block.start) * block.row_bytes]


def row_parts(rows: dict[str, tuple[Segment, ...]]) -> list[torch.Tensor]:
    """A capsule's bytes as views of its blocks, in capsule layout order (FIXED first): concatenated, its bytes."""
    return [segment_bytes(s) for segs in rows.values() for s in segs]


@dataclasses.dataclass(eq=False)
class StoredCapsule:
    """A stored capsule: its info and its bytes: on the device tier its segments per buffer (FIXED first), on the
    host tier one full host tensor, on the disk tier its file (``<capsule_dir>/<id>.capsule``)."""
    info: CapsuleInfo
    fingerprint: str
    rows: dict[str, tuple[Segment, ...]]
    pinned: bool = False
    last_used: int = 0
    tier: str = DEVICE
    host: torch.Tensor | None = None
    owns_file: bool = False      # its file was written by a spill (a drop deletes it); exports and indexed files stay


def is_pinned(stored: StoredCapsule) -> bool:
    """Pinned capsules (and the node's interrupted-* ones) never leave the device."""
    return stored.pinned or stored.info.id.startswith(INTERRUPTED_PREFIX)


class LiveRows:
    """Per KV buffer: the blocks whose rows the live arena holds, as (block id, lo, hi), equal up to ``valid``."""

    def __init__(self, names):
        self._names = tuple(names)
        self.clear()

    def clear(self) -> None:
        self._rows: dict[str, tuple[tuple[int, int, int], ...]] = {n: () for n in self._names}
        self._valid = dict.fromkeys(self._names, 0)

    def set(self, name: str, segments: tuple[Segment, ...], valid: int) -> None:
        self._rows[name] = tuple((b.id, lo, hi) for b, lo, hi in segments)
        self._valid[name] = valid

    def truncate(self, position: int) -> None:
        """Rows from ``position`` on are no longer known (rollback; new tokens are written there next)."""
        for name in self._names:
            self._valid[name] = min(self._valid[name], position)

    def common(self, name: str, segments: tuple[Segment, ...]) -> int:
        """How many leading rows of ``segments`` the live arena already holds (same blocks, same rows)."""
        live, done, i, j = self._rows[name], 0, 0, 0
        while i < len(live) and j < len(segments) and live[i][0] == segments[j][0].id:
            done = min(live[i][2], segments[j][2])
            i += live[i][2] == done
            j += segments[j][2] == done
        return min(done, self._valid[name])

    def shareable(self, name: str, limit: int, blocks: dict[int, Block]) -> tuple[Segment, ...]:
        """The live rows [0, q <= limit) still backed by stored blocks, as segments (q as large as possible)."""
        limit = min(limit, self._valid[name])
        out = []
        for bid, lo, hi in self._rows[name]:
            block = blocks.get(bid)
            if block is None or lo >= limit:
                break
            out.append((block, lo, min(hi, limit)))
        return tuple(out)


class DeltaStore(CapsuleStore):
    """The capsule store over shared blocks: ids, lineage and the budget as in :class:`CapsuleStore`, bytes counted
    once per block. Values are :class:`StoredCapsule`."""

    def __init__(self, budget_bytes: int, layout: Layout):
        super().__init__(budget_bytes)
        self.layout = layout
        self._blocks: dict[int, Block] = {}     # every block some stored capsule holds, by id
        self._clock = itertools.count(1)

    @property
    def blocks(self) -> dict[int, Block]:
        return self._blocks

    @property
    def host_bytes(self) -> int:
        return sum(c.host.numel() for c in self._capsules.values() if c.host is not None)

    @property
    def used_bytes(self) -> int:
        """The device tier's bytes: every held block once, plus every capsule's label."""
        return (sum(b.nbytes for b in self._blocks.values())
                + sum(label_nbytes(c.info.label) for c in self._capsules.values()))

    def check_room(self, nbytes: int, label: str = "") -> None:
        """Refuse unless ``nbytes`` more device bytes and a capsule with this label fit in the budget."""
        nbytes += label_nbytes(label)
        if self.used_bytes + nbytes > self.budget_bytes:
            raise FlashRTError(
                ErrorCode.BUDGET_EXCEEDED,
                f"capsule of {nbytes} B does not fit: {self.used_bytes} of {self.budget_bytes} B in use")

    def added_bytes(self, capsule: StoredCapsule) -> int:
        """The blocks of this capsule not held yet."""
        fresh = {b.id: b for segs in capsule.rows.values() for b, _, _ in segs if b.id not in self._blocks}
        return sum(b.nbytes for b in fresh.values())

    def add(self, capsule: StoredCapsule, lineage_parent: str) -> None:
        """Store a capsule within the budget (its new blocks and its label)."""
        self.check_room(self.added_bytes(capsule), capsule.info.label)
        super().add(capsule, lineage_parent)

    def add_rows(self, info: CapsuleInfo, fingerprint: str, rows: dict[str, tuple[Segment, ...]],
                 lineage_parent: str, pinned: bool = False) -> StoredCapsule:
        stored = StoredCapsule(info, fingerprint, rows, pinned, next(self._clock))
        self.add(stored, lineage_parent)
        self.attach(stored, rows)
        return stored

    def attach(self, stored: StoredCapsule, rows: dict[str, tuple[Segment, ...]]) -> None:
        """Put the capsule on the device tier, holding these segments."""
        stored.rows, stored.tier, stored.host = rows, DEVICE, None
        for segs in rows.values():
            for block, _, _ in segs:
                block.refs += 1
                self._blocks[block.id] = block

    def release(self, stored: StoredCapsule) -> None:
        """Let go of the capsule's segments; blocks nobody else holds are freed."""
        for segs in stored.rows.values():
            for block, _, _ in segs:
                block.refs -= 1
                if not block.refs:
                    del self._blocks[block.id]
        stored.rows = {}

    def eviction(self, need: int, keep) -> list[StoredCapsule] | None:
        """The least recently used device capsules (``keep(capsule)`` false) whose spilling frees ``need`` bytes
        of the device budget, fewest first; None if even all of them would not."""
        holders: dict[int, set[str]] = {}
        for c in self._capsules.values():
            for segs in c.rows.values():
                for block, _, _ in segs:
                    holders.setdefault(block.id, set()).add(c.info.id)
        short = self.used_bytes + need - self.budget_bytes
        chosen: list[StoredCapsule] = []
        for candidate in sorted((c for c in self._capsules.values() if c.tier == DEVICE and not keep(c)),
                                key=lambda c: c.last_used):
            if short <= 0:
                break
            chosen.append(candidate)
            ids = {c.info.id for c in chosen}
            freed = sum(self._blocks[b].nbytes for b, who in holders.items() if who <= ids)
            if freed >= short:
                return chosen
        return chosen if short <= 0 else None

    def drop(self, capsule_id: str) -> tuple[int, str]:
        """Remove a capsule; returns the bytes freed (its blocks no other capsule holds) and its nearest stored
        ancestor."""
        stored = self.get(capsule_id)
        before = self.used_bytes + self.host_bytes
        parent = super().drop(capsule_id)
        self.release(stored)
        stored.host = None
        return before - self.used_bytes - self.host_bytes, parent

    def touch(self, capsule_id: str) -> None:
        self.get(capsule_id).last_used = next(self._clock)

    def split_bytes(self, stored: StoredCapsule) -> tuple[int, int]:
        """(own, shared): its bytes in blocks only it holds, and in blocks other capsules hold too."""
        own = shared = 0
        for segs in stored.rows.values():
            for block, lo, hi in segs:
                nbytes = (hi - lo) * block.row_bytes
                if block.refs > 1:
                    shared += nbytes
                else:
                    own += nbytes
        return own, shared

    def info(self, capsule_id: str) -> CapsuleInfo:
        stored = self.get(capsule_id)
        own, shared = self.split_bytes(stored) if stored.tier == DEVICE else (stored.info.nbytes, 0)
        tier = stored.info.tier if stored.tier == DEVICE else stored.tier    # the device tier by its memory kind
        return dataclasses.replace(stored.info, own_bytes=own, shared_bytes=shared, pinned=is_pinned(stored),
                                   tier=tier)

    def infos(self) -> list[CapsuleInfo]:
        return [self.info(capsule_id) for capsule_id in self._capsules]

    def materialise(self, capsule_id: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The full bytes of a device or host tier capsule in capsule layout, into ``out`` (default: a new tensor
        where its bytes are)."""
        stored = self.get(capsule_id)
        if stored.host is not None:
            return stored.host.clone() if out is None else out.copy_(stored.host)
        parts = row_parts(stored.rows)
        if out is None:
            return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        offset = 0
        for part in parts:
            out[offset:offset + part.numel()].copy_(part, non_blocking=True)
            offset += part.numel()
        return out

    def full_capsule(self, capsule_id: str) -> Capsule:
        stored = self.get(capsule_id)
        return Capsule(stored.info, stored.fingerprint, self.materialise(capsule_id))


def rows_of_full(layout: Layout, data: torch.Tensor, position: int,
                 device: torch.device | None = None) -> dict[str, tuple[Segment, ...]]:
    """Fresh blocks on ``device`` (default: data's), copies one per buffer, holding a full capsule's bytes ``data``."""
    device = data.device if device is None else device

    def copy(start: int, length: int) -> torch.Tensor:
        return torch.empty(length, dtype=torch.uint8, device=device).copy_(data[start:start + length])

    rows = {FIXED: ((Block(0, layout.fixed_bytes, copy(0, layout.fixed_bytes)), 0, 1),)}
    offset = layout.fixed_bytes
    for name, row_size in layout.row_bytes.items():
        length = position * row_size
        rows[name] = ((Block(0, row_size, copy(offset, length)), 0, position),) if position else ()
        offset += length
    return rows


def opaque_rows(data: torch.Tensor) -> dict[str, tuple[Segment, ...]]:
    """A capsule of another engine (its layout unknown here): one block, kept whole; it never restores."""
    return {FIXED: ((Block(0, data.numel(), data.clone()), 0, 1),)}
