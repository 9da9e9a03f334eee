"""Copies between the live arena and capsules, sharing what they can.

:class:`LiveRows` records, per KV buffer, which blocks the live arena's rows [0, valid) equal, and which stored fixed
block the live fixed-size state equals (by block identity, so nothing is kept alive by it): a snapshot shares those
rows instead of copying them, and a restore copies only rows where the live arena and the capsule are backed by
different blocks, and the fixed state only when the live one is not that capsule's (restoring the capsule the stream
was just restored from or snapshotted into, with nothing run since, writes no fixed state). :class:`LiveCopier`
does those copies.

A restore is host-bound: each ``copy_`` is a dispatch and a ``cudaMemcpyAsync`` (8.5 us of host time each on an H100
host), each slice a view (2.8 us); a sibling restore was four copies and six slices (``bench/profile_restore.py``).
So a restore's ranges below :data:`BATCHED_COPY_BYTES` (the metadata, a sibling's fixed state and KV rows) go out
in one ``torch._foreach_copy_`` over 4-byte words (one launch), only larger ones alone (a full restore's KV rows),
over views cached on the blocks. The views of a capsule's fixed state and of its whole segments are made when it is
stored, so that its first restore costs what later ones do (a planner restores each branch it made; the first
restore of each made them before), and a restore that writes whole segments keeps its writes, grouped for issue
(:class:`RestoreCopies`), on the capsule's fixed block: a planner restores its root before every branch. On CUDA such
a restore made of batched copies only (a sibling's) is captured into a graph at its second issue and replayed from it
after (:class:`RestoreGraphs`): a graph's launch takes a third of the batched copy call's host time, and the same
device time (``bench/restore_copies.py`` on an H100: 2.6 against 8.7 us; a graph of a memcpy and a batched copy, tried
in ``c529386``, took the memcpy's device time).
"""
from __future__ import annotations

import torch

from ..arena import Arena
from .capsule import FIXED, Block, Layout, Segment
from .store import CapsuleStore

Plan = dict[str, tuple[tuple[Segment, ...], int]]    # per KV buffer: the shared segments, the row copying starts at
# A range this large goes alone to cudaMemcpyAsync, whose copy engine streams a large range faster than the SMs do;
# smaller ranges share one batched copy (torch's multi-tensor apply: one launch, about a third of a memcpy call's host
# time) over 4-byte words, which gives a block 256 KiB, so a sibling's 20 MB fixed state spreads over 80 blocks.
# bench/restore_copies.py on an H100 (the 0.8B at 16k): a sibling restore's copies in one batched copy take 7.5 us of
# host time and 22 us of device time, against 25 and 35 us as a memcpy of the fixed state and a batched copy of the rest
BATCHED_COPY_BYTES = 32 << 20

Write = tuple[torch.Tensor, torch.Tensor]      # destination, source: a byte range as words


def write(dst: torch.Tensor, src: torch.Tensor) -> Write:
    """A copy of the byte range ``src`` into ``dst``, as 4-byte words where both are aligned (else as bytes)."""
    if dst.numel() % 4 == 0 and dst.data_ptr() % 4 == 0 and src.data_ptr() % 4 == 0:
        return dst.view(torch.int32), src.view(torch.int32)
    return dst, src


class RestoreGraphs:
    """Captures restores' batched copies on a side stream of their own, into one memory pool (copies allocate
    nothing); ``thread_local``: a capture does not stop another thread's work (a tier's background write)."""

    def __init__(self, device: torch.device):
        self.stream, self.pool = torch.cuda.Stream(device), torch.cuda.graph_pool_handle()

    def capture(self, issue) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            issue()
            graph.capture_end()
        return graph


class RestoreCopies:
    """The writes of one restore, grouped once for issue: ranges of BATCHED_COPY_BYTES or more each alone, the rest
    in one batched copy per word type. A capsule's fixed block keeps those of its restores of whole segments, by the
    rows they start at (its rows, and its forks', are the same blocks for as long as it lives, and these views keep
    their memory alive for the graph, which holds only addresses)."""

    __slots__ = ("alone", "batches", "issued", "graph")

    def __init__(self, writes: list[Write]):
        self.issued, self.graph = 0, None
        self.alone: list[Write] = []
        batches: dict[torch.dtype, tuple[list, list]] = {}
        for dst, src in writes:
            if dst.nbytes >= BATCHED_COPY_BYTES:
                self.alone.append((dst, src))
            else:
                dsts, srcs = batches.setdefault(dst.dtype, ([], []))
                dsts.append(dst)
                srcs.append(src)
        self.batches = tuple(batches.values())

    def issue(self, graphs: RestoreGraphs | None = None) -> None:
        """Write them; ``graphs`` (CUDA): from the second issue on, batched copies alone go from a graph."""
        if self.graph is None and graphs is not None and self.issued and self.batches and not self.alone:
            self.graph = graphs.capture(self._copy)
        self.issued += 1
        if self.graph is None:
            self._copy()
        else:
            self.graph.replay()

    def _copy(self) -> None:
        for dst, src in self.alone:
            dst.copy_(src, non_blocking=True)
        for dsts, srcs in self.batches:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)


class LiveRows:
    """Per KV buffer: the blocks whose rows the live arena holds, as (block id, lo, hi), equal up to ``valid``; and the
    id of the stored fixed block the live fixed-size state equals (None: none known)."""

    def __init__(self, names):
        self._names = tuple(names)
        self.clear()

    def clear(self) -> None:
        self._rows: dict[str, tuple[tuple[int, int, int], ...]] = {n: () for n in self._names}
        self._valid = dict.fromkeys(self._names, 0)
        self.fixed_id: int | None = None

    def set(self, name: str, segments: tuple[Segment, ...], valid: int) -> None:
        self._rows[name] = tuple((b.id, lo, hi) for b, lo, hi in segments)
        self._valid[name] = valid

    def truncate(self, position: int) -> None:
        """Rows from ``position`` on are no longer known (rollback; new tokens are written there next), and the fixed
        state is being changed. Every operation that writes the live state calls it (or :meth:`clear`)."""
        self.fixed_id = None
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


class LiveCopier:
    """Takes the live state as capsule rows (a snapshot) and writes capsule rows into it (a restore)."""

    def __init__(self, arena: Arena, layout: Layout, store: CapsuleStore):
        self.arena, self.layout, self.store = arena, layout, store
        self.rows = LiveRows(layout.row_bytes)     # which stored blocks the live KV rows and fixed state equal
        self.graphs = RestoreGraphs(arena.storage.device) if arena.storage.is_cuda else None
        # the fixed state's byte ranges as (live view, capsule offset, length), all of it and the metadata alone:
        # computed once, every restore writes one of them
        self._fixed_ranges = {names: tuple((arena.storage[offset:offset + length], capsule_offset, length)
                                           for offset, capsule_offset, length in arena.segments(0, names))
                              for names in (None, ("meta",))}

    def plan(self, position: int) -> Plan:
        """Per KV buffer: the stored segments the live rows share, and the row from which they must be copied."""
        plan = {}
        for name in self.layout.row_bytes:
            shared = self.rows.shareable(name, position, self.store.blocks)
            plan[name] = (shared, shared[-1][2] if shared else 0)
        return plan

    def plan_bytes(self, plan: Plan, position: int) -> int:
        """The bytes a capsule at ``position`` copies under ``plan`` (the fixed state and the unshared rows)."""
        return self.layout.fixed_bytes + sum((position - start) * self.layout.row_bytes[name]
                                             for name, (_, start) in plan.items())

    def take(self, plan: Plan, position: int) -> dict[str, tuple[Segment, ...]]:
        """The live state as segments: a copy of the fixed state, shared rows, and copies of the rows after them."""
        fixed = torch.empty(self.layout.fixed_bytes, dtype=torch.uint8, device=self.arena.storage.device)
        self.arena.read_live(0, fixed)
        rows = {FIXED: ((Block(0, fixed.numel(), fixed), 0, 1),)}
        for name, (shared, start) in plan.items():
            spec, fresh = self.arena.specs[name], ()
            if position > start:
                data = self.arena.storage[spec.offset + start * spec.row_bytes:
                                          spec.offset + position * spec.row_bytes].clone()
                fresh = ((Block(start, spec.row_bytes, data), start, position),)
            rows[name] = shared + fresh
        return rows

    def taken(self, rows: dict[str, tuple[Segment, ...]], position: int) -> None:
        """The live KV rows now equal these stored segments (the capsule they were taken into is stored); the views
        a restore of them writes with are made now."""
        for name in self.layout.row_bytes:
            self.rows.set(name, rows[name], position)
            for block, lo, hi in rows[name]:
                self._segment_write(name, block, lo, hi, keep=True)
        fixed = rows[FIXED][0][0]
        self.rows.fixed_id = fixed.id
        self._fixed_writes(fixed, None)

    def load(self, rows: dict[str, tuple[Segment, ...]], position: int, kv_only: bool = False) -> int:
        """Write a capsule's rows into the live arena: its fixed state unless the live one is that block already,
        and only the KV rows the arena does not already hold; returns the bytes written. ``kv_only``: only KV and
        the metadata."""
        fixed = rows[FIXED][0][0]
        names = ("kv",) if kv_only else tuple(self.layout.row_bytes)
        starts = [self.rows.common(name, rows[name]) for name in names]
        written = kv_only or fixed.id != self.rows.fixed_id
        fixed_names = ("meta",) if kv_only else None
        key = ("restore", written, kv_only, *starts)
        copies = fixed.writes.get(key)
        if copies is None:
            writes, whole = list(self._fixed_writes(fixed, fixed_names)) if written else [], True
            for name, start in zip(names, starts):
                for block, first, hi in rows[name]:
                    lo = max(first, start)
                    if lo < hi:
                        writes.append(self._segment_write(name, block, lo, hi, keep=lo == first))
                        whole &= lo == first
            copies = RestoreCopies(writes)
            if whole:
                fixed.writes[key] = copies
        copies.issue(self.graphs)
        copied = sum(length for _, _, length in self._fixed_ranges[fixed_names]) if written else 0
        for name, start in zip(names, starts):
            self.rows.set(name, rows[name], position)
            copied += max(0, position - start) * self.layout.row_bytes[name]
        self.rows.truncate(position)
        self.rows.fixed_id = None if kv_only else fixed.id
        return copied

    def _fixed_writes(self, fixed: Block, names: tuple[str, ...] | None) -> tuple[Write, ...]:
        """The writes of a capsule's fixed state (``names``: only those buffers), made once and kept on its block."""
        if names not in fixed.writes:
            fixed.writes[names] = tuple(write(live, fixed.data[offset:offset + length])
                                        for live, offset, length in self._fixed_ranges[names])
        return fixed.writes[names]

    def _segment_write(self, name: str, block: Block, lo: int, hi: int, keep: bool) -> Write:
        """The write of a block's rows [lo, hi) into the live KV buffer ``name``; ``keep`` it on the block for a
        whole segment (a sibling's rows, a full restore), not for a part after a rollback (it starts anywhere, and
        keeping it would grow the block)."""
        cached = block.writes.get((lo, hi))
        if cached is None:
            spec = self.arena.specs[name]
            row = spec.row_bytes
            cached = write(self.arena.storage[spec.offset + lo * row:spec.offset + hi * row],
                           block.data[(lo - block.start) * row:(hi - block.start) * row])
            if keep:
                block.writes[lo, hi] = cached
        return cached
