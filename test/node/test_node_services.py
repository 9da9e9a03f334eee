"""Every state service of the flashrt node through real rclpy/DDS: success paths, and refusals that
answer with their error code and leave the live state and every capsule byte-identical."""
import pytest
import torch
from capsule_helpers import flip_capsule_byte, plant_foreign_capsule
from conftest import wait_for
from std_srvs.srv import Trigger

from flashrt_ros.msg import ErrorCode, StateEvent
from flashrt_ros.runtime import Engine, EngineConfig
from flashrt_ros.session import ObservationInput
from flashrt_ros.srv import DropCapsule, Fork, ListCapsules, Restore, Resume, Rollback, Snapshot

NODE_PARAMS = {"capsule_budget_mb": 1}


def on_engine(node, fn):
    """Run ``fn(session)`` on the node's engine thread (test setup and inspection only)."""
    return node.worker.submit(fn).result(20.0)


def engine_state(node):
    return on_engine(node, lambda s: (s.engine.live_checksum(), s.engine.position,
                                      [(c.id, c.checksum) for c in s.engine.capsules()]))


def observe(node, text):
    on_engine(node, lambda s: s.observe(ObservationInput(text=text)))


@pytest.fixture(scope="module")
def events(node_and_client):
    """Every StateEvent the node publishes during this module."""
    node, client = node_and_client
    received = client.subscribe(StateEvent, "events")
    wait_for(lambda: node.count_subscribers(f"{node.get_fully_qualified_name()}/events") > 0, what="subscription")
    return received


@pytest.fixture
def fresh(node_and_client):
    """Each test starts from an empty context without capsules."""
    node, client = node_and_client
    assert client.call(Trigger, "reset").success
    for capsule in client.call(ListCapsules, "list_capsules").capsules:
        assert client.call(DropCapsule, "drop_capsule", capsule_id=capsule.id).success
    return node, client


def test_snapshot_list_restore_and_drop(fresh):
    node, client = fresh
    observe(node, "The cup is on the table.")
    snap = client.call(Snapshot, "snapshot", capsule_id="cup", label="seen cup")
    assert snap.success and snap.error_code == ErrorCode.OK and snap.latency_ms > 0
    assert (snap.capsule.id, snap.capsule.label, snap.capsule.position) == ("cup", "seen cup", 24)
    assert snap.capsule.bytes > 0 and snap.capsule.checksum and snap.capsule.created.sec > 0

    auto = client.call(Snapshot, "snapshot")  # no id: the node picks one
    assert auto.success and auto.capsule.id and auto.capsule.id != "cup"
    listing = client.call(ListCapsules, "list_capsules")
    assert [c.id for c in listing.capsules] == ["cup", auto.capsule.id]
    # the second capsule of the same live state shares its KV rows: only its fixed state is its own
    assert auto.capsule.shared_bytes > 0 and auto.capsule.own_bytes + auto.capsule.shared_bytes == auto.capsule.bytes
    assert listing.capsules[1].shared_bytes == auto.capsule.shared_bytes
    assert listing.used_bytes == snap.capsule.bytes + auto.capsule.own_bytes + len("seen cup")
    assert listing.budget_bytes == 1 << 20 and listing.live_position == 24
    assert listing.live_parent == auto.capsule.id

    saved = engine_state(node)[0]
    observe(node, " It falls.")
    restore = client.call(Restore, "restore", capsule_id="cup", verify_checksum=True)
    assert restore.success and restore.position == 24 and restore.capsule.id == "cup"
    assert engine_state(node)[0] == saved  # byte-exact

    drop = client.call(DropCapsule, "drop_capsule", capsule_id=auto.capsule.id)
    assert drop.success and drop.freed_bytes == auto.capsule.own_bytes   # "cup" keeps the shared rows
    assert [c.id for c in client.call(ListCapsules, "list_capsules").capsules] == ["cup"]


def test_fork_rollback_and_reset(fresh):
    node, client = fresh
    observe(node, "abc")
    client.call(Snapshot, "snapshot", capsule_id="base")
    base_state = engine_state(node)[0]
    observe(node, "defg")

    fork = client.call(Fork, "fork", source_id="base", capsule_id="alt", label="branch", switch_to=True)
    assert fork.success and fork.capsule.parent == "base" and fork.position == 3
    assert engine_state(node)[0] == base_state
    live_fork = client.call(Fork, "fork", capsule_id="here")  # fork of the live state, no switch
    assert live_fork.success and live_fork.capsule.position == 3

    observe(node, "hi")
    observe(node, "jk")
    back = client.call(Rollback, "rollback", steps=1)
    assert back.success and back.position == 5
    to_base = client.call(Rollback, "rollback", capsule_id="base")
    assert to_base.success and to_base.position == 3 and engine_state(node)[0] == base_state

    reset = client.call(Trigger, "reset")
    assert reset.success and engine_state(node)[1] == 0
    assert len(client.call(ListCapsules, "list_capsules").capsules) == 3  # reset keeps capsules


@pytest.fixture(scope="module")
def foreign_capsule():
    """An engine with other weights (seed) than the node's, holding the capsule ``foreign``."""
    other = Engine(EngineConfig(model="tiny", max_context=512, seed=1))
    other.ingest(other.tokenizer.encode("elsewhere"))
    other.snapshot("foreign")
    return other


def corrupt(session, capsule_id):
    """Flip a byte of a stored capsule (what bit rot in memory or on disk would do)."""
    flip_capsule_byte(session.engine, capsule_id, -1, 0xFF)


REFUSALS = [
    ("snapshot malformed id", Snapshot, "snapshot", dict(capsule_id="../x"), ErrorCode.INVALID_CAPSULE_ID),
    ("snapshot duplicate id", Snapshot, "snapshot", dict(capsule_id="base"), ErrorCode.DUPLICATE_CAPSULE_ID),
    ("restore unknown", Restore, "restore", dict(capsule_id="nope"), ErrorCode.UNKNOWN_CAPSULE),
    ("restore malformed id", Restore, "restore", dict(capsule_id="a b"), ErrorCode.INVALID_CAPSULE_ID),
    ("restore foreign", Restore, "restore", dict(capsule_id="foreign"), ErrorCode.FINGERPRINT_MISMATCH),
    ("restore corrupted", Restore, "restore", dict(capsule_id="bad", verify_checksum=True),
     ErrorCode.CHECKSUM_MISMATCH),
    ("fork unknown", Fork, "fork", dict(source_id="nope"), ErrorCode.UNKNOWN_CAPSULE),
    ("fork foreign", Fork, "fork", dict(source_id="foreign", capsule_id="f2"), ErrorCode.FINGERPRINT_MISMATCH),
    ("fork duplicate id", Fork, "fork", dict(source_id="base", capsule_id="base"), ErrorCode.DUPLICATE_CAPSULE_ID),
    ("rollback unknown", Rollback, "rollback", dict(capsule_id="nope"), ErrorCode.UNKNOWN_CAPSULE),
    ("rollback not in lineage", Rollback, "rollback", dict(capsule_id="side"), ErrorCode.NOT_IN_LINEAGE),
    ("rollback too far", Rollback, "rollback", dict(steps=10_000), ErrorCode.NO_HISTORY),
    ("rollback without target", Rollback, "rollback", dict(), ErrorCode.INVALID_ARGUMENT),
    ("drop unknown", DropCapsule, "drop_capsule", dict(capsule_id="nope"), ErrorCode.UNKNOWN_CAPSULE),
    ("drop malformed id", DropCapsule, "drop_capsule", dict(capsule_id=""), ErrorCode.INVALID_CAPSULE_ID),
    ("resume nothing", Resume, "resume", dict(), ErrorCode.NOTHING_TO_RESUME),
    ("resume malformed id", Resume, "resume", dict(capsule_id="x" * 65), ErrorCode.INVALID_CAPSULE_ID),
    ("snapshot over budget", Snapshot, "snapshot", dict(), ErrorCode.BUDGET_EXCEEDED),
]


@pytest.mark.parametrize("name,srv,service,fields,code", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusal_answers_its_code_and_changes_nothing(fresh, events, foreign_capsule, name, srv, service, fields, code):
    node, client = fresh
    observe(node, "side branch")
    client.call(Snapshot, "snapshot", capsule_id="side")
    client.call(Trigger, "reset")  # 'side' is no ancestor of the live state any more
    observe(node, "the base")
    client.call(Snapshot, "snapshot", capsule_id="base")
    client.call(Snapshot, "snapshot", capsule_id="bad")
    on_engine(node, lambda s: corrupt(s, "bad"))
    on_engine(node, lambda s: plant_foreign_capsule(s.engine, foreign_capsule, "foreign"))
    if code == ErrorCode.BUDGET_EXCEEDED:
        observe(node, "x" * 400)
        while client.call(Snapshot, "snapshot").success:  # fill the 1 MiB budget
            pass
    before, seen = engine_state(node), len(events)

    response = client.call(srv, service, **fields)

    assert not response.success and response.error_code == code and response.message
    assert engine_state(node) == before
    new = wait_for(lambda: events[seen:], what="the refusal's event")
    assert [(e.success, e.error_code) for e in new] == [(False, code)]
