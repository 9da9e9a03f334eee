"""Packaging stays consistent: package.xml, CMakeLists.txt, setup.cfg, requirements and README agree
with each other and with what the code actually imports and the repository actually holds."""
import ast
import configparser
import importlib
import importlib.metadata
import pathlib
import re
import sys
import sysconfig

import pytest
from catkin_pkg.package import parse_package

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "flashrt_ros"


# ---------------------------------------------------------------- helpers

def console_scripts() -> dict[str, str]:
    """name -> 'module:function' from setup.cfg."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(tuple(part.strip() for part in line.split("=", 1)) for line in lines)


def cmake_list(variable: str) -> list[str]:
    """The quoted items of `set(VARIABLE ...)` in CMakeLists.txt."""
    match = re.search(rf"set\({variable}\s+(.*?)\)", (ROOT / "CMakeLists.txt").read_text(), re.S)
    assert match, f"set({variable} ...) not found in CMakeLists.txt"
    return re.findall(r'"([^"]+)"', match.group(1))


def _optional(node: ast.Try) -> bool:
    """A try block that survives a failed import: its imports are optional extras (fla, cupy)."""
    caught = set()
    for handler in node.handlers:
        if handler.type is not None:
            elts = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            caught.update(ast.unparse(e) for e in elts)
    return bool(caught & {"ImportError", "ModuleNotFoundError", "Exception"})


def imports(path: pathlib.Path) -> tuple[set[str], set[str]]:
    """Top-level names of a file's absolute, non-optional imports: (at module level, inside functions)."""
    eager: set[str] = set()
    lazy: set[str] = set()

    def visit(node, found):
        if isinstance(node, ast.Try) and _optional(node):
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found = lazy
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child, found)

    visit(ast.parse(path.read_text(), filename=str(path)), eager)
    return eager, lazy - eager


def package_imports() -> tuple[set[str], set[str]]:
    """Third-party imports of the whole Python package: (needed to import a module, needed by a call)."""
    eager, lazy = set(), set()
    for path in (ROOT / PACKAGE).rglob("*.py"):
        file_eager, file_lazy = imports(path)
        eager |= third_party(file_eager)
        lazy |= third_party(file_lazy)
    return eager, lazy - eager


def third_party(names: set[str]) -> set[str]:
    return {n for n in names if n not in sys.stdlib_module_names and n not in (PACKAGE, "__future__")}


def is_ros_package(name: str) -> bool:
    """Installed as a ROS package (the ROS wheels and colcon install share/<name>/package.xml)."""
    return (pathlib.Path(sys.prefix) / "share" / name / "package.xml").is_file()


def pinned(requirements: str) -> dict[str, str]:
    """Normalised distribution name -> exact version, from one requirements file."""
    pins = {}
    for line in (ROOT / "requirements" / requirements).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            name, _, version = line.partition("==")
            assert version, f"{requirements}: {line!r} is not an exact pin"
            pins[normalise(name.split("[")[0])] = version
    return pins


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def package():
    return parse_package(str(ROOT / "package.xml"))


# ---------------------------------------------------------------- package.xml

def test_package_xml_is_valid_format_3_interface_package(package):
    package.validate()  # raises InvalidPackage
    assert package.name == PACKAGE
    assert package.package_format == 3
    assert package.get_build_type() == "ament_cmake"
    assert "rosidl_interface_packages" in [g.name for g in package.member_of_groups]


def test_package_xml_declares_the_interface_dependencies(package):
    text = (ROOT / "CMakeLists.txt").read_text()
    cmake_deps = re.search(r"DEPENDENCIES\s+([^)\n]+)", text).group(1).split()
    build = {d.name for d in package.build_depends + package.buildtool_depends}
    run = {d.name for d in package.exec_depends}
    assert {"rosidl_default_generators", "ament_cmake"} <= build
    assert "rosidl_default_runtime" in run
    for dep in cmake_deps:
        assert dep in build and dep in run, f"{dep} (rosidl DEPENDENCIES) must be a <depend>"


def test_package_xml_lists_every_ros_package_the_code_imports(package):
    declared = {d.name for d in package.exec_depends}
    ros = {name for name in set().union(*package_imports()) if is_ros_package(name)}
    assert "rclpy" in ros, "the scan must see the node's imports"
    assert sorted(ros - declared) == []
    # The launch file runs only on a ROS install, so its imports are ROS packages by definition.
    launch_imports = set().union(*(third_party(set().union(*imports(p))) for p in (ROOT / "launch").glob("*.py")))
    assert sorted(launch_imports - declared) == []


def test_requirements_pin_every_python_library_the_code_imports():
    """Module-level imports need a runtime pin; imports inside a function (an optional feature such as
    `bench --compare-hf`) may come from the test requirements instead."""
    runtime = set(pinned("runtime.txt"))
    anywhere = runtime | set(pinned("test.txt"))
    distributions = importlib.metadata.packages_distributions()
    eager, lazy = package_imports()
    missing = []
    for names, allowed in ((eager, runtime), (lazy, anywhere)):
        for name in sorted(n for n in names if not is_ros_package(n)):
            dists = {normalise(d) for d in distributions.get(name, [])}
            if not dists & allowed:
                missing.append(f"{name} (from {sorted(dists) or 'no installed distribution'})")
    assert missing == []


def test_requirements_are_exact_pins_that_agree_with_the_lock():
    lock = pinned("constraints.txt")
    for requirements in ("runtime.txt", "build.txt", "test.txt"):
        for name, version in pinned(requirements).items():
            if name != "setuptools":  # pip freeze leaves setuptools out of the lock
                assert lock.get(name) == version, f"{requirements}: {name}=={version}, lock: {lock.get(name)}"
    assert lock["torch"].endswith("+cpu"), "CI must never resolve the CUDA build of torch"


# ---------------------------------------------------------------- executables

def test_colcon_executables_match_the_console_scripts():
    scripts = console_scripts()
    executables = dict(entry.split("=", 1) for entry in cmake_list("FLASHRT_EXECUTABLES"))
    assert {"flashrt_node", "flashrt_bag", "flashrt-runtime"} <= set(executables)
    assert {name: scripts.get(name) for name in executables} == executables


@pytest.mark.parametrize("name", sorted(console_scripts()))
def test_console_script_targets_exist(name):
    module, _, function = console_scripts()[name].partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_readme_commands_are_console_scripts():
    readme = ROOT / "README.md"
    if not readme.is_file():
        pytest.skip("README.md not written yet")
    text = readme.read_text()
    scripts, executables = set(console_scripts()), {e.split("=")[0] for e in cmake_list("FLASHRT_EXECUTABLES")}
    commands = set(re.findall(r"^\s*(?:\$\s*)?(?:[A-Z_]+=\S+\s+)*(flashrt[-_][\w-]+)(?=\s|$)", text, re.M))
    assert commands, "README shows no flashrt command"
    assert sorted(commands - scripts) == []
    assert sorted(set(re.findall(r"ros2 run flashrt_ros ([\w-]+)", text)) - executables) == []


# ---------------------------------------------------------------- interfaces

def test_cmake_interface_list_matches_the_files():
    on_disk = sorted(str(p.relative_to(ROOT)) for kind in ("msg", "srv", "action")
                     for p in (ROOT / kind).glob(f"*.{kind}"))
    assert sorted(cmake_list("FLASHRT_INTERFACES")) == on_disk


# ---------------------------------------------------------------- what `pip install .` puts into the prefix

def installed_files() -> set[str]:
    """Files pip recorded for the installed flashrt_ros, relative to sys.prefix. Read from site-packages: the
    checkout on sys.path may hold a build's flashrt_ros.egg-info, which records no installed files."""
    site = sysconfig.get_paths()["purelib"]
    dists = list(importlib.metadata.distributions(name=PACKAGE, path=[site]))
    if not dists:
        pytest.skip("flashrt_ros is not installed (make env / pip install --no-build-isolation .)")
    files = dists[0].files or []
    prefix = pathlib.Path(sys.prefix).resolve()
    return {str(pathlib.Path(f.locate()).resolve().relative_to(prefix)) for f in files
            if pathlib.Path(f.locate()).resolve().is_relative_to(prefix)}


def test_the_ament_index_marker_is_in_the_tree_and_installed():
    marker = ROOT / "resource" / PACKAGE
    assert marker.is_file() and marker.read_bytes() == b"", "the ament index marker is an empty file"
    assert f"share/ament_index/resource_index/packages/{PACKAGE}" in installed_files()
    assert f'"resource/${{PROJECT_NAME}}"' in (ROOT / "CMakeLists.txt").read_text(), "colcon installs it too"


def test_pip_installs_the_ros2_run_executables_and_the_share_files():
    """`ros2 run` and `ros2 launch` find these in the venv as they do after colcon build."""
    files = installed_files()
    for entry in cmake_list("FLASHRT_EXECUTABLES"):
        name, target = entry.split("=")
        assert f"lib/{PACKAGE}/{name}" in files
        script = pathlib.Path(sys.prefix, "lib", PACKAGE, name)
        assert script.stat().st_mode & 0o111, f"{script} is not executable"
        shebang, *body = script.read_text().splitlines()
        assert pathlib.Path(shebang[2:]).resolve() == pathlib.Path(sys.executable).resolve()
        module, function = target.split(":")
        assert f"from {module} import {function}" in body
    expected = {f"share/{PACKAGE}/package.xml"} | {
        f"share/{PACKAGE}/{p.relative_to(ROOT)}" for p in [*ROOT.glob("launch/*.py"), *ROOT.glob("config/*.yaml")]}
    assert expected <= files
