"""The adversarial suite for capsule files (issue 33): fuzzed headers and payloads (digests recomputed, as anyone who
may write capsule_dir can without a key) and raw damage never crash the engine; each file is refused or accepted
consistently by import and by the disk index at configure; a refusal leaves the live state and every stored capsule
byte-unchanged. Then fault injection: the folder removed or unwritable, a process killed during a spill and a drop
and restarted over the same capsule_dir. A longer run of the fuzzing is behind the ``soak`` marker."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flashrt_ros.runtime import Engine, ErrorCode, FlashRTError
from flashrt_ros.runtime.capsule import file as capsule_file
from flashrt_ros.runtime.capsule.capsule import MAX_CREATED_S
from test_capsule_file import assemble, make_engine, split
from test_runtime_capsules import CONFIG, PROMPT, assert_same_state, observable_state, refused

CI_EXAMPLES, SOAK_EXAMPLES = 25, 2000


def fuzz(body, examples: int, explicit=(), **strategies):
    """A hypothesis test of ``body`` over ``strategies``, always trying the ``explicit`` cases too (a new test each
    call: CI and soak share the body)."""
    test = given(**strategies)(body)
    for case in explicit:
        test = example(**case)(test)
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])(test)


def soak(test):
    """The long run of a fuzz test: marked ``soak`` and skipped unless FLASHRT_SOAK=1 (minutes, not for CI)."""
    marked = pytest.mark.soak(test)
    return pytest.mark.skipif(not os.environ.get("FLASHRT_SOAK"),
                              reason="soak: a long fuzzing run, set FLASHRT_SOAK=1 to run it")(marked)


@pytest.fixture
def engine(tmp_path):
    """An engine holding ``keep`` (whose bytes a refusal must not change), the file ``s.capsule`` it exported, and
    that file's good bytes (``engine.good``)."""
    eng = make_engine(tmp_path)
    eng.ingest(PROMPT)
    eng.snapshot("keep")
    eng.ingest(list(b"more"))
    eng.snapshot("s")
    eng.export_capsule("s")
    eng.drop("s")
    eng.good = (tmp_path / "s.capsule").read_bytes()
    return eng


# ---- what a hostile header holds --------------------------------------------------------------------------

EDGE_NUMBERS = [0, -1, 1e20, 1e308, -1e308, math.inf, -math.inf, math.nan, 2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64,
                MAX_CREATED_S, MAX_CREATED_S + 1, 4102444800.5, 1 << 200]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(), st.text(max_size=70),
                    st.sampled_from(EDGE_NUMBERS), st.sampled_from(["", ".", "..", "s", "a/b", "../s", "x" * 65]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
FIELDS = (*capsule_file.INFO_FIELDS, "fingerprint", "auth", "extra")


@st.composite
def header_edits(draw):
    """{field: new value or None (= removed)} for a few of the header's fields."""
    fields = draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=2, unique=True))
    numbers = st.sampled_from(EDGE_NUMBERS) | st.floats() | st.integers(-2 ** 70, 2 ** 70) | json_values
    values = {"extra": json_values, "position": numbers, "nbytes": numbers, "created": numbers}
    return {f: draw(values.get(f, st.none() | json_values)) for f in fields}


def edited(blob: bytes, edits: dict) -> bytes:
    header, payload = split(blob)
    for field, value in edits.items():
        target = header if field in ("fingerprint", "auth", "extra") else header["info"]
        if value is None and field != "extra":
            target.pop(field, None)
        else:
            target[field] = value
    return assemble(json.dumps(header).encode(), payload)


def verdicts(engine: Engine, folder) -> tuple[object, object, Engine]:
    """Import the file (refused: its error code, the state checked unchanged; accepted: its info) and index it in
    a new engine over the folder (listed: its info; refused: the reason). Anything but FlashRTError fails."""
    before = observable_state(engine)
    try:
        imported = engine.import_capsule("s")
    except FlashRTError as err:
        assert err.message
        assert_same_state(before, observable_state(engine))
        imported = err.code
    restarted = make_engine(folder)
    listed = restarted.capsule("s") if "s" in restarted.store else restarted.capsule_dir_refused
    return imported, listed, restarted


def check_consistent(engine: Engine, folder, payload: bytes) -> None:
    imported, listed, restarted = verdicts(engine, folder)
    for info in [i for i in (imported, listed) if not isinstance(i, (ErrorCode, list))]:
        assert 0 <= info.created <= MAX_CREATED_S and 0 <= info.position <= CONFIG.max_context
    if not isinstance(imported, ErrorCode):             # accepted by import: listed too, and byte-exact
        assert not isinstance(listed, list), listed
        assert bytes(engine.capsule_bytes("s").numpy()) == payload
        engine.drop("s")
    if not isinstance(listed, list):                    # listed: restores exactly, or is refused cleanly
        try:
            restarted.restore("s", verify_checksum=True)
        except FlashRTError as err:
            assert err.code in (ErrorCode.CHECKSUM_MISMATCH, ErrorCode.INVALID_ARGUMENT), err
            assert isinstance(imported, ErrorCode)
        else:
            assert bytes(restarted.live_bytes().numpy()) == payload
    restarted.close()


def fuzzed_header(engine, tmp_path, edits):
    """Headers refused or accepted consistently by import and the index, never a crash."""
    path = tmp_path / "s.capsule"
    path.write_bytes(edited(engine.good, edits))
    check_consistent(engine, tmp_path, split(engine.good)[1])


def fuzzed_payload(engine, tmp_path, edits, cut):
    """Payload edits with the digests recomputed: the device checksum refuses them (import and restore)."""
    header, payload = split(engine.good)
    data = bytearray(payload)
    for where, value in edits:
        data[int(where * len(data))] = value
    data = data[:len(data) + cut] if cut < 0 else data + bytes(cut)
    (tmp_path / "s.capsule").write_bytes(assemble(header, bytes(data)))
    imported, listed, restarted = verdicts(engine, tmp_path)
    if bytes(data) == payload:
        assert not isinstance(imported, ErrorCode)
        engine.drop("s")
    else:
        assert imported == ErrorCode.CHECKSUM_MISMATCH
        assert isinstance(listed, list) or restarted.capsule("s").nbytes == len(payload)
    restarted.close()


def raw_damage(engine, tmp_path, where, junk, keep):
    """Bytes replaced, the file cut short: no digest is recomputed, so import refuses it, and so does the index or
    (damage past the header) the first read of the capsule it listed."""
    blob = engine.good
    at = int(where * len(blob))
    damaged = blob[:at] + junk + blob[at + len(junk):] if junk else blob[:int(keep * len(blob))]
    if damaged == blob:
        return
    (tmp_path / "s.capsule").write_bytes(damaged)
    imported, listed, restarted = verdicts(engine, tmp_path)
    assert isinstance(imported, ErrorCode)
    if not isinstance(listed, list):          # the index reads headers only: damage past it shows at the read
        with pytest.raises(FlashRTError) as error:
            restarted.restore("s")
        assert error.value.code == ErrorCode.CHECKSUM_MISMATCH and restarted.position == 0
    restarted.close()


HEADERS = dict(edits=header_edits(), explicit=[{"edits": {"created": 1e20}}, {"edits": {"created": 1e308}},
                                               {"edits": {"position": 1 << 40}}])
PAYLOADS = dict(edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1,
                               max_size=4), cut=st.integers(-8, 8))
DAMAGE = dict(where=st.floats(0, 1, exclude_max=True), junk=st.binary(max_size=64), keep=st.floats(0, 1))
test_fuzzed_headers_are_refused_or_accepted_consistently = fuzz(fuzzed_header, CI_EXAMPLES, **HEADERS)
test_fuzzed_payloads_are_refused_by_the_device_checksum = fuzz(fuzzed_payload, CI_EXAMPLES, **PAYLOADS)
test_raw_damage_is_refused_by_import_and_the_index = fuzz(raw_damage, CI_EXAMPLES, **DAMAGE)
test_soak_fuzzed_headers = soak(fuzz(fuzzed_header, SOAK_EXAMPLES, **HEADERS))
test_soak_fuzzed_payloads = soak(fuzz(fuzzed_payload, SOAK_EXAMPLES, **PAYLOADS))
test_soak_raw_damage = soak(fuzz(raw_damage, SOAK_EXAMPLES, **DAMAGE))


# ---- fault injection -------------------------------------------------------------------------------------------

def test_a_removed_capsule_dir_refuses_file_calls_cleanly_and_keeps_every_capsule(engine, tmp_path):
    keep = engine.capsule_bytes("keep").clone()
    shutil.rmtree(tmp_path)
    with refused(engine, ErrorCode.UNKNOWN_CAPSULE):
        engine.import_capsule("s")
    with refused(engine, ErrorCode.INVALID_ARGUMENT) as error:
        engine.export_capsule("keep")
    assert "does not exist" in error.value.message
    with pytest.raises(FlashRTError) as error:
        engine.spill("keep", "disk")
    assert error.value.code == ErrorCode.FILE_ERROR and "stays on the host tier" in error.value.message
    assert "the disk tier failed" in engine.stats()["capsule_tier_error"]
    engine.restore("keep", verify_checksum=True)          # fetched back: nothing is left stranded
    assert torch.equal(engine.capsule_bytes("keep"), keep) and engine.stats()["capsule_tier_error"] == ""
    restarted = make_engine(tmp_path)                    # configure creates the folder again
    assert restarted.capsules() == [] and tmp_path.is_dir()


def test_an_unwritable_capsule_dir_refuses_export_with_file_error(engine, tmp_path, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(capsule_file.tempfile, "mkstemp", denied)   # root ignores a chmod: deny the create itself
    with refused(engine, ErrorCode.FILE_ERROR) as error:
        engine.export_capsule("keep")
    assert "Permission denied" in error.value.message
    assert sorted(os.listdir(tmp_path)) == ["s.capsule"]


KILLED = textwrap.dedent("""
    import os, sys, threading
    from flashrt_ros.runtime import Engine, EngineConfig
    from flashrt_ros.runtime.capsule import file as capsule_file
    engine = Engine(EngineConfig(model="tiny", max_context=256, prefill_chunk=16, capsule_dir=sys.argv[1]))
    engine.ingest([4] * 100)
    engine.snapshot("kept")
    engine.export_capsule("kept")
    engine.ingest([5] * 50)
    engine.snapshot("dropped")
    go, done, real = threading.Event(), threading.Event(), capsule_file.write_capsule_file

    def held(*args, **kwargs):
        go.wait()
        try:
            return real(*args, **kwargs)
        finally:
            done.set()
    capsule_file.write_capsule_file = held
    engine.spill("dropped", "disk", wait=False)
    engine.drop("dropped")
    go.set()
    done.wait()                  # the write has ended; no capsule call runs after it: the parent kills us now
    print("ready", flush=True)
    threading.Event().wait()
""")


def test_killed_after_a_drop_during_a_spill_the_capsule_does_not_come_back(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             env=env)
    try:
        assert child.stdout.readline().strip() == "ready"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    restarted = make_engine(tmp_path, max_context=256, prefill_chunk=16)
    assert [c.id for c in restarted.capsules()] == ["kept"]
    assert capsule_file.capsule_file_ids(tmp_path) == ["kept"]
