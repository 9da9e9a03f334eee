"""Capsules against a hostile capsule_dir and failing tiers (issue 33): every value a file holds is range-checked
before use, only plain files are read (no link, no FIFO), the disk index and the id rule agree, drops are durable,
budgets hold when a tier fails, and the number of capsules is bounded. Each test failed on the code before its fix."""
import math
import os
import threading

import pytest

from flashrt_ros.runtime import ErrorCode, FlashRTError
from flashrt_ros.runtime.capsule import file as capsule_file
from flashrt_ros.runtime.capsule.capsule import MAX_CREATED_S
from test_capsule_file import assemble, make_engine, split
from test_runtime_capsules import PROMPT, refused


@pytest.fixture
def engine(tmp_path):
    eng = make_engine(tmp_path)
    eng.ingest(PROMPT)
    eng.snapshot("keep")
    eng.snapshot("s")
    eng.export_capsule("s")
    eng.drop("s")
    return eng


def forged(folder, capsule_id: str = "s", **info) -> None:
    """Rewrite ``<capsule_id>.capsule`` with these info fields, its digests recomputed (no key: anyone can)."""
    path = folder / f"{capsule_id}.capsule"
    header, payload = split(path.read_bytes())
    header["info"].update(info)
    path.write_bytes(assemble(header, payload))


# ---- (1) every value read from a file is range-checked -------------------------------------------------------

@pytest.mark.parametrize("field, value", [("created", 1e20), ("created", 1e308), ("created", MAX_CREATED_S + 1),
                                          ("created", -1.0), ("created", math.nan), ("position", 1 << 40),
                                          ("nbytes", 1 << 70)])
def test_a_header_value_out_of_range_is_refused_on_import_and_never_indexed(engine, tmp_path, field, value):
    forged(tmp_path, **{field: value})
    with refused(engine, ErrorCode.CHECKSUM_MISMATCH) as error:       # nothing changes (refused() checks)
        engine.import_capsule("s")
    assert field in error.value.message
    restarted = make_engine(tmp_path)
    assert restarted.capsules() == [], "the file entered the disk index"
    assert len(restarted.capsule_dir_refused) == 1 and field in restarted.capsule_dir_refused[0]


def test_a_date_after_2038_round_trips_through_a_file(engine, tmp_path):
    created = 4102444800.25                                   # 2100-01-01T00:00:00.25Z
    forged(tmp_path, created=created)
    assert engine.import_capsule("s").created == created
    assert make_engine(tmp_path).capsule("s").created == created


# ---- (5, 10) plain files only: no FIFO, no link ---------------------------------------------------------------

def bounded(call, seconds: float = 30.0):
    """Run ``call`` on a thread; fail (instead of hanging the suite) unless it ends in ``seconds``."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except Exception as err:              # noqa: BLE001 - handed to the test
            outcome["error"] = err
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return thread.is_alive(), outcome


def test_a_fifo_named_like_a_capsule_file_is_refused_without_blocking(engine, tmp_path):
    fifo = tmp_path / "f.capsule"
    os.mkfifo(fifo)
    try:
        hung, outcome = bounded(lambda: engine.import_capsule("f"))
    finally:   # let a blocked reader go (the old code waited in open() for a writer)
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK) if hung else None
        if writer is not None:
            os.close(writer)
    assert not hung, "import_capsule blocked on a FIFO"
    assert outcome["error"].code == ErrorCode.FILE_ERROR and "not a plain file" in outcome["error"].message
    hung, outcome = bounded(lambda: make_engine(tmp_path))
    assert not hung and "value" in outcome
    assert [c.id for c in outcome["value"].capsules()] == ["s"]
    assert any(why.startswith("f.capsule") and "not a plain file" in why
               for why in outcome["value"].capsule_dir_refused)


def test_a_symbolic_link_out_of_capsule_dir_is_never_followed(engine, tmp_path, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    os.replace(tmp_path / "s.capsule", elsewhere / "s.capsule")
    (tmp_path / "s.capsule").symlink_to(elsewhere / "s.capsule")
    with refused(engine, ErrorCode.FILE_ERROR) as error:
        engine.import_capsule("s")
    assert "symbolic link" in error.value.message
    restarted = make_engine(tmp_path)
    assert restarted.capsules() == []
    assert any("symbolic link" in why for why in restarted.capsule_dir_refused)


def test_a_directory_named_like_a_capsule_file_is_refused(engine, tmp_path):
    (tmp_path / "d.capsule").mkdir()
    with refused(engine, ErrorCode.FILE_ERROR) as error:
        engine.import_capsule("d")
    assert "not a plain file" in error.value.message


# ---- (7) the disk index and the id rule agree ----------------------------------------------------------------

@pytest.mark.parametrize("capsule_id", [".a", "..", ".capsule"])
def test_an_id_starting_with_a_dot_survives_a_restart(tmp_path, capsule_id):
    eng = make_engine(tmp_path)
    eng.ingest(PROMPT)
    eng.snapshot(capsule_id)
    eng.export_capsule(capsule_id)
    assert capsule_file.capsule_file_ids(tmp_path) == [capsule_id]
    restarted = make_engine(tmp_path)
    assert [c.id for c in restarted.capsules()] == [capsule_id] and restarted.capsule_dir_refused == []
    restarted.restore(capsule_id, verify_checksum=True)


# ---- (6) drops are durable; Engine.close finishes the tiers ---------------------------------------------------

def held_writes(monkeypatch):
    """Hold every capsule file write until ``go`` is set; ``done`` is set when one has ended (the engine is not
    told: no capsule call runs in between, as when the process dies right then)."""
    go, done, real = threading.Event(), threading.Event(), capsule_file.write_capsule_file

    def held(*args, **kwargs):
        assert go.wait(60), "the test never let the write go"
        try:
            return real(*args, **kwargs)
        finally:
            done.set()
    monkeypatch.setattr(capsule_file, "write_capsule_file", held)
    return go, done


def test_a_capsule_dropped_while_its_spill_file_is_written_does_not_come_back(engine, tmp_path, monkeypatch):
    engine.snapshot("a")
    go, done = held_writes(monkeypatch)
    engine.spill("a", "disk", wait=False)
    engine.drop("a")
    go.set()
    assert done.wait(60)
    assert not (tmp_path / "a.capsule").exists(), "the dropped capsule's file was published"
    restarted = make_engine(tmp_path)                 # a restart right after the write (no capsule call between)
    assert sorted(c.id for c in restarted.capsules()) == ["s"]


def test_close_finishes_pending_spills_and_is_idempotent(engine, tmp_path, monkeypatch):
    engine.snapshot("a")
    expected = engine.capsule_bytes("a").clone()
    go, _ = held_writes(monkeypatch)
    engine.spill("a", "disk", wait=False)
    go.set()
    engine.close()
    engine.close()
    assert engine.capsule("a").tier == "disk"
    restarted = make_engine(tmp_path)
    assert sorted(c.id for c in restarted.capsules()) == ["a", "s"]
    assert restarted.capsule_bytes("a").equal(expected)


# ---- (9) the number of capsules is bounded -------------------------------------------------------------------

def test_max_capsules_bounds_snapshot_fork_import_and_the_disk_index(tmp_path):
    eng = make_engine(tmp_path, max_capsules=3)
    eng.ingest(PROMPT)
    eng.snapshot("a")
    eng.export_capsule("a")
    eng.fork("a", "b")
    eng.fork(None, "c")                                      # zero-byte forks count as much as any capsule
    for refusal in (lambda: eng.snapshot("d"), lambda: eng.fork("a", "d"), lambda: eng.fork(None, "d")):
        with refused(eng, ErrorCode.BUDGET_EXCEEDED) as error:
            refusal()
        assert "max_capsules" in error.value.message
    eng.drop("a")
    eng.snapshot("d")
    with refused(eng, ErrorCode.BUDGET_EXCEEDED):
        eng.import_capsule("a")
    eng.drop("d")
    assert eng.import_capsule("a").id == "a"
    for capsule_id in ("b", "c"):
        eng.export_capsule(capsule_id)
    eng.drop("a")                                            # its exported file stays
    eng.snapshot("e")
    eng.export_capsule("e")
    restarted = make_engine(tmp_path, max_capsules=3)
    assert sorted(c.id for c in restarted.capsules()) == ["a", "b", "c"]
    assert restarted.capsule_dir_refused == ["e.capsule: 3 capsules are stored already (max_capsules): drop one first"]


def test_max_capsules_must_be_positive():
    from flashrt_ros.runtime import EngineConfig
    with pytest.raises(FlashRTError, match="max_capsules"):
        EngineConfig(max_capsules=0).validate()


# ---- (8) budgets hold when a tier fails ---------------------------------------------------------------------

def test_with_lru_a_failed_disk_tier_refuses_instead_of_filling_host_memory(tmp_path, monkeypatch):
    eng = make_engine(tmp_path, capsule_evict_policy="lru")
    eng.ingest(PROMPT)
    capsule_nbytes = eng.snapshot("probe").nbytes
    eng = make_engine(tmp_path, capsule_evict_policy="lru", capsule_budget_bytes=2 * capsule_nbytes + 1024)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(capsule_file, "write_capsule_file", full)
    refusals = []
    for i in range(20):
        eng.reset()                          # each capsule holds rows of its own (none shared: eviction frees them)
        eng.ingest(PROMPT)
        eng.capsules()                       # settles the writes that ended
        try:
            eng.snapshot(f"s{i}")
        except FlashRTError as err:
            refusals.append(err)
        assert eng.store.host_bytes <= eng.tiers.staging_limit, "host memory grew past every bound"
        assert eng.capsule_bytes_used <= eng.capsule_budget_bytes
    assert refusals and all(e.code == ErrorCode.BUDGET_EXCEEDED for e in refusals)
    assert "the disk tier failed" in refusals[-1].message and "No space left" in refusals[-1].message
    assert "No space left" in eng.stats()["capsule_tier_error"]
    stranded = [c.id for c in eng.capsules() if c.tier == "host"]
    assert stranded
    monkeypatch.undo()                       # the disk works again: drop what it could not take
    for capsule_id in stranded:
        eng.drop(capsule_id)
    assert eng.stats()["capsule_tier_error"] == ""
    eng.snapshot("after")


# ---- (11) a missing capsule is UNKNOWN_CAPSULE, whatever its id ---------------------------------------------

@pytest.mark.parametrize("pinned", [False, True])
def test_pinning_a_missing_interrupted_capsule_answers_unknown_capsule(engine, pinned):
    from flashrt_ros.discretiser import Discretiser
    from flashrt_ros.session import Session
    session = Session(engine, discretiser=Discretiser(bins=255, token_offset=257), emit=lambda out: None)
    with refused(engine, ErrorCode.UNKNOWN_CAPSULE):
        session.pin_capsule("interrupted-7", pinned)
