#!/usr/bin/env python3
"""Point the ROS 2 wheels' exported CMake targets at this interpreter's include dirs.

The ``ros-*`` wheels on PyPI are built in a manylinux container, and their exported CMake targets
(``$PREFIX/share/<pkg>/cmake/*.cmake``) keep two include paths of that container:
``/opt/python/cp311-cp311/include/python3.11`` and numpy's include dir below it. CMake refuses an
imported target whose include dir does not exist, so ``rosidl_generate_interfaces`` fails to configure
until those strings name this interpreter's dirs. The rewrite is idempotent (a fixed file no longer
contains the build-machine paths) and touches nothing else.

Usage: python scripts/fix_ros_cmake_paths.py [PREFIX]   (PREFIX defaults to sys.prefix, the venv)
"""
import pathlib
import re
import sys
import sysconfig

import numpy

# The build container's interpreter include dir, and numpy's include dir inside its site-packages.
_BUILD_PYTHON_INCLUDE = re.compile(r"/opt/python/cp3\d+-cp3\d+t?/include/python3\.\d+t?")
_BUILD_NUMPY_INCLUDE = re.compile(
    r"/opt/python/cp3\d+-cp3\d+t?/lib/python3\.\d+t?/site-packages/numpy/(?:_)?core/include")


def fix_file(path: pathlib.Path, python_include: str, numpy_include: str) -> bool:
    """Rewrite the build-machine include paths in one CMake file; return whether it changed."""
    text = path.read_text()
    # numpy first: its path starts with the same /opt/python/... prefix as the interpreter's.
    fixed = _BUILD_NUMPY_INCLUDE.sub(numpy_include, text)
    fixed = _BUILD_PYTHON_INCLUDE.sub(python_include, fixed)
    if fixed == text:
        return False
    path.write_text(fixed)
    return True


def main(argv: list[str]) -> int:
    prefix = pathlib.Path(argv[1] if len(argv) > 1 else sys.prefix)
    share = prefix / "share"
    if not share.is_dir():
        print(f"no {share}: are the ROS 2 wheels installed in this prefix?", file=sys.stderr)
        return 1
    python_include = sysconfig.get_path("include")
    numpy_include = numpy.get_include()
    changed = [p for p in sorted(share.glob("**/*.cmake"))
               if fix_file(p, python_include, numpy_include)]
    print(f"fix_ros_cmake_paths: rewrote {len(changed)} file(s) under {share}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
