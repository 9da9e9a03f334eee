"""launch/flashrt.launch.py: checked statically everywhere, and loaded where ROS 2 `launch` is installed.

`launch`/`launch_ros` are not on PyPI, so CI here runs only the static checks (the file parses, declares
exactly the documented arguments, starts a declared executable, references config files that exist);
the `launch`-marked test runs on a ROS 2 install (e.g. the robot, after `colcon build`).
"""
import ast
import configparser
import importlib.util
import pathlib
import re

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCH_FILE = ROOT / "launch" / "flashrt.launch.py"
ARGUMENTS = {"params_file", "namespace", "node_name", "autostart", "model", "device"}


def calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == name]


def keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


@pytest.fixture(scope="module")
def tree():
    return ast.parse(LAUNCH_FILE.read_text(), filename=str(LAUNCH_FILE))


def test_declares_exactly_the_documented_arguments(tree):
    declared = [ast.literal_eval(c.args[0]) for c in calls(tree, "DeclareLaunchArgument")]
    assert sorted(declared) == sorted(ARGUMENTS)
    doc = ast.get_docstring(tree)
    assert all(f"{name}:=" in doc or f"  {name} " in doc for name in ARGUMENTS), "docstring documents each"


def test_argument_defaults(tree):
    defaults = {ast.literal_eval(c.args[0]): keyword(c, "default_value")
                for c in calls(tree, "DeclareLaunchArgument")}
    assert {n: ast.literal_eval(defaults[n]) for n in ("namespace", "node_name", "autostart", "model", "device")} == {
        "namespace": "", "node_name": "flashrt", "autostart": "true", "model": "", "device": ""}
    assert calls(defaults["params_file"], "FindPackageShare"), "params_file defaults into the package share"


def test_starts_a_lifecycle_node_of_a_declared_executable(tree):
    (node,) = calls(tree, "LifecycleNode")
    assert ast.literal_eval(keyword(node, "package")) == "flashrt_ros"
    executable = ast.literal_eval(keyword(node, "executable"))
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    scripts = [line.split("=")[0].strip()
               for line in cfg["options.entry_points"]["console_scripts"].strip().splitlines()]
    assert executable in scripts
    assert f'"{executable}=' in (ROOT / "CMakeLists.txt").read_text(), "colcon installs it to lib/flashrt_ros"


def test_referenced_config_files_exist(tree):
    referenced = []
    for join in calls(tree, "PathJoinSubstitution"):
        parts = [ast.literal_eval(e) for e in join.args[0].elts if isinstance(e, ast.Constant)]
        referenced.append(ROOT.joinpath(*parts))
    assert referenced, "the default params file is referenced"
    for path in referenced:
        assert path.is_file(), f"{path.relative_to(ROOT)} is referenced by the launch file but missing"


@pytest.mark.launch
def test_loads_and_builds_the_node_description():
    # Submodules, because the repository's own launch/ directory imports as an empty namespace package.
    pytest.importorskip("launch.actions", reason="ROS 2 `launch` is not installed (not on PyPI)")
    pytest.importorskip("launch_ros.actions", reason="ROS 2 `launch_ros` is not installed (not on PyPI)")
    from launch import LaunchContext
    from launch.actions import DeclareLaunchArgument, OpaqueFunction
    from launch_ros.actions import LifecycleNode

    spec = importlib.util.spec_from_file_location("flashrt_launch", LAUNCH_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    description = module.generate_launch_description()
    declared = [e for e in description.entities if isinstance(e, DeclareLaunchArgument)]
    assert {a.name for a in declared} == ARGUMENTS

    def node_for(**overrides):
        context = LaunchContext()
        for argument in declared:
            context.launch_configurations[argument.name] = (
                overrides[argument.name] if argument.name in overrides else
                "".join(s.perform(context) for s in argument.default_value))
        (opaque,) = [e for e in description.entities if isinstance(e, OpaqueFunction)]
        (node,) = opaque.execute(context)
        assert isinstance(node, LifecycleNode)
        return node, context

    def override_names(node, context):
        # launch_ros keeps a node's parameters private; the last entry is the launch file's overrides dict.
        overrides = node._Node__parameters[-1]
        return {"".join(s.perform(context) for s in key) for key in overrides}

    node, context = node_for(params_file=str(ROOT / "config" / "default.yaml"))
    assert (node.node_package, node.node_executable) == ("flashrt_ros", "flashrt_node")
    assert override_names(node, context) == {"autostart"}, "an empty model/device keeps the params file's"

    node, context = node_for(params_file=str(ROOT / "config" / "thor.yaml"), model="tiny", autostart="false")
    assert override_names(node, context) == {"autostart", "model"}
    node, context = node_for(params_file=str(ROOT / "config" / "thor.yaml"), device="cpu")
    assert override_names(node, context) == {"autostart", "device"}


def test_readme_and_thor_file_name_the_same_model_folder():
    """The launch lines with thor.yaml name its model; the pre-quantised section names another folder on purpose."""
    thor = yaml.safe_load((ROOT / "config" / "thor.yaml").read_text())["/**"]["ros__parameters"]["model"]
    text = (ROOT / "README.md").read_text()
    start = text.index("### Pre-quantised checkpoints on the robot")
    end = text.index("\n#", start + 1)
    readme = re.findall(r"model:=(\S+)", text[:start] + text[end:])
    assert readme and set(readme) == {thor}
    assert re.findall(r"model:=(\S+)", text[start:end]), "the pre-quantised section shows a model:= line"
