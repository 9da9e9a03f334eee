"""~/export_capsule and ~/import_capsule through real rclpy/DDS, and the capsule_dir / capsule_key_file parameters:
files named by id in the node's folder, signed with its key, refusals that change nothing, persistence over a
reconfigure (a new engine), and a key file that fails configure with the reason."""
import pytest
from capsule_helpers import assemble, split
from conftest import TINY_PARAMS, RosClient, running_node, wait_for
from lifecycle_msgs.msg import State, Transition
from rclpy.parameter import Parameter
from test_node_lifecycle import lifecycle_state, transition
from test_node_services import engine_state, events, fresh, observe, on_engine  # noqa: F401 - fixtures

from flashrt_ros.msg import ErrorCode
from flashrt_ros.runtime import Engine, EngineConfig
from flashrt_ros.runtime.capsule import file as capsule_file
from flashrt_ros.session import ObservationInput
from flashrt_ros.srv import DropCapsule, ExportCapsule, ImportCapsule, ListCapsules, Restore, Snapshot


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("node_capsules")
    key = root / "capsule.key"
    key.write_bytes(b"robot fleet key, 32 bytes long!!")
    return root / "capsules", key          # the capsule folder does not exist yet: configure creates it


@pytest.fixture(scope="module")
def node_and_client(ros_context, folders):
    folder, key = folders
    params = {**TINY_PARAMS, "capsule_dir": str(folder), "capsule_key_file": str(key)}
    with running_node(ros_context, "/t_node_capsule_files", **params) as node:
        client = RosClient(ros_context, node.get_fully_qualified_name())
        yield node, client
        client.close()


@pytest.fixture
def clean(fresh, folders):
    """An empty context without capsules, and an empty capsule folder."""
    for path in folders[0].iterdir():
        path.unlink()
    return fresh


def last_event(events, op):
    return wait_for(lambda: [e for e in events if e.op == op], what=f"a {op!r} event")[-1]


def test_an_export_survives_a_reconfigure_and_stays_exported(clean, folders, events):
    node, client = clean
    folder, key = folders
    observe(node, "The cup is on the table.")
    snap = client.call(Snapshot, "snapshot", capsule_id="cup", label="seen cup")
    continuation = on_engine(node, lambda s: list(s.engine.generate(6, stop_token_ids=[])))

    exported = client.call(ExportCapsule, "export_capsule", capsule_id="cup")
    assert exported.success and exported.error_code == ErrorCode.OK and exported.latency_ms > 0
    assert (exported.capsule.id, exported.capsule.label, exported.capsule.checksum) == ("cup", "seen cup",
                                                                                       snap.capsule.checksum)
    assert [p.name for p in folder.iterdir()] == ["cup.capsule"]
    header, _ = capsule_file.read_capsule_header(folder / "cup.capsule", key=key.read_bytes())
    assert header.label == "seen cup"
    event = last_event(events, "export")
    assert (event.success, event.capsule_id, event.result_id) == (True, "cup", "cup")

    # a new engine (cleanup + configure), as after a restart: the file is indexed as a disk-tier capsule
    for step in (Transition.TRANSITION_DEACTIVATE, Transition.TRANSITION_CLEANUP, Transition.TRANSITION_CONFIGURE,
                 Transition.TRANSITION_ACTIVATE):
        assert transition(client, step)
    listed = client.call(ListCapsules, "list_capsules").capsules
    assert [(c.id, c.tier, c.checksum) for c in listed] == [("cup", "disk", snap.capsule.checksum)]
    blob = (folder / "cup.capsule").read_bytes()
    again = client.call(ExportCapsule, "export_capsule", capsule_id="cup")    # its file holds it already
    assert again.success and (folder / "cup.capsule").read_bytes() == blob
    assert client.call(Restore, "restore", capsule_id="cup", verify_checksum=True).success
    assert on_engine(node, lambda s: list(s.engine.generate(6, stop_token_ids=[]))) == continuation


def test_a_file_from_another_robot_imports_and_continues_token_identically(clean, folders, events):
    """Another engine of the same fingerprint (the other robot) exports into a folder; the file is copied into
    the node's capsule_dir while it runs, and ~/import_capsule takes it."""
    node, client = clean
    folder, key = folders
    robot = Engine(EngineConfig(model="tiny", max_context=TINY_PARAMS["max_context"],
                                capsule_dir=str(folder.parent / "robot"), capsule_key_file=str(key)))
    assert robot.fingerprint == on_engine(node, lambda s: s.engine.fingerprint)
    robot.ingest(robot.tokenizer.encode("Handed over by the other arm."))
    robot.snapshot("handover", label="from arm 2")
    continuation = list(robot.generate(6, stop_token_ids=[]))
    robot.export_capsule("handover")
    (folder / "handover.capsule").write_bytes(robot.capsule_file("handover").read_bytes())

    imported = client.call(ImportCapsule, "import_capsule", capsule_id="handover")
    assert imported.success and (imported.capsule.id, imported.capsule.label) == ("handover", "from arm 2")
    assert imported.capsule.checksum == robot.capsule("handover").checksum and imported.position == 0
    assert last_event(events, "import").result_id == "handover"
    assert client.call(Restore, "restore", capsule_id="handover", verify_checksum=True).success
    assert on_engine(node, lambda s: list(s.engine.generate(6, stop_token_ids=[]))) == continuation


def unsigned_copy(src, dst):
    """The file as an engine without a key would have written it."""
    header, payload = split(src.read_bytes())
    dst.write_bytes(assemble({**header, "auth": "sha256"}, payload))


REFUSALS = [
    ("export unknown", ExportCapsule, dict(capsule_id="nope"), ErrorCode.UNKNOWN_CAPSULE),
    ("export existing file", ExportCapsule, dict(capsule_id="base"), ErrorCode.DUPLICATE_CAPSULE_ID),
    ("export path as id", ExportCapsule, dict(capsule_id="../base"), ErrorCode.INVALID_CAPSULE_ID),
    ("import missing file", ImportCapsule, dict(capsule_id="nope"), ErrorCode.UNKNOWN_CAPSULE),
    ("import path as id", ImportCapsule, dict(capsule_id="../base"), ErrorCode.INVALID_CAPSULE_ID),
    ("import reserved id", ImportCapsule, dict(capsule_id="interrupted-1"), ErrorCode.INVALID_CAPSULE_ID),
    ("import stored id", ImportCapsule, dict(capsule_id="base"), ErrorCode.DUPLICATE_CAPSULE_ID),
    ("import damaged", ImportCapsule, dict(capsule_id="damaged"), ErrorCode.CHECKSUM_MISMATCH),
    ("import unsigned", ImportCapsule, dict(capsule_id="unsigned"), ErrorCode.CHECKSUM_MISMATCH),
]


@pytest.mark.parametrize("name,srv,fields,code", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusal_answers_its_code_and_changes_nothing(clean, folders, events, name, srv, fields, code):
    node, client = clean
    folder, _ = folders
    observe(node, "the base")
    client.call(Snapshot, "snapshot", capsule_id="base")
    assert client.call(ExportCapsule, "export_capsule", capsule_id="base").success
    for other in ("damaged", "unsigned"):
        on_engine(node, lambda s, other=other: s.engine.fork("base", other))
        assert client.call(ExportCapsule, "export_capsule", capsule_id=other).success
        assert client.call(DropCapsule, "drop_capsule", capsule_id=other).success
    blob = bytearray((folder / "damaged.capsule").read_bytes())
    blob[-40] ^= 0x01                      # a payload byte
    (folder / "damaged.capsule").write_bytes(bytes(blob))
    unsigned_copy(folder / "unsigned.capsule", folder / "unsigned.capsule")
    service = "export_capsule" if srv is ExportCapsule else "import_capsule"
    before, files, seen = engine_state(node), {p.name: p.read_bytes() for p in folder.iterdir()}, len(events)

    response = client.call(srv, service, **fields)

    assert not response.success and response.error_code == code and response.message
    assert engine_state(node) == before
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    event = wait_for(lambda: events[seen:], what="the refusal's event")[-1]
    assert (event.op, event.success, event.error_code) == (service.split("_")[0], False, code)


def test_without_a_capsule_dir_both_services_answer_no_capsule_dir(node_and_client, folders):
    node, client = node_and_client
    params = [Parameter("capsule_dir", value=""), Parameter("capsule_key_file", value="")]
    try:
        for step in (Transition.TRANSITION_DEACTIVATE, Transition.TRANSITION_CLEANUP):
            assert transition(client, step)
        assert node.set_parameters(params)[0].successful
        for step in (Transition.TRANSITION_CONFIGURE, Transition.TRANSITION_ACTIVATE):
            assert transition(client, step)
        on_engine(node, lambda s: s.observe(ObservationInput(text="x")) or s.snapshot("x"))
        for srv, service in ((ExportCapsule, "export_capsule"), (ImportCapsule, "import_capsule")):
            response = client.call(srv, service, capsule_id="x")
            assert not response.success and response.error_code == ErrorCode.NO_CAPSULE_DIR
            assert "capsule_dir" in response.message
    finally:
        for step in (Transition.TRANSITION_DEACTIVATE, Transition.TRANSITION_CLEANUP):
            transition(client, step)
        node.set_parameters([Parameter("capsule_dir", value=str(folders[0])),
                             Parameter("capsule_key_file", value=str(folders[1]))])
        for step in (Transition.TRANSITION_CONFIGURE, Transition.TRANSITION_ACTIVATE):
            transition(client, step)
    assert lifecycle_state(client) == State.PRIMARY_STATE_ACTIVE


@pytest.mark.parametrize("content, says", [(None, "cannot be read"), (b"", "holds 0 bytes")],
                         ids=["missing", "empty"])
def test_an_unusable_key_file_fails_configure_with_the_reason(ros_context, tmp_path, content, says):
    key = tmp_path / "capsule.key"
    if content is not None:
        key.write_bytes(content)
    params = {**TINY_PARAMS, "autostart": False, "capsule_dir": str(tmp_path / "c"), "capsule_key_file": str(key)}
    with running_node(ros_context, f"/t_bad_key_{'missing' if content is None else 'empty'}", **params) as node:
        client = RosClient(ros_context, node.get_fully_qualified_name())
        try:
            assert not transition(client, Transition.TRANSITION_CONFIGURE)
            assert lifecycle_state(client) == State.PRIMARY_STATE_UNCONFIGURED and node.worker is None
            assert "capsule_key_file" in node._last_error and says in node._last_error
        finally:
            client.close()
