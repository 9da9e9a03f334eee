"""The delta capsule store against a naive full-copy model, driven by random operation sequences (hypothesis).

The model keeps a whole arena (uint8) and every capsule as a full copy of the live bytes, and applies each operation
the plain way: a restore writes the capsule's every live byte, a rollback writes the boundary's fixed state back.
Ingest and generate run on a twin engine loaded with the model's arena, so the model's arena after them is what
the computation gives from the model's state. After every step the engine's whole arena equals the model's, every
capsule's bytes equal the model's copy, and the budget's used bytes are exactly the distinct blocks held plus the
labels; the host bytes are exactly the full copies of the host-tier capsules (a disk spill's staging copy among
them while its file is written in the background). Background writes and prefetches end whenever they do: every
invariant holds at any point of them.

The model also knows which capsule's fixed state the live state still is (restored from or snapshotted into, with
nothing run since, and the capsule's device copy the same one: a spill and a fetch make new blocks): a restore of
that capsule must write nothing, and a restore of any other must write the whole fixed state.
"""
import dataclasses
import itertools

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError, SamplingParams
from flashrt_ros.runtime.capsule import file as capsule_file
from flashrt_ros.runtime.capsule.capsule import DEVICE, DISK, HOST, label_nbytes

# room for about six capsules at full context: snapshots, forks and fetches evict (lru) to disk
CONFIG = EngineConfig(model="tiny", max_context=160, prefill_chunk=16, history_depth=6,
                      capsule_budget_bytes=600_000)
IDS = ("a", "b", "c", "d", "e", "f")
_ENGINES: dict[str, Engine] = {}


def engines(folder) -> tuple[Engine, Engine]:
    """The engine under test (capsule files in ``folder``) and its twin, built once: construction dominates a tiny
    engine's cost."""
    if not _ENGINES:
        _ENGINES["engine"] = Engine(dataclasses.replace(CONFIG, capsule_dir=str(folder), capsule_evict_policy="lru"))
        _ENGINES["twin"] = Engine(CONFIG)
    return _ENGINES["engine"], _ENGINES["twin"]


def held_bytes(engine: Engine) -> int:
    """What the store really holds: each distinct block once, plus every capsule's label (read without settling
    background work, which would move capsules)."""
    blocks = {}
    for info in engine.store.infos():
        for segments in engine.store.get(info.id).rows.values():
            blocks.update({block.id: block.data.numel() for block, _, _ in segments})
    return sum(blocks.values()) + sum(label_nbytes(c.label) for c in engine.store.infos())


class CapsuleStoreMachine(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.engine, self.twin = engines(self.folder)
        self.engine.tiers.drain()
        for info in self.engine.capsules():
            self.engine.drop(info.id)
        self.engine.tiers.drain()
        self.engine.capsules()                       # (deletes the files of dropped capsules' ended writes)
        for path in self.folder.iterdir():
            path.unlink()
        self.engine.reset()
        self.arena = self.engine.arena.storage.clone()
        self.capsules: dict[str, torch.Tensor] = {}
        self.boundaries = [self.fixed()]
        self.fixed_span = self.engine.arena.specs["kv"].offset
        # the fixed state's identity: one token per stored device copy; the live state's, while it is one of them
        self.fixed_tokens: dict[str, int] = {}
        self.live_fixed: int | None = None
        self.last_capsule: str | None = None         # the capsule the live state was last loaded from or saved into
        self.new_token = itertools.count().__next__

    # ---- the model ---------------------------------------------------------------------------------------
    def fixed(self) -> torch.Tensor:
        return self.arena[:self.engine.arena.specs["kv"].offset].clone()

    def position(self) -> int:
        return int(self.arena[:8].view(torch.int64)[0])

    def live(self) -> torch.Tensor:
        out = torch.empty(self.engine.arena.live_nbytes(self.position()), dtype=torch.uint8)
        for arena_off, capsule_off, length in self.engine.arena.segments(self.position()):
            out[capsule_off:capsule_off + length] = self.arena[arena_off:arena_off + length]
        return out

    def load(self, data: torch.Tensor, position: int, names=None) -> None:
        for arena_off, capsule_off, length in self.engine.arena.segments(position, names):
            self.arena[arena_off:arena_off + length] = data[capsule_off:capsule_off + length]

    def push(self) -> None:
        self.boundaries = (self.boundaries + [self.fixed()])[-CONFIG.history_depth:]

    def on_twin(self, operation):
        """Run ``operation`` on the twin from the model's arena; the model's arena becomes the twin's."""
        self.twin.arena.storage.copy_(self.arena)
        self.twin._moved_to(None)                    # its arena was written behind its back: read the position
        result = operation(self.twin)
        self.arena = self.twin.arena.storage.clone()
        return result

    def allowed(self, operation) -> bool:
        """Run an engine call the budget may refuse even after eviction (all else pinned or shared); a refusal
        changes nothing, which the invariants check."""
        try:
            operation()
        except FlashRTError as err:
            assert err.code == ErrorCode.BUDGET_EXCEEDED, err
            return False
        return True

    def free_id(self, data) -> str:
        return data.draw(st.sampled_from([i for i in IDS if i not in self.capsules]))

    def some_id(self, data) -> str:
        return data.draw(st.sampled_from(sorted(self.capsules)))

    # ---- rules -------------------------------------------------------------------------------------------
    @rule(tokens=st.lists(st.integers(0, 511), min_size=1, max_size=40))
    def ingest(self, tokens):
        if self.position() + len(tokens) > CONFIG.max_context:
            return
        self.engine.ingest(tokens)
        self.on_twin(lambda twin: twin.ingest(tokens))
        self.push()
        self.live_fixed = None

    @precondition(lambda self: 0 < self.position() < CONFIG.max_context - 6)
    @rule(count=st.integers(1, 5), temperature=st.sampled_from([0.0, 0.8]))
    def generate(self, count, temperature):
        sampling = SamplingParams(temperature=temperature)
        tokens = list(self.engine.generate(count, sampling, stop_token_ids=[]))
        for token in tokens:                  # the model steps one token at a time: a boundary after each
            assert [token] == self.on_twin(lambda twin: list(twin.generate(1, sampling, stop_token_ids=[])))
            self.push()
        self.live_fixed = None

    @precondition(lambda self: len(self.capsules) < len(IDS))
    @rule(data=st.data(), label=st.sampled_from(["", "root", "é" * 5]))
    def snapshot(self, data, label):
        capsule_id = self.free_id(data)
        if self.allowed(lambda: self.engine.snapshot(capsule_id, label=label, pinned=data.draw(st.booleans()))):
            self.capsules[capsule_id] = self.live()
            self.fixed_tokens[capsule_id] = self.live_fixed = self.new_token()
            self.last_capsule = capsule_id

    @precondition(lambda self: self.capsules and len(self.capsules) < len(IDS))
    @rule(data=st.data(), switch=st.booleans(), of_live=st.booleans())
    def fork(self, data, switch, of_live):
        source, capsule_id = (None if of_live else self.some_id(data)), self.free_id(data)
        if not self.allowed(lambda: self.engine.fork(source, capsule_id, switch=switch)):
            return
        self.capsules[capsule_id] = self.live() if source is None else self.capsules[source].clone()
        if source is None:                           # a snapshot of the live state under another name
            self.fixed_tokens[capsule_id] = self.live_fixed = self.new_token()
            self.last_capsule = capsule_id
        else:                                        # shares the source's blocks
            self.fixed_tokens[capsule_id] = self.fixed_tokens[source]
        if switch and source is not None:
            self.check_restore_bytes(capsule_id)
            self.load(self.capsules[capsule_id], self.engine.capsule(capsule_id).position)
            self.boundaries = [self.fixed()]

    @precondition(lambda self: self.capsules)
    @rule(data=st.data(), kv_only=st.booleans())
    def restore(self, data, kv_only):
        self.restore_id(self.some_id(data), kv_only)

    @precondition(lambda self: self.capsules)
    @rule(data=st.data())
    def restore_one_then_another_and_back(self, data):
        """A planner's back and forth: each restore writes from the row where the live rows and the capsule part,
        which differs from one restore of a capsule to the next (it keeps its restores' writes by that row)."""
        first, second = self.some_id(data), self.some_id(data)
        for capsule_id in (first, second, first):
            self.restore_id(capsule_id)
            self.arena_matches_the_model()

    @precondition(lambda self: self.live_fixed in self.fixed_tokens.values())
    @rule()
    def restore_the_live_capsule(self):
        """A restore of the capsule the live state still is: nothing to write."""
        self.restore_id(next(c for c, t in self.fixed_tokens.items() if t == self.live_fixed))

    @precondition(lambda self: self.last_capsule in self.capsules)
    @rule()
    def restore_the_last_capsule(self):
        """A restore of the capsule last restored or snapshotted, whatever ran since (ingest, generate, reseed,
        rollback...): it writes nothing only if nothing did."""
        self.restore_id(self.last_capsule)

    def restore_id(self, capsule_id, kv_only=False):
        if not self.allowed(lambda: self.engine.restore(capsule_id, kv_only=kv_only)):
            return
        if not kv_only:
            self.check_restore_bytes(capsule_id)
        self.load(self.capsules[capsule_id], self.engine.capsule(capsule_id).position,
                  ("meta", "kv") if kv_only else None)
        self.boundaries = [self.fixed()]
        self.live_fixed = None if kv_only else self.fixed_tokens[capsule_id]
        self.last_capsule = capsule_id

    def check_restore_bytes(self, capsule_id):
        """After a restore (or a switch, or a rollback to a capsule) that the engine accepted."""
        if self.fixed_tokens[capsule_id] == self.live_fixed:
            assert self.engine.last_restore_bytes == 0, "the live state was this capsule: nothing to write"
        else:
            assert self.engine.last_restore_bytes >= self.engine.layout.fixed_bytes, "the fixed state not written"
        self.live_fixed = self.fixed_tokens[capsule_id]
        self.last_capsule = capsule_id

    @precondition(lambda self: len(self.capsules) < len(IDS) and len(self.engine._boundaries) > 1)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 511), min_size=1, max_size=40))
    def retry(self, data, tokens):
        """A planner's retry: keep the state, go one boundary back, continue differently, then come back (the
        new rows overwrite rows the capsule holds, so the restore must rewrite them)."""
        capsule_id = self.free_id(data)
        if not self.allowed(lambda: self.engine.snapshot(capsule_id)):
            return
        self.capsules[capsule_id] = self.live()
        self.fixed_tokens[capsule_id] = self.live_fixed = self.new_token()
        self.last_capsule = capsule_id
        self.rollback_steps(1)
        self.ingest(tokens)
        self.restore_id(capsule_id)

    @rule(steps=st.sampled_from([1, 1, 2, 4]))
    def rollback_steps(self, steps):
        del self.boundaries[:len(self.boundaries) - len(self.engine._boundaries)]   # drops trim the oldest
        try:
            self.engine.rollback(steps=steps)
        except FlashRTError as err:
            assert err.code == ErrorCode.NO_HISTORY and steps >= len(self.boundaries)
            return
        del self.boundaries[len(self.boundaries) - steps:]
        self.arena[:self.fixed_span] = self.boundaries[-1]
        self.live_fixed = None

    @precondition(lambda self: self.engine.live_parent)
    @rule(data=st.data())
    def rollback_to_ancestor(self, data):
        capsule_id = data.draw(st.sampled_from(self.engine.store.ancestors(self.engine.live_parent)))
        if not self.allowed(lambda: self.engine.rollback(capsule_id=capsule_id)):
            return
        self.check_restore_bytes(capsule_id)
        self.load(self.capsules[capsule_id], self.engine.capsule(capsule_id).position)
        self.boundaries = [self.fixed()]

    @precondition(lambda self: self.capsules)
    @rule(data=st.data())
    def drop(self, data):
        capsule_id = self.some_id(data)
        info = self.engine.capsule(capsule_id)
        # in memory, at least what it holds alone (a block it holds only part of is freed whole); a disk-tier
        # capsule holds only its label in memory (as may one whose background write ends before the drop)
        own = 0 if info.tier == "disk" or capsule_id in self.engine.tiers.pending else info.own_bytes
        assert self.engine.drop(capsule_id) >= own + label_nbytes(info.label)
        del self.capsules[capsule_id], self.fixed_tokens[capsule_id]

    @precondition(lambda self: self.capsules)
    @rule(data=st.data())
    def export_drop_import(self, data):
        capsule_id = self.some_id(data)
        self.engine.export_capsule(capsule_id)       # (a disk-tier capsule's file is its export: kept by the drop)
        self.engine.drop(capsule_id)
        if self.allowed(lambda: self.engine.import_capsule(capsule_id)):
            assert self.engine.capsule(capsule_id).tier != "disk"
            self.fixed_tokens[capsule_id] = self.new_token()          # new blocks
        else:
            del self.capsules[capsule_id], self.fixed_tokens[capsule_id]
        self.engine.capsule_file(capsule_id).unlink()

    @precondition(lambda self: self.capsules)
    @rule(data=st.data(), wait=st.booleans())
    def spill(self, data, wait):
        """A disk spill; without ``wait`` its file is written in the background (the capsule on its host copy)."""
        capsule_id = self.some_id(data)
        info = self.engine.capsule(capsule_id)
        if info.pinned or info.tier == "disk":
            try:
                self.engine.spill(capsule_id, wait=wait)
            except FlashRTError as err:
                assert err.code == ErrorCode.INVALID_ARGUMENT
                return
            raise AssertionError("a pinned or spilled capsule was spilled")
        tier = self.engine.spill(capsule_id, wait=wait).tier
        assert tier == "disk" if wait else tier in ("host", "disk")
        assert not self.engine.store.get(capsule_id).rows            # its device blocks are released at once

    @precondition(lambda self: self.capsules)
    @rule(data=st.data(), wait=st.booleans())
    def fetch(self, data, wait):
        """A fetch, or a prefetch (read in the background, attached at a later capsule call)."""
        capsule_id = self.some_id(data)
        if self.allowed(lambda: self.engine.fetch(capsule_id, wait=wait)) and wait:
            assert self.engine.capsule(capsule_id).tier != "disk"
        if not wait:      # the read ends here, so the prefetch is attached at the next call (a reproducible run)
            self.engine.tiers.drain()

    @rule()
    def background_work_ends(self):
        self.engine.tiers.drain()

    @precondition(lambda self: self.capsules)
    @rule(data=st.data(), pinned=st.booleans())
    def pin(self, data, pinned):
        capsule_id = self.some_id(data)
        if self.allowed(lambda: self.engine.pin(capsule_id, pinned)):
            assert self.engine.capsule(capsule_id).pinned == pinned

    @rule()
    def reset(self):
        self.engine.reset()
        self.on_twin(lambda twin: twin.reset())
        self.boundaries = [self.fixed()]
        self.live_fixed = None

    @rule(seed=st.integers(0, 2 ** 20))
    def reseed(self, seed):
        self.engine.reseed(seed)
        self.on_twin(lambda twin: twin.reseed(seed))
        self.boundaries = [self.fixed()]
        self.live_fixed = None

    # ---- what must hold after every step -----------------------------------------------------------------
    @invariant()
    def capsules_off_the_device_come_back_as_new_blocks(self):
        """(Model bookkeeping, run after every step: a capsule that left the device, evicted, spilled or on its
        way to disk, is new blocks when it is next fetched.)"""
        for capsule_id in self.fixed_tokens:
            if self.engine.store.get(capsule_id).tier in (HOST, DISK):
                self.fixed_tokens[capsule_id] = self.new_token()

    @invariant()
    def arena_matches_the_model(self):
        assert torch.equal(self.engine.arena.storage, self.arena), "live arena differs from the full-copy model"

    @invariant()
    def capsules_match_the_model(self):
        assert sorted(c.id for c in self.engine.capsules()) == sorted(self.capsules)
        for info in self.engine.capsules():
            assert torch.equal(self.engine.capsule_bytes(info.id), self.capsules[info.id]), info.id
            assert info.own_bytes + info.shared_bytes == info.nbytes == self.capsules[info.id].numel()
            # the store reports a kept info while what it is made of is unchanged: never a stale one (made afresh
            # once the kept one is forgotten)
            self.engine.store.get(info.id).reported = None
            assert info == self.engine.store.info(info.id), info.id

    @invariant()
    def budget_is_exact(self):
        self.engine.capsules()                       # settles what has ended; nothing moves until the next call
        assert self.engine.capsule_bytes_used == held_bytes(self.engine) <= self.engine.capsule_budget_bytes, (
            {b.id: (b.nbytes, b.refs) for b in self.engine.store.blocks.values()},
            [(c.id, c.tier, c.own_bytes, c.shared_bytes) for c in self.engine.capsules()])

    @invariant()
    def host_bytes_are_exactly_the_host_copies(self):
        stored = [self.engine.store.get(info.id) for info in self.engine.capsules()]
        assert self.engine.stats()["capsule_host_bytes"] == sum(c.info.nbytes for c in stored if c.tier == HOST)
        for c in stored:
            assert (c.host is not None) == (c.tier == HOST) and bool(c.rows) == (c.tier == DEVICE), c.info.id
            # no pinned host tier on the CPU: a host-tier capsule is a disk spill whose file is being written
            assert c.tier != HOST or c.info.id in self.engine.tiers.pending, c.info.id

    @invariant()
    def pinned_capsules_stay_on_the_device_and_spilled_ones_are_complete_files(self):
        disk = set()
        for info in self.engine.capsules():
            assert info.tier != "disk" or (not info.pinned and self.engine.capsule_file(info.id).is_file())
            disk |= {info.id} if info.tier == "disk" else set()
        pending = set(self.engine.tiers.pending)
        assert set(capsule_file.capsule_file_ids(self.folder)) <= disk | pending, "a stray capsule file"
        if not pending:
            assert not [p for p in self.folder.iterdir() if p.name.startswith(".")], "a temporary file is left"


SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_capsule_store_matches_the_full_copy_model(tmp_path):
    CapsuleStoreMachine.folder = tmp_path
    run_state_machine_as_test(CapsuleStoreMachine, settings=SETTINGS)
