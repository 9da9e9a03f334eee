"""Per-topic comparison of a replay's outputs with the recorded ones, and its text report.

Messages are compared by index within each output topic (the i-th recorded ``~/tokens`` chunk with
the i-th replayed one, and so on). Every field counts except those that measure time, which differ
between any two runs by nature: headers, observation stamps and latencies. Action ``values`` may
differ by ``tolerance`` (absolute, per value); token ids never may.
"""
from dataclasses import dataclass

import numpy as np

from flashrt_ros.bag.typestore import field_names

OUTPUT_TOPICS = ("tokens", "action", "events")
_TIMING_FIELDS = {"header", "observation_stamp", "latency_ms"}
_TOLERANT_FIELDS = {("action", "values")}


def comparable(msg) -> dict:
    """The fields of a message that a replay must reproduce, as plain Python values."""
    out = {}
    for name in field_names(msg.__msgtype__):
        if name in _TIMING_FIELDS:
            continue
        out[name] = _plain(getattr(msg, name))
    return out


def _plain(value):
    if hasattr(value, "__msgtype__"):  # a nested message (a StateEvent's observation)
        return comparable(value)
    if isinstance(value, list):        # nested messages (an observation's images)
        return [_plain(item) for item in value]
    return value.tolist() if isinstance(value, np.ndarray) else value


def _differs(topic: str, recorded: dict, replayed: dict, tolerance: float) -> list[str]:
    """Names of the fields that differ (beyond ``tolerance`` where a field allows one)."""
    bad = []
    for name, want in recorded.items():
        got = replayed[name]
        if (topic, name) in _TOLERANT_FIELDS:
            same = len(want) == len(got) and all(abs(a - b) <= tolerance for a, b in zip(want, got))
        else:
            same = want == got
        if not same:
            bad.append(name)
    return bad


@dataclass
class Divergence:
    index: int               # message number within the topic (0-based)
    recorded: dict | None    # None: the replay produced a message the recording does not have
    replayed: dict | None    # None: the replay is missing this recorded message
    fields: list[str]        # the differing fields (empty when one side is missing)


@dataclass
class TopicResult:
    topic: str
    matched: int = 0
    mismatched: int = 0
    missing: int = 0         # recorded, not replayed
    extra: int = 0           # replayed, not recorded
    first: Divergence | None = None

    @property
    def identical(self) -> bool:
        return self.first is None


def compare_topic(topic: str, recorded: list, replayed: list, tolerance: float = 0.0) -> TopicResult:
    """Compare two message lists of one topic."""
    result = TopicResult(topic)
    for index in range(max(len(recorded), len(replayed))):
        want = comparable(recorded[index]) if index < len(recorded) else None
        got = comparable(replayed[index]) if index < len(replayed) else None
        if want is None or got is None:
            result.missing += got is None
            result.extra += want is None
            bad = []
        else:
            bad = _differs(topic, want, got, tolerance)
            if not bad:
                result.matched += 1
                continue
            result.mismatched += 1
        if result.first is None:
            result.first = Divergence(index, want, got, bad)
    return result


def compare(recorded: dict[str, list], replayed: dict[str, list], tolerance: float = 0.0) -> list[TopicResult]:
    """Compare every output topic; the arguments map a short topic name to its messages in order."""
    return [compare_topic(t, recorded.get(t, []), replayed.get(t, []), tolerance) for t in OUTPUT_TOPICS]


def _describe(message: dict | None) -> str:
    if message is None:
        return "(none)"
    return ", ".join(f"{k}={v!r}" for k, v in message.items())


def format_report(results: list[TopicResult], notes: list[str] = ()) -> str:
    """Human-readable report: one count line per topic, then each topic's first divergent message."""
    lines = [f"{'topic':<10}{'matched':>9}{'mismatched':>12}{'missing':>9}{'extra':>7}"]
    for r in results:
        lines.append(f"{r.topic:<10}{r.matched:>9}{r.mismatched:>12}{r.missing:>9}{r.extra:>7}")
    for r in results:
        if r.first is None:
            continue
        d = r.first
        what = f"differs in {', '.join(d.fields)}" if d.fields else (
            "missing from the replay" if d.replayed is None else "not in the recording")
        lines.append(f"first divergence on ~/{r.topic}: message #{d.index} {what}")
        for side, message in (("recorded", d.recorded), ("replayed", d.replayed)):
            if message is not None and "token_ids" in message:
                lines.append(f"  {side} token_ids: {message['token_ids']}")
            lines.append(f"  {side}: {_describe(message)}")
    lines.extend(f"note: {n}" for n in notes)
    identical = all(r.identical for r in results)
    lines.append("RESULT: identical" if identical else "RESULT: diverged")
    return "\n".join(lines)
