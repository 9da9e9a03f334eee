"""rosbags' rosbag2 writer, completed to write what rosbag2 itself writes.

rosbags writes ``ros_distro: rosbags`` and gives MCAP channels only ``offered_qos_profiles``. rosbag2
writes the recording machine's ROS distribution (metadata.yaml, the MCAP ``rosbag2`` metadata record, the
sqlite3 ``schema`` table) and, for MCAP, also ``topic_type_hash`` (RIHS01) in each channel's metadata,
where its MCAP reader looks for the type hash. :class:`Rosbag2Writer` adds both through rosbags' own
extension point (``Writer.STORAGE_PLUGINS``).
"""
import os
from importlib.metadata import PackageNotFoundError, version
from io import BytesIO

import yaml
from rosbags.rosbag2 import StoragePlugin, Writer
from rosbags.rosbag2.storage_mcap import Channel, McapWriter, write_channel, write_string
from rosbags.rosbag2.storage_sqlite3 import Sqlite3Writer

# rclpy's major version -> ROS 2 distribution, for the ROS wheels (a venv sets no ROS_DISTRO).
_RCLPY_DISTROS = {3: "humble", 7: "jazzy", 9: "kilted"}


def ros_distro() -> str:
    """The ROS 2 distribution of this machine, as rosbag2 records it: ``$ROS_DISTRO`` (set by a ROS
    install's setup.bash), else the distribution of the installed ``ros-rclpy`` wheel, else empty."""
    if os.environ.get("ROS_DISTRO"):
        return os.environ["ROS_DISTRO"]
    try:
        return _RCLPY_DISTROS.get(int(version("ros-rclpy").split(".")[0]), "")
    except PackageNotFoundError:
        return ""


def _with_distro(text: str, key: str | None = None) -> str:
    """YAML ``text`` of bag metadata (under ``key`` in metadata.yaml) with this machine's ros_distro."""
    data = yaml.safe_load(text)
    (data[key] if key else data)["ros_distro"] = ros_distro()
    out = yaml.safe_dump(data, default_flow_style=False, sort_keys=False)
    return out if key else out.strip()


class _McapStorage(McapWriter):
    def add_connection(self, connection, offered_qos_profiles: str) -> None:
        metadata = BytesIO()
        for key, value in (("offered_qos_profiles", offered_qos_profiles), ("topic_type_hash", connection.digest)):
            write_string(metadata, key)
            write_string(metadata, value)
        self.channels.append(Channel(connection.id, connection.msgtype, connection.topic,
                                     connection.ext.serialization_format, metadata.getvalue()))
        self.channel_stats[connection.id] = 0
        write_channel(self.chunk.bio, self.channels[-1], self.schemas)

    def close(self, version: int, metadata: str) -> None:
        super().close(version, _with_distro(metadata))


class _Sqlite3Storage(Sqlite3Writer):
    def close(self, version: int, metadata: str) -> None:
        self.cursor.execute("UPDATE schema SET ros_distro = ?", (ros_distro(),))
        super().close(version, _with_distro(metadata))


class Rosbag2Writer(Writer):
    """``rosbags.rosbag2.Writer`` that records the ROS distribution and the MCAP topic type hashes."""

    STORAGE_PLUGINS = {StoragePlugin.SQLITE3: _Sqlite3Storage, StoragePlugin.MCAP: _McapStorage}

    def close(self) -> None:
        super().close()
        tmp = self.metapath.with_suffix(".yaml.tmp")
        tmp.write_text(_with_distro(self.metapath.read_text(), "rosbag2_bagfile_information"), "utf8")
        tmp.replace(self.metapath)
