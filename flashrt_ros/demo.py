"""``flashrt_demo``: start a local flashrt node with the tiny model and show what capsules do.

The scripted session: observation -> tokens, snapshot, fork, rollback, restore, and an urgent
observation that interrupts a long generation which is then resumed. It prints each operation's
latency (client round trip and the node's own figure) and two token-identity checks:

* restore: the continuation after restoring a snapshot equals the one generated right after taking it;
* resume: the tokens of the interrupted generation plus the resumed ones equal an uninterrupted run.

It exits non-zero when a check fails. DDS stays on loopback: the ROS environment variables are set
here (when unset) before rclpy is imported, and the node subprocess inherits them.

:func:`ensure_loopback_env` and :func:`node_process` are also used by the latency benchmark and tests.
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parents[1]


def ensure_loopback_env() -> None:
    """Keep DDS on loopback and off the default domain, unless the caller already chose."""
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    os.environ.setdefault("ROS_LOCALHOST_ONLY", "1")
    os.environ.setdefault("ROS_DOMAIN_ID", str(1 + os.getpid() % 100))


@contextmanager
def node_process(log_path, **params):
    """Run ``python -m flashrt_ros.node`` with ``params`` as ROS parameters; stop it on exit.

    The node's output goes to ``log_path``. On exit the node gets SIGINT (a clean shutdown), then
    SIGTERM and SIGKILL if it does not stop in time; ``proc.returncode`` then tells how it ended.
    """
    args = [f"{k}:={str(v).lower() if isinstance(v, bool) else v}" for k, v in params.items()]
    cmd = [sys.executable, "-m", "flashrt_ros.node", "--ros-args",
           *[a for arg in args for a in ("-p", arg)]]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_SOURCE_ROOT), env.get("PYTHONPATH")]))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        for sig, grace in ((signal.SIGINT, 20), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            if proc.poll() is not None:
                break
            proc.send_signal(sig)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass


@contextmanager
def local_node(log_path, timeout=120.0, **params):
    """Start a node (:func:`node_process`) and yield ``(client, proc)`` once the node is active.

    The client runs on its own rclpy context, so it coexists with any other rclpy use in the
    process; the ROS environment must already be set (:func:`ensure_loopback_env`).
    """
    import rclpy

    from flashrt_ros.client import ClientError, FlashRTClient

    with node_process(log_path, **params) as proc:
        context = rclpy.Context()
        rclpy.init(context=context)
        node = rclpy.create_node(f"flashrt_client_{os.getpid()}", context=context)
        client = FlashRTClient(node, timeout=timeout)
        try:
            deadline = time.monotonic() + timeout
            while True:  # in short steps, so that a node that died is reported at once
                try:
                    client.wait_ready(min(5.0, max(0.0, deadline - time.monotonic())))
                    break
                except ClientError as exc:
                    if proc.poll() is None and time.monotonic() < deadline:
                        continue
                    why = (f"node exited with code {proc.returncode}" if proc.poll() is not None
                           else f"node not ready after {timeout:.0f} s ({exc})")
                    log = Path(log_path).read_text(errors="replace")[-4000:]
                    raise ClientError(f"{why}\n--- node log ({log_path}) ---\n{log}") from None
            yield client, proc
        finally:
            client.close()
            node.destroy_node()
            context.try_shutdown()


class Report:
    """Collects the latency rows and check lines the demo prints."""

    def __init__(self):
        self.rows = []
        self.failed = []

    def timed(self, op, call, node_ms=lambda response: getattr(response, "latency_ms", None)):
        """Run ``call()``, record its round trip, fail loudly if the node refused it."""
        start = time.perf_counter()
        response = call()
        round_trip = (time.perf_counter() - start) * 1e3
        if getattr(response, "success", True) is False:
            raise RuntimeError(f"{op} refused: error_code {response.error_code}: {response.message}")
        self.rows.append((op, round_trip, node_ms(response)))
        return response

    def check(self, name, ok, detail):
        print(f"CHECK {name}: {'PASS' if ok else 'FAIL'} ({detail})", flush=True)
        if not ok:
            self.failed.append(name)

    def table(self) -> str:
        lines = ["| operation | round trip (ms) | node latency (ms) |", "|---|---:|---:|"]
        for op, round_trip, node_ms in self.rows:
            lines.append(f"| {op} | {round_trip:.2f} | {'' if node_ms is None else f'{node_ms:.2f}'} |")
        return "\n".join(lines)


def scripted_session(client, report, long_tokens):
    """The demo's operations against a ready node (see the module docstring)."""
    from flashrt_ros.msg import Observation

    report.timed("reset", client.reset)
    first = report.timed("observe -> tokens (8)",
                         lambda: client.observe("The robot sees a red cup on the table.", 8))
    print(f"tokens: {first.token_ids} {first.text!r}")
    cup = report.timed("snapshot", lambda: client.snapshot("red cup seen")).capsule
    before = client.observe(" Plan:", 16)
    report.timed("restore", lambda: client.restore(cup.id))
    after = client.observe(" Plan:", 16)
    report.check("restore -> same continuation", after.token_ids == before.token_ids,
                 f"{len(before.token_ids)} tokens, capsule {cup.id} at position {cup.position}")

    fork = report.timed("fork", lambda: client.fork(cup.id, label="alternative")).capsule
    rolled = report.timed("rollback", lambda: client.rollback(cup.id))
    report.check("rollback -> capsule position", rolled.position == cup.position,
                 f"position {rolled.position}, capsule at {cup.position}")
    restored = report.timed("restore fork", lambda: client.restore(fork.id))
    report.check("restore fork -> fork position", restored.position == fork.position,
                 f"position {restored.position}, fork at {fork.position}")

    task = " Describe every object on the table in detail."
    client.restore(cup.id)
    uninterrupted = client.observe(task, long_tokens)
    client.restore(cup.id)
    long_stamp = client.publish(client.observation(task, max_new_tokens=long_tokens))
    client.wait_tokens(stamp_ns=long_stamp, min_tokens=1)
    urgent = report.timed("urgent observation -> tokens (4)",
                          lambda: client.observe("Stop! A person is near the table.", 4,
                                                 priority=Observation.PRIORITY_URGENT), node_ms=lambda r: None)
    interrupted = client.wait_tokens(stamp_ns=long_stamp)
    print(f"urgent tokens: {urgent.token_ids}; interrupted after {len(interrupted.token_ids)} tokens "
          f"({interrupted.finish_reason})")
    resume = report.timed("resume", client.resume, node_ms=lambda r: None)
    resumed = client.wait_tokens(request_id=resume.request_id)
    joined = interrupted.token_ids + resumed.token_ids
    report.check("resume -> same tokens as uninterrupted run",
                 interrupted.finish_reason == "preempted" and joined == uninterrupted.token_ids,
                 f"{len(interrupted.token_ids)} + {len(resumed.token_ids)} tokens vs "
                 f"{len(uninterrupted.token_ids)}, interrupted stream ended '{interrupted.finish_reason}'")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Scripted flashrt_ros session against a local tiny-model node.")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--long-tokens", type=int, default=64,
                        help="length of the generation that the urgent observation interrupts")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the node")
    args = parser.parse_args(argv)

    ensure_loopback_env()
    from flashrt_ros.client import ClientError

    log_path = Path(tempfile.mkdtemp(prefix="flashrt_demo_")) / "node.log"
    report = Report()
    try:
        with local_node(log_path, args.timeout, model=args.model, max_context=args.max_context,
                        autostart=True, stream_chunk_tokens=1) as (client, proc):
            scripted_session(client, report, args.long_tokens)
    except (ClientError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report.check("node stopped cleanly", proc.returncode == 0, f"exit code {proc.returncode}")
    print(report.table())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
