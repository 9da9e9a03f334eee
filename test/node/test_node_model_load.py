"""Configuring the node on a bad checkpoint folder fails with LOAD_FAILED naming the file and the tensor, leaves the
node unconfigured with nothing held, and the same node configures once the folder is repaired."""
from conftest import TINY_PARAMS, RosClient, running_node
from lifecycle_msgs.msg import State, Transition
from lifecycle_msgs.srv import ChangeState, GetState

from flashrt_ros.tools import checkpoint_writer
from flashrt_ros.srv import Snapshot


def lifecycle_state(client) -> int:
    return client.call(GetState, "get_state").current_state.id


def transition(client, transition_id) -> bool:
    return client.call(ChangeState, "change_state", transition=Transition(id=transition_id)).success


def test_a_truncated_shard_fails_configure_and_the_repaired_folder_configures(ros_context, tmp_path):
    folder = checkpoint_writer.write("tiny", tmp_path / "nvfp4", "nvfp4", shard_bytes=60_000)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    intact = shard.read_bytes()
    shard.write_bytes(intact[:-64])
    params = {**TINY_PARAMS, "autostart": False, "model": str(folder), "weights_format": "nvfp4"}
    with running_node(ros_context, "/t_model_load", **params) as node:
        client = RosClient(ros_context, node.get_fully_qualified_name())
        try:
            assert not transition(client, Transition.TRANSITION_CONFIGURE)
            assert lifecycle_state(client) == State.PRIMARY_STATE_UNCONFIGURED and node.worker is None
            error = node._last_error
            assert "LOAD_FAILED" in error and shard.name in error and "truncated: tensor" in error, error
            shard.write_bytes(intact)
            assert transition(client, Transition.TRANSITION_CONFIGURE)
            assert transition(client, Transition.TRANSITION_ACTIVATE)
            assert client.call(Snapshot, "snapshot").success
        finally:
            client.close()
