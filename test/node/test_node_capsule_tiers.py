"""~/spill_capsule, ~/fetch_capsule and ~/pin_capsule through real rclpy/DDS: a capsule moves down to disk and
back byte-exact, a prefetch lands at the next capsule call, pinning keeps a capsule on the device, and every bad
request answers its code and changes nothing (tiers, files, live state)."""
import pytest
from conftest import TINY_PARAMS, RosClient, running_node, wait_for
from test_node_services import engine_state, events, fresh, observe, on_engine  # noqa: F401 - fixtures

from flashrt_ros.msg import ErrorCode
from flashrt_ros.srv import FetchCapsule, ListCapsules, PinCapsule, Restore, Snapshot, SpillCapsule


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("node_tiers") / "capsules"


@pytest.fixture(scope="module")
def node_and_client(ros_context, folder):
    with running_node(ros_context, "/t_node_capsule_tiers", **{**TINY_PARAMS, "capsule_dir": str(folder)}) as node:
        client = RosClient(ros_context, node.get_fully_qualified_name())
        yield node, client
        client.close()


def tiers(client) -> dict:
    return {c.id: (c.tier, c.pinned) for c in client.call(ListCapsules, "list_capsules").capsules}


def files(folder) -> list:
    return sorted(p.name for p in folder.iterdir())


def test_a_capsule_spills_to_disk_is_prefetched_and_restores_byte_exact(fresh, folder, events):
    node, client = fresh
    observe(node, "The cup is on the table.")
    client.call(Snapshot, "snapshot", capsule_id="cup")
    live = on_engine(node, lambda s: s.engine.live_bytes().clone())
    on_engine(node, lambda s: s.engine.reset())

    spilled = client.call(SpillCapsule, "spill_capsule", capsule_id="cup", tier="disk", wait=True)
    assert spilled.success and spilled.error_code == ErrorCode.OK and spilled.capsule.tier == "disk"
    assert files(folder) == ["cup.capsule"] and spilled.position == 0
    event = wait_for(lambda: [e for e in events if e.op == "spill"], what="a spill event")[-1]
    assert (event.capsule_id, event.tier, event.wait, event.success) == ("cup", "disk", True, True)

    prefetch = client.call(FetchCapsule, "fetch_capsule", capsule_id="cup", wait=False)
    assert prefetch.success and prefetch.capsule.tier == "disk"          # answered before the read lands
    on_engine(node, lambda s: s.engine.tiers.drain())
    assert tiers(client) == {"cup": ("host", False)} and files(folder) == []   # (the CPU's device tier: host)

    assert client.call(SpillCapsule, "spill_capsule", capsule_id="cup", tier="", wait=False).success
    restored = client.call(Restore, "restore", capsule_id="cup")        # from its staging copy or its file
    assert restored.success
    assert on_engine(node, lambda s: bool((s.engine.live_bytes() == live).all()))
    fetched = client.call(FetchCapsule, "fetch_capsule", capsule_id="cup", wait=True)
    assert fetched.success and fetched.capsule.tier == "host"


def test_a_pinned_capsule_is_fetched_first_and_never_spills(fresh, folder):
    node, client = fresh
    observe(node, "the root")
    client.call(Snapshot, "snapshot", capsule_id="root")
    assert client.call(SpillCapsule, "spill_capsule", capsule_id="root", tier="disk", wait=True).success
    pinned = client.call(PinCapsule, "pin_capsule", capsule_id="root", pinned=True)
    assert pinned.success and pinned.capsule.pinned and pinned.capsule.tier == "host"
    refused = client.call(SpillCapsule, "spill_capsule", capsule_id="root", tier="disk", wait=True)
    assert refused.error_code == ErrorCode.INVALID_ARGUMENT and "pinned" in refused.message
    assert client.call(PinCapsule, "pin_capsule", capsule_id="root", pinned=False).capsule.pinned is False
    assert client.call(SpillCapsule, "spill_capsule", capsule_id="root", tier="disk", wait=True).success


REFUSALS = [
    ("spill unknown", SpillCapsule, "spill_capsule", dict(capsule_id="nope", tier="disk", wait=True),
     ErrorCode.UNKNOWN_CAPSULE),
    ("spill bad tier", SpillCapsule, "spill_capsule", dict(capsule_id="base", tier="moon", wait=True),
     ErrorCode.INVALID_ARGUMENT),
    ("spill host on cpu", SpillCapsule, "spill_capsule", dict(capsule_id="base", tier="host", wait=True),
     ErrorCode.INVALID_ARGUMENT),
    ("spill pinned", SpillCapsule, "spill_capsule", dict(capsule_id="held", tier="", wait=False),
     ErrorCode.INVALID_ARGUMENT),
    ("fetch unknown", FetchCapsule, "fetch_capsule", dict(capsule_id="nope", wait=False), ErrorCode.UNKNOWN_CAPSULE),
    ("pin unknown", PinCapsule, "pin_capsule", dict(capsule_id="nope", pinned=True), ErrorCode.UNKNOWN_CAPSULE),
    ("unpin interrupted", PinCapsule, "pin_capsule", dict(capsule_id="interrupted-7", pinned=False),
     ErrorCode.INVALID_ARGUMENT),
]


@pytest.mark.parametrize("name,srv,service,fields,code", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_bad_request_answers_its_code_and_changes_nothing(fresh, folder, events, name, srv, service, fields, code):
    node, client = fresh
    observe(node, "the base")
    client.call(Snapshot, "snapshot", capsule_id="base")
    client.call(Snapshot, "snapshot", capsule_id="held", pinned=True)
    on_engine(node, lambda s: s.engine.snapshot("interrupted-7"))      # as a preemption leaves it
    before, where, seen = engine_state(node), tiers(client), len(events)

    response = client.call(srv, service, **fields)

    assert not response.success and response.error_code == code and response.message
    assert engine_state(node) == before and tiers(client) == where and files(folder) == []
    event = wait_for(lambda: events[seen:], what="the refusal's event")[-1]
    assert (event.op, event.success, event.error_code) == (service.split("_")[0], False, code)
