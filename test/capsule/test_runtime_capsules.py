"""Capsules: byte-exact snapshot/restore, fork, rollback, budget, files, and refusals that change nothing."""
import dataclasses
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashrt_ros.runtime import (MAX_LABEL_BYTES, Engine, EngineConfig, ErrorCode, FlashRTError, SamplingParams,
                                 validate_capsule_id)
from flashrt_ros.runtime.capsule.capsule import FIXED
from flashrt_ros.runtime.checksum import checksum

from capsule_helpers import flip_capsule_byte, plant_foreign_capsule

CONFIG = EngineConfig(model="tiny", max_context=256, prefill_chunk=16, history_depth=8)
PROMPT = list(b"capsules keep the whole state: ")          # 31 tokens: one full prefill chunk and a remainder


def make_engine(**overrides) -> Engine:
    return Engine(dataclasses.replace(CONFIG, **overrides))


@pytest.fixture
def engine() -> Engine:
    eng = make_engine()
    eng.ingest(PROMPT)
    return eng


def greedy(engine: Engine, n: int) -> list[int]:
    return list(engine.generate(n, stop_token_ids=[]))


def dirty(engine: Engine) -> None:
    """Move the live state far from where it was: more context and generated tokens."""
    engine.ingest(list(b"something else entirely"))
    greedy(engine, 3)


corrupt = flip_capsule_byte


def assert_live_is(engine: Engine, capsule_id: str) -> None:
    info = engine.capsule(capsule_id)
    assert engine.position == info.position
    assert torch.equal(engine.live_bytes(), engine.capsule_bytes(capsule_id))
    assert engine.live_checksum() == info.checksum


# ---- refusals change nothing ------------------------------------------------------------------------------

def observable_state(engine: Engine) -> dict:
    """Everything a refused request must leave as it was: live bytes, position, lineage, every capsule."""
    return {"live": engine.live_bytes().clone(), "position": engine.position, "parent": engine.live_parent,
            "used": engine.capsule_bytes_used,
            "capsules": {c.id: (c, engine.capsule_bytes(c.id).clone()) for c in engine.capsules()}}


def assert_same_state(before: dict, after: dict) -> None:
    assert torch.equal(after["live"], before["live"]), "live state bytes changed"
    assert (after["position"], after["parent"], after["used"]) == (before["position"], before["parent"],
                                                                   before["used"])
    assert after["capsules"].keys() == before["capsules"].keys()
    for capsule_id, (info, data) in before["capsules"].items():
        assert after["capsules"][capsule_id][0] == info
        assert torch.equal(after["capsules"][capsule_id][1], data), f"capsule {capsule_id} changed"


@contextmanager
def refused(engine: Engine, code: ErrorCode):
    """Expect FlashRTError(code) with a message, and no change to the engine's state."""
    before = observable_state(engine)
    with pytest.raises(FlashRTError) as error:
        yield error
    assert error.value.code == code, error.value
    assert error.value.message
    assert_same_state(before, observable_state(engine))


@pytest.fixture(scope="module")
def foreign_engine():
    """An engine of another model (same preset, other weights seed) holding the capsule ``foreign``."""
    other = make_engine(seed=1)
    other.ingest(PROMPT)
    other.snapshot("foreign")
    return other


@pytest.fixture
def lineage(engine, foreign_engine, tmp_path):
    """An engine whose live state descends from `later` <- `base`, with a sibling fork `side`, a corrupted capsule
    and a capsule of another model (capsule files: test_capsule_file.py)."""
    engine.snapshot("base")
    greedy(engine, 2)
    engine.fork(capsule_id="corrupt")
    corrupt(engine, "corrupt", 100, 0x10)
    engine.snapshot("later")
    engine.fork("base", "side")
    greedy(engine, 2)
    plant_foreign_capsule(engine, foreign_engine, "foreign")
    return engine, tmp_path


REFUSALS = {
    "snapshot-duplicate-id": (ErrorCode.DUPLICATE_CAPSULE_ID, lambda e, d: e.snapshot("base")),
    "snapshot-id-with-space": (ErrorCode.INVALID_CAPSULE_ID, lambda e, d: e.snapshot("a b")),
    "snapshot-id-with-slash": (ErrorCode.INVALID_CAPSULE_ID, lambda e, d: e.snapshot("../x")),
    "snapshot-id-too-long": (ErrorCode.INVALID_CAPSULE_ID, lambda e, d: e.snapshot("x" * 65)),
    "snapshot-id-non-ascii": (ErrorCode.INVALID_CAPSULE_ID, lambda e, d: e.snapshot("café")),
    "snapshot-label-too-long": (ErrorCode.INVALID_ARGUMENT, lambda e, d: e.snapshot("l", "x" * (MAX_LABEL_BYTES + 1))),
    "snapshot-label-too-many-utf8-bytes": (ErrorCode.INVALID_ARGUMENT,
                                           lambda e, d: e.snapshot("l", "é" * (MAX_LABEL_BYTES // 2 + 1))),
    "fork-label-too-long": (ErrorCode.INVALID_ARGUMENT, lambda e, d: e.fork("base", "l", "x" * (MAX_LABEL_BYTES + 1))),
    "fork-live-label-too-long": (ErrorCode.INVALID_ARGUMENT,
                                 lambda e, d: e.fork(None, "l", "x" * (MAX_LABEL_BYTES + 1), switch=True)),
    "restore-unknown": (ErrorCode.UNKNOWN_CAPSULE, lambda e, d: e.restore("nope")),
    "restore-empty-id": (ErrorCode.INVALID_CAPSULE_ID, lambda e, d: e.restore("")),
    "restore-corrupted-verified": (ErrorCode.CHECKSUM_MISMATCH,
                                   lambda e, d: e.restore("corrupt", verify_checksum=True)),
    "restore-foreign": (ErrorCode.FINGERPRINT_MISMATCH, lambda e, d: e.restore("foreign")),
    "restore-foreign-kv-only": (ErrorCode.FINGERPRINT_MISMATCH, lambda e, d: e.restore("foreign", kv_only=True)),
    "fork-unknown": (ErrorCode.UNKNOWN_CAPSULE, lambda e, d: e.fork("nope", "n1")),
    "fork-duplicate-target": (ErrorCode.DUPLICATE_CAPSULE_ID, lambda e, d: e.fork("base", "side")),
    "fork-live-duplicate-target": (ErrorCode.DUPLICATE_CAPSULE_ID, lambda e, d: e.fork(None, "later", switch=True)),
    "fork-invalid-target": (ErrorCode.INVALID_CAPSULE_ID, lambda e, d: e.fork("base", "bad id", switch=True)),
    "fork-foreign": (ErrorCode.FINGERPRINT_MISMATCH, lambda e, d: e.fork("foreign", "f2", switch=True)),
    "rollback-neither": (ErrorCode.INVALID_ARGUMENT, lambda e, d: e.rollback()),
    "rollback-both": (ErrorCode.INVALID_ARGUMENT, lambda e, d: e.rollback("base", steps=1)),
    "rollback-zero-steps": (ErrorCode.INVALID_ARGUMENT, lambda e, d: e.rollback(steps=0)),
    "rollback-negative-steps": (ErrorCode.INVALID_ARGUMENT, lambda e, d: e.rollback(steps=-2)),
    "rollback-past-history": (ErrorCode.NO_HISTORY, lambda e, d: e.rollback(steps=CONFIG.history_depth)),
    "rollback-to-sibling": (ErrorCode.NOT_IN_LINEAGE, lambda e, d: e.rollback("side")),
    "rollback-to-unknown": (ErrorCode.UNKNOWN_CAPSULE, lambda e, d: e.rollback("nope")),
    "rollback-to-foreign": (ErrorCode.FINGERPRINT_MISMATCH, lambda e, d: e.rollback("foreign")),
    "drop-unknown": (ErrorCode.UNKNOWN_CAPSULE, lambda e, d: e.drop("nope")),
    "ingest-over-context": (ErrorCode.CONTEXT_OVERFLOW, lambda e, d: e.ingest([1] * (CONFIG.max_context + 1))),
    "ingest-just-over-context": (ErrorCode.CONTEXT_OVERFLOW,
                                 lambda e, d: e.ingest([1] * (CONFIG.max_context - e.position + 1))),
    "ingest-token-too-large": (ErrorCode.TOKEN_OUT_OF_RANGE, lambda e, d: e.ingest([1, 2, e.vocab_size])),
    "ingest-negative-token": (ErrorCode.TOKEN_OUT_OF_RANGE, lambda e, d: e.ingest([-1])),
    "ingest-non-integer-token": (ErrorCode.INVALID_ARGUMENT, lambda e, d: e.ingest([1, "x"])),
    "generate-negative-count": (ErrorCode.INVALID_ARGUMENT, lambda e, d: e.generate(-1)),
    "generate-bad-temperature": (ErrorCode.INVALID_ARGUMENT,
                                 lambda e, d: e.generate(3, SamplingParams(temperature=-0.5))),
    "generate-bad-top-p": (ErrorCode.INVALID_ARGUMENT,
                           lambda e, d: e.generate(3, SamplingParams(temperature=1.0, top_p=0.0))),
    "reseed-negative": (ErrorCode.INVALID_ARGUMENT, lambda e, d: e.reseed(-1)),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusal_changes_nothing(lineage, name):
    engine, folder = lineage
    code, call = REFUSALS[name]
    files = sorted(folder.rglob("*"))
    with refused(engine, code):
        call(engine, folder)
    assert sorted(folder.rglob("*")) == files, "a refused call left files behind"


def test_the_refusal_fixture_is_otherwise_healthy(lineage):
    """The table's engine is healthy: the same kinds of calls with valid arguments succeed."""
    engine, folder = lineage
    engine.restore("later", verify_checksum=True)
    engine.rollback("base")
    engine.fork("base", "n1", switch=True)
    engine.ingest([1, 2])
    assert engine.rollback(steps=1) == engine.capsule("base").position


# ---- snapshot / restore -----------------------------------------------------------------------------------

def test_snapshot_dirty_restore_is_byte_exact_and_continues_identically(engine):
    info = engine.snapshot("s", label="before")
    assert (info.id, info.label, info.position, info.parent, info.tier) == ("s", "before", len(PROMPT), "", "host")
    assert info.nbytes == engine.capsule_bytes("s").numel()
    assert info.checksum == checksum(engine.capsule_bytes("s"))
    assert_live_is(engine, "s")
    assert engine.live_parent == "s"
    continuation = greedy(engine, 8)
    dirty(engine)
    assert engine.live_checksum() != info.checksum
    assert engine.restore("s", verify_checksum=True) == info
    assert_live_is(engine, "s")
    assert greedy(engine, 8) == continuation


def test_snapshot_mid_generation_at_a_token_boundary(engine):
    """The node snapshots between two generate() steps; the stream then carries on unchanged."""
    engine.snapshot("start")
    reference = greedy(engine, 10)
    engine.restore("start")
    stream = engine.generate(10, stop_token_ids=[])
    head = [next(stream) for _ in range(4)]
    engine.snapshot("mid")
    assert head + list(stream) == reference
    engine.restore("mid")
    assert engine.position == len(PROMPT) + 4
    assert greedy(engine, 6) == reference[4:]


def test_generated_ids_and_capsule_order(engine):
    first, second = engine.snapshot(), engine.snapshot(label="two")
    assert (first.id, second.id) == ("c0001", "c0002")
    assert second.parent == first.id
    engine.snapshot("named")
    assert [c.id for c in engine.capsules()] == ["c0001", "c0002", "named"]
    assert engine.capsule("c0002").label == "two"


def test_reset_keeps_capsules(engine):
    engine.snapshot("s")
    continuation = greedy(engine, 5)
    engine.reset()
    assert (engine.position, engine.live_parent) == (0, "")
    engine.restore("s")
    assert greedy(engine, 5) == continuation


def test_kv_only_restore_diverges_from_the_true_continuation(engine):
    """The ablation restores KV and position but keeps the dirty recurrent/conv state: the hybrid model notices."""
    engine.snapshot("s")
    true_logits = engine.next_token_logits()
    continuation = greedy(engine, 8)
    dirty(engine)
    engine.restore("s", kv_only=True)
    assert engine.position == len(PROMPT)
    assert not torch.equal(engine.live_bytes(), engine.capsule_bytes("s"))
    assert (engine.next_token_logits() - true_logits).norm() > 1e-3 * true_logits.norm()
    assert greedy(engine, 8) != continuation
    engine.restore("s")
    assert greedy(engine, 8) == continuation


# ---- fork ---------------------------------------------------------------------------------------------------

def test_forks_of_one_capsule_continue_identically_and_independently(engine):
    engine.snapshot("root")
    a, b = engine.fork("root", "a"), engine.fork("root", "b", label="second")
    assert (a.parent, b.parent, b.label, a.position) == ("root", "root", "second", len(PROMPT))
    assert a.checksum == engine.capsule("root").checksum
    engine.restore("a")
    from_a = greedy(engine, 8)
    engine.ingest(list(b"branch a goes on"))
    engine.restore("b")
    assert engine.live_parent == "b"
    assert greedy(engine, 8) == from_a
    corrupt(engine, "a", 0, 0xFF)                             # forks share their blocks: each sees the damage
    for capsule_id in ("root", "a", "b"):
        with pytest.raises(FlashRTError) as err:
            engine.restore(capsule_id, verify_checksum=True)
        assert err.value.code == ErrorCode.CHECKSUM_MISMATCH
    assert engine.capsule("a").shared_bytes == engine.capsule("a").nbytes


def test_fork_of_live_and_switch(engine):
    engine.snapshot("root")
    greedy(engine, 2)
    side = engine.fork(capsule_id="side")
    assert side.parent == "root" and engine.live_parent == "root"
    assert_live_is(engine, "side")
    switched = engine.fork("root", "again", switch=True)
    assert engine.live_parent == "again"
    assert engine.position == switched.position == len(PROMPT)
    assert_live_is(engine, "root")


# ---- rollback -----------------------------------------------------------------------------------------------

def test_rollback_by_steps_walks_back_commit_boundaries(engine):
    engine.snapshot("s")
    tokens = greedy(engine, 5)
    assert engine.rollback(steps=5) == len(PROMPT)
    assert_live_is(engine, "s")
    assert greedy(engine, 5) == tokens
    assert engine.rollback(steps=2) == len(PROMPT) + 3
    assert greedy(engine, 2) == tokens[3:]


def test_rollback_by_steps_counts_ingests_as_one_boundary(engine):
    engine.snapshot("s")
    engine.ingest(list(b"one ingest, many tokens"))
    assert engine.rollback(steps=1) == len(PROMPT)
    assert_live_is(engine, "s")


def test_rollback_history_is_bounded_by_history_depth(engine):
    """Step past the ring of kept boundaries (it wraps), snapshotting each token: every kept boundary is exact."""
    depth = CONFIG.history_depth
    stream = engine.generate(depth + 3, stop_token_ids=[])
    for index, _ in enumerate(stream):
        engine.snapshot(f"t{index}")
    with refused(engine, ErrorCode.NO_HISTORY):
        engine.rollback(steps=depth)
    last = depth + 2
    for steps in (2, depth - 3):                    # two back, then on to the oldest boundary kept
        engine.rollback(steps=steps)
        last -= steps
        assert_live_is(engine, f"t{last}")
        assert engine.live_parent == f"t{last}"


def test_restore_starts_a_new_history(engine):
    engine.snapshot("s")
    greedy(engine, 3)
    engine.restore("s")
    with refused(engine, ErrorCode.NO_HISTORY):
        engine.rollback(steps=1)


def test_rollback_by_steps_back_to_the_restore_point(engine):
    """The boundary a restore starts from is backed by the capsule itself."""
    engine.snapshot("s")
    tokens = greedy(engine, 4)
    dirty(engine)
    engine.restore("s")
    greedy(engine, 3)
    assert engine.rollback(steps=3) == len(PROMPT)
    assert_live_is(engine, "s")
    assert greedy(engine, 4) == tokens


def test_rollback_to_an_ancestor_capsule(engine):
    engine.snapshot("a")
    tokens = greedy(engine, 3)
    engine.snapshot("b")
    greedy(engine, 3)
    assert engine.rollback("a") == len(PROMPT)
    assert engine.live_parent == "a"
    assert_live_is(engine, "a")
    assert greedy(engine, 3) == tokens
    with refused(engine, ErrorCode.NOT_IN_LINEAGE):       # b descends from a, it is not an ancestor of the live state
        engine.rollback("b")


def test_dropping_an_intermediate_capsule_keeps_the_lineage(engine):
    """live <- b <- a: with b dropped, the live state still descends from a."""
    engine.snapshot("a")
    greedy(engine, 2)
    engine.snapshot("b")
    greedy(engine, 2)
    engine.drop("b")
    assert engine.rollback("a") == len(PROMPT)
    assert_live_is(engine, "a")


def test_rollback_by_steps_moves_the_lineage_back(engine):
    engine.snapshot("a")
    greedy(engine, 1)
    engine.snapshot("b")
    greedy(engine, 1)
    engine.rollback(steps=2)
    assert engine.live_parent == "a"
    assert_live_is(engine, "a")


# ---- budget and drop ----------------------------------------------------------------------------------------

def test_budget_counts_shared_blocks_once_refuses_what_does_not_fit_and_drop_frees_it(engine, tmp_path):
    size = engine.snapshot("probe").nbytes
    fixed = engine.layout.fixed_bytes
    tight = make_engine(capsule_budget_bytes=size + fixed + fixed // 2)
    tight.ingest(PROMPT)
    tight.snapshot("a")
    assert tight.fork("a", "b").shared_bytes == size         # a fork holds no bytes of its own
    assert tight.capsule_bytes_used == size
    assert tight.snapshot("c").own_bytes == fixed            # same live rows: only the fixed state is new
    assert tight.capsule_bytes_used == size + fixed
    with refused(tight, ErrorCode.BUDGET_EXCEEDED):
        tight.snapshot("d")
    with refused(tight, ErrorCode.BUDGET_EXCEEDED):
        tight.fork(None, "d")
    assert tight.drop("a") == 0                             # b holds every block of a
    assert tight.drop("b") == fixed                         # c still holds the KV rows
    assert tight.capsule_bytes_used == size
    with refused(tight, ErrorCode.UNKNOWN_CAPSULE):
        tight.restore("a")
    assert tight.snapshot("d").own_bytes == fixed
    assert tight.stats()["capsule_count"] == 2


def test_stats_report_capsule_use_and_speed(engine):
    engine.snapshot("s")
    greedy(engine, 3)
    stats = engine.stats()
    assert (stats["capsule_count"], stats["capsule_bytes"]) == (1, engine.capsule("s").nbytes)
    assert stats["arena_bytes"] == engine.arena_bytes
    assert stats["ttft_ms"] > 0 and stats["decode_tokens_per_s"] > 0


def test_capsules_grow_with_the_context(engine):
    short = engine.snapshot("short")
    greedy(engine, 4)
    longer = engine.snapshot("longer")
    assert longer.nbytes > short.nbytes


# ---- files --------------------------------------------------------------------------------------------------

def test_capsule_without_stored_checksum_still_round_trips_through_a_file(tmp_path):
    engine = make_engine(checksum_on_snapshot=False, capsule_dir=str(tmp_path))
    engine.ingest(PROMPT)
    assert engine.snapshot("s").checksum == ""
    with refused(engine, ErrorCode.INVALID_ARGUMENT):
        engine.restore("s", verify_checksum=True)
    engine.export_capsule("s")
    engine.drop("s")
    imported = engine.import_capsule("s")
    assert imported.checksum == engine.live_checksum()


def test_corrupted_capsule_in_memory_is_caught_when_verified(engine):
    engine.snapshot("s")
    corrupt(engine, "s", engine.capsule("s").nbytes // 2)
    with refused(engine, ErrorCode.CHECKSUM_MISMATCH):
        engine.restore("s", verify_checksum=True)


@pytest.mark.parametrize("other", [dict(seed=1), dict(max_context=128), dict(prefill_chunk=32)],
                         ids=["other-weights", "other-max-context", "other-prefill-chunk"])
def test_capsule_of_another_engine_is_refused_on_restore(engine, tmp_path, other):
    foreign = make_engine(**other, capsule_dir=str(tmp_path))
    foreign.ingest(PROMPT)
    foreign.snapshot("f")
    foreign.export_capsule("f")
    assert foreign.fingerprint != engine.fingerprint
    importer = make_engine(capsule_dir=str(tmp_path))
    with refused(importer, ErrorCode.FINGERPRINT_MISMATCH):
        importer.import_capsule("f")
    plant_foreign_capsule(engine, foreign, "f")
    with refused(engine, ErrorCode.FINGERPRINT_MISMATCH):
        engine.restore("f")


def test_a_reused_id_does_not_rewire_the_lineage(engine):
    engine.ingest(engine.tokenizer.encode("pick up the cup"))
    engine.snapshot("root")
    greedy(engine, 3)
    engine.snapshot("x")
    engine.drop("x")                       # the live state now descends from root directly
    assert engine.live_parent == "root"
    greedy(engine, 2)
    engine.snapshot("x")                   # the id comes back, as a child of root
    assert engine.store.ancestors(engine.live_parent) == ["x", "root"]
    assert engine.rollback(capsule_id="root") == engine.capsule("root").position

    engine.reset()
    engine.ingest(engine.tokenizer.encode("other"))
    engine.snapshot("other")
    engine.reset()
    engine.ingest(engine.tokenizer.encode("main"))
    engine.snapshot("y")
    engine.drop("y")
    engine.fork(source_id="other", capsule_id="y")     # an unrelated capsule takes the dropped id
    with refused(engine, ErrorCode.NOT_IN_LINEAGE):
        engine.rollback(capsule_id="other")


def test_a_refused_snapshot_does_not_use_up_an_automatic_id():
    sizes = make_engine().arena
    # the second snapshot shares the first one's 10 rows: it needs the fixed state and 200 rows
    engine = make_engine(capsule_budget_bytes=sizes.live_nbytes(10) + sizes.live_nbytes(200) - 1)
    engine.ingest(list(range(10)))
    assert engine.snapshot().id == "c0001"
    engine.ingest(list(range(200)))
    with refused(engine, ErrorCode.BUDGET_EXCEEDED):
        engine.snapshot()
    engine.drop("c0001")
    assert engine.snapshot().id == "c0002"


def test_explicit_numbered_ids_move_the_automatic_numbering_on(engine):
    """A bag replay re-creates recorded automatic ids explicitly; the next automatic id must match the recording."""
    engine.ingest(list(range(10)))
    engine.snapshot("c0001")
    engine.drop("c0001")
    assert engine.snapshot().id == "c0002"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(digits=st.integers(min_value=4, max_value=63), nines=st.booleans())
def test_generated_ids_stay_valid_whatever_explicit_numbered_ids_came_before(engine, digits, nines):
    """An explicit id of the generated form, up to the 64-character limit, must not push the next generated id
    past it: such a capsule could never be restored or dropped (a budget leak any client could cause)."""
    explicit = "c" + ("9" * digits if nines else "1" + "0" * (digits - 1))
    engine.snapshot(explicit)
    generated = engine.snapshot().id
    assert validate_capsule_id(generated) and generated != explicit
    engine.restore(generated)
    assert engine.drop(generated) > 0 and engine.drop(explicit) > 0
    assert engine.capsule_bytes_used == 0


def test_labels_count_in_the_budget(engine):
    """A label is held with its capsule: the budget and list_capsules' used bytes include its UTF-8 bytes."""
    payload = engine.arena.live_nbytes(engine.position)
    fitted = make_engine(capsule_budget_bytes=payload + 20)
    fitted.ingest(PROMPT)
    with refused(fitted, ErrorCode.BUDGET_EXCEEDED):
        fitted.snapshot("a", label="é" * 11)          # 22 bytes of label: 2 over
    info = fitted.snapshot("a", label="é" * 10)
    assert fitted.capsule_bytes_used == info.nbytes + 20 == fitted.capsule_budget_bytes
    with refused(fitted, ErrorCode.BUDGET_EXCEEDED):
        fitted.fork("a", "b", label="x")             # a fork shares every block: only its label is new


def test_dropping_the_restored_capsule_releases_its_bytes_and_keeps_rollback_working(engine):
    start = engine.ingest(list(range(20)))
    engine.snapshot("big")
    greedy(engine, 3)
    engine.restore("big")
    greedy(engine, 4)
    fixed = engine.store.get("big").rows[FIXED][0][0]
    engine.drop("big")
    assert not any(b.fixed is fixed for b in engine._boundaries)
    assert engine.rollback(steps=3) == start + 1
    engine.snapshot("again")
    engine.restore("again")
    engine.drop("again")                   # it backed the only boundary, which becomes a copy of the live state
    before = engine.live_bytes()
    greedy(engine, 2)
    assert engine.rollback(steps=2) == start + 1
    assert torch.equal(engine.live_bytes(), before)


def test_stored_checksums_are_computed_in_place_and_equal_the_bytes_checksum(engine):
    """A snapshot's checksum (over its blocks, shared rows included) and the live checksum (over the arena's byte
    ranges) equal the checksum of the full bytes; verify_checksum accepts the capsule and a child sharing its rows."""
    root = engine.snapshot(capsule_id="root")
    assert root.checksum == checksum(engine.capsule_bytes("root")) == engine.live_checksum()
    greedy(engine, 3)
    child = engine.snapshot(capsule_id="child")                   # shares root's rows
    assert engine.store.info("child").shared_bytes > 0
    assert child.checksum == checksum(engine.capsule_bytes("child")) == engine.live_checksum()
    dirty(engine)
    assert engine.restore("child", verify_checksum=True).checksum == child.checksum


OPERATIONS = st.lists(st.tuples(st.sampled_from(["ingest", "generate", "snapshot", "restore", "rollback", "reset",
                                                 "fork", "bad_ingest"]), st.integers(1, 3)), min_size=1, max_size=12)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations=OPERATIONS)
def test_the_engine_knows_the_live_position_without_reading_the_arena(engine, operations):
    """The host-side position (no device sync) equals the arena's after every operation, refused ones included."""
    for operation, n in operations:
        capsules = engine.capsules()
        try:
            if operation == "ingest":
                engine.ingest(PROMPT[:n])
            elif operation == "generate":
                greedy(engine, n)
            elif operation == "snapshot":
                engine.snapshot()
            elif operation == "restore" and capsules:
                engine.restore(capsules[n % len(capsules)].id)
            elif operation == "rollback":
                engine.rollback(steps=n)
            elif operation == "reset":
                engine.reset()
            elif operation == "fork" and capsules:
                engine.fork(capsules[n % len(capsules)].id, switch=True)
            elif operation == "bad_ingest":
                engine.ingest([0] * (engine.max_context + n))
        except FlashRTError:
            pass
        assert engine.position == engine.arena.position(), operation
