"""The README's shell examples and the ROS 2 introspection tools against a node started by `ros2 launch`
with the default parameter file: every `ros2 service call` / `ros2 topic pub` / `ros2 action send_goal` /
`ros2 param set` line of the README's bash blocks runs verbatim (read from the README here, so the two
cannot drift) and prints what the README says; `ros2 param list/get/describe`, `ros2 interface show`,
`ros2 pkg`. See ros2_tools.py for where they run.
"""
import re
import shlex
import sys

import pytest
from conftest import RosClient, wait_for
from lifecycle_msgs.msg import State
from ros2_tools import (ROOT, require_tools, ros2, ros2_daemon_stopped, started, wait_for_daemon,  # noqa: F401
                        wait_for_state)

require_tools()

from flashrt_ros.msg import ErrorCode, TokenChunk  # noqa: E402
from flashrt_ros.params import PARAMETERS  # noqa: E402

pytestmark = pytest.mark.launch
README_VERBS = ("ros2 service call", "ros2 topic pub", "ros2 action send_goal", "ros2 param set")


def readme_examples() -> list[str]:
    text = (ROOT / "README.md").read_text()
    lines = [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]
    return [line for line in lines if line.startswith(README_VERBS)]


@pytest.fixture(scope="module")
def default_node(tmp_path_factory, ros_context):
    """`ros2 launch flashrt_ros flashrt.launch.py` with the default parameter file: the README's /flashrt."""
    log = tmp_path_factory.mktemp("cli") / "launch.log"
    with started("launch", "flashrt_ros", "flashrt.launch.py", "device:=cpu", log=log):
        client = RosClient(ros_context, "/flashrt")
        wait_for_state(client, State.PRIMARY_STATE_ACTIVE, log)
        wait_for_daemon("/flashrt")
        yield client, log
        client.close()


def expected(line: str, output: str) -> None:
    """What a README example must print: a refusal where its comment says `refused`, success otherwise."""
    refused = "# refused" in line
    code = re.search(r"# refused: ([A-Z_]+)", line)
    if line.startswith("ros2 service call"):
        assert "response:" in output and ("success=False" if refused else "success=True") in output, output
        assert code is None or f"error_code={getattr(ErrorCode, code.group(1))}" in output, output
    elif line.startswith("ros2 topic pub"):
        assert "publishing #1" in output, output
    elif line.startswith("ros2 action send_goal"):
        assert "Goal accepted" in output, output
        assert f"Goal finished with status: {'ABORTED' if refused else 'SUCCEEDED'}" in output, output
        assert "--feedback" not in line or "Feedback:" in output, output
        assert "output_type" not in line or "finish_reason: stop" in output, output   # a complete message
    else:
        assert ("Setting parameter failed" if refused else "Set parameter successful") in output, output


def test_every_readme_example_runs_verbatim_and_says_what_the_readme_says(default_node):
    client, _ = default_node
    examples = readme_examples()
    assert {verb for verb in README_VERBS if any(e.startswith(verb) for e in examples)} == set(README_VERBS)
    tokens = []
    subscription = client.node.create_subscription(TokenChunk, "/flashrt/tokens", tokens.append, 100)
    wait_for(lambda: subscription.get_publisher_count() > 0, 20.0, "a match with the node's ~/tokens")
    for line in examples:
        finals = sum(c.final for c in tokens)
        output = ros2(*shlex.split(line, comments=True)[1:])
        expected(line, output)
        if line.startswith("ros2 topic pub"):  # the observation was taken and answered on ~/tokens
            wait_for(lambda: sum(c.final for c in tokens) > finals, 60.0, f"the final chunk after: {line}")


def test_param_list_get_and_describe(default_node):
    listed = {line.strip() for line in ros2("param", "list", "/flashrt").splitlines()}
    assert {name for name, *_ in PARAMETERS} <= listed
    assert ros2("param", "get", "/flashrt", "max_context").strip() == "Integer value is: 512"  # default.yaml
    described = ros2("param", "describe", "/flashrt", "autostart", "seed", "sampling.top_p")
    assert "Read only: true" in described.split("Parameter name: seed")[0]  # autostart
    assert "read at configure" in described and "applies to the next generation" in described
    refused = ros2("param", "set", "/flashrt", "sampling.top_p", "0.0")
    assert "Setting parameter failed: sampling.top_p must be in (0, 1], got 0.0" in refused
    assert ros2("param", "get", "/flashrt", "sampling.top_p").strip() == "Double value is: 1.0"


def test_interface_show_and_package_contents(default_node):
    generate = ros2("interface", "show", "flashrt_ros/action/Generate")
    assert re.search(r"^float32 top_p 1\.0\b", generate, re.M), generate
    listed = set(ros2("interface", "package", "flashrt_ros").split())
    on_disk = {f"flashrt_ros/{kind}/{p.stem}" for kind in ("msg", "srv", "action") for p in (ROOT / kind).glob(f"*.{kind}")}
    assert listed == on_disk
    assert ros2("pkg", "prefix", "flashrt_ros").strip() == sys.prefix
    executables = {line.split()[1] for line in ros2("pkg", "executables", "flashrt_ros").splitlines()}
    assert {"flashrt_node", "flashrt_bag", "flashrt-runtime"} <= executables
