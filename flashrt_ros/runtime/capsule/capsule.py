"""Capsules (immutable copies of the live state) and the budgeted store that holds them (files: capsule_file.py)."""
from __future__ import annotations

import dataclasses
import re

import torch

from ..errors import ErrorCode, FlashRTError

MAX_ID_CHARS = 64
MAX_LABEL_BYTES = 256      # UTF-8 bytes; a label is held with its capsule and counts in the budget
INTERRUPTED_PREFIX = "interrupted-"   # a preempted stream is kept as interrupted-<request id>
RESERVED_ID_PREFIXES = (INTERRUPTED_PREFIX,)   # ids the node creates itself: clients may not take them
_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,%d}" % MAX_ID_CHARS)
# Explicit ids of the generated form move the numbering on (a bag replay names them); beyond 9 digits they do not,
# so a generated id stays short (at most 1 + 10 characters) whatever a client chose.
_AUTO_ID = re.compile(r"c(\d{4,9})")


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
    own_bytes: int = 0       # held by this capsule alone (capsule_store.DeltaStore fills these in)
    shared_bytes: int = 0    # held in blocks other capsules hold too (counted once in the budget)
    pinned: bool = False     # never evicted off the device


@dataclasses.dataclass(frozen=True)
class Capsule:
    info: CapsuleInfo
    fingerprint: str
    data: torch.Tensor  # uint8, the arena's live bytes in manifest order


class CapsuleStore:
    """Capsules by id, in creation order, with their lineage and the automatic numbering. What they hold and the
    byte budget are the subclass's (:class:`flashrt_ros.runtime.capsule_store.DeltaStore`). Failed calls change
    nothing."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._capsules: dict[str, Capsule] = {}
        # lineage: stored id -> nearest stored ancestor ("" = none); a drop re-points its children
        self._parents: dict[str, str] = {}
        self._counter = 0

    def __contains__(self, capsule_id: str) -> bool:
        return capsule_id in self._capsules

    def get(self, capsule_id: str) -> Capsule:
        validate_capsule_id(capsule_id)
        try:
            return self._capsules[capsule_id]
        except KeyError:
            raise FlashRTError(ErrorCode.UNKNOWN_CAPSULE, f"no capsule {capsule_id!r}") from None

    def new_id(self, requested: str | None, label: str = "") -> str:
        """Validate a requested id (or pick the next free ``cNNNN``) and the label before any bytes are copied.

        Nothing is reserved: a later refusal (e.g. the budget) leaves the numbering as it was.
        """
        label_nbytes(label)
        if requested:
            validate_capsule_id(requested)
            if requested in self._capsules:
                raise FlashRTError(ErrorCode.DUPLICATE_CAPSULE_ID, f"capsule {requested!r} already exists")
            return requested
        number = self._counter + 1
        while f"c{number:04d}" in self._capsules:
            number += 1
        return f"c{number:04d}"

    def add(self, capsule: Capsule, lineage_parent: str) -> None:
        """Store a capsule; ``lineage_parent`` is a stored capsule it descends from, or ""."""
        self._capsules[capsule.info.id] = capsule
        self._parents[capsule.info.id] = lineage_parent if lineage_parent in self._capsules else ""
        numbered = _AUTO_ID.fullmatch(capsule.info.id)
        if numbered:   # ids given explicitly (e.g. by a bag replay) move the numbering on, as when picked here
            self._counter = max(self._counter, int(numbered.group(1)))

    def drop(self, capsule_id: str) -> str:
        """Remove a capsule; returns its nearest stored ancestor, which its children now descend from."""
        self.get(capsule_id)
        del self._capsules[capsule_id]
        parent = self._parents.pop(capsule_id)
        for child, ancestor in self._parents.items():
            if ancestor == capsule_id:
                self._parents[child] = parent
        return parent

    def ancestors(self, capsule_id: str) -> list[str]:
        """capsule_id, then its stored ancestors, nearest first."""
        chain = []
        while capsule_id in self._capsules:
            chain.append(capsule_id)
            capsule_id = self._parents[capsule_id]
        return chain

