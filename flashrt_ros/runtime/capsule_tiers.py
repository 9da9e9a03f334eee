"""Capsule tiers below the device: pinned host memory (discrete GPUs) and the capsule directory on disk.

A capsule leaves the device whole: its full bytes go to one pinned host tensor or to ``<capsule_dir>/<id>.capsule``
(written by :mod:`capsule_file`: atomic, so a visible file is always complete), and its device blocks are released
(blocks other capsules share stay). Coming back (a fetch) it gets fresh device blocks. A disk spill asked for
without waiting is written by a background thread from a host copy; the capsule stays restorable on the device
until the file is complete, and :meth:`Tiers.finish` (run by the engine at its capsule calls) moves it to disk.

On the CPU and on integrated GPUs (Jetson: host and device are one DRAM, pinned-host registration is unsupported)
there is no host tier: the next tier after the device is disk.
"""
from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from . import capsule_file
from .capsule_store import DEVICE, DISK, HOST, DeltaStore, StoredCapsule, is_pinned, rows_of_full
from .capsules import Capsule
from .errors import ErrorCode, FlashRTError

POLICIES = ("refuse", "lru")
_log = logging.getLogger("flashrt.runtime")


class Tiers:
    def __init__(self, store: DeltaStore, device: torch.device, capsule_dir: Path | None, key: bytes | None,
                 host_tier: bool, host_budget_bytes: int):
        self.store, self.device, self.capsule_dir, self.key = store, device, capsule_dir, key
        self.host_budget_bytes = host_budget_bytes if host_tier else 0
        self.names = (DEVICE,) + ((HOST,) if self.host_budget_bytes else ()) + ((DISK,) if capsule_dir else ())
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capsule-spill")
        self._pending: dict[str, tuple[Future, StoredCapsule]] = {}

    # ---- where a capsule can go ---------------------------------------------------------------------------
    def path(self, capsule_id: str) -> Path:
        return capsule_file.capsule_path(self.capsule_dir, capsule_id)

    def below(self, stored: StoredCapsule) -> str | None:
        """The tier an evicted capsule goes to: host while it has room, else disk; None if neither."""
        if stored.tier == DEVICE and HOST in self.names and \
                self.store.host_bytes + stored.info.nbytes <= self.host_budget_bytes:
            return HOST
        return DISK if DISK in self.names and stored.tier != DISK else None

    def check_target(self, stored: StoredCapsule, tier: str) -> None:
        """Refuse (changing nothing) a move of ``stored`` to ``tier``."""
        what = f"capsule {stored.info.id!r}"
        if tier not in (HOST, DISK):
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"spill tier must be 'host' or 'disk', got {tier!r}")
        if is_pinned(stored):
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"{what} is pinned: it never leaves the device")
        if tier not in self.names:
            why = ("the capsule_dir parameter is empty" if tier == DISK
                   else "no pinned host tier here (CPU, integrated memory, or a host budget of 0)")
            raise FlashRTError(ErrorCode.NO_CAPSULE_DIR if tier == DISK else ErrorCode.INVALID_ARGUMENT,
                               f"cannot spill {what} to {tier}: {why}")
        if stored.tier == tier or (stored.tier == DISK):
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"{what} is on the {stored.tier} tier already")
        if tier == HOST and (stored.tier != DEVICE or
                             self.store.host_bytes + stored.info.nbytes > self.host_budget_bytes):
            raise FlashRTError(ErrorCode.BUDGET_EXCEEDED, f"{what} ({stored.info.nbytes} B) does not fit the host "
                                                          f"tier: {self.store.host_bytes} of "
                                                          f"{self.host_budget_bytes} B in use")
        if tier == DISK and self.path(stored.info.id).exists() and not self._same_file(stored):
            raise FlashRTError(ErrorCode.DUPLICATE_CAPSULE_ID, f"{self.path(stored.info.id).name} in the capsule "
                                                               f"directory holds another capsule")

    def _same_file(self, stored: StoredCapsule) -> bool:
        """The file of this id already holds this capsule (an export of it): a spill need not write it."""
        try:
            info, fingerprint = capsule_file.read_capsule_header(self.path(stored.info.id), self.key)
        except FlashRTError:
            return False
        return (fingerprint, info.checksum, info.created, info.nbytes) == (
            stored.fingerprint, stored.info.checksum, stored.info.created, stored.info.nbytes) and bool(info.checksum)

    # ---- moves -------------------------------------------------------------------------------------------
    def _host_copy(self, stored: StoredCapsule, pinned: bool) -> torch.Tensor:
        out = torch.empty(stored.info.nbytes, dtype=torch.uint8, pin_memory=pinned and self.device.type == "cuda")
        self.store.materialise(stored.info.id, out)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out

    def spill(self, stored: StoredCapsule, tier: str, wait: bool = True) -> None:
        """Move a capsule to ``tier`` (checked by :meth:`check_target`)."""
        if tier == HOST:
            host = self._host_copy(stored, pinned=True)
            self.store.release(stored)
            stored.host, stored.tier = host, HOST
            return
        if stored.info.id in self._pending:
            self.wait(stored.info.id)
            return
        if self._same_file(stored):
            self._to_disk(stored, owns_file=False)
            return
        data = self._host_copy(stored, pinned=False)
        capsule = Capsule(stored.info, stored.fingerprint, data)
        future = self._writer.submit(capsule_file.write_capsule_file, capsule, self.path(stored.info.id), self.key)
        self._pending[stored.info.id] = (future, stored)
        if wait:
            self.wait(stored.info.id)

    def _to_disk(self, stored: StoredCapsule, owns_file: bool) -> None:
        self.store.release(stored)
        stored.host, stored.tier, stored.owns_file = None, DISK, owns_file

    def finish(self) -> None:
        """Move every capsule whose background file write has completed to the disk tier."""
        for capsule_id in [i for i, (f, _) in self._pending.items() if f.done()]:
            self._complete(capsule_id)

    def wait(self, capsule_id: str) -> None:
        if capsule_id in self._pending:
            self._pending[capsule_id][0].exception()       # blocks until the write ended
            self._complete(capsule_id)

    def _complete(self, capsule_id: str) -> None:
        future, stored = self._pending.pop(capsule_id)
        if future.exception() is not None:
            _log.warning("spill of capsule %r to disk failed (it stays where it was): %s", capsule_id,
                         future.exception())
            return
        if capsule_id in self.store and self.store.get(capsule_id) is stored:
            self._to_disk(stored, owns_file=True)
        else:                                  # dropped while its file was written
            self.path(capsule_id).unlink(missing_ok=True)

    def read(self, stored: StoredCapsule, device: torch.device | str) -> torch.Tensor:
        """The full bytes of a disk-tier capsule, read and authenticated from its file."""
        def expect(info, fingerprint):
            if (info.id, info.nbytes, fingerprint) != (stored.info.id, stored.info.nbytes, stored.fingerprint):
                raise FlashRTError(ErrorCode.CHECKSUM_MISMATCH, f"{self.path(stored.info.id).name} no longer holds "
                                                                f"capsule {stored.info.id!r}")
        return capsule_file.read_capsule_file(self.path(stored.info.id), device, expect=expect, key=self.key).data

    def fetch_bytes(self, stored: StoredCapsule) -> torch.Tensor:
        """A host or disk tier capsule's full bytes in host memory (checked), before any room is made for it."""
        return stored.host if stored.tier == HOST else self.read(stored, "cpu")

    def attach(self, stored: StoredCapsule, data: torch.Tensor) -> None:
        """Put a fetched capsule back on the device (room already made)."""
        self.store.attach(stored, rows_of_full(self.store.layout, data, stored.info.position, self.device))
        # the device tier by its memory kind, as a snapshot reports it
        stored.info = dataclasses.replace(stored.info, tier="device" if self.device.type == "cuda" else "host")
        if stored.owns_file:
            self.path(stored.info.id).unlink(missing_ok=True)
            stored.owns_file = False

    def forget(self, stored: StoredCapsule) -> None:
        """A dropped capsule: finish its pending write, delete the file a spill wrote for it."""
        self.wait(stored.info.id)
        if stored.owns_file:
            self.path(stored.info.id).unlink(missing_ok=True)

    # ---- configure -----------------------------------------------------------------------------------------
    def index(self, fingerprint: str, nbytes_at) -> list[str]:
        """List ``<capsule_dir>/*.capsule`` as disk-tier capsules (headers only); returns why files were refused."""
        refused = []
        for capsule_id in capsule_file.capsule_file_ids(self.capsule_dir) if self.capsule_dir else ():
            try:
                info, file_fingerprint = capsule_file.read_capsule_header(self.path(capsule_id), self.key)
            except FlashRTError as err:
                refused.append(f"{capsule_id}.capsule: {err.message}")
                continue
            if file_fingerprint != fingerprint:
                refused.append(f"{capsule_id}.capsule: taken from another model, config or plan (fingerprint "
                               f"{file_fingerprint[:12]}..., this engine {fingerprint[:12]}...)")
            elif info.id != capsule_id or info.nbytes != nbytes_at(info.position):
                refused.append(f"{capsule_id}.capsule: its header does not match its name or its size")
            else:
                try:
                    self.store.new_id(capsule_id, info.label)
                    stored = StoredCapsule(dataclasses.replace(info, tier=DISK), file_fingerprint, {}, tier=DISK)
                    self.store.add(stored, lineage_parent="")      # only its label counts in the device budget
                except FlashRTError as err:
                    refused.append(f"{capsule_id}.capsule: {err.message}")
        for why in refused:
            _log.warning("capsule directory: refused %s", why)
        return refused

    def close(self) -> None:
        self._writer.shutdown(wait=True)
