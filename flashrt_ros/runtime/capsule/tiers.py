"""Capsule tiers below the device: pinned host memory (discrete GPUs) and the capsule directory on disk.

A capsule leaves the device whole: its full bytes go to one host tensor (on CUDA pinned, copied on a side stream
whose event readers wait on, so the engine stream waits for nothing) and its device blocks are released at once
(blocks other capsules share stay). A host-tier spill ends there. A disk spill keeps that host copy as its
*staging* copy: the capsule is on the host tier (readable, restorable, counted in ``host_bytes``) while a background
thread writes ``<capsule_dir>/<id>.capsule`` (atomic, :mod:`capsule_file`), and :meth:`Tiers.finish` (run by the
engine at its capsule calls) moves it to disk once the file is complete. A write that fails leaves it on the host
copy, with a logged warning. So an eviction makes device room without waiting for the disk.

Coming back (a fetch) a capsule gets fresh device blocks; a disk-tier capsule can be prefetched: a second thread
reads and authenticates its file, and the engine attaches it at its next capsule call (:meth:`Tiers.fetched`).

On the CPU and on integrated GPUs (Jetson: host and device are one DRAM, pinned-host registration is unsupported)
there is no host tier: the next tier after the device is disk, and a disk spill's staging copy is ordinary memory in
that same DRAM (the device bytes it replaces are freed, so the pool does not grow while the file is written).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from . import file as capsule_file
from .capsule import DEVICE, DISK, HOST, Capsule, StoredCapsule, is_pinned, label_nbytes, rows_of_full
from .store import CapsuleStore
from ..errors import ErrorCode, FlashRTError

POLICIES = ("refuse", "lru")   # a capsule that does not fit the device budget: refused, or room made (victims)
_log = logging.getLogger("flashrt.runtime")


@dataclasses.dataclass(eq=False)
class _Write:
    """A background write of a capsule's file. Its publication (the rename to the file's name) and a drop of the
    capsule are serialised, so a dropped capsule's file never outlives the drop (nor a crash right after it)."""
    stored: StoredCapsule
    staging: torch.Tensor          # the host copy the file is written from (the capsule's bytes until it is done)
    future: Future | None = None
    dropped: bool = False
    published: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def publish(self, tmp: str, path: Path) -> bool:
        """(The writer thread, once the file is complete.) Rename it into place unless the capsule was dropped."""
        with self.lock:
            if not self.dropped:
                os.replace(tmp, path)
                self.published = True
            return self.published

    def drop(self, path: Path) -> None:
        """The capsule was dropped: its file never appears, or goes now if it already has."""
        with self.lock:
            self.dropped = True
            if self.published:
                capsule_file.remove_capsule_file(path)


class Tiers:
    def __init__(self, store: CapsuleStore, device: torch.device, capsule_dir: Path | None, key: bytes | None,
                 host_tier: bool, host_budget_bytes: int, policy: str = "refuse"):
        self.store, self.device, self.capsule_dir, self.key = store, device, capsule_dir, key
        self.policy = policy
        self.host_budget_bytes = host_budget_bytes if host_tier else 0
        self.names = (DEVICE,) + ((HOST,) if self.host_budget_bytes else ()) + ((DISK,) if capsule_dir else ())
        self._pin = host_tier and device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capsule-spill")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capsule-fetch")
        self._writes: dict[str, _Write] = {}
        self._reads: dict[str, tuple[Future, StoredCapsule]] = {}
        self._copies: dict[str, torch.cuda.Event] = {}     # host copies still in flight on the side stream
        self._failed: dict[str, tuple[StoredCapsule, str]] = {}   # capsules left on their host copy by a failed write

    # ---- where a capsule can go ---------------------------------------------------------------------------
    def path(self, capsule_id: str) -> Path:
        return capsule_file.capsule_path(self.capsule_dir, capsule_id)

    def below(self, stored: StoredCapsule) -> str | None:
        """The tier an evicted capsule goes to: host while it has room, else disk; None if neither."""
        if stored.tier == DEVICE and HOST in self.names and \
                self.store.host_bytes + stored.info.nbytes <= self.host_budget_bytes:
            return HOST
        return DISK if DISK in self.names and stored.tier != DISK else None

    def victims(self, need: int, label: str, protect: set[int] = frozenset(),
                keep_ids: tuple[str, ...] = ()) -> list[StoredCapsule]:
        """The eviction policy. [] if ``need`` bytes and the label fit the device budget now; else, under the lru
        policy, the capsules to spill first (never pinned, never ``keep_ids``, never a holder of a block in
        ``protect``); else refuse."""
        try:
            self.store.check_room(need, label)
            return []
        except FlashRTError as err:
            if self.policy != "lru":
                raise
            refusal = err

        def keep(c: StoredCapsule) -> bool:
            return (is_pinned(c) or c.info.id in keep_ids
                    or any(b.id in protect for segments in c.rows.values() for b, _, _ in segments))
        victims = self.store.eviction(need + label_nbytes(label), keep)
        failure = self.disk_failure
        if victims is None or ((DISK not in self.names or failure) and sum(v.info.nbytes for v in victims)
                               > self.host_budget_bytes - self.store.host_bytes):
            why = f"; {failure}" if failure and victims is not None else ""
            raise FlashRTError(ErrorCode.BUDGET_EXCEEDED, f"{refusal.message}; spilling every unpinned capsule "
                                                          f"to the tiers below ({', '.join(self.names[1:]) or 'none'}) "
                                                          f"would not make room{why}")
        return victims

    @property
    def disk_failure(self) -> str:
        """Why the disk tier takes no evictions now ("" = it does): capsules whose file write failed are still on
        their host copy, outside every budget, until they are dropped, fetched or spilled again."""
        for capsule_id, (stored, _) in list(self._failed.items()):
            if capsule_id not in self.store or self.store.get(capsule_id) is not stored or stored.tier != HOST:
                del self._failed[capsule_id]
        if not self._failed:
            return ""
        stranded = [stored for stored, _ in self._failed.values()]
        last = next(reversed(self._failed.values()))[1]
        return (f"the disk tier failed: {len(stranded)} capsule(s), {sum(c.info.nbytes for c in stranded)} B, "
                f"are held in host memory after failed writes (last: {last}); drop or fetch them, or fix capsule_dir")

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
        if tier == DISK and stored.info.id not in self._writes and os.path.lexists(self.path(stored.info.id)) \
                and not self._same_file(stored):
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
    def _host_copy(self, stored: StoredCapsule) -> torch.Tensor:
        """The capsule's full bytes in a new host tensor. On CUDA the copy runs on the side stream (after the work
        queued so far) and the blocks are marked used by it, so releasing them at once is safe; readers wait on
        the event :meth:`ready` keeps."""
        out = torch.empty(stored.info.nbytes, dtype=torch.uint8, pin_memory=self._pin)
        if self._stream is None:
            return self.store.materialise(stored.info.id, out)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self.store.materialise(stored.info.id, out)
            for segments in stored.rows.values():
                for block, _, _ in segments:
                    block.data.record_stream(self._stream)
            self._copies[stored.info.id] = event = torch.cuda.Event()
            event.record(self._stream)
        return out

    def ready(self, stored: StoredCapsule) -> None:
        """Wait until the capsule's host copy (if one is in flight) is complete, before reading it."""
        event = self._copies.pop(stored.info.id, None)
        if event is not None:
            event.synchronize()

    def spill(self, stored: StoredCapsule, tier: str, wait: bool = True) -> None:
        """Move a capsule to ``tier`` (checked by :meth:`check_target`). A disk spill returns once its device
        blocks are released; unless ``wait`` its file is written in the background (see the module doc)."""
        write = self._writes.get(stored.info.id)
        if tier == DISK and not wait and write is not None and stored.host is write.staging:
            return                          # its file is being written: this spill joins that write
        self.wait(stored.info.id)           # an earlier write of this id ends first (it may finish this spill)
        if stored.tier == DISK:
            return
        if tier == HOST:
            host = self._host_copy(stored)
            self.store.release(stored)
            stored.host, stored.tier = host, HOST
            return
        if self._same_file(stored):
            self._to_disk(stored, owns_file=False)
            return
        if stored.host is None:
            self._bound_staging(stored.info.nbytes)
        staging = stored.host if stored.host is not None else self._host_copy(stored)
        self.store.release(stored)
        stored.host, stored.tier = staging, HOST
        write = self._writes[stored.info.id] = _Write(stored, staging)
        write.future = self._writer.submit(self._write, Capsule(stored.info, stored.fingerprint, staging),
                                           self.path(stored.info.id), self._copies.get(stored.info.id), write)
        error = self.wait(stored.info.id) if wait else None
        if error is not None:
            raise FlashRTError(ErrorCode.FILE_ERROR, f"spill of capsule {stored.info.id!r} to disk failed, it stays "
                                                     f"on the host tier: {error}")

    @property
    def staging_limit(self) -> int:
        """Host bytes that pending writes may hold: twice the device capsule budget."""
        return 2 * self.store.budget_bytes

    def _bound_staging(self, nbytes: int) -> None:
        """Pending writes hold their staging copies (also of capsules dropped or fetched back meanwhile): past
        :attr:`staging_limit`, wait for the oldest first, so a burst of evictions slows down instead of growing
        host memory without bound."""
        while self._writes and sum(w.staging.numel() for w in self._writes.values()) + nbytes > self.staging_limit:
            self.wait(next(iter(self._writes)))

    def _write(self, capsule: Capsule, path: Path, event: torch.cuda.Event | None, write: _Write) -> None:
        """(The writer thread.)"""
        if event is not None:
            event.synchronize()
        capsule_file.write_capsule_file(capsule, path, self.key, publish=write.publish)

    def _to_disk(self, stored: StoredCapsule, owns_file: bool) -> None:
        self.store.release(stored)
        self._copies.pop(stored.info.id, None)
        stored.host, stored.tier, stored.owns_file = None, DISK, owns_file

    def finish(self) -> None:
        """Settle every background write that has ended; forget host copies that are complete."""
        for capsule_id in [i for i, w in self._writes.items() if w.future.done()]:
            self._complete(capsule_id)
        for capsule_id in [i for i, e in self._copies.items() if e.query()]:
            del self._copies[capsule_id]

    def wait(self, capsule_id: str) -> BaseException | None:
        """Wait for the background write of this capsule, if one is pending, and settle it; returns its error."""
        if capsule_id not in self._writes:
            return None
        concurrent.futures.wait([self._writes[capsule_id].future])
        return self._complete(capsule_id)

    def drain(self) -> None:
        """Wait for every background write and read (a prefetch stays to be attached by :meth:`fetched`)."""
        for capsule_id in list(self._writes):
            self.wait(capsule_id)
        concurrent.futures.wait([future for future, _ in self._reads.values()])

    @property
    def pending(self) -> tuple[str, ...]:
        """The capsules whose file is being written."""
        return tuple(self._writes)

    def _complete(self, capsule_id: str) -> BaseException | None:
        write = self._writes.pop(capsule_id)
        if write.future.cancelled():
            return None
        stored, error = write.stored, write.future.exception()
        current = capsule_id in self.store and self.store.get(capsule_id) is stored and stored.host is write.staging
        if error is not None:
            if current:
                _log.warning("spill of capsule %r to disk failed; it stays on its host copy (%d B): %s",
                             capsule_id, write.staging.numel(), error)
                self._failed.pop(capsule_id, None)               # the newest failure last
                self._failed[capsule_id] = (stored, str(error))
            return error
        if current:
            self._to_disk(stored, owns_file=True)
        elif not write.dropped:                # fetched back while its file was written (a drop removed its own)
            capsule_file.remove_capsule_file(self.path(capsule_id))
        return None

    # ---- fetches -------------------------------------------------------------------------------------------
    def read(self, stored: StoredCapsule, device: torch.device | str) -> torch.Tensor:
        """The full bytes of a disk-tier capsule, read and authenticated from its file."""
        def expect(info, fingerprint):
            if (info.id, info.nbytes, fingerprint) != (stored.info.id, stored.info.nbytes, stored.fingerprint):
                raise FlashRTError(ErrorCode.CHECKSUM_MISMATCH, f"{self.path(stored.info.id).name} no longer holds "
                                                                f"capsule {stored.info.id!r}")
        return capsule_file.read_capsule_file(self.path(stored.info.id), device, expect=expect, key=self.key).data

    def full_bytes(self, stored: StoredCapsule, device: torch.device | str) -> torch.Tensor:
        """A copy of the capsule's full bytes, wherever it is (a disk-tier one read from its file)."""
        if stored.tier == DISK:
            return self.read(stored, device)
        self.ready(stored)
        return self.store.materialise(stored.info.id)

    def prefetch(self, stored: StoredCapsule) -> None:
        """Start reading a disk-tier capsule's file in the background (:meth:`fetched` hands it over)."""
        if stored.info.id not in self._reads:
            self._reads[stored.info.id] = (self._reader.submit(self.read, stored, "cpu"), stored)

    def fetched(self) -> list[tuple[StoredCapsule, torch.Tensor]]:
        """The prefetches that have ended, each still a disk-tier capsule of the store, with its bytes (a failed
        one is logged and forgotten: the capsule stays on disk)."""
        out = []
        for capsule_id in [i for i, (f, _) in self._reads.items() if f.done()]:
            future, stored = self._reads.pop(capsule_id)
            if future.exception() is not None:
                _log.warning("prefetch of capsule %r failed; it stays on disk: %s", capsule_id, future.exception())
            elif capsule_id in self.store and self.store.get(capsule_id) is stored and stored.tier == DISK:
                out.append((stored, future.result()))
        return out

    def fetch_bytes(self, stored: StoredCapsule) -> torch.Tensor:
        """A host or disk tier capsule's full bytes in host memory (checked), before any room is made for it; a
        pending prefetch of it is waited for."""
        if stored.info.id in self._reads:
            return self._reads.pop(stored.info.id)[0].result()
        if stored.tier == HOST:
            self.ready(stored)
            return stored.host
        return self.read(stored, "cpu")

    def attach(self, stored: StoredCapsule, data: torch.Tensor) -> None:
        """Put a fetched capsule back on the device (room already made)."""
        self.store.attach(stored, rows_of_full(self.store.layout, data, stored.info.position, self.device))
        # the device tier by its memory kind, as a snapshot reports it
        stored.info = dataclasses.replace(stored.info, tier="device" if self.device.type == "cuda" else "host")
        if stored.owns_file:
            capsule_file.remove_capsule_file(self.path(stored.info.id))
            stored.owns_file = False

    def forget(self, stored: StoredCapsule) -> None:
        """A dropped capsule: cancel its queued write (a running one never publishes its file, or removes it if it
        did) and its prefetch, delete the file a spill wrote for it. Durable when this returns."""
        write = self._writes.get(stored.info.id)
        if write is not None and write.stored is stored:
            if write.future.cancel():
                del self._writes[stored.info.id]
            else:
                write.drop(self.path(stored.info.id))
        read = self._reads.get(stored.info.id)
        if read is not None and read[1] is stored:
            read[0].cancel()
            del self._reads[stored.info.id]
        self._copies.pop(stored.info.id, None)
        if stored.owns_file:
            capsule_file.remove_capsule_file(self.path(stored.info.id))

    # ---- configure -----------------------------------------------------------------------------------------
    def index(self, check_fingerprint: Callable[[str, str], None], nbytes_at) -> list[str]:
        """List ``<capsule_dir>/*.capsule`` as disk-tier capsules (headers only); returns why files were refused.
        ``check_fingerprint(what, fingerprint)``: the engine's refusal of a capsule bound to another engine."""
        refused = []
        for capsule_id in capsule_file.capsule_file_ids(self.capsule_dir) if self.capsule_dir else ():
            try:
                info, file_fingerprint = capsule_file.read_capsule_header(self.path(capsule_id), self.key)
                check_fingerprint("the file", file_fingerprint)
            except FlashRTError as err:
                refused.append(f"{capsule_id}.capsule: {err.message}")
                continue
            if info.id != capsule_id or info.nbytes != nbytes_at(info.position):
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
        """Finish every pending write and read, then stop the threads (again: nothing more to do)."""
        self.drain()
        self.finish()
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
