"""Running the real ROS 2 command-line tools from tests (test_ros2_cli.py, test_ros2_launch.py).

They run where `ros2` (ros2cli) and launch_ros are installed: CI installs them from ../shared/ros-tools, a
robot has them with ROS 2; elsewhere :func:`require_tools` skips the module with the reason. The tools
find the package through AMENT_PREFIX_PATH (the venv is the ROS prefix); the nodes they start import the
working tree (PYTHONPATH), as the in-process tests do. DDS settings (loopback, ROS_DOMAIN_ID) come from
conftest.py's environment.
"""
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from lifecycle_msgs.srv import GetState

ROOT = Path(__file__).resolve().parents[2]
ROS2 = Path(sys.executable).with_name("ros2")
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
       "AMENT_PREFIX_PATH": os.pathsep.join(p for p in (sys.prefix, os.environ.get("AMENT_PREFIX_PATH")) if p)}


def require_tools() -> None:
    """Skip the calling test module unless ros2cli and launch_ros are installed."""
    pytest.importorskip("launch_ros.actions", reason="ROS 2 launch_ros is not installed (../shared/ros-tools)")
    if not ROS2.is_file():
        pytest.skip(f"the ros2 command (ros2cli) is not installed next to {sys.executable}",
                    allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def ros2_daemon_stopped():
    """ros2cli starts a daemon for this ROS_DOMAIN_ID on first use; stop it after the module."""
    yield
    subprocess.run([str(ROS2), "daemon", "stop"], env=ENV, capture_output=True, timeout=30)


# what ros2cli answers when it found no node, or no service of it, in the graph yet
NOT_FOUND = ("Node not found", "Wait for service timed out")


def ros2(*args: str, timeout: float = 60.0, find_timeout: float = 30.0) -> str:
    """Run `ros2 ARGS...`; its stdout and stderr together (it must exit 0). Asked again while it answers that it
    did not find the node or its service: the verbs that take a node (`param`, `lifecycle`) look it up in the
    daemon's graph, which can lag behind, or briefly lose, a node it listed a moment before on a loaded machine,
    and `param set` then waits a few seconds for the node's parameter services (both seen in CI); a call that found
    no node or service did nothing, so asking again is safe. Anything else it answers, and a node still missing
    after ``find_timeout`` s, fail."""
    deadline = time.monotonic() + find_timeout
    while True:
        done = subprocess.run([str(ROS2), *args], env=ENV, capture_output=True, text=True, timeout=timeout)
        output = done.stdout + done.stderr
        if done.returncode == 0 or not any(m in output for m in NOT_FOUND) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert done.returncode == 0, f"ros2 {' '.join(args)} exited {done.returncode}:\n{output}"
    return output


@contextmanager
def started(*command: str, log: Path):
    """`ros2 launch` / `ros2 run` in its own process group; SIGINT (then SIGKILL) on exit."""
    with log.open("w") as out:
        process = subprocess.Popen([str(ROS2), *command], env=ENV, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        yield process
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def lifecycle_state(node: str) -> str:
    return ros2("lifecycle", "get", node).split()[0]


def wait_for_state(client, state: int, log: Path, timeout: float = 120.0) -> None:
    """Wait (in-process, cheaper than polling the CLI) until the node is in lifecycle ``state``.

    A process started by `ros2 launch` / `ros2 run` may take long to answer on a loaded machine (its
    services appear before it spins, and a request sent before the reply path matched is lost), so an
    unanswered get_state is sent again every few seconds until the deadline."""
    deadline = time.monotonic() + timeout
    get_state = client.node.create_client(GetState, f"{client.target}/get_state")
    try:
        while (left := deadline - time.monotonic()) > 0:
            answered = threading.Event()
            future = get_state.call_async(GetState.Request())
            future.add_done_callback(lambda _, done=answered: done.set())
            if answered.wait(min(5.0, left)) and future.result().current_state.id == state:
                return
            time.sleep(0.2)
    finally:
        client.node.destroy_client(get_state)
    pytest.fail(f"{client.target} did not reach state {state} within {timeout} s; log:\n{log.read_text()}")


def wait_for_daemon(node: str, timeout: float = 30.0) -> None:
    """Wait until the ros2 daemon lists ``node``: `ros2 param` asks the daemon for node names and says
    "Node not found" while a freshly started one has not discovered it yet. The daemon is started first:
    a call that finds none spawns it but answers from a node of its own, so it would prove nothing."""
    ros2("daemon", "start")
    deadline = time.monotonic() + timeout
    while node not in ros2("node", "list").split():
        if time.monotonic() > deadline:
            pytest.fail(f"the ros2 daemon did not discover {node} within {timeout} s")
        time.sleep(0.3)


def lifecycle_set(node: str, transition: str) -> str:
    # `ros2 lifecycle set` exits 0 when the transition fails: its output says which.
    return ros2("lifecycle", "set", node, transition).strip()
