"""Capsule files (format 2): authenticated, size-checked before any allocation, streamed, written atomically.

Layout of ``<capsule_dir>/<capsule_id>.capsule``::

    prelude     magic "FLASHRT-CAPSULE\\0", uint32 version (2), uint64 header length      (little-endian)
    header      JSON: {"auth", "fingerprint", "info": {id, parent, label, position, nbytes, checksum, created}}
                plus, for a capsule taken during a constrained generation, "constraint": {grammar, tokens} (the
                matcher's state, outside the arena: constraint.py; the engine rebuilds the matcher from it)
    header tag  32 bytes: MAC(prelude + header)                   -> the header alone can be trusted cheaply
    payload     info.nbytes bytes: the capsule's bytes in capsule layout
    file tag    32 bytes: MAC(prelude + header + header tag + payload)

MAC is HMAC-SHA256 with the configured key (``auth`` "hmac-sha256"), else plain SHA-256 (``auth`` "sha256").
Every byte of the file is covered. Without a key the digest catches damage and edits, but anyone who can write
the file can recompute it: only a key makes a forged file (e.g. another model's bytes under this engine's
fingerprint) detectable. A reader uses its own key setting, never the header's ``auth``: with a key it refuses
unsigned files, without one it refuses signed files (it cannot check them).

Reading opens plain files only, never through a symbolic link and never waiting on a FIFO. It checks, in order
and before allocating anything: the prelude, the header tag, the header's fields, their types and ranges (position,
nbytes, created: the MAX_* limits of :mod:`.capsule`), the file size against the header, then the caller's
``expect(info, fingerprint)`` (the engine: its fingerprint, the byte count its arena has at that position, the id,
the budget; a constraint that does not rebuild). Only then is one tensor of the payload's size allocated and filled chunk by chunk while hashing; the
file tag and the capsule's device checksum are checked before the capsule is returned. Version 1 files (whose
label, parent and created were outside a linear checksum) are refused with that reason.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import json
import math
import os
import re
import stat
import struct
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import torch

from .capsule import (MAX_CREATED_S, MAX_NBYTES, MAX_POSITION, Capsule, CapsuleInfo, label_nbytes,
                      validate_capsule_id)
from ..checksum import checksum
from ..constraint import ConstraintState
from ..errors import ErrorCode, FlashRTError

FILE_SUFFIX = ".capsule"
MIN_KEY_BYTES = 16
MAX_HEADER_BYTES = 8 << 20           # ids, a label, a fingerprint, a grammar and the tokens it accepted
CHUNK_BYTES = 16 << 20               # payload bytes read, hashed and copied per step (bounds the extra memory)
_MAGIC = b"FLASHRT-CAPSULE\0"
_VERSION = 2
_PRELUDE = struct.Struct("<16sIQ")   # magic, version, header length
_TAG_BYTES = 32
_HEADER_DOMAIN = b"flashrt-capsule-header\0"
_FILE_DOMAIN = b"flashrt-capsule-file\0"
INFO_FIELDS = ("id", "parent", "label", "position", "nbytes", "checksum", "created")
_HEADER_FIELDS = {"auth", "fingerprint", "info"}          # and "constraint" when the capsule has one
_HEX = re.compile(r"[0-9a-f]+")


# ---- names and keys ---------------------------------------------------------------------------------------

def capsule_path(capsule_dir: str | Path, capsule_id: str) -> Path:
    """The one naming rule: ``<capsule_dir>/<capsule_id>.capsule`` (the id is validated, so never a path)."""
    return Path(capsule_dir) / f"{validate_capsule_id(capsule_id)}{FILE_SUFFIX}"


def capsule_file_ids(capsule_dir: str | Path) -> list[str]:
    """Ids of the capsule files in a directory, sorted: every entry named ``<valid id>.capsule`` (the one naming
    rule, :func:`capsule_path`), whatever it is (reading one that is not a plain file refuses it, :func:`_open`).
    A temporary file (``write_capsule_file``) ends in ``.tmp``, so it is never such a name."""
    ids = []
    for name in os.listdir(capsule_dir):
        if name.endswith(FILE_SUFFIX):
            try:
                ids.append(validate_capsule_id(name[:-len(FILE_SUFFIX)]))
            except FlashRTError:
                continue
    return sorted(ids)


def prepare_capsule_dir(capsule_dir: str) -> Path:
    """The configured capsule directory ('~' expanded), created if missing; INVALID_ARGUMENT if it cannot be used."""
    path = Path(capsule_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"capsule_dir {capsule_dir!r} cannot be created: "
                                                       f"{err.strerror or err}") from None
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"capsule_dir {capsule_dir!r} is not readable and writable")
    return path


def load_key(key_file: str) -> bytes:
    """The HMAC key: the bytes of the file ('~' expanded) as they are (e.g. ``head -c 32 /dev/urandom > key``), at
    least MIN_KEY_BYTES; INVALID_ARGUMENT if the file cannot be read or is too short."""
    try:
        key = Path(key_file).expanduser().read_bytes()
    except OSError as err:
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"capsule_key_file {key_file!r} cannot be read: "
                                                       f"{err.strerror or err}") from None
    if len(key) < MIN_KEY_BYTES:
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"capsule_key_file {key_file!r} holds {len(key)} bytes; "
                                                       f"a key needs at least {MIN_KEY_BYTES}")
    return key


# ---- writing ------------------------------------------------------------------------------------------------

def _mac(key: bytes | None, domain: bytes):
    mac = hmac.new(key, digestmod=hashlib.sha256) if key is not None else hashlib.sha256()
    mac.update(domain)
    return mac


def _auth(key: bytes | None) -> str:
    return "hmac-sha256" if key is not None else "sha256"


def _payload_chunks(data: torch.Tensor) -> Iterator[memoryview]:
    """The payload in CHUNK_BYTES pieces as host memory (a device tensor is staged through one host buffer)."""
    if data.device.type == "cpu":
        view = memoryview(data.numpy())
        for start in range(0, len(view), CHUNK_BYTES):
            yield view[start:start + CHUNK_BYTES]
        return
    staging = torch.empty(min(CHUNK_BYTES, data.numel()), dtype=torch.uint8)
    view = memoryview(staging.numpy())
    for start in range(0, data.numel(), CHUNK_BYTES):
        piece = data[start:start + CHUNK_BYTES]
        staging[:piece.numel()].copy_(piece)
        yield view[:piece.numel()]


def _replace(tmp: str, path: Path) -> bool:
    os.replace(tmp, path)
    return True


def write_capsule_file(capsule: Capsule, path: str | Path, key: bytes | None = None,
                       publish: Callable[[str, Path], bool] = _replace) -> None:
    """Write ``capsule`` (its full bytes) atomically: a '.'-named temporary file in the same folder, fsync, then
    rename over ``path`` and fsync the folder. A crash at any point leaves ``path`` as it was (absent or the old
    file). A capsule without a stored checksum gets one computed here. ``publish(tmp, path)`` does the rename; if
    it returns False (the caller withdrew the file) the temporary file is removed and ``path`` is left alone."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"cannot write {path}: folder {path.parent} does not exist")
    info = capsule.info
    if not info.checksum:
        info = dataclasses.replace(info, checksum=checksum(capsule.data))
    if capsule.data.dtype != torch.uint8 or capsule.data.numel() != info.nbytes:
        raise FlashRTError(ErrorCode.INTERNAL, f"capsule {info.id!r}: {capsule.data.numel()} bytes, info says "
                                               f"{info.nbytes}")
    fields = {"auth": _auth(key), "fingerprint": capsule.fingerprint,
              "info": {name: getattr(info, name) for name in INFO_FIELDS}}
    if info.constraint is not None:
        fields["constraint"] = {"grammar": info.constraint.grammar, "tokens": list(info.constraint.tokens)}
    header = json.dumps(fields, sort_keys=True).encode()
    prelude = _PRELUDE.pack(_MAGIC, _VERSION, len(header))
    header_mac, file_mac = _mac(key, _HEADER_DOMAIN), _mac(key, _FILE_DOMAIN)
    header_mac.update(prelude + header)
    header_tag = header_mac.digest()
    file_mac.update(prelude + header + header_tag)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:                 # an unwritable or vanished folder: refused, not a crash
        raise FlashRTError(ErrorCode.FILE_ERROR, f"cannot write {path}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(prelude + header + header_tag)
            for chunk in _payload_chunks(capsule.data):
                file_mac.update(chunk)
                f.write(chunk)
            f.write(file_mac.digest())
            f.flush()
            os.fsync(f.fileno())
        if not publish(tmp, path):
            Path(tmp).unlink(missing_ok=True)
            return
        _fsync_dir(path.parent)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise FlashRTError(ErrorCode.FILE_ERROR, f"cannot write {path}: {err.strerror or err}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_capsule_file(path: Path) -> None:
    """Delete a capsule file for good: unlinked and the folder synced, so it does not come back after a crash."""
    try:
        path.unlink()
    except FileNotFoundError:
        return
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- reading ------------------------------------------------------------------------------------------------

def _corrupt(path: Path, why: str) -> FlashRTError:
    return FlashRTError(ErrorCode.CHECKSUM_MISMATCH, f"{path.name}: refused capsule file ({why})")


def _open(path: Path):
    """Open a capsule file for reading: a plain file only, never through a link, and never waiting (O_NOFOLLOW,
    O_NONBLOCK: a FIFO or device of that name is refused, not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FlashRTError(ErrorCode.UNKNOWN_CAPSULE, f"no capsule file {path.name} in {path.parent}") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise FlashRTError(ErrorCode.FILE_ERROR, f"{path.name} is a symbolic link: capsule files must be plain "
                                                     f"files in {path.parent}") from None
        raise FlashRTError(ErrorCode.FILE_ERROR, f"cannot read {path}: {err.strerror or err}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FlashRTError(ErrorCode.FILE_ERROR, f"{path.name} is not a plain file (a directory, FIFO, socket or "
                                                 f"device): capsule files must be plain files in {path.parent}")
    return os.fdopen(fd, "rb")


def _read_exact(f, count: int, path: Path, what: str) -> bytes:
    data = f.read(count)
    if len(data) != count:
        raise _corrupt(path, f"file ends inside its {what}")
    return data


def _peek_auth(header: bytes) -> str:
    """The header's claimed ``auth``, for the refusal message only (the header failed its tag: untrusted)."""
    try:
        return str(json.loads(header).get("auth", ""))
    except (ValueError, AttributeError, RecursionError):
        return ""


def _parse_header(header: bytes, path: Path, key: bytes | None) -> tuple[CapsuleInfo, str]:
    def bad(why: str) -> FlashRTError:
        return _corrupt(path, f"header: {why}")

    try:
        fields = json.loads(header)
    except (ValueError, RecursionError) as err:
        raise bad(f"not JSON ({type(err).__name__})") from None
    if not isinstance(fields, dict) or set(fields) - {"constraint"} != _HEADER_FIELDS:
        raise bad("expected exactly the fields auth, fingerprint, info (and constraint)")
    info, fingerprint = fields["info"], fields["fingerprint"]
    if fields["auth"] != _auth(key):
        raise bad(f"auth {fields['auth']!r}, expected {_auth(key)!r}")
    if not isinstance(fingerprint, str) or not _HEX.fullmatch(fingerprint):
        raise bad("fingerprint is not a hex string")
    if not isinstance(info, dict) or set(info) != set(INFO_FIELDS):
        raise bad(f"info needs exactly the fields {', '.join(INFO_FIELDS)}")
    for name, limit in (("position", MAX_POSITION), ("nbytes", MAX_NBYTES)):
        if type(info[name]) is not int or not 0 <= info[name] <= limit:
            raise bad(f"{name} must be an integer in [0, {limit}]")
    if not all(isinstance(info[name], str) for name in ("id", "parent", "label", "checksum")):
        raise bad("id, parent, label and checksum must be strings")
    if not _HEX.fullmatch(info["checksum"]):
        raise bad("checksum is not a hex string")
    created = info["created"]
    if type(created) not in (int, float) or not (math.isfinite(created) and 0 <= created <= MAX_CREATED_S):
        raise bad(f"created must be a unix time in [0, {MAX_CREATED_S}] s")
    validate_capsule_id(info["id"])
    if info["parent"]:
        validate_capsule_id(info["parent"])
    label_nbytes(info["label"])
    return CapsuleInfo(tier="disk", constraint=_parse_constraint(fields.get("constraint"), info["position"], bad),
                       **info), fingerprint


def _parse_constraint(fields, position: int, bad) -> ConstraintState | None:
    """The header's matcher state: a grammar text and at most ``position`` token ids (whether the grammar
    accepts them is the engine's check)."""
    if fields is None:
        return None
    if not isinstance(fields, dict) or set(fields) != {"grammar", "tokens"} or not isinstance(fields["grammar"], str):
        raise bad("constraint needs exactly a grammar string and a tokens list")
    tokens = fields["tokens"]
    if not isinstance(tokens, list) or len(tokens) > position or \
            not all(type(t) is int and t >= 0 for t in tokens):
        raise bad(f"constraint tokens must be at most position ({position}) non-negative integers")
    return ConstraintState(fields["grammar"], tuple(tokens))


def _verified_header(f, path: Path, key: bytes | None):
    """Read and authenticate the prelude and header of an open file; returns (info, fingerprint, the file MAC
    fed with everything before the payload). Checks the file size against the header; reads nothing else."""
    prelude = _read_exact(f, _PRELUDE.size, path, "prelude")
    magic, version, header_len = _PRELUDE.unpack(prelude)
    if magic != _MAGIC:
        raise _corrupt(path, "not a flashrt capsule file")
    if version == 1:
        raise _corrupt(path, "format version 1 is unauthenticated (label, parent and created were outside a linear "
                             "checksum): re-export the capsule from an engine of this version")
    if version != _VERSION:
        raise _corrupt(path, f"unknown format version {version}")
    if header_len > MAX_HEADER_BYTES:
        raise _corrupt(path, f"header of {header_len} bytes, more than {MAX_HEADER_BYTES}")
    header = _read_exact(f, header_len, path, "header")
    tag = _read_exact(f, _TAG_BYTES, path, "header tag")
    header_mac = _mac(key, _HEADER_DOMAIN)
    header_mac.update(prelude + header)
    if not hmac.compare_digest(header_mac.digest(), tag):
        claimed = _peek_auth(header)
        if key is not None and claimed == "sha256":
            why = "the file is not signed, and this engine requires files signed with its capsule key"
        elif key is None and claimed == "hmac-sha256":
            why = "the file is signed with a key and this engine has none configured (capsule_key_file)"
        elif key is not None:
            why = "its header does not authenticate with this engine's capsule key (signed with another key, or edited)"
        else:
            why = "its header does not match its digest (edited or damaged)"
        raise _corrupt(path, why)
    info, fingerprint = _parse_header(header, path, key)
    expected = _PRELUDE.size + header_len + _TAG_BYTES + info.nbytes + _TAG_BYTES
    size = os.fstat(f.fileno()).st_size
    if size != expected:
        raise _corrupt(path, f"{size} bytes, its header makes it {expected} (truncated or extended)")
    file_mac = _mac(key, _FILE_DOMAIN)
    file_mac.update(prelude + header + tag)
    return info, fingerprint, file_mac


def read_capsule_header(path: str | Path, key: bytes | None = None) -> tuple[CapsuleInfo, str]:
    """The authenticated header of a capsule file, without reading its payload: (info with tier "disk",
    fingerprint). Refuses as :func:`read_capsule_file` does up to the payload."""
    path = Path(path)
    with _open(path) as f:
        info, fingerprint, _ = _verified_header(f, path, key)
    return info, fingerprint


def _fill(f, data: torch.Tensor, mac, path: Path) -> None:
    """Read the payload into ``data`` chunk by chunk, feeding ``mac``; a device tensor through one host buffer."""
    on_host = data.device.type == "cpu"
    target = data if on_host else torch.empty(min(CHUNK_BYTES, data.numel()), dtype=torch.uint8)
    view = memoryview(target.numpy())
    for start in range(0, data.numel(), CHUNK_BYTES):
        count = min(CHUNK_BYTES, data.numel() - start)
        window = view[start:start + count] if on_host else view[:count]
        done = 0
        while done < count:
            got = f.readinto(window[done:])
            if not got:
                raise _corrupt(path, "file ends inside its payload")
            done += got
        mac.update(window)
        if not on_host:
            data[start:start + count].copy_(target[:count])


def read_capsule_file(path: str | Path, device: torch.device | str, *,
                      expect: Callable[[CapsuleInfo, str], None], key: bytes | None = None) -> Capsule:
    """Read, authenticate and check a capsule file into one tensor on ``device``.

    ``expect(info, fingerprint)`` runs once the header is authenticated and the file size matches it, before
    anything is allocated; it raises FlashRTError to refuse (an engine checks its fingerprint, the byte count of
    ``info.position``, the id and its budget there). Any damage is CHECKSUM_MISMATCH with what was wrong."""
    path = Path(path)
    with _open(path) as f:
        info, fingerprint, mac = _verified_header(f, path, key)
        expect(info, fingerprint)
        data = torch.empty(info.nbytes, dtype=torch.uint8, device=device)
        _fill(f, data, mac, path)
        if not hmac.compare_digest(mac.digest(), _read_exact(f, _TAG_BYTES, path, "file tag")):
            raise _corrupt(path, "its payload does not match its digest")
    if checksum(data) != info.checksum:
        raise _corrupt(path, "its bytes do not match its device checksum")
    return Capsule(dataclasses.replace(info, tier="device" if data.is_cuda else "host"), fingerprint, data)
