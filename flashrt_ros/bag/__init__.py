"""rosbag2 regression tooling: record a flashrt node's session, replay it, prove the outputs identical.

Modules, one job each:

* :mod:`~flashrt_ros.bag.typestore` — a ``rosbags`` typestore with the package's messages;
* :mod:`~flashrt_ros.bag.bagfile` — session bags (MCAP or sqlite3) with their header;
* :mod:`~flashrt_ros.bag.script` — the recorded calls, in order, with where each ran;
* :mod:`~flashrt_ros.bag.replay` — offline replay on an in-process Session (no ROS graph);
* :mod:`~flashrt_ros.bag.record` / :mod:`~flashrt_ros.bag.live` — recording and live replay (rclpy);
* :mod:`~flashrt_ros.bag.compare` — per-topic comparison and the report;
* :mod:`~flashrt_ros.bag.cli` — the ``flashrt_bag`` command.
"""
