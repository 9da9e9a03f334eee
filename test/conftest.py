"""Shared pytest setup: DDS stays on loopback, one compute thread, and fixtures to run a flashrt node
in-process.

The environment is fixed at import, before any test module imports rclpy or torch (node subprocesses
that tests start inherit it): discovery limited to localhost, a random ROS_DOMAIN_ID (unless one is
set) so parallel runs do not see each other, one domain each for pytest-xdist's workers (``make test`` runs
``-n auto``: gw0 keeps the run's domain, gw1 the next, ...), and OMP_NUM_THREADS=1. The tiny model gains nothing from
intra-op threads, while every engine (the test process's and each node subprocess's) spinning a
thread per core on a 2-core CI machine makes decode steps orders of magnitude slower.
"""
import importlib.util
import os
import random
import sys

os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
os.environ["ROS_LOCALHOST_ONLY"] = "1"
os.environ.setdefault("ROS_DOMAIN_ID", str(random.randint(1, 100)))
worker = os.environ.get("PYTEST_XDIST_WORKER", "")     # xdist's gw0, gw1, ...: set before this file is imported
if worker.startswith("gw"):
    os.environ["ROS_DOMAIN_ID"] = str((int(os.environ["ROS_DOMAIN_ID"]) + int(worker[2:]) - 1) % 100 + 1)
os.environ["OMP_NUM_THREADS"] = "1"
# Triton kernels are checked on the CPU through Triton's interpreter; it must be chosen before triton is imported.
if not os.path.exists("/dev/nvidia0") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "torch" in sys.modules:  # imported by a plugin before this file: the variable came too late for it
    sys.modules["torch"].set_num_threads(1)


def _interpreter_patches_the_language_once_per_launch():
    """Triton's interpreter (the pinned 3.9.0) swaps the builtins of the language modules a function names
    (triton.language, triton.language.core) for interpreted ones at each kernel launch, restoring them when its grid
    ends, and again at every call of a @jit function inside the kernel, where they are swapped already: each repeat
    scans the modules with inspect.getmembers, half of a speculative decoding test's time. Here a call whose modules
    are all swapped right now (their ``arange`` is no longer the builtin) patches nothing; any other patches as
    before, so launches still patch and restore."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang

    class _AlreadyPatched:
        def restore(self):
            pass

    def patch_unless_patched(fn):
        named = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        if named and not any(tl.core.is_builtin(module.arange) for module in named):
            return _AlreadyPatched()
        return patch_lang(fn)
    interpreter._patch_lang = patch_unless_patched


if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):  # (make test-jazzy has none)
    _interpreter_patches_the_language_once_per_launch()

import threading  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import pytest  # noqa: E402

TINY_PARAMS = {"model": "tiny", "max_context": 512, "capsule_budget_mb": 16, "stream_chunk_tokens": 4,
               "diagnostics_period_s": 0.2, "request_timeout_s": 10.0}


def wait_for(predicate, timeout=10.0, what="condition"):
    """Poll ``predicate`` until it is truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


class RosClient:
    """A plain rclpy node (own executor thread) that calls a flashrt node's services, topics and action."""

    def __init__(self, context, target: str):
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.node import Node

        from flashrt_ros.client import BackgroundSpinner

        self.node = Node(f"test_client_{os.getpid()}_{random.randint(0, 1 << 30)}", context=context)
        self.target = target  # fully qualified name of the flashrt node, e.g. /t/flashrt
        self._clients = {}
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(self.node)
        self._spinner = BackgroundSpinner(executor)

    def wait(self, future, timeout):
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        if not done.wait(timeout):
            pytest.fail(f"no answer within {timeout} s")
        return future.result()

    def call(self, srv_type, name: str, timeout: float = 20.0, **fields):
        """Call ``<target>/<name>`` (or an absolute ``name``) and return the response."""
        path = name if name.startswith("/") else f"{self.target}/{name}"
        client = self._clients.get(path)
        if client is None:
            client = self._clients[path] = self.node.create_client(srv_type, path)
        assert client.wait_for_service(timeout_sec=10.0), f"service {path} not available"
        return self.wait(client.call_async(srv_type.Request(**fields)), timeout)

    def subscribe(self, msg_type, topic: str, qos=100) -> list:
        """Collect every message on ``<target>/<topic>`` (or an absolute topic) into the returned list."""
        path = topic if topic.startswith("/") else f"{self.target}/{topic}"
        received = []
        self.node.create_subscription(msg_type, path, received.append, qos)
        return received

    def publisher(self, msg_type, topic: str, qos=10):
        path = topic if topic.startswith("/") else f"{self.target}/{topic}"
        pub = self.node.create_publisher(msg_type, path, qos)
        return pub

    def action_client(self, action_type, name: str):
        from rclpy.action import ActionClient

        client = ActionClient(self.node, action_type, f"{self.target}/{name}")
        assert client.wait_for_server(timeout_sec=10.0), f"action {name} not available"
        return client

    def send_goal(self, client, goal, feedback: list, timeout: float = 30.0):
        """Send a goal; return its goal handle once accepted (feedback messages go into ``feedback``)."""
        return self.wait(client.send_goal_async(goal, feedback_callback=feedback.append), timeout)

    def result(self, goal_handle, timeout: float = 60.0):
        return self.wait(goal_handle.get_result_async(), timeout)

    def close(self):
        self._spinner.close(5.0)
        self.node.destroy_node()


@pytest.fixture(scope="module")
def ros_context():
    import rclpy

    context = rclpy.Context()
    rclpy.init(context=context)
    yield context
    rclpy.try_shutdown(context=context)


@contextmanager
def running_node(context, namespace: str, cli_args=None, **params):
    """A FlashRTNode spun by a MultiThreadedExecutor in a thread, as ``main()`` would run it."""
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.parameter import Parameter

    from flashrt_ros.client import BackgroundSpinner

    from flashrt_ros.node import EXECUTOR_THREADS, FlashRTNode

    node = FlashRTNode(namespace=namespace, context=context, cli_args=cli_args,
                       parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS, context=context)
    executor.add_node(node)
    try:
        with BackgroundSpinner(executor):
            yield node
    finally:
        node.destroy_node()


@pytest.fixture(scope="module")
def node_and_client(ros_context, request):
    """A tiny-model node (active) in its own namespace, and a client node aimed at it.

    A test module may set ``NODE_PARAMS`` to override :data:`TINY_PARAMS`.
    """
    namespace = f"/t_{request.module.__name__.rsplit('.', 1)[-1]}"
    params = {**TINY_PARAMS, **getattr(request.module, "NODE_PARAMS", {})}
    with running_node(ros_context, namespace, **params) as node:
        client = RosClient(ros_context, node.get_fully_qualified_name())
        yield node, client
        client.close()


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty hands out NaN-filled tensors, so an output element a kernel fails to write shows up."""
    import torch

    real = torch.empty

    def empty(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out
    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A small Qwen3.5-layout model with its MTP head, trained here by bench/train_tiny_lm.py, once per session (the
    weight-format fidelity and the speculative-decoding tests of test/runtime/ share it). Returns its folder and
    training record."""
    import bench_scripts     # test/runtime/, on sys.path for the tests there that use this

    folder = tmp_path_factory.mktemp("trained") / "lm"
    record = bench_scripts.load("train_tiny_lm").build(
        folder, steps=150, hidden=64, layers=4, heads=4, head_dim=16, vocab=320, batch=16, seq_len=64, lr=3e-3,
        corpus_chars=400_000, heldout=0.02, seed=0)
    return folder, record
