"""What the node and its peers (the client, the bag tools) agree on beyond the msg/srv/action files: the QoS of
the node's request queues, the name of its ``/diagnostics`` status and its typed output topics. Light to import: rclpy's QoS only."""
from rclpy.qos import QoSProfile, ReliabilityPolicy

# Request queues of every service and of the action's goal/cancel/result services: a burst of this many requests
# waits in DDS (reliable) until an executor thread takes it, instead of being dropped at the default depth of 10.
REQUEST_QUEUE_DEPTH = 1000
REQUEST_QOS = QoSProfile(depth=REQUEST_QUEUE_DEPTH, reliability=ReliabilityPolicy.RELIABLE)


def diagnostics_name(node_fqn: str) -> str:
    """The /diagnostics status name of the node ``node_fqn`` (fully qualified, so two nodes of the
    same name in different namespaces stay apart)."""
    return f"{node_fqn}: engine"


def typed_topic(type_name: str) -> str:
    """Where the node publishes the parsed message of a goal with ``output_type`` (``pkg/msg/Type``)."""
    package, _, name = type_name.split("/")
    return f"~/typed/{package}/msg/{name}"
