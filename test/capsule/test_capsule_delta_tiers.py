"""Delta capsules, lineage-aware restore and the tiers below the device, case by case (the stateful test drives
them at random): what a restore copies, what a drop frees, what eviction moves, what a restart finds on disk."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError
from flashrt_ros.runtime.capsule import file as capsule_file
from flashrt_ros.runtime.capsule import live
from flashrt_ros.runtime.platform import PlatformReport

CONFIG = EngineConfig(model="tiny", max_context=256, prefill_chunk=16, history_depth=8)
ROOT = list(range(1, 101))                      # 100 tokens of shared context


def make(**overrides) -> Engine:
    return Engine(dataclasses.replace(CONFIG, **overrides))


def greedy(engine: Engine, n: int) -> list[int]:
    return list(engine.generate(n, stop_token_ids=[]))


def planner(engine: Engine, branches: int = 3, tokens: int = 10) -> dict[str, torch.Tensor]:
    """A root and sibling branches of it, as a planner makes them; returns each capsule's full bytes."""
    engine.ingest(ROOT)
    engine.snapshot("root")
    for i in range(branches):
        engine.restore("root")
        engine.ingest([200 + i] * 3)
        greedy(engine, tokens - 3)
        engine.snapshot(f"b{i}")
    return {c.id: engine.capsule_bytes(c.id).clone() for c in engine.capsules()}


def row_bytes(engine: Engine) -> int:
    return sum(engine.layout.row_bytes.values())


def assert_live_is(engine: Engine, full: torch.Tensor) -> None:
    assert torch.equal(engine.live_bytes(), full)


# ---- delta capsules and lineage-aware restore --------------------------------------------------------------

def test_branches_hold_only_their_divergence_and_count_shared_rows_once():
    engine = make()
    full = planner(engine)
    root = engine.capsule("root")
    fixed = engine.layout.fixed_bytes
    for i in range(3):
        branch = engine.capsule(f"b{i}")
        assert branch.shared_bytes == 100 * row_bytes(engine)          # the root's rows
        assert branch.own_bytes == fixed + 10 * row_bytes(engine)
        assert torch.equal(engine.capsule_bytes(f"b{i}"), full[f"b{i}"])
    assert root.shared_bytes == 100 * row_bytes(engine) and root.own_bytes == fixed
    assert engine.capsule_bytes_used == root.nbytes + 3 * (fixed + 10 * row_bytes(engine))


def test_sibling_restore_copies_the_fixed_state_and_the_divergence_only_and_is_byte_exact():
    engine = make()
    full = planner(engine)
    engine.restore("b0")
    engine.restore("b1")
    assert engine.last_restore_bytes == engine.layout.fixed_bytes + 10 * row_bytes(engine)
    assert_live_is(engine, full["b1"])
    after_sibling = greedy(engine, 6)
    engine.reset()                                   # nothing live: a full restore
    engine.restore("b1")
    assert engine.last_restore_bytes == engine.capsule("b1").nbytes
    assert greedy(engine, 6) == after_sibling


def test_a_sibling_restore_is_one_batched_copy_and_repeats_byte_exact(monkeypatch):
    """The host-bound path: a sibling restore writes its ranges (fixed state, divergent rows) in one batched copy,
    over views made when each capsule was stored (not on its first restore: no restore makes one); restores back
    and forth keep matching the capsules' bytes. (The tiny model's fixed state is under BATCHED_COPY_BYTES, so every
    range is batched here.)"""
    engine = make()
    assert engine.layout.fixed_bytes < live.BATCHED_COPY_BYTES
    full = planner(engine)
    calls, views = [], []
    batched, make_write = torch._foreach_copy_, live.write
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dsts, srcs, **kw: (calls.append(len(dsts)),
                                                                            batched(dsts, srcs, **kw)))
    monkeypatch.setattr(live, "write", lambda dst, src: (views.append(dst.numel()), make_write(dst, src))[1])
    for name in ("b0", "b1", "b2", "b1", "b0", "b2"):
        calls.clear()
        engine.restore(name)
        assert_live_is(engine, full[name])
        assert len(calls) == 1 and calls[0] >= 2, calls      # the fixed state's ranges and the branch's rows
    assert views == []
    engine.ingest([7] * 4)
    engine.snapshot("b3")             # a new capsule's views are made as it is stored: its fixed state, its own rows
    assert sum(views) == engine.layout.fixed_bytes + 4 * row_bytes(engine)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("limit", [1 << 40, 64], ids=["all-batched", "large-alone"])
def test_restore_copies_write_every_pair_whatever_its_size_alignment_or_dtype(limit, device, monkeypatch):
    """Ranges at or above BATCHED_COPY_BYTES go alone, the others in one batched copy per word type; odd lengths and
    offsets stay bytes, aligned ones become 4-byte words: every destination ends equal to its source, nothing else
    moves, each of three issues. On CUDA, copies all batched are replayed from a graph from the second issue on."""
    monkeypatch.setattr(live, "BATCHED_COPY_BYTES", limit)
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g).to(device)
    dst = torch.zeros(4096, dtype=torch.uint8, device=device)
    ranges = [(0, 64), (72, 3), (80, 2000), (2101, 17), (2200, 1600)]     # word-aligned or not, small and large
    copies = live.RestoreCopies([live.write(dst[o:o + n], src[o:o + n]) for o, n in ranges])
    assert sorted(d.nbytes for d, _ in copies.alone) == sorted(n for _, n in ranges if n >= limit)
    batched = [{d.dtype for d in dsts} for dsts, _ in copies.batches]
    assert all(len(dtypes) == 1 for dtypes in batched) and len(batched) == len(set().union(*batched))
    written = torch.zeros(4096, dtype=torch.bool, device=device)
    for offset, length in ranges:
        written[offset:offset + length] = True
    graphs = live.RestoreGraphs(torch.device(device)) if device == "cuda" else None
    for issue in range(3):
        dst.zero_()
        copies.issue(graphs)
        assert torch.equal(dst[written], src[written]) and not bool(dst[~written].any()), issue
        assert (copies.graph is not None) == (device == "cuda" and issue > 0 and not copies.alone), issue
    assert live.write(dst[8:24], src[8:24])[0].dtype == torch.int32
    assert live.write(dst[9:25], src[9:25])[0].dtype == torch.uint8


def test_restore_after_a_rollback_below_the_capsule_rewrites_the_overwritten_rows():
    engine = make()
    engine.ingest(ROOT)
    engine.ingest([7] * 20)
    engine.snapshot("a")
    block = engine.store.get("a").rows["kv"][0][0]
    assert list(block.writes) == [(0, 120)]          # its whole segment's views, made when it was stored
    want = engine.capsule_bytes("a").clone()
    engine.rollback(steps=1)                         # back to 100 tokens; rows 100..119 are overwritten next
    engine.ingest([9] * 20)
    engine.restore("a")
    assert engine.last_restore_bytes == engine.layout.fixed_bytes + 20 * row_bytes(engine)
    assert_live_is(engine, want)
    # the restore wrote a part of a's block (rows 100..119): its views are not kept on the block (a rollback can
    # leave the stream anywhere; a whole segment's views are kept, once)
    assert list(block.writes) == [(0, 120)]
    engine.reset()
    engine.restore("a")
    assert list(block.writes) == [(0, 120)]
    assert_live_is(engine, want)


def test_dropping_the_common_parent_keeps_the_shared_rows_of_its_children():
    engine = make()
    full = planner(engine)
    before = engine.capsule_bytes_used
    assert engine.drop("root") == engine.layout.fixed_bytes          # its rows are its children's too
    assert engine.capsule_bytes_used == before - engine.layout.fixed_bytes
    for i in range(3):
        assert torch.equal(engine.capsule_bytes(f"b{i}"), full[f"b{i}"])
        assert engine.capsule(f"b{i}").shared_bytes == 100 * row_bytes(engine)
    engine.restore("b2")
    engine.restore("b0")
    assert_live_is(engine, full["b0"])
    engine.drop("b1")
    engine.drop("b2")                                # b0 alone holds the old root rows now
    assert engine.capsule("b0").own_bytes == engine.capsule("b0").nbytes
    assert engine.capsule_bytes_used == engine.capsule("b0").nbytes


def test_kv_only_reset_and_reseed_restores_match_a_full_copy():
    engine = make()
    full = planner(engine)
    engine.restore("b0")
    arena = engine.arena.storage.clone()
    engine.restore("b1", kv_only=True)               # the full-copy ablation: meta and KV rows from b1, the rest kept
    kv, meta = engine.arena.specs["kv"], engine.arena.specs["meta"]
    position = engine.capsule("b1").position
    expected = arena.clone()
    for arena_off, capsule_off, length in engine.arena.segments(position, ("meta", "kv")):
        expected[arena_off:arena_off + length] = full["b1"][capsule_off:capsule_off + length]
    assert torch.equal(engine.arena.storage, expected)
    assert engine.last_restore_bytes == meta.nbytes + 10 * kv.row_bytes
    engine.reseed(5)
    engine.restore("b2")
    assert_live_is(engine, full["b2"])
    engine.reset()
    engine.restore("b0")
    assert engine.last_restore_bytes == engine.capsule("b0").nbytes
    assert_live_is(engine, full["b0"])


# ---- tiers and eviction ----------------------------------------------------------------------------------

def room_for(capsules: float) -> int:
    """A device budget of about this many 110-token capsules."""
    return int(capsules * make().arena.live_nbytes(110))


def lru_engine(tmp_path, **overrides) -> Engine:
    return make(capsule_dir=str(tmp_path), capsule_evict_policy="lru", **overrides)


def separate_capsules(engine: Engine, ids) -> dict[str, torch.Tensor]:
    """Capsules that share nothing (a reset between them)."""
    out = {}
    for n, capsule_id in enumerate(ids):
        engine.reset()
        engine.ingest([n + 1] * 110)
        engine.snapshot(capsule_id)
        out[capsule_id] = engine.capsule_bytes(capsule_id).clone()
    return out


def tiers(engine: Engine) -> dict[str, str]:
    """Where each capsule is once the background file writes have ended."""
    engine.tiers.drain()
    return {c.id: c.tier for c in engine.capsules()}


def test_refuse_policy_refuses_and_moves_nothing(tmp_path):
    engine = make(capsule_dir=str(tmp_path), capsule_budget_bytes=room_for(2.5))
    separate_capsules(engine, "ab")
    with pytest.raises(FlashRTError) as err:
        separate_capsules(engine, "c")
    assert err.value.code == ErrorCode.BUDGET_EXCEEDED
    assert tiers(engine) == {"a": "host", "b": "host"} and not list(tmp_path.iterdir())


def test_lru_evicts_the_least_recently_used_to_disk_and_restores_it_byte_exact(tmp_path):
    engine = lru_engine(tmp_path, capsule_budget_bytes=room_for(2.5))
    full = separate_capsules(engine, "ab")
    engine.restore("a")                               # b is now the least recently used
    full.update(separate_capsules(engine, "c"))
    assert tiers(engine) == {"a": "host", "b": "disk", "c": "host"}
    assert capsule_file.capsule_file_ids(tmp_path) == ["b"]
    assert torch.equal(engine.capsule_bytes("b"), full["b"])
    engine.restore("b")                               # fetched first, evicting the LRU one (a)
    assert tiers(engine) == {"a": "disk", "b": "host", "c": "host"}
    assert_live_is(engine, full["b"])
    assert capsule_file.capsule_file_ids(tmp_path) == ["a"]         # b's spill file went with its fetch
    for capsule_id, data in full.items():
        assert torch.equal(engine.capsule_bytes(capsule_id), data)
    assert engine.capsule_bytes_used <= engine.capsule_budget_bytes


def test_pinned_and_interrupted_capsules_never_leave_the_device(tmp_path):
    engine = lru_engine(tmp_path, capsule_budget_bytes=room_for(2.5))
    separate_capsules(engine, ["interrupted-7"])
    engine.reset()
    engine.ingest([5] * 110)
    assert engine.snapshot("root", pinned=True).pinned
    with pytest.raises(FlashRTError) as err:
        separate_capsules(engine, "c")                # only pinned capsules could make room
    assert err.value.code == ErrorCode.BUDGET_EXCEEDED and "would not make room" in err.value.message
    assert tiers(engine) == {"interrupted-7": "host", "root": "host"}
    for capsule_id in ("interrupted-7", "root"):
        with pytest.raises(FlashRTError) as err:
            engine.spill(capsule_id)
        assert err.value.code == ErrorCode.INVALID_ARGUMENT and "pinned" in err.value.message
    engine.pin("root", False)
    separate_capsules(engine, "c")
    assert tiers(engine) == {"interrupted-7": "host", "root": "disk", "c": "host"}
    assert engine.pin("root").tier == "host"         # pinning fetches it back (c goes down to make room)
    assert tiers(engine)["c"] == "disk"


def test_host_tier_comes_first_while_it_has_room_then_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(PlatformReport, "pinned_host_tier", property(lambda self: True))
    size = make().arena.live_nbytes(110)
    engine = lru_engine(tmp_path, capsule_budget_bytes=room_for(1.5), capsule_host_budget_bytes=size)
    full = separate_capsules(engine, "abc")
    engine.tiers.drain()
    assert engine.tiers.names == ("device", "host", "disk")
    assert [engine.store.get(i).tier for i in "abc"] == ["host", "disk", "device"]
    assert engine.stats()["capsule_host_bytes"] == size
    engine.restore("a")                              # from the host tier; c goes down (the host is full: disk)
    engine.tiers.drain()
    assert [engine.store.get(i).tier for i in "abc"] == ["device", "disk", "disk"]
    assert_live_is(engine, full["a"])


def test_a_drop_frees_exactly_its_own_bytes_on_its_tier_and_the_budget_follows(tmp_path, monkeypatch):
    """What a drop reports: a host-tier capsule its host copy, a disk-tier one nothing in memory, a device one its
    blocks; the device budget's used bytes (kept as blocks come and go) fall by exactly the device capsule's."""
    monkeypatch.setattr(PlatformReport, "pinned_host_tier", property(lambda self: True))
    size = make().arena.live_nbytes(110)
    engine = lru_engine(tmp_path, capsule_budget_bytes=room_for(1.5), capsule_host_budget_bytes=size)
    separate_capsules(engine, "abc")
    engine.tiers.drain()
    assert [engine.store.get(i).tier for i in "abc"] == ["host", "disk", "device"]
    used = engine.capsule_bytes_used
    assert engine.drop("a") == size and engine.stats()["capsule_host_bytes"] == 0
    assert engine.drop("b") == 0
    assert engine.capsule_bytes_used == used == size
    assert engine.drop("c") == size and engine.capsule_bytes_used == 0


def test_a_background_spill_frees_the_device_at_once_and_lands_on_disk(tmp_path):
    engine = make(capsule_dir=str(tmp_path))
    full = separate_capsules(engine, "a")
    engine.spill("a", wait=False)
    assert engine.capsule_bytes_used == 0 and engine.stats()["capsule_host_bytes"] == full["a"].numel()
    engine.tiers.wait("a")
    assert engine.capsule("a").tier == "disk" and engine.capsule_bytes_used == 0
    assert engine.stats()["capsule_host_bytes"] == 0
    assert torch.equal(engine.capsule_bytes("a"), full["a"])
    engine.drop("a")                                 # a spill's own file goes with its capsule
    assert not list(tmp_path.iterdir())


class Gate:
    """Patches a capsule_file function so that each call waits until the test opens the gate (or raises
    ``error``); records the calls. Nothing is timed: the test decides when the background thread may go on."""

    def __init__(self, monkeypatch, name, error=None):
        self.real, self.error = getattr(capsule_file, name), error
        self.open_, self.started, self.calls = threading.Event(), threading.Event(), 0
        monkeypatch.setattr(capsule_file, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.started.set()
        assert self.open_.wait(60), "the test never opened the gate"
        if self.error is not None:
            raise self.error
        return self.real(*args, **kwargs)

    def open(self):
        self.open_.set()


def test_a_burst_of_evictions_waits_for_the_oldest_write_once_staging_would_pass_its_limit(tmp_path, monkeypatch):
    """Staging copies of pending writes stay within twice the device budget: the eviction that would pass it waits
    for the oldest write first (the gate opens only then), and every capsule still reads back byte-exact."""
    engine = lru_engine(tmp_path, capsule_budget_bytes=room_for(1.5))
    gate = Gate(monkeypatch, "write_capsule_file")
    waits, real_wait = [], engine.tiers.wait

    def wait(capsule_id):
        if capsule_id in engine.tiers.pending:
            waits.append((capsule_id, engine.tiers.pending))
            gate.open()
        return real_wait(capsule_id)

    monkeypatch.setattr(engine.tiers, "wait", wait)
    full = separate_capsules(engine, "abcd")          # b, c, d evict a, b, c: three staged, within 2 x 1.5
    assert engine.tiers.pending == ("a", "b", "c") and waits == []
    assert engine.stats()["capsule_host_bytes"] <= engine.tiers.staging_limit
    full.update(separate_capsules(engine, "e"))      # a fourth staging copy would pass the limit
    assert waits and waits[0] == ("a", ("a", "b", "c"))
    assert "a" not in engine.tiers.pending and capsule_file.capsule_file_ids(tmp_path)[0] == "a"
    for capsule_id, data in full.items():
        assert torch.equal(engine.capsule_bytes(capsule_id), data)


def test_an_lru_eviction_returns_before_its_file_is_written_and_the_capsule_stays_readable(tmp_path, monkeypatch):
    engine = lru_engine(tmp_path, capsule_budget_bytes=room_for(1.5))
    gate = Gate(monkeypatch, "write_capsule_file")
    full = separate_capsules(engine, "ab")           # b's snapshot evicts a: its file write is blocked
    assert engine.tiers.pending == ("a",) and capsule_file.capsule_file_ids(tmp_path) == []
    assert engine.store.get("a").tier == "host"       # its staging copy, counted as host bytes
    assert engine.stats()["capsule_host_bytes"] == full["a"].numel()
    assert engine.capsule_bytes_used == engine.store.used_bytes <= engine.capsule_budget_bytes
    assert torch.equal(engine.capsule_bytes("a"), full["a"])
    engine.restore("a")                              # from the staging copy; b is evicted (queued behind a)
    assert_live_is(engine, full["a"])
    gate.open()
    assert tiers(engine) == {"a": "host", "b": "disk"}            # (the CPU's device tier reports "host")
    assert engine.store.get("a").tier == "device" and engine.stats()["capsule_host_bytes"] == 0
    assert capsule_file.capsule_file_ids(tmp_path) == ["b"]       # a's file went: a is on the device again
    for capsule_id, data in full.items():
        assert torch.equal(engine.capsule_bytes(capsule_id), data)


def test_a_failed_write_leaves_the_capsule_on_its_host_copy_restorable(tmp_path, monkeypatch, caplog):
    engine = make(capsule_dir=str(tmp_path))
    full = separate_capsules(engine, "a")
    gate = Gate(monkeypatch, "write_capsule_file", error=OSError(28, "No space left on device"))
    gate.open()
    with pytest.raises(FlashRTError) as err:
        engine.spill("a")
    assert err.value.code == ErrorCode.FILE_ERROR and "No space left" in err.value.message
    engine.spill("a", wait=False)                    # again, in the background: logged, not lost
    assert tiers(engine) == {"a": "host"} and "stays on its host copy" in caplog.text
    assert engine.store.get("a").tier == "host" and engine.stats()["capsule_host_bytes"] == full["a"].numel()
    assert engine.capsule_bytes_used == 0 and capsule_file.capsule_file_ids(tmp_path) == []
    engine.restore("a")
    assert_live_is(engine, full["a"])
    assert engine.store.get("a").tier == "device" and engine.stats()["capsule_host_bytes"] == 0
    monkeypatch.setattr(capsule_file, "write_capsule_file", gate.real)
    assert engine.spill("a").tier == "disk"          # the disk works again: a retry lands


def test_a_drop_during_a_pending_write_leaves_no_file(tmp_path, monkeypatch):
    engine = make(capsule_dir=str(tmp_path))
    separate_capsules(engine, "ab")
    gate = Gate(monkeypatch, "write_capsule_file")
    engine.spill("a", wait=False)
    assert gate.started.wait(60)                     # a's write runs (blocked), b's is queued behind it
    engine.spill("b", wait=False)
    assert engine.drop("b") > 0 and engine.drop("a") > 0     # b's write is cancelled, a's is running
    assert engine.capsules() == [] and engine.stats()["capsule_host_bytes"] == 0
    gate.open()
    engine.tiers.drain()
    engine.capsules()
    assert gate.calls == 1 and list(tmp_path.iterdir()) == []


def test_a_second_disk_spill_joins_the_pending_write_whether_or_not_it_has_ended(tmp_path, monkeypatch):
    """The same request gives the same answer: a spill of a capsule whose file is being written joins that write,
    also when the write ends between the caller's look (host tier) and the call; a capsule already settled on disk
    is refused."""
    engine = make(capsule_dir=str(tmp_path))
    full = separate_capsules(engine, "ab")
    gate = Gate(monkeypatch, "write_capsule_file")
    engine.spill("a", wait=False)
    assert engine.spill("a", wait=False).tier == "host" and engine.tiers.pending == ("a",)   # still blocked
    engine.spill("b", wait=False)
    gate.open()
    for capsule_id in "ab":                          # the writes end; nothing has settled them yet
        engine.tiers._writes[capsule_id].future.result(timeout=60)
    assert engine.capsule("a").tier == "host"
    assert engine.spill("a", wait=False).tier == "disk"      # (settles b's ended write too)
    assert gate.calls == 2 and capsule_file.capsule_file_ids(tmp_path) == ["a", "b"]
    for capsule_id in "ab":
        assert engine.capsule(capsule_id).tier == "disk"
        with pytest.raises(FlashRTError) as err:
            engine.spill(capsule_id)
        assert err.value.code == ErrorCode.INVALID_ARGUMENT and "disk tier already" in err.value.message
    for capsule_id, data in full.items():
        assert torch.equal(engine.capsule_bytes(capsule_id), data)


def test_a_prefetch_reads_in_the_background_and_a_restore_waits_for_it(tmp_path, monkeypatch):
    engine = make(capsule_dir=str(tmp_path))
    full = separate_capsules(engine, "ab")
    engine.spill("a")
    engine.spill("b")
    gate = Gate(monkeypatch, "read_capsule_file")
    assert engine.fetch("a", wait=False).tier == "disk"     # returns while the read is blocked
    assert engine.fetch("b", wait=False).tier == "disk"
    assert gate.started.wait(60) and engine.capsule_bytes_used == 0
    gate.open()
    engine.restore("b")                              # waits for its read (not a second one)
    assert_live_is(engine, full["b"])
    engine.tiers.drain()
    assert tiers(engine) == {"a": "host", "b": "host"}     # a attached at the next capsule call
    assert gate.calls == 2 and capsule_file.capsule_file_ids(tmp_path) == []
    for capsule_id, data in full.items():
        assert torch.equal(engine.capsule_bytes(capsule_id), data)


def test_a_prefetch_that_cannot_fit_is_refused_and_a_failed_one_leaves_the_capsule_on_disk(tmp_path, caplog):
    engine = make(capsule_dir=str(tmp_path), capsule_budget_bytes=room_for(1.5))
    separate_capsules(engine, "a")
    engine.spill("a")
    separate_capsules(engine, "b")
    with pytest.raises(FlashRTError) as err:
        engine.fetch("a", wait=False)                # the refuse policy: no room for it
    assert err.value.code == ErrorCode.BUDGET_EXCEEDED and engine.tiers._reads == {}
    engine.drop("b")
    path = engine.capsule_file("a")
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    path.write_bytes(bytes(data))
    engine.fetch("a", wait=False)
    assert tiers(engine) == {"a": "disk"} and "prefetch of capsule 'a' failed" in caplog.text
    with pytest.raises(FlashRTError) as err:
        engine.restore("a")
    assert err.value.code == ErrorCode.CHECKSUM_MISMATCH


def test_capsules_on_disk_survive_a_restart_and_other_fingerprints_are_refused_with_the_reason(tmp_path):
    engine = make(capsule_dir=str(tmp_path))
    full = separate_capsules(engine, "ab")
    engine.spill("a")
    engine.export_capsule("b")
    other = make(seed=1)
    other.ingest([3] * 5)
    other.snapshot("foreign")
    capsule_file.write_capsule_file(other.store.full_capsule("foreign"), tmp_path / "foreign.capsule")
    (tmp_path / "junk.capsule").write_bytes(b"not a capsule")
    restarted = make(capsule_dir=str(tmp_path))
    assert tiers(restarted) == {"a": "disk", "b": "disk"}
    refused = dict(line.split(": ", 1) for line in restarted.capsule_dir_refused)
    assert sorted(refused) == ["foreign.capsule", "junk.capsule"]
    assert "another model" in refused["foreign.capsule"]
    assert restarted.capsule_bytes_used == 0
    restarted.restore("b", verify_checksum=True)
    assert_live_is(restarted, full["b"])
    assert restarted.import_capsule("a").tier == "host"      # a listed file: importing it is a fetch
    assert torch.equal(restarted.capsule_bytes("a"), full["a"])
    restarted.drop("b")
    assert (tmp_path / "b.capsule").is_file()        # an indexed file is not the engine's to delete


CRASH = textwrap.dedent("""
    import os, signal, sys, time
    from flashrt_ros.runtime import Engine, EngineConfig
    from flashrt_ros.runtime.capsule import file as capsule_file
    engine = Engine(EngineConfig(model="tiny", max_context=256, prefill_chunk=16, capsule_dir=sys.argv[1]))
    engine.ingest([4] * 200)
    engine.snapshot("a")
    capsule_file.CHUNK_BYTES = 4096
    real = capsule_file._payload_chunks
    def slow(data):
        for n, chunk in enumerate(real(data)):
            if n == int(sys.argv[2]):
                os.kill(os.getpid(), signal.SIGKILL)     # dies in the middle of the spill's file
            yield chunk
    capsule_file._payload_chunks = slow
    engine.spill("a")
""")


@pytest.mark.parametrize("chunk", [0, 3, 10_000])
def test_a_spill_killed_mid_write_leaves_no_visible_file(tmp_path, chunk):
    done = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path), str(chunk)], capture_output=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=120)
    visible = capsule_file.capsule_file_ids(tmp_path)
    if chunk < 10_000:
        assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
        assert visible == []                                      # at most a '.'-named temporary file
    else:                                                         # never killed: the file is complete
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        assert visible == ["a"]
    restarted = make(capsule_dir=str(tmp_path))
    assert restarted.capsule_dir_refused == []
    assert sorted(tiers(restarted)) == visible


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_discrete_gpu_capsules_spill_to_pinned_host_memory_and_come_back_byte_exact(tmp_path):
    engine = lru_engine(tmp_path, device="cuda", capsule_budget_bytes=room_for(2.5))
    if engine.platform.integrated:
        assert engine.tiers.names == ("device", "disk")             # Jetson: no pinned-host tier
        return
    assert engine.tiers.names == ("device", "host", "disk")
    full = planner(engine, branches=3)
    engine.restore("b1")
    assert engine.last_restore_bytes == engine.layout.fixed_bytes + 10 * row_bytes(engine)
    assert engine.spill("b0").tier == "host" and engine.store.get("b0").host.is_pinned()
    assert engine.spill("b2", "disk").tier == "disk"
    for capsule_id in ("b0", "b2"):
        assert torch.equal(engine.capsule_bytes(capsule_id).cpu(), full[capsule_id].cpu())
        engine.restore(capsule_id)
        assert torch.equal(engine.live_bytes().cpu(), full[capsule_id].cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_an_eviction_stages_on_a_side_stream_and_reads_back_while_its_write_is_pending(tmp_path,
                                                                                                monkeypatch):
    engine = lru_engine(tmp_path, device="cuda", capsule_budget_bytes=room_for(1.5), capsule_host_budget_bytes=0)
    gate = Gate(monkeypatch, "write_capsule_file")
    full = separate_capsules(engine, "ab")           # b's snapshot evicts a: staged, its write blocked
    assert engine.tiers.pending == ("a",)
    assert engine.store.get("a").host.is_pinned() == (not engine.platform.integrated)   # Jetson: plain DRAM
    assert torch.equal(engine.capsule_bytes("a").cpu(), full["a"].cpu())
    engine.restore("a")
    assert torch.equal(engine.live_bytes().cpu(), full["a"].cpu())
    gate.open()
    assert tiers(engine)["b"] == "disk" and engine.stats()["capsule_host_bytes"] == 0
    assert torch.equal(engine.capsule_bytes("b").cpu(), full["b"].cpu())
    engine.restore("b")
    assert torch.equal(engine.live_bytes().cpu(), full["b"].cpu())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_a_capsules_restores_keep_their_writes_and_stay_byte_exact_and_token_identical(device):
    """A capsule keeps the writes of its restores of whole segments: in a planner's loop (siblings, the root, a
    branch after tokens and a rollback, whose rows are written from inside a segment and so are not kept) every
    restore leaves its capsule's bytes live and the tokens after it are the first restore's; on CUDA too, where
    the batched copy moves 4-byte words."""
    engine = make(device=device)
    full = planner(engine, branches=3)
    after: dict[str, list[int]] = {}
    for _ in range(3):
        for capsule_id in ("b0", "root", "b2", "b1", "b2"):
            engine.restore(capsule_id)
            assert torch.equal(engine.live_bytes().cpu(), full[capsule_id].cpu()), capsule_id
            tokens = greedy(engine, 4)
            assert after.setdefault(capsule_id, tokens) == tokens, capsule_id
            engine.rollback(steps=2)
    kept = {capsule_id: [copies for copies in engine.store.get(capsule_id).rows["fixed"][0][0].writes.values()
                         if isinstance(copies, live.RestoreCopies)]
            for capsule_id in ("root", "b0", "b1", "b2")}
    assert all(kept.values()), kept
    # on CUDA the restores issued again (every capsule's was) replay a graph, which wrote the bytes checked above
    graphed = [copies.graph is not None for kept_copies in kept.values() for copies in kept_copies
               if copies.issued > 1 and not copies.alone]
    assert set(graphed) == {device == "cuda"}, graphed


def test_bench_capsules_cli_reports_sharing_and_every_tier(tmp_path, capsys):
    from flashrt_ros.tools import cli
    out = tmp_path / "bench.json"
    assert cli.main(["bench-capsules", "--context", "128", "--branches", "4", "--branch-tokens", "16",
                     "--repeats", "2", "--capsule-dir", str(tmp_path / "dir"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    engine = make()
    fixed, rows = engine.layout.fixed_bytes, row_bytes(engine)
    assert result["one_full_capsule_bytes"] == engine.arena.live_nbytes(128)
    assert result["delta_bytes"] == engine.arena.live_nbytes(128) + 4 * (fixed + 16 * rows)
    assert result["full_copies_bytes"] == engine.arena.live_nbytes(128) + 4 * engine.arena.live_nbytes(144)
    assert result["sibling_restore_bytes"] == fixed + 16 * rows
    assert result["tiers"] == ["device", "disk"]
    for key in ("sibling_first_restore_p50_ms", "sibling_second_restore_p50_ms", "sibling_restore_p50_ms",
                "full_restore_p50_ms", "copy_floor_p50_ms", "disk_spill_p50_ms",
                "disk_fetch_p50_ms", "disk_spill_floor_ms", "export_gb_s", "import_gb_s",
                "sibling_restore_host_p50_ms", "sibling_restore_device_p50_ms", "sibling_bytes_floor_p50_ms",
                "sibling_back_to_back_ms", "copy_floor_back_to_back_ms"):
        assert result[key] > 0, key
    assert result["sibling_over_bytes_floor"] == result["sibling_restore_p50_ms"] / result["sibling_bytes_floor_p50_ms"]
    assert result["sibling_first_over_floor"] == result["sibling_first_restore_p50_ms"] / result["copy_floor_p50_ms"]
    assert result["sibling_back_to_back_over_floor"] == \
        result["sibling_back_to_back_ms"] / result["copy_floor_back_to_back_ms"]
    assert result["provenance"]["device_type"] == "cpu"
