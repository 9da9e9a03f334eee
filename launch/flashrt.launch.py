"""Start the flashrt node as a managed lifecycle node.

    ros2 launch flashrt_ros flashrt.launch.py [params_file:=...] [namespace:=...] [node_name:=...]
                                              [autostart:=true|false] [model:=...] [device:=...]

Arguments:
  params_file  parameters YAML (default: share/flashrt_ros/config/default.yaml; config/thor.yaml for
               Jetson AGX Thor). The shipped files use the top-level key `/**:`, so they fit any node_name.
  namespace    ROS namespace of the node (default: none).
  node_name    node name (default: flashrt); its services and topics live under ~/ of this name.
  autostart    true: the node configures and activates itself; false: it stays unconfigured until a
               lifecycle manager (or `ros2 lifecycle set`) drives it.
  model        when non-empty, overrides the params file's `model` (tiny, a preset, or a local HF folder).
  device       when non-empty, overrides the params file's `device` (cpu, cuda, cuda:N).
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import LifecycleNode
from launch_ros.parameter_descriptions import ParameterValue
from launch_ros.substitutions import FindPackageShare


# Launch arguments that override the params file's parameter of the same name only when non-empty.
OPTIONAL_OVERRIDES = ("model", "device")


def _flashrt_node(context):
    """The node; an OpaqueFunction because `model` and `device` are passed only when non-empty."""
    overrides = {"autostart": ParameterValue(LaunchConfiguration("autostart"), value_type=bool)}
    for name in OPTIONAL_OVERRIDES:
        value = LaunchConfiguration(name).perform(context)
        if value:
            overrides[name] = value
    return [LifecycleNode(
        package="flashrt_ros",
        executable="flashrt_node",
        name=LaunchConfiguration("node_name"),
        namespace=LaunchConfiguration("namespace"),
        parameters=[LaunchConfiguration("params_file"), overrides],
        output="screen",
        emulate_tty=True,
    )]


def generate_launch_description():
    return LaunchDescription([
        DeclareLaunchArgument(
            "params_file",
            default_value=PathJoinSubstitution([FindPackageShare("flashrt_ros"), "config", "default.yaml"]),
            description="parameters YAML for the node"),
        DeclareLaunchArgument("namespace", default_value="", description="ROS namespace of the node"),
        DeclareLaunchArgument("node_name", default_value="flashrt", description="name of the node"),
        DeclareLaunchArgument(
            "autostart", default_value="true", choices=["true", "false"],
            description="configure and activate on start; false waits for a lifecycle manager"),
        DeclareLaunchArgument(
            "model", default_value="",
            description="overrides the params file's model when non-empty (tiny, a preset, or an HF folder)"),
        DeclareLaunchArgument(
            "device", default_value="", description="overrides the params file's device when non-empty"),
        OpaqueFunction(function=_flashrt_node),
    ])
