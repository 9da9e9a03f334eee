"""Reading and writing flashrt_ros session bags (standard rosbag2, through the `rosbags` library).

A session bag holds the node's four topics (``~/observation`` in; ``~/tokens``, ``~/action`` and
``~/events`` out) with their message definitions embedded, plus a :class:`BagHeader` in the rosbag2
metadata's ``custom_data``: what the replay needs to rebuild the engine and to refuse a different model.
MCAP is the default storage; sqlite3 bags are read and written the same way. Bags are written as rosbag2
writes them (:mod:`flashrt_ros.bag.storage`): each topic with the QoS profiles its publishers offered, the
type hash, and the ROS distribution of the recording machine.
"""
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import apsw  # rosbags' sqlite3 driver; its errors mean a corrupt .db3
from rosbags.rosbag2 import Reader, ReaderError, StoragePlugin, WriterError

from flashrt_ros.bag.storage import Rosbag2Writer
from flashrt_ros.bag.typestore import PACKAGE, typestore

#: short topic name (relative to the node) -> message type
TOPICS = {
    "observation": f"{PACKAGE}/msg/Observation",
    "tokens": f"{PACKAGE}/msg/TokenChunk",
    "action": f"{PACKAGE}/msg/ActionChunk",
    "events": f"{PACKAGE}/msg/StateEvent",
}
STORAGES = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}
_KEY = PACKAGE + "."  # prefix of our keys in custom_data
# 2: every operation's StateEvent carries its request (observation, sampling, ids), the running request and its
# boundary, so goals, cancels and lifecycle transitions replay. 3: StateEvent gained `tier` and `wait` (spill, fetch)
# in the middle of the message, so a format-2 event would deserialize misaligned. 4: Observation gained `images`
# (sensor_msgs/Image[]) and StateEvent `image_digests`. Older bags are refused, with why.
BAG_FORMAT = 4
_OLDER_FORMATS = {
    "1": "its StateEvents lack the request fields (observations, sampling, running request) that replay re-issues, "
         "and its ~/generate goals, cancels and lifecycle transitions were not recorded",
    "2": "its StateEvents were recorded before the `tier` and `wait` fields (capsule spill and fetch) and cannot be "
         "read with this StateEvent definition",
    "3": "its Observations and StateEvents were recorded before the `images` and `image_digests` fields (camera "
         "observations) and cannot be read with these definitions",
}


class BagError(Exception):
    """The bag cannot be used: missing, truncated, corrupt, or not a flashrt_ros session bag."""


@dataclass(frozen=True)
class BagHeader:
    """What a session was recorded against."""

    node: str                  # fully qualified node name, e.g. "/flashrt"; topics live under it
    fingerprint: str           # Engine.fingerprint of the recording node
    parameters: dict = field(default_factory=dict)  # the node's parameters (name -> value)
    package_version: str = ""

    def to_custom_data(self) -> dict[str, str]:
        return {
            _KEY + "format": str(BAG_FORMAT),
            _KEY + "node": self.node,
            _KEY + "fingerprint": self.fingerprint,
            _KEY + "parameters": json.dumps(self.parameters, sort_keys=True),
            _KEY + "package_version": self.package_version,
        }

    @classmethod
    def from_custom_data(cls, data: dict | None) -> "BagHeader":
        data = data or {}
        if _KEY + "fingerprint" not in data:
            raise BagError("bag has no flashrt_ros header (custom_data): record with `flashrt_bag record`, "
                           "or give a `ros2 bag record` bag its header with `flashrt_bag adopt`")
        recorded = data.get(_KEY + "format", "1")
        if recorded != str(BAG_FORMAT):
            why = _OLDER_FORMATS.get(recorded, f"format {BAG_FORMAT} is the only one this version reads")
            raise BagError(f"bag format {recorded} (this version writes and reads format {BAG_FORMAT}) cannot be "
                           f"replayed: {why}; record the session again")
        try:
            parameters = json.loads(data.get(_KEY + "parameters", "{}"))
        except json.JSONDecodeError as exc:
            raise BagError(f"bag header parameters are not valid JSON: {exc}") from None
        return cls(node=data.get(_KEY + "node", ""), fingerprint=data[_KEY + "fingerprint"],
                   parameters=parameters, package_version=data.get(_KEY + "package_version", ""))

    def topic(self, short: str) -> str:
        """Full topic name of one of :data:`TOPICS` for this node."""
        return f"{self.node.rstrip('/')}/{short}"


@dataclass(frozen=True)
class Record:
    """One message of a session bag, deserialised."""

    topic: str   # short name: a key of TOPICS
    stamp: int   # bag (receive) time in ns
    msg: object  # rosbags message object


class BagWriter:
    """Context manager writing one session bag; the header goes into the metadata on close.

    ``offered_qos(topic)`` (a key of :data:`TOPICS`) gives the rosbags ``Qos`` profiles that the topic's
    publishers offer. It is asked when the topic's connection is made, which is at the topic's first
    message (so the publishers are known, as when rosbag2 records) or at close for a topic that had none.
    """

    def __init__(self, path: str | Path, header: BagHeader, storage: str = "mcap", offered_qos=None):
        if storage not in STORAGES:
            raise BagError(f"unknown storage {storage!r}; use one of {sorted(STORAGES)}")
        self.header = header
        self._path = Path(path)
        self._storage = STORAGES[storage]
        self._offered_qos = offered_qos or (lambda topic: [])
        self._connections = {}

    def __enter__(self) -> "BagWriter":
        try:
            self._writer = Rosbag2Writer(self._path, version=9, storage_plugin=self._storage)
            self._writer.open()
        except WriterError as exc:
            raise BagError(str(exc)) from None
        for key, value in self.header.to_custom_data().items():
            self._writer.set_custom_data(key, value)
        return self

    def __exit__(self, *exc_info) -> None:
        if exc_info[0] is None:
            for topic in TOPICS:  # every session bag lists the four topics
                self._connection(topic)
        self._writer.__exit__(*exc_info)

    def _connection(self, topic: str):
        if topic not in self._connections:
            self._connections[topic] = self._writer.add_connection(
                self.header.topic(topic), TOPICS[topic], typestore=typestore(),
                offered_qos_profiles=self._offered_qos(topic))
        return self._connections[topic]

    def write_cdr(self, topic: str, stamp: int, data: bytes) -> None:
        """Write an already serialised (CDR) message, as received from the ROS graph."""
        self._writer.write(self._connection(topic), stamp, data)

    def write(self, topic: str, stamp: int, msg: object) -> None:
        self.write_cdr(topic, stamp, typestore().serialize_cdr(msg, TOPICS[topic]))


# What rosbags and the storage libraries raise on a truncated or corrupt file.
_READ_ERRORS = (ReaderError, OSError, ValueError, KeyError, IndexError, EOFError, ArithmeticError,
                struct.error, apsw.Error)


def read_bag(path: str | Path) -> tuple[BagHeader, list[Record]]:
    """The header and every message of the session bag at ``path`` (a bag directory), in bag-time
    order. Raises :class:`BagError` with a readable reason for anything that is not a sound bag."""
    path = Path(path)
    if not (path / "metadata.yaml").is_file():
        raise BagError(f"{path} is not a rosbag2 bag directory (no metadata.yaml)")
    try:
        with Reader(path) as reader:
            header = BagHeader.from_custom_data(reader.storage.metadata.custom)
            wanted = {header.topic(short): short for short in TOPICS}
            connections = [c for c in reader.connections if c.topic in wanted]
            records = [
                Record(wanted[conn.topic], stamp,
                       typestore().deserialize_cdr(data, TOPICS[wanted[conn.topic]]))
                for conn, stamp, data in reader.messages(connections)
            ]
    except BagError:
        raise
    except _READ_ERRORS as exc:
        raise BagError(f"cannot read bag {path}: {type(exc).__name__}: {exc}") from None
    records.sort(key=lambda r: r.stamp)
    return header, records


def adopt_bag(source: str | Path, target: str | Path, header: BagHeader, storage: str = "mcap") -> int:
    """Copy ``header.node``'s four topics from any rosbag2 bag (e.g. one that ``ros2 bag record``
    wrote, without a header) into a new session bag with ``header``; returns the message count."""
    source = Path(source)
    wanted = {header.topic(short): short for short in TOPICS}
    count = 0
    try:
        with Reader(source) as reader:
            connections = [c for c in reader.connections if c.topic in wanted]
            wrong = [c.topic for c in connections if c.msgtype != TOPICS[wanted[c.topic]]]
            if wrong or not connections:
                raise BagError(f"{source} has no flashrt_ros topics of {header.node} "
                               f"(or they carry other types: {wrong})")
            qos = {wanted[c.topic]: c.ext.offered_qos_profiles for c in connections}
            with BagWriter(target, header, storage, lambda topic: qos.get(topic, [])) as bag:
                for conn, stamp, data in reader.messages(connections):
                    bag.write_cdr(wanted[conn.topic], stamp, data)
                    count += 1
    except BagError:
        raise
    except _READ_ERRORS as exc:
        raise BagError(f"cannot read bag {source}: {type(exc).__name__}: {exc}") from None
    return count
