"""``flashrt_bag``: record a flashrt node's session into a bag and replay it as a regression test.

    flashrt_bag record [--node /flashrt] [-o BAG] [--storage mcap|sqlite3] [--duration S] [--timeout S]
    flashrt_bag adopt ROS2_BAG [--node /flashrt] -o BAG [--storage mcap|sqlite3] [--timeout S]
    flashrt_bag replay BAG (--offline | --live [--node NAME]) [--tolerance X]
                       [--allow-model-change] [-o OUT_BAG]

Exit codes of ``replay``: 0 every output identical, 1 diverged (the report names the first
divergent message per topic), 2 bad input (missing/corrupt bag, unusable bag, other model refused,
node unreachable, interrupted). ``record`` exits 0 after a clean stop (Ctrl-C once
recording, or ``--duration``) that recorded at least one message, and ``adopt`` after writing the
bag; both exit 2 otherwise, e.g. when the node is unconfigured (asked at once) or publishes no engine
fingerprint on ``/diagnostics`` within ``--timeout``, or nothing was recorded (the bag is kept, empty).
The bag tools never load the model to learn the fingerprint: the node reports it.

DDS stays on loopback unless the caller's environment says otherwise
(``ROS_AUTOMATIC_DISCOVERY_RANGE``/``ROS_LOCALHOST_ONLY`` default to local); set ``ROS_DOMAIN_ID``
to the node's domain.
"""
import argparse
import os
import sys
import time
from pathlib import Path

from flashrt_ros.bag.bagfile import STORAGES, BagError, read_bag
from flashrt_ros.bag.compare import OUTPUT_TOPICS, compare, format_report
from flashrt_ros.bag.script import build_script

IDENTICAL, DIVERGED, BAD_INPUT = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashrt_bag", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record a running node's session (rclpy, no rosbag2 needed)")
    rec.add_argument("--node", default="/flashrt", help="fully qualified name of the flashrt node")
    rec.add_argument("-o", "--output", type=Path, help="bag directory to create (default: flashrt_<time>)")
    rec.add_argument("--storage", choices=sorted(STORAGES), default="mcap")
    rec.add_argument("--duration", type=float, help="stop after this many seconds (default: Ctrl-C)")
    rec.add_argument("--timeout", type=float, default=30.0,
                     help="seconds to wait for the node's parameters, /diagnostics and topics")
    adopt = sub.add_parser("adopt", help="give a `ros2 bag record` bag of the node's topics the header "
                                         "read from the running node (writes a new session bag)")
    adopt.add_argument("source", type=Path, help="bag directory written by `ros2 bag record`")
    adopt.add_argument("--node", default="/flashrt", help="the recorded node, still running")
    adopt.add_argument("-o", "--output", type=Path, required=True, help="session bag directory to create")
    adopt.add_argument("--storage", choices=sorted(STORAGES), default="mcap")
    adopt.add_argument("--timeout", type=float, default=30.0,
                       help="seconds to wait for the node's parameters and /diagnostics")
    rep = sub.add_parser("replay", help="replay a session bag and compare the outputs")
    rep.add_argument("bag", type=Path)
    mode = rep.add_mutually_exclusive_group(required=True)
    mode.add_argument("--offline", action="store_true", help="drive an in-process engine (no ROS graph)")
    mode.add_argument("--live", action="store_true", help="drive a running node and record its answers")
    rep.add_argument("--node", help="live: the node to drive (default: the recorded node's name)")
    rep.add_argument("--tolerance", type=float, default=0.0,
                     help="absolute tolerance for ~/action values (token ids must always match)")
    rep.add_argument("--allow-model-change", action="store_true",
                     help="replay even if the engine fingerprint differs from the recording's")
    rep.add_argument("-o", "--output", type=Path, help="live: keep the node's answers in this bag")
    rep.add_argument("--timeout", type=float, default=60.0, help="live: seconds to wait for the node")
    return parser


def _loopback_defaults() -> None:
    """Keep DDS discovery on this host unless the caller chose otherwise (before rclpy loads)."""
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    os.environ.setdefault("ROS_LOCALHOST_ONLY", "1")


# The ROS-side modules are imported inside the commands: the DDS environment must be settled first
# (see main), and an offline replay needs no ROS graph.

def replay(args) -> int:
    header, records = read_bag(args.bag)
    script = build_script(records)
    if args.offline:
        from flashrt_ros.bag.replay import replay_offline
        outputs, notes = replay_offline(header, script, allow_model_change=args.allow_model_change)
    else:
        from flashrt_ros.bag.live import replay_live
        outputs, notes = replay_live(header, records, script, node=args.node or header.node,
                                     allow_model_change=args.allow_model_change, output=args.output,
                                     timeout=args.timeout)
    recorded = {t: [r.msg for r in records if r.topic == t] for t in OUTPUT_TOPICS}
    results = compare(recorded, outputs, args.tolerance)
    print(f"replay of {args.bag} ({'offline' if args.offline else 'live'}): {len(script)} calls, "
          f"package {header.package_version or '?'}, fingerprint {header.fingerprint[:16]}")
    print(format_report(results, notes))
    return IDENTICAL if all(r.identical for r in results) else DIVERGED


def record(args) -> int:
    from flashrt_ros.bag.live import record_node
    output = args.output or Path(time.strftime("flashrt_%Y%m%d-%H%M%S"))
    count = record_node(args.node, output, args.storage, args.duration, args.timeout)
    if count == 0:
        raise BagError(f"recorded no messages into {output}: did {args.node} receive an observation "
                       "while recording, on this ROS_DOMAIN_ID?")
    print(f"recorded {count} messages into {output}")
    return 0


def adopt(args) -> int:
    from flashrt_ros.bag.live import adopt_recording
    count = adopt_recording(args.source, args.node, args.output, args.storage, args.timeout)
    print(f"wrote {count} messages with {args.node}'s header into {args.output}")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command != "replay" or args.live:
        _loopback_defaults()
    try:
        return {"record": record, "adopt": adopt, "replay": replay}[args.command](args)
    except BagError as exc:
        print(f"flashrt_bag: error: {exc}", file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C before recording started, or during a replay
        print("flashrt_bag: interrupted", file=sys.stderr)
        return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
