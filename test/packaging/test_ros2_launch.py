"""`ros2 launch` with the Thor parameter file in a namespace under another name, driven by `ros2 lifecycle`
and `ros2 param`; `ros2 run`. See ros2_tools.py for where they run.
"""
import sys

import re

import pytest
import yaml
from conftest import RosClient
from lifecycle_msgs.msg import State
from ros2_tools import (lifecycle_set, lifecycle_state, require_tools, ros2, ros2_daemon_stopped,  # noqa: F401
                        started, wait_for_daemon, wait_for_state)

require_tools()
pytestmark = pytest.mark.launch


def test_thor_file_in_a_namespace_driven_through_the_lifecycle(ros_context, tmp_path):
    """The Thor profile on the CPU, unconfigured at start, in a namespace under another name; `ros2 lifecycle`
    drives it. tiny's 512-token vocabulary cannot hold Thor's action bins, so the first configure fails
    (the node stays unconfigured and accepts new values), then succeeds once the discretiser fits."""
    node, log = "/robot/arm_llm", tmp_path / "thor.log"
    (tmp_path / "fit_tiny.yaml").write_text(
        "/**:\n  ros__parameters:\n    discretiser:\n      token_offset: 257\n      bins: 255\n")
    with started("launch", "flashrt_ros", "flashrt.launch.py", "autostart:=false", "namespace:=robot",
                 "node_name:=arm_llm", "model:=tiny", "device:=cpu",
                 f"params_file:={sys.prefix}/share/flashrt_ros/config/thor.yaml", log=log):
        client = RosClient(ros_context, node)
        try:
            wait_for_state(client, State.PRIMARY_STATE_UNCONFIGURED, log)
        finally:
            client.close()
        wait_for_daemon(node)
        dumped = yaml.safe_load(ros2("param", "dump", node))[node]["ros__parameters"]
        assert (dumped["max_context"], dumped["dtype"], dumped["device"]) == (16384, "bfloat16", "cpu")
        assert lifecycle_set(node, "configure") == "Transitioning failed"
        assert lifecycle_state(node) == "unconfigured"
        assert "Set parameter discretiser.bins successful" in ros2("param", "load", node, str(tmp_path / "fit_tiny.yaml"))
        assert lifecycle_set(node, "configure") == "Transitioning successful"
        assert "Setting parameter failed: max_context: read at configure" in ros2(
            "param", "set", node, "max_context", "1024")
        assert lifecycle_set(node, "activate") == "Transitioning successful"
        listing = ros2("service", "call", f"{node}/list_capsules", "flashrt_ros/srv/ListCapsules")
        # thor.yaml's budget (8 GiB), capped by its capsule_budget_fraction of MemAvailable on this machine
        budget = int(re.search(r"budget_bytes=(\d+)", listing).group(1))
        assert "success=True" in listing and 0 < budget <= 8192 << 20
        for transition, state in (("deactivate", "inactive"), ("cleanup", "unconfigured")):
            assert lifecycle_set(node, transition) == "Transitioning successful"
            assert lifecycle_state(node) == state
        assert "Set parameter successful" in ros2("param", "set", node, "max_context", "1024")


def test_ros2_run_starts_the_node(ros_context, tmp_path):
    log = tmp_path / "run.log"
    with started("run", "flashrt_ros", "flashrt_node", "--ros-args", "-r", "__node:=run_node",
                 "-p", "autostart:=false", log=log):
        client = RosClient(ros_context, "/run_node")
        try:
            wait_for_state(client, State.PRIMARY_STATE_UNCONFIGURED, log)
        finally:
            client.close()
        wait_for_daemon("/run_node")
        assert lifecycle_state("/run_node") == "unconfigured"
