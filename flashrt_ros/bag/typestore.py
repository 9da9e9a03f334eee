"""A `rosbags` typestore that knows the flashrt_ros messages.

The definitions are read from the package's own ``.msg`` files, so the bag carries exactly what the
node publishes: an installed copy (``share/flashrt_ros/msg`` under an ``AMENT_PREFIX_PATH`` entry or
this Python's prefix, where ``pip install`` puts it) wins over the source tree's ``msg/`` folder,
which serves a checkout that has not been built yet.
"""
import functools
import os
import sys
from pathlib import Path

from rosbags.typesys import Stores, get_typestore, get_types_from_msg
from rosbags.typesys.store import Typestore

PACKAGE = "flashrt_ros"


def msg_dir() -> Path:
    """The folder holding flashrt_ros' ``.msg`` files (installed copy first, then the source tree)."""
    prefixes = [p for p in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep) if p] + [sys.prefix]
    candidates = [Path(p, "share", PACKAGE, "msg") for p in prefixes]
    candidates.append(Path(__file__).resolve().parents[2] / "msg")
    for folder in candidates:
        if (folder / "Observation.msg").is_file():
            return folder
    raise FileNotFoundError(f"no {PACKAGE} .msg files in any of: {', '.join(map(str, candidates))}")


@functools.cache
def typestore() -> Typestore:
    """ROS 2 Jazzy's standard types plus every flashrt_ros message (registered together, so nested
    types such as ``CapsuleInfo`` resolve)."""
    store = get_typestore(Stores.ROS2_JAZZY)
    types = {}
    for path in sorted(msg_dir().glob("*.msg")):
        types.update(get_types_from_msg(path.read_text(), f"{PACKAGE}/msg/{path.stem}"))
    store.register(types)
    return store


def field_names(msgtype: str) -> list[str]:
    """The data fields of ``msgtype`` in definition order (constants excluded)."""
    return [name for name, _ in typestore().fielddefs[msgtype][1]]
