"""The engine's capsules: the store, the tiers below the device, and capsule files, behind one object.

:class:`CapsuleManager` holds every capsule call that does not read or write the live arena (the engine keeps those:
snapshot, restore, fork, rollback). Every call validates first and refuses with :class:`FlashRTError` before it
changes anything; each settles the background work of the tiers first (spills that ended, prefetches to attach).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import torch

from ..checksum import checksum
from ..errors import ErrorCode, FlashRTError
from . import file as capsule_file
from .capsule import DEVICE, DISK, CapsuleInfo, Layout, StoredCapsule, row_parts, rows_of_full
from .store import CapsuleStore
from .tiers import Tiers

_log = logging.getLogger("flashrt.runtime")


class CapsuleManager:
    def __init__(self, store: CapsuleStore, tiers: Tiers, check_fingerprint: Callable[[str, str], None],
                 max_context: int, nbytes_at: Callable[[int], int], on_settle: Callable[[], None],
                 check_constraint: Callable[[CapsuleInfo], object]):
        """``check_fingerprint(what, fingerprint)``: the engine's refusal of a capsule bound to another engine (it
        names the reason); ``nbytes_at(position)``: the capsule bytes of the engine's arena at ``position``;
        ``on_settle``: called after every settle, so the engine can let go of what it kept of blocks that left the
        device; ``check_constraint(info)``: the engine's refusal of a capsule whose grammar state (``info.constraint``)
        does not rebuild."""
        self.store, self.tiers, self._check_fingerprint = store, tiers, check_fingerprint
        self._check_constraint = check_constraint
        self.max_context, self._nbytes_at, self._on_settle = max_context, nbytes_at, on_settle

    @property
    def layout(self) -> Layout:
        return self.store.layout

    @property
    def capsule_dir(self) -> Path | None:
        return self.tiers.capsule_dir

    # ---- tiers -------------------------------------------------------------------------------------------
    def settle(self, prefetched: bool = True) -> None:
        """Finish the background spills that are done, attach the prefetches that are (unless not ``prefetched``:
        inside :meth:`make_room`, whose room is another capsule's)."""
        self.tiers.finish()
        for stored, data in self.tiers.fetched() if prefetched else ():
            try:
                self.on_device(stored, data)
            except FlashRTError as err:
                _log.warning("prefetched capsule %r stays on disk: %s", stored.info.id, err.message)
        self._on_settle()

    def make_room(self, need: int, label: str, protect: set[int] = frozenset(),
                  keep_ids: tuple[str, ...] = ()) -> None:
        """Make ``need`` device bytes and a capsule labelled ``label`` fit, spilling as the policy allows."""
        for victim in self.tiers.victims(need, label, protect, keep_ids):
            self.tiers.spill(victim, self.tiers.below(victim), wait=False)     # never waits for a file write
        self.settle(prefetched=False)

    def spill(self, capsule_id: str, tier: str = "", wait: bool = True) -> CapsuleInfo:
        joins_its_write = tier in ("", DISK) and capsule_id in self.tiers.pending
        self.settle()
        stored = self.store.get(capsule_id)
        tier = tier or (self.tiers.below(stored) or DISK)
        if not (joins_its_write and stored.tier == DISK):
            self.tiers.check_target(stored, tier)
        self.tiers.spill(stored, tier, wait)
        self.settle()
        return self.store.info(capsule_id)

    def fetch(self, capsule_id: str, wait: bool = True) -> CapsuleInfo:
        self.settle()
        stored = self.store.get(capsule_id)
        if not wait and stored.tier == DISK:
            self.tiers.victims(self.layout.nbytes(stored.info.position), "", keep_ids=(capsule_id,))
            self.tiers.prefetch(stored)
        else:
            self.on_device(stored)
        return self.store.info(capsule_id)

    def on_device(self, stored: StoredCapsule, data: torch.Tensor | None = None) -> None:
        """Bring a spilled capsule back onto the device (its bytes ``data`` if already read)."""
        if stored.tier != DEVICE:
            if data is None:
                data = self.tiers.fetch_bytes(stored)        # read and checked before any room is made
            self.make_room(self.layout.nbytes(stored.info.position), "", keep_ids=(stored.info.id,))
            self.tiers.attach(stored, data)

    def pin(self, capsule_id: str, pinned: bool = True) -> CapsuleInfo:
        self.settle()
        stored = self.store.get(capsule_id)
        if pinned:
            self.on_device(stored)
        stored.pinned = pinned
        return self.store.info(capsule_id)

    def drop(self, capsule_id: str) -> tuple[int, str]:
        """Free a capsule; returns the bytes freed and its nearest stored ancestor."""
        self.settle()
        self.tiers.forget(self.store.get(capsule_id))
        freed, parent = self.store.drop(capsule_id)
        self.settle()
        return freed, parent

    def infos(self) -> list[CapsuleInfo]:
        self.settle()
        return self.store.infos()

    def close(self) -> None:
        self.tiers.close()

    # ---- what may become live --------------------------------------------------------------------------------
    def restorable(self, capsule_id: str, verify_checksum: bool, fetch: bool = True) -> StoredCapsule:
        """A capsule that may become live, on the device (fetched if it was spilled, unless not ``fetch``)."""
        self.settle()
        capsule = self.store.get(capsule_id)
        self._check_fingerprint(f"capsule {capsule_id!r}", capsule.fingerprint)
        self.check_size(capsule.info, f"capsule {capsule_id!r}")
        if verify_checksum:
            if not capsule.info.checksum:
                raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"capsule {capsule_id!r} has no stored checksum")
            if self.capsule_checksum(capsule) != capsule.info.checksum:
                raise FlashRTError(ErrorCode.CHECKSUM_MISMATCH, f"capsule {capsule_id!r} is corrupted: its bytes "
                                                                f"no longer match its checksum")
        if fetch:
            self.on_device(capsule)
        return capsule

    def check_size(self, info: CapsuleInfo, what: str) -> None:
        """A header whose position does not match the payload would leave stale KV rows live: refuse it."""
        if info.position > self.max_context or info.nbytes != self._nbytes_at(info.position):
            raise FlashRTError(ErrorCode.CHECKSUM_MISMATCH, f"{what}: corrupted (its size does not match its "
                                                            f"position {info.position})")

    def capsule_checksum(self, stored: StoredCapsule) -> str:
        """In place for a device-tier capsule (its blocks), else over its bytes from the tier it is on."""
        return checksum(row_parts(stored.rows) if stored.tier == DEVICE else self.capsule_bytes(stored.info.id))

    def capsule_bytes(self, capsule_id: str) -> torch.Tensor:
        return self.tiers.full_bytes(self.store.get(capsule_id), self.tiers.device)

    # ---- files -------------------------------------------------------------------------------------------
    def capsule_file(self, capsule_id: str) -> Path:
        if self.capsule_dir is None:
            raise FlashRTError(ErrorCode.NO_CAPSULE_DIR, "capsule files are disabled: the capsule_dir parameter is "
                                                         "empty")
        return capsule_file.capsule_path(self.capsule_dir, capsule_id)

    def export_capsule(self, capsule_id: str) -> CapsuleInfo:
        path = self.capsule_file(capsule_id)
        info = self.store.info(capsule_id)
        self.tiers.wait(capsule_id)                    # a pending spill of it ends first: its file is the export
        stored = self.store.get(capsule_id)
        if stored.tier == DISK:
            stored.owns_file = False
            return self.store.info(capsule_id)
        if os.path.lexists(path):             # any entry of that name, a link or a FIFO too
            raise FlashRTError(ErrorCode.DUPLICATE_CAPSULE_ID, f"{path.name} already exists in the capsule "
                                                               f"directory (remove it to export {capsule_id!r} again)")
        self.tiers.ready(stored)
        capsule_file.write_capsule_file(self.store.full_capsule(capsule_id), path, key=self.tiers.key)
        return info

    def _check_import(self, capsule_id: str, info: CapsuleInfo, fingerprint: str) -> None:
        """What a capsule file must be to enter the store, checked before its payload is read."""
        if info.id != capsule_id:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"{capsule_id}.capsule holds capsule {info.id!r} "
                                                           f"(a renamed file): name it {info.id}.capsule")
        self._check_fingerprint(f"capsule file {capsule_id!r}", fingerprint)
        self.check_size(info, f"capsule file {capsule_id!r}")
        self._check_constraint(info)
        self.store.new_id(capsule_id, info.label)
        self.tiers.victims(info.nbytes, info.label)    # refuses unless it fits (after eviction, under lru)

    def import_capsule(self, capsule_id: str) -> CapsuleInfo:
        self.tiers.wait(capsule_id)                    # a dropped capsule's pending write of this id ends first
        if capsule_id in self.store and self.store.get(capsule_id).tier == DISK:
            return self.fetch(capsule_id)
        capsule = capsule_file.read_capsule_file(self.capsule_file(capsule_id), self.tiers.device, key=self.tiers.key,
                                                 expect=lambda info, fp: self._check_import(capsule_id, info, fp))
        self.make_room(capsule.info.nbytes, capsule.info.label)
        rows = rows_of_full(self.layout, capsule.data, capsule.info.position)
        self.store.add_rows(capsule.info, capsule.fingerprint, rows, lineage_parent="")
        return self.store.info(capsule_id)
