"""Capsules (immutable copies of the live state) and the budgeted store that holds them, plus the file format."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import tempfile
from pathlib import Path

import torch

from .checksum import checksum
from .errors import ErrorCode, FlashRTError

MAX_ID_CHARS = 64
MAX_LABEL_BYTES = 256      # UTF-8 bytes; a label is held with its capsule and counts in the budget
INTERRUPTED_PREFIX = "interrupted-"   # a preempted stream is kept as interrupted-<request id>
RESERVED_ID_PREFIXES = (INTERRUPTED_PREFIX,)   # ids the node creates itself: clients may not take them
_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,%d}" % MAX_ID_CHARS)
# Explicit ids of the generated form move the numbering on (a bag replay names them); beyond 9 digits they do not,
# so a generated id stays short (at most 1 + 10 characters) whatever a client chose.
_AUTO_ID = re.compile(r"c(\d{4,9})")
_FILE_MAGIC = b"FLASHRT-CAPSULE\0"
_FILE_VERSION = 1
_HEADER = struct.Struct("<16sIQ")  # magic, version, header length


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
    nbytes: int
    tier: str          # device | host
    checksum: str
    created: float     # unix time


@dataclasses.dataclass(frozen=True)
class Capsule:
    info: CapsuleInfo
    fingerprint: str
    data: torch.Tensor  # uint8, the arena's live bytes in manifest order


class CapsuleStore:
    """Capsules by id, in creation order, within a byte budget. Failed calls change nothing."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._capsules: dict[str, Capsule] = {}
        # lineage: stored id -> nearest stored ancestor ("" = none); a drop re-points its children
        self._parents: dict[str, str] = {}
        self._counter = 0

    @property
    def used_bytes(self) -> int:
        """Payload and label bytes of every stored capsule."""
        return sum(c.info.nbytes + label_nbytes(c.info.label) for c in self._capsules.values())

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

    def check_room(self, nbytes: int, label: str = "") -> None:
        """Refuse unless a capsule of ``nbytes`` payload bytes with this label fits in the budget."""
        nbytes += label_nbytes(label)
        if self.used_bytes + nbytes > self.budget_bytes:
            raise FlashRTError(
                ErrorCode.BUDGET_EXCEEDED,
                f"capsule of {nbytes} B does not fit: {self.used_bytes} of {self.budget_bytes} B in use")

    def add(self, capsule: Capsule, lineage_parent: str) -> None:
        """Store a capsule; ``lineage_parent`` is a stored capsule it descends from, or ""."""
        self.check_room(capsule.info.nbytes, capsule.info.label)
        self._capsules[capsule.info.id] = capsule
        self._parents[capsule.info.id] = lineage_parent if lineage_parent in self._capsules else ""
        numbered = _AUTO_ID.fullmatch(capsule.info.id)
        if numbered:   # ids given explicitly (e.g. by a bag replay) move the numbering on, as when picked here
            self._counter = max(self._counter, int(numbered.group(1)))

    def drop(self, capsule_id: str) -> tuple[int, str]:
        """Remove a capsule; returns its bytes and its nearest stored ancestor, which its children now descend from."""
        capsule = self.get(capsule_id)
        del self._capsules[capsule_id]
        parent = self._parents.pop(capsule_id)
        for child, ancestor in self._parents.items():
            if ancestor == capsule_id:
                self._parents[child] = parent
        return capsule.info.nbytes, parent

    def infos(self) -> list[CapsuleInfo]:
        return [c.info for c in self._capsules.values()]

    def ancestors(self, capsule_id: str) -> list[str]:
        """capsule_id, then its stored ancestors, nearest first."""
        chain = []
        while capsule_id in self._capsules:
            chain.append(capsule_id)
            capsule_id = self._parents[capsule_id]
        return chain


def write_capsule_file(capsule: Capsule, path: Path) -> None:
    """Atomic: written to a temporary file in the same folder, then renamed over ``path``."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"cannot write {path}: folder {path.parent} does not exist")
    info = capsule.info if capsule.info.checksum else dataclasses.replace(capsule.info, checksum=checksum(capsule.data))
    header = json.dumps({"info": dataclasses.asdict(info), "fingerprint": capsule.fingerprint}).encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_HEADER.pack(_FILE_MAGIC, _FILE_VERSION, len(header)))
            f.write(header)
            f.write(capsule.data.cpu().numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_capsule_file(path: Path, device: torch.device) -> Capsule:
    """Parse and verify a capsule file; any damage is reported as CHECKSUM_MISMATCH with what was wrong."""
    def corrupt(why: str) -> FlashRTError:
        return FlashRTError(ErrorCode.CHECKSUM_MISMATCH, f"{path}: corrupted capsule file ({why})")

    path = Path(path)
    if not path.is_file():
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"capsule file {path} does not exist")
    blob = path.read_bytes()
    if len(blob) < _HEADER.size:
        raise corrupt("shorter than its header")
    magic, version, header_len = _HEADER.unpack_from(blob)
    if magic != _FILE_MAGIC or version != _FILE_VERSION:
        raise corrupt("not a flashrt capsule file, or an unknown version")
    try:
        header = json.loads(blob[_HEADER.size:_HEADER.size + header_len])
        info = CapsuleInfo(**header["info"])
        fingerprint = header["fingerprint"]
        types = {"id": str, "parent": str, "label": str, "position": int, "nbytes": int, "tier": str,
                 "checksum": str, "created": (int, float)}
        wrong = [name for name, kind in types.items() if not isinstance(getattr(info, name), kind)]
        if wrong or not isinstance(fingerprint, str):
            raise TypeError(f"fields of the wrong type: {wrong or ['fingerprint']}")
    except (ValueError, KeyError, TypeError) as err:
        raise corrupt(f"unreadable header: {err}") from None
    payload = blob[_HEADER.size + header_len:]
    if len(payload) != info.nbytes:
        raise corrupt(f"{len(payload)} payload bytes, header says {info.nbytes}")
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    if checksum(data) != info.checksum:
        raise corrupt("checksum does not match its bytes")
    return Capsule(dataclasses.replace(info, tier="device" if data.is_cuda else "host"), fingerprint, data)
