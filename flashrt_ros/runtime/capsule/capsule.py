"""What a capsule is: its id and label rules, its info, and its bytes.

A capsule is an immutable copy of the engine's live state, identified by the engine's fingerprint (model, config,
decode plan: a capsule restores only into an engine of the same model and config, under either decode plan; see
``Engine._check_fingerprint``). Its bytes follow the arena's manifest
(:class:`Layout`): the fixed-size state (meta, hidden, conv, recurrent) as one row, then each KV buffer's rows
[0, position).

KV caches are append-only and position-major, so a capsule taken after its lineage parent repeats the parent's rows
[0, p). A stored capsule is therefore a list of *segments* per buffer: (block, lo, hi) = rows [lo, hi) of an
immutable, reference-counted :class:`Block`, in row order, covering [0, position); the fixed-size state is one more
buffer of one row (:data:`FIXED`).
"""
from __future__ import annotations

import dataclasses
import itertools
import re

import torch

from ..arena import Arena
from ..constraint import ConstraintState
from ..errors import ErrorCode, FlashRTError

MAX_ID_CHARS = 64
MAX_LABEL_BYTES = 256      # UTF-8 bytes; a label is held with its capsule and counts in the budget
INTERRUPTED_PREFIX = "interrupted-"   # a preempted stream is kept as interrupted-<request id>
RESERVED_ID_PREFIXES = (INTERRUPTED_PREFIX,)   # ids the node creates itself: clients may not take them
_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,%d}" % MAX_ID_CHARS)
# The ranges of a capsule's numbers, wherever they come from (a file header is checked against them before use):
MAX_POSITION = (1 << 32) - 1                  # CapsuleInfo.position is a uint32 on the wire
MAX_NBYTES = (1 << 63) - 1                    # CapsuleInfo.bytes: an int64 byte count (a tensor's size)
MAX_CREATED_S = ((1 << 63) - 1) // 10 ** 9    # a unix time whose nanoseconds fit an int64 (ROS time): before 2262
_block_ids = itertools.count(1)


def validate_capsule_id(capsule_id: str) -> str:
    if not isinstance(capsule_id, str) or not _ID_PATTERN.fullmatch(capsule_id):
        raise FlashRTError(ErrorCode.INVALID_CAPSULE_ID,
                           f"capsule id {capsule_id!r} must match [A-Za-z0-9_.-]{{1,64}}")
    return capsule_id


def validate_client_capsule_id(capsule_id: str) -> str:
    """An id a client asks for: a valid id outside the reserved prefixes."""
    validate_capsule_id(capsule_id)
    reserved = next((p for p in RESERVED_ID_PREFIXES if capsule_id.startswith(p)), None)
    if reserved:
        raise FlashRTError(ErrorCode.INVALID_CAPSULE_ID,
                           f"capsule id {capsule_id!r}: the prefix {reserved!r} is reserved for the node's own capsules")
    return capsule_id


def label_nbytes(label: str) -> int:
    """The bytes a label holds in the store; refuses a label that is not a string or is over MAX_LABEL_BYTES."""
    if not isinstance(label, str):
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"a capsule label must be a string, got {type(label).__name__}")
    nbytes = len(label.encode())
    if nbytes > MAX_LABEL_BYTES:
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT,
                           f"capsule label of {nbytes} bytes is over the limit of {MAX_LABEL_BYTES} (UTF-8)")
    return nbytes


@dataclasses.dataclass(frozen=True)
class CapsuleInfo:
    id: str
    parent: str
    label: str
    position: int
    nbytes: int        # the full capsule (what a restore writes, what a file holds)
    tier: str          # device | host | disk
    checksum: str
    created: float     # unix time
    own_bytes: int = 0       # held by this capsule alone (the store fills these in)
    shared_bytes: int = 0    # held in blocks other capsules hold too (counted once in the budget)
    pinned: bool = False     # never evicted off the device
    constraint: ConstraintState | None = None   # the grammar matcher's state then (outside the arena, see
                                                # constraint.py); its file carries it


@dataclasses.dataclass(frozen=True)
class Capsule:
    info: CapsuleInfo
    fingerprint: str
    data: torch.Tensor  # uint8, the arena's live bytes in manifest order


FIXED = "fixed"          # the pseudo-buffer of the fixed-size state: one row of Layout.fixed_bytes
DEVICE, HOST, DISK = "device", "host", "disk"     # tiers: the engine's device, pinned host memory, capsule_dir


@dataclasses.dataclass(eq=False)
class Block:
    """Rows [start, start + rows) of one buffer; never written after it is made."""
    start: int
    row_bytes: int
    data: torch.Tensor       # uint8, rows * row_bytes
    id: int = dataclasses.field(default_factory=lambda: next(_block_ids))
    refs: int = 0            # segments of stored capsules that hold it
    # (destination, source) views a restore wrote its rows with, by range: made once (a view costs microseconds of
    # host time, a sibling restore is host-bound) and freed with the block; a fixed block also keeps its capsule's
    # restores' writes (live.RestoreCopies), by the rows they start at
    writes: dict = dataclasses.field(default_factory=dict, repr=False)

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
    # the info the store last reported, with what it was made of (CapsuleStore.info): every restore reports one, and
    # a dataclasses.replace costs several microseconds of a host-bound restore's time
    reported: tuple | None = dataclasses.field(default=None, repr=False)


def is_pinned(stored: StoredCapsule) -> bool:
    """Pinned capsules (and the node's interrupted-* ones) never leave the device."""
    return stored.pinned or stored.info.id.startswith(INTERRUPTED_PREFIX)



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
