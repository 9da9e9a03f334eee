"""flashrt_ros.tools: what a developer runs, not the robot: the ``flashrt-runtime`` CLI (``python -m
flashrt_ros.tools``), the paper's capsule checks (verify), and the benchmarks of the engine, the capsule tiers,
capsule files, weight formats and the ROS node. Nothing in flashrt_ros.runtime or the node imports this package.
"""
