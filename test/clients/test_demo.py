"""The demo and the ROS latency benchmark end to end: each starts its own node in a subprocess."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_module(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=600)


def test_demo_runs_and_its_checks_pass():
    done = run_module("flashrt_ros.demo", "--max-context", "512")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for check in ("restore -> same continuation", "rollback -> capsule position",
                  "restore fork -> fork position", "resume -> same tokens as uninterrupted run",
                  "node stopped cleanly"):
        assert any(line.startswith(f"CHECK {check}: PASS") for line in lines), done.stdout
    assert not any(": FAIL" in line for line in lines)
    table = [line for line in lines if line.startswith("| ")]
    ops = {line.split("|")[1].strip() for line in table}
    assert {"snapshot", "restore", "fork", "rollback", "resume", "urgent observation -> tokens (4)"} <= ops


def test_local_node_reports_a_node_that_cannot_start(tmp_path):
    from flashrt_ros.client import ClientError
    from flashrt_ros.demo import local_node

    log = tmp_path / "node.log"
    with pytest.raises(ClientError, match="node not ready after 20 s") as failure:   # (a loaded CI machine
        with local_node(log, timeout=20.0, model=str(tmp_path / "no_such_model")):   # may take 8 s to import)
            pass
    assert "configure failed" in str(failure.value)  # the node's log comes with the error


def test_bench_node_measures_every_row_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    done = run_module("flashrt_ros.tools.bench_node", "--contexts", "16", "64", "--calls", "3", "--trials", "2",
                      "--long-tokens", "48", "--burst-observations", "20", "--burst-calls", "10", "--burst-goals", "12",
                      "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())["results"]
    assert [(r["op"], r["round_trip"]["n"]) for r in results] == [
        ("snapshot", 3), ("restore", 3), ("snapshot", 3), ("restore", 3),
        ("urgent observation -> first token (generation running)", 2),
        ("same observation -> first token (idle)", 2)]
    assert [r["position"] for r in results[:4]] == [17, 17, 65, 65]  # the context asked for + 1 generated
    assert all(0 < r["round_trip"]["p50_ms"] <= r["round_trip"]["p99_ms"] for r in results)
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    bursts = json.loads(out.read_text())["bursts"]
    assert len(table) == 2 + len(results) + len(bursts)  # each table's header, then one row per result
    assert [(b["sent"], b["answered"]) for b in bursts] == [(20, 20), (10, 10), (12, 12)]


def test_bench_node_measures_observations_at_sensor_rate(tmp_path):
    out = tmp_path / "rates.json"
    done = run_module("flashrt_ros.tools.bench_node", "--rates-only", "--rates", "100", "--rate-seconds", "0.5",
                      "--probe-hz", "10", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["observation_rates"]
    assert [(r["rate_hz"], r["probe"], r["published"], r["applied"], r["first_token"]["n"]) for r in rows] == [
        (100, "normal", 50, 50, 5), (100, "urgent", 50, 50, 5)]
    assert all(0 < r["groups"] <= r["applied"] and r["ingest"]["n"] == 50 for r in rows)
    assert rows[1]["urgent_wait_ms_max"] > 0  # the node measured how long its urgent probes waited
    assert len([line for line in done.stdout.splitlines() if line.startswith("| ")]) == 1 + len(rows)  # header, rows
