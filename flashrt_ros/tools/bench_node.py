"""ROS latency benchmark: the flashrt node in one process, this client in another.

Measures, over loopback DDS:

* service round trip p50/p99 of ``~/snapshot`` and ``~/restore`` at a few context lengths (the
  node's own ``latency_ms`` is reported next to it, so the ROS share is visible);
* the latency from publishing an urgent observation to receiving its first token while a long
  generation runs, next to the same observation's latency on an idle node (the node streams one
  token per chunk here, so the first chunk is the first token);
* bursts: 500 observations published at full speed, 100 concurrent service calls and 30 concurrent
  ``~/generate`` goals, each as answered / sent and the p50/p99 time to its answer;
* observations at sensor rate (``--rates``): at each rate, short ingest-only observations for
  ``--rate-seconds``, ``--probe-hz`` of them per second probes that generate one token (normal, then in a
  second run urgent): the sustained observations/s the node applied, publish -> 'observe' event
  latency of every observation, publish -> first token latency of the probes, and (urgent runs) the
  longest an urgent probe waited in the node for the engine (``urgent_wait_ms_max`` on /diagnostics).

Prints a markdown table and writes the raw figures as JSON (``--out``)::

    python -m flashrt_ros.tools.bench_node --model tiny --out bench_node.json
"""
import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from flashrt_ros.demo import ensure_loopback_env, local_node
from flashrt_ros.tools import provenance


def percentiles(samples_ms):
    ordered = sorted(samples_ms)

    def pick(q):
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"n": len(ordered), "p50_ms": statistics.median(ordered), "p99_ms": pick(0.99),
            "max_ms": ordered[-1]}


def _check(response, what):
    if not response.success:
        raise RuntimeError(f"{what} refused: error_code {response.error_code}: {response.message}")
    return response


def fill_context(client, tokens: int) -> int:
    """Reset, then feed ``tokens`` token ids and generate one token; returns the live position.

    The ids are printable ASCII (32..126), valid in every model's vocabulary (tiny is byte-level).
    """
    _check(client.reset(), "reset")
    ids = [32 + (7 * i) % 95 for i in range(tokens)]
    return _check(client.generate(token_ids=ids, max_new_tokens=1, temperature=0.0), "generate").position


def service_latency(client, context, calls):
    """Snapshot and restore ``calls`` times each at ``context`` tokens."""
    position = fill_context(client, context)
    snap_rt, snap_node, restore_rt, restore_node = [], [], [], []
    for _ in range(calls):
        start = time.perf_counter()
        response = _check(client.snapshot("bench"), "snapshot")
        snap_rt.append((time.perf_counter() - start) * 1e3)
        snap_node.append(response.latency_ms)
        _check(client.drop(response.capsule.id), "drop")
    capsule = _check(client.snapshot("bench restore"), "snapshot").capsule
    for _ in range(calls):
        start = time.perf_counter()
        response = _check(client.restore(capsule.id), "restore")
        restore_rt.append((time.perf_counter() - start) * 1e3)
        restore_node.append(response.latency_ms)
    _check(client.drop(capsule.id), "drop")
    return [
        {"op": "snapshot", "position": position, "round_trip": percentiles(snap_rt),
         "node": percentiles(snap_node), "capsule_bytes": capsule.bytes},
        {"op": "restore", "position": position, "round_trip": percentiles(restore_rt),
         "node": percentiles(restore_node), "capsule_bytes": capsule.bytes},
    ]


def first_token_latency(client, trials, long_tokens):
    """Publish -> first token of an observation: urgent while a long generation runs, and idle.

    The idle figure (the same observation with nothing running) is the baseline: the difference is
    what preempting costs (finishing the current decode step and keeping the interrupted capsule).
    """
    from flashrt_ros.msg import Observation

    def first_token_ms(observation):
        start = time.perf_counter()
        stream = client.wait_tokens(stamp_ns=client.publish(observation))
        return (stream.first_token_at - start) * 1e3

    urgent, idle = [], []
    _check(client.reset(), "reset")
    _check(client.generate("The robot is working in the kitchen.", 1, temperature=0.0), "generate")
    base = _check(client.snapshot("bench urgent base"), "snapshot").capsule
    for trial in range(trials):
        text = f"Stop now ({trial})."
        _check(client.restore(base.id), "restore")
        idle.append(first_token_ms(client.observation(text, max_new_tokens=1)))
        _check(client.restore(base.id), "restore")
        long_stamp = client.publish(client.observation(" Describe the kitchen.", max_new_tokens=long_tokens))
        client.wait_tokens(stamp_ns=long_stamp, min_tokens=1)
        urgent.append(first_token_ms(client.observation(text, max_new_tokens=1,
                                                        priority=Observation.PRIORITY_URGENT)))
        interrupted = client.wait_tokens(stamp_ns=long_stamp)
        if interrupted.finish_reason != "preempted":
            raise RuntimeError(f"trial {trial}: the long generation ended '{interrupted.finish_reason}' "
                               "before the urgent observation arrived")
        _check(client.drop(f"interrupted-{interrupted.request_id}"), "drop")
    _check(client.drop(base.id), "drop")
    return [{"op": "urgent observation -> first token (generation running)", "position": base.position,
             "round_trip": percentiles(urgent)},
            {"op": "same observation -> first token (idle)", "position": base.position,
             "round_trip": percentiles(idle)}]


def _wait_all(count, answered, timeout: float, quiet_s: float = 5.0) -> None:
    """Wait until ``answered()`` reaches ``count``, or nothing new arrived for ``quiet_s`` (lost for good)."""
    deadline, last, last_change = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = answered()
        if n >= count:
            return
        if n != last:
            last, last_change = n, time.monotonic()
        elif time.monotonic() - last_change > quiet_s:
            return
        time.sleep(0.01)


def _burst_row(op, sent, latencies_ms, extra=None):
    row = {"op": op, "sent": sent, "answered": len(latencies_ms),
           "round_trip": percentiles(latencies_ms) if latencies_ms else None}
    return {**row, **(extra or {})}


def burst_observations(client, count: int = 500, timeout: float = 120.0):
    """Publish ``count`` generating observations (one token id, one new token) as fast as possible; an
    observation is answered by its final ~/tokens chunk (success or ``error``). Also counts the node's
    'observation_lost' reports on ~/events (0 on a node that predates them)."""
    from flashrt_ros.msg import StateEvent

    lost = []
    sub = client.node.create_subscription(
        StateEvent, f"{client.ns}/events", lambda e: lost.append(e.count) if e.op == "observation_lost" else None,
        1000)
    sent_at = {}
    for _ in range(count):
        observation = client.observation(token_ids=[65], max_new_tokens=1)
        sent_at[client.publish(observation)] = time.perf_counter()
    _wait_all(count, lambda: len(client.finished_streams(sent_at)), timeout)
    done = client.finished_streams(sent_at)
    client.node.destroy_subscription(sub)
    latencies = [(s.first_token_at - sent_at[stamp]) * 1e3 for stamp, s in done.items()]
    return _burst_row("burst: observations -> final chunk", count, latencies, {"reported_lost": sum(lost)})


def burst_services(client, count: int = 100, timeout: float = 60.0):
    """``count`` concurrent service calls (half snapshots, half list_capsules); each must be answered."""
    started = time.perf_counter()
    answered = {}
    futures = [client.call_async("snapshot" if i % 2 else "list_capsules", **({"label": "burst"} if i % 2 else {}))
               for i in range(count)]
    for i, future in enumerate(futures):
        future.add_done_callback(lambda f, i=i: answered.setdefault(i, (time.perf_counter() - started) * 1e3))
    _wait_all(count, lambda: len(answered), timeout)
    refused = sum(1 for f in futures if f.done() and f.result() is not None and not f.result().success)
    for f in futures:
        if f.done() and f.result() is not None and getattr(f.result(), "capsule", None) and f.result().success:
            client.drop(f.result().capsule.id)
    return _burst_row("burst: concurrent service calls", count, list(answered.values()), {"refused": refused})


def burst_goals(client, count: int = 30, timeout: float = 120.0):
    """``count`` ~/generate goals at once: each gets a result or a rejection (goals past the cap)."""
    from flashrt_ros.client import ClientError

    started = time.perf_counter()
    answered, rejected = {}, []
    futures = [client.generate_async(token_ids=[66], max_new_tokens=2, temperature=0.0) for _ in range(count)]

    def done(i, future):
        answered.setdefault(i, (time.perf_counter() - started) * 1e3)
        if isinstance(future.exception(), ClientError):
            rejected.append(i)
    for i, future in enumerate(futures):
        future.add_done_callback(lambda f, i=i: done(i, f))
    _wait_all(count, lambda: len(answered), timeout)
    return _burst_row("burst: concurrent ~/generate goals", count, list(answered.values()),
                      {"rejected": len(rejected)})


def observation_rate(client, rate_hz: float, seconds: float, probe_hz: float, urgent: bool,
                     timeout: float = 120.0) -> dict:
    """Publish ``rate_hz * seconds`` short observations at ``rate_hz`` into a reset node, ``probe_hz`` of them
    per second probes that generate one token (urgent or normal); the figures of :func:`observation_rates`."""
    from diagnostic_msgs.msg import DiagnosticArray

    from flashrt_ros.msg import Observation, StateEvent

    _check(client.reset(), "reset")
    applied, dropped, waits = {}, [], []
    diagnostics = client.node.create_subscription(DiagnosticArray, "/diagnostics", lambda m: waits.extend(
        float(kv.value) for s in m.status for kv in s.values if kv.key == "urgent_wait_ms_max"), 10)

    def on_event(e):
        stamp = e.observation.header.stamp.sec * 1_000_000_000 + e.observation.header.stamp.nanosec
        if e.op == "observe" and e.success:
            applied.setdefault(stamp, (time.perf_counter(), e.count))
        elif e.op in ("observe", "observation_dropped", "observation_lost"):
            dropped.append(e.op)
    sub = client.node.create_subscription(StateEvent, f"{client.ns}/events", on_event, 1000)
    count = int(rate_hz * seconds)
    sent_at, probes = {}, []
    priority = Observation.PRIORITY_URGENT if urgent else Observation.PRIORITY_NORMAL
    start = time.perf_counter()
    probe_every = max(1, round(rate_hz / probe_hz))
    for i in range(count):
        probe = (i + 1) % probe_every == 0
        msg = client.observation(f"j{i % 100};", max_new_tokens=1 if probe else 0,
                                 priority=priority if probe else Observation.PRIORITY_NORMAL)
        stamp = client.publish(msg)
        sent_at[stamp] = time.perf_counter()
        if probe:
            probes.append(stamp)
        delay = start + (i + 1) / rate_hz - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    published_s = time.perf_counter() - start
    _wait_all(count, lambda: len(applied) + len(dropped), timeout)
    _wait_all(len(probes), lambda: len(client.finished_streams(probes)), timeout)
    client.node.destroy_subscription(sub)
    seen = len(waits)
    _wait_all(seen + 1, lambda: len(waits), 10.0)  # the diagnostics message that covers the run's end
    client.node.destroy_subscription(diagnostics)
    streams = client.finished_streams(probes)
    last = max((t for t, _ in applied.values()), default=start)
    ingest = [(applied[s][0] - sent_at[s]) * 1e3 for s in sent_at if s in applied]
    first = [(streams[s].first_token_at - sent_at[s]) * 1e3 for s in probes if s in streams]
    return {"rate_hz": rate_hz, "probe": "urgent" if urgent else "normal", "published": count,
            "published_hz": count / published_s, "applied": len(applied), "not_applied_events": len(dropped),
            "sustained_per_s": len(applied) / (last - start) if applied else 0.0,
            "groups": sum(1 for _, n in applied.values() if n == 0),
            "ingest": percentiles(ingest) if ingest else None,
            "first_token": percentiles(first) if first else None,
            "urgent_wait_ms_max": max(waits, default=0.0)}


def observation_rates(client, rates, seconds: float, probe_hz: float) -> list[dict]:
    """Each rate twice: probes of normal priority, then urgent ones."""
    return [observation_rate(client, rate, seconds, probe_hz, urgent) for rate in rates for urgent in (False, True)]


def rates_markdown(rows) -> str:
    lines = ["| rate (Hz) | probe | published | applied | sustained (obs/s) | prefills | observe p50 / p99 (ms) | "
             "probe first token p50 / p99 (ms) | urgent wait max (ms) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ing, ft = (f"{p['p50_ms']:.1f} / {p['p99_ms']:.1f}" if p else "—" for p in (r["ingest"], r["first_token"]))
        wait = f"{r['urgent_wait_ms_max']:.1f}" if r["probe"] == "urgent" else ""
        lines.append(f"| {r['rate_hz']:g} | {r['probe']} | {r['published']} | {r['applied']} | "
                     f"{r['sustained_per_s']:.0f} | {r['groups']} | {ing} | {ft} | {wait} |")
    return "\n".join(lines)


def markdown(rows) -> str:
    lines = ["| measurement | context (tokens) | n | p50 (ms) | p99 (ms) | node p50 (ms) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        rt = r["round_trip"]
        node_p50 = f"{r['node']['p50_ms']:.3f}" if "node" in r else ""
        lines.append(f"| {r['op']} | {r['position']} | {rt['n']} | {rt['p50_ms']:.2f} | {rt['p99_ms']:.2f} | "
                     f"{node_p50} |")
    return "\n".join(lines)


def burst_markdown(rows) -> str:
    lines = ["| burst | sent | answered | p50 (ms) | p99 (ms) | notes |", "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        rt = r["round_trip"] or {"p50_ms": float("nan"), "p99_ms": float("nan")}
        notes = ", ".join(f"{k} {r[k]}" for k in ("reported_lost", "refused", "rejected") if k in r)
        lines.append(f"| {r['op']} | {r['sent']} | {r['answered']} | {rt['p50_ms']:.1f} | {rt['p99_ms']:.1f} | {notes} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1536])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--long-tokens", type=int, default=256)
    parser.add_argument("--burst-observations", type=int, default=500)
    parser.add_argument("--burst-calls", type=int, default=100)
    parser.add_argument("--burst-goals", type=int, default=30)
    parser.add_argument("--rates", type=float, nargs="*", default=[],
                        help="observation rates (Hz) to run the sensor-rate measurement at (none: skip it)")
    parser.add_argument("--rate-seconds", type=float, default=2.0)
    parser.add_argument("--probe-hz", type=float, default=10.0, help="probes (one generated token) per second")
    parser.add_argument("--rates-only", action="store_true", help="run only the sensor-rate measurement")
    parser.add_argument("--node-param", action="append", default=[], metavar="NAME=VALUE",
                        help="a further node parameter, e.g. observation_queue.max_group_bytes=256")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    max_context = max(max(args.contexts) + args.long_tokens, 2 * args.burst_observations + 4 * args.burst_goals,
                      6 * int(max(args.rates, default=0) * args.rate_seconds)) + 128

    ensure_loopback_env()
    log_path = Path(tempfile.mkdtemp(prefix="flashrt_bench_")) / "node.log"
    rows, bursts = [], []
    with local_node(log_path, 300.0, model=args.model, device=args.device, max_context=max_context,
                    autostart=True, stream_chunk_tokens=1, **dict(p.split("=", 1) for p in args.node_param)) as (client, _):
        if not args.rates_only:
            rows = [row for context in args.contexts for row in service_latency(client, context, args.calls)]
            rows += first_token_latency(client, args.trials, args.long_tokens)
            _check(client.reset(), "reset")
            bursts = [burst_observations(client, args.burst_observations),
                      burst_services(client, args.burst_calls), burst_goals(client, args.burst_goals)]
        rates = observation_rates(client, args.rates, args.rate_seconds, args.probe_hz)
    for table, render in ((rows, markdown), (bursts, burst_markdown), (rates, rates_markdown)):
        if table:
            print(render(table))
            print()
    if args.out:
        meta = {"model": args.model, "device": args.device, "max_context": max_context, "node_params": args.node_param,
                "machine": platform.platform()}
        provenance.write_result(args.out, {"meta": meta, "results": rows, "bursts": bursts,
                                           "observation_rates": rates}, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
