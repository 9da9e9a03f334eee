"""Load, bounded: bursts against a node in its own process, every request accounted for, memory bounded.

Loopback only. Counts: 500 observations published at full speed, 100 concurrent service calls, 30 concurrent
``~/generate`` goals (past the cap of goals in flight they are rejected, never left unanswered). The figures
themselves (p50/p99) are the benchmark's (``flashrt_ros.tools.bench_node``); here only the accounting is asserted.
"""
import time
from pathlib import Path

import pytest
from conftest import TINY_PARAMS, RosClient, running_node, wait_for

from flashrt_ros.tools.bench_node import burst_goals, burst_observations, burst_services
from flashrt_ros.demo import local_node
from flashrt_ros.ros_convert import SequenceGaps

OBSERVATIONS, CALLS, GOALS = 500, 100, 30
RSS_GROWTH_LIMIT_MIB = 150  # capsule budget (16 MiB) + DDS history of the bursts, with room for the allocator


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def node_process(tmp_path_factory):
    params = {**TINY_PARAMS, "max_context": 2048, "request_timeout_s": 30.0}
    with local_node(tmp_path_factory.mktemp("load") / "node.log", 120.0, **params) as (client, proc):
        client.observe("warm up", 2)
        client.generate("warm up", 2, temperature=0.0)
        yield client, proc


def test_bursts_are_all_answered_and_memory_stays_bounded(node_process):
    client, proc = node_process
    start, rss_before = time.monotonic(), rss_mib(proc.pid)

    observed = burst_observations(client, OBSERVATIONS, timeout=60.0)
    assert observed["answered"] == OBSERVATIONS and observed["reported_lost"] == 0, observed
    assert client.reset().success

    called = burst_services(client, CALLS, timeout=60.0)
    assert called["answered"] == CALLS, called  # a success or an error code each (BUDGET_EXCEEDED may refuse)

    goals = burst_goals(client, GOALS, timeout=60.0)
    assert goals["answered"] == GOALS, goals
    assert 0 < GOALS - goals["rejected"] <= GOALS  # some ran; the rest were rejected with a goal response

    growth = rss_mib(proc.pid) - rss_before
    assert growth < RSS_GROWTH_LIMIT_MIB, f"node RSS grew by {growth:.0f} MiB"
    assert time.monotonic() - start < 120


def test_sequence_gaps_count_what_was_lost_per_publisher():
    gaps = SequenceGaps()

    def info(gid, number):
        return {"publication_sequence_number": number, "publisher_gid": {"data": bytes([gid])}}
    assert [gaps.seen(info(1, n)) for n in (1, 2, 5, 6)] == [0, 0, 2, 0]
    assert gaps.seen(info(2, 7)) == 0  # a publisher first seen mid-stream: nothing known to be lost
    assert gaps.seen(info(1, 4)) == 0  # late or duplicate: no negative counts
    assert gaps.seen(None) == gaps.seen({"publication_sequence_number": None}) == 0


def test_lost_observations_are_an_event_a_counter_and_a_log_line(ros_context):
    from diagnostic_msgs.msg import DiagnosticArray
    from flashrt_ros.msg import Observation, StateEvent

    with running_node(ros_context, "/t_load_loss", **TINY_PARAMS) as node:
        client = RosClient(ros_context, node.get_fully_qualified_name())
        try:
            events = client.subscribe(StateEvent, "events")
            diagnostics = client.subscribe(DiagnosticArray, "/diagnostics")
            wait_for(lambda: node.count_subscribers(f"{node.get_fully_qualified_name()}/events") > 0)
            msg = Observation(text="a")
            for number in (1, 2, 6):  # 3, 4 and 5 never arrived
                node._on_observation(msg, {"publication_sequence_number": number,
                                           "publisher_gid": {"data": b"\x01"}})
            lost = wait_for(lambda: [e for e in events if e.op == "observation_lost"], what="the loss event")
            assert lost[0].count == 3 and "3 observation(s) lost" in lost[0].message
            # the observations that did arrive were processed (the first empty context observe is fine)
            wait_for(lambda: sum(e.op == "observe" and e.success for e in events) == 3, what="three observe events")

            def counter():
                for array in diagnostics:
                    for status in array.status:
                        values = {v.key: v.value for v in status.values}
                        if values.get("observations_lost") == "3":
                            return True
                return False
            wait_for(counter, what="observations_lost 3 on /diagnostics")
        finally:
            client.close()
