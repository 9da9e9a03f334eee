"""The capsule store: capsules by id over shared blocks, their lineage, the numbering and the device byte budget.

Blocks are reference-counted: dropping a capsule frees only the blocks no other capsule holds, and the budget counts
every block once, so it is exactly the bytes held.
"""
from __future__ import annotations

import dataclasses
import itertools
import re

import torch

from ..errors import ErrorCode, FlashRTError
from .capsule import (DEVICE, Block, Capsule, CapsuleInfo, Layout, Segment, StoredCapsule, is_pinned, label_nbytes,
                      row_parts, validate_capsule_id)

# Explicit ids of the generated form move the numbering on (a bag replay names them); beyond 9 digits they do not,
# so a generated id stays short (at most 1 + 10 characters) whatever a client chose.
_AUTO_ID = re.compile(r"c(\d{4,9})")


class CapsuleStore:
    """Capsules by id (:class:`StoredCapsule`), in creation order, with their lineage and the automatic numbering;
    their bytes as shared blocks, counted once per block in the device budget. Failed calls change nothing."""

    def __init__(self, budget_bytes: int, layout: Layout, max_capsules: int):
        self.budget_bytes = budget_bytes
        self.layout = layout
        self.max_capsules = max_capsules
        self._capsules: dict[str, StoredCapsule] = {}
        # lineage: stored id -> nearest stored ancestor ("" = none); a drop re-points its children
        self._parents: dict[str, str] = {}
        self._counter = 0
        self._blocks: dict[int, Block] = {}     # every block some stored capsule holds, by id
        # used_bytes' two sums, kept as blocks and capsules come and go: read on every snapshot, fork and eviction
        # check, a sum over the store would cost each of them time in proportion to the capsules stored
        self._block_bytes = self._label_bytes = 0
        self._clock = itertools.count(1)

    def __contains__(self, capsule_id: str) -> bool:
        return capsule_id in self._capsules

    def get(self, capsule_id: str) -> StoredCapsule:
        try:
            return self._capsules[capsule_id]      # a stored id was validated on its way in
        except (KeyError, TypeError):
            validate_capsule_id(capsule_id)        # INVALID_CAPSULE_ID before UNKNOWN_CAPSULE
            raise FlashRTError(ErrorCode.UNKNOWN_CAPSULE, f"no capsule {capsule_id!r}") from None

    def new_id(self, requested: str | None, label: str = "") -> str:
        """Validate a requested id (or pick the next free ``cNNNN``) and the label before any bytes are copied.

        Nothing is reserved: a later refusal (e.g. the budget) leaves the numbering as it was. BUDGET_EXCEEDED when
        max_capsules are stored already.
        """
        label_nbytes(label)
        if len(self._capsules) >= self.max_capsules:
            raise FlashRTError(ErrorCode.BUDGET_EXCEEDED, f"{len(self._capsules)} capsules are stored already "
                                                          f"(max_capsules): drop one first")
        if requested:
            validate_capsule_id(requested)
            if requested in self._capsules:
                raise FlashRTError(ErrorCode.DUPLICATE_CAPSULE_ID, f"capsule {requested!r} already exists")
            return requested
        number = self._counter + 1
        while f"c{number:04d}" in self._capsules:
            number += 1
        return f"c{number:04d}"

    def ancestors(self, capsule_id: str) -> list[str]:
        """capsule_id, then its stored ancestors, nearest first."""
        chain = []
        while capsule_id in self._capsules:
            chain.append(capsule_id)
            capsule_id = self._parents[capsule_id]
        return chain

    @property
    def blocks(self) -> dict[int, Block]:
        return self._blocks

    @property
    def host_bytes(self) -> int:
        return sum(c.host.numel() for c in self._capsules.values() if c.host is not None)

    @property
    def used_bytes(self) -> int:
        """The device tier's bytes: every held block once, plus every capsule's label."""
        return self._block_bytes + self._label_bytes

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
        """Store a capsule within the budget (its new blocks and its label); ``lineage_parent`` is a stored capsule
        it descends from, or ""."""
        self.check_room(self.added_bytes(capsule), capsule.info.label)
        self._capsules[capsule.info.id] = capsule
        self._label_bytes += label_nbytes(capsule.info.label)
        self._parents[capsule.info.id] = lineage_parent if lineage_parent in self._capsules else ""
        numbered = _AUTO_ID.fullmatch(capsule.info.id)
        if numbered:   # ids given explicitly (e.g. by a bag replay) move the numbering on, as when picked here
            self._counter = max(self._counter, int(numbered.group(1)))

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
                if block.id not in self._blocks:
                    self._blocks[block.id] = block
                    self._block_bytes += block.nbytes

    def release(self, stored: StoredCapsule) -> None:
        """Let go of the capsule's segments; blocks nobody else holds are freed."""
        for segs in stored.rows.values():
            for block, _, _ in segs:
                block.refs -= 1
                if not block.refs:
                    del self._blocks[block.id]
                    self._block_bytes -= block.nbytes
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
        before = self.used_bytes + (stored.host.numel() if stored.host is not None else 0)   # its host copy, if any
        del self._capsules[capsule_id]
        self._label_bytes -= label_nbytes(stored.info.label)
        parent = self._parents.pop(capsule_id)
        for child, ancestor in self._parents.items():
            if ancestor == capsule_id:
                self._parents[child] = parent
        self.release(stored)
        stored.host = None
        return before - self.used_bytes, parent

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
        made_of, reported = (own, shared, is_pinned(stored), tier), stored.reported
        if reported is None or reported[0] is not stored.info or reported[1] != made_of:
            reported = stored.reported = (stored.info, made_of, dataclasses.replace(
                stored.info, own_bytes=own, shared_bytes=shared, pinned=made_of[2], tier=tier))
        return reported[2]

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
