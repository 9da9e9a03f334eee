"""The README's parameter table, checked against (and rewritten from) what the node declares and the shipped files.

Each row of the table under "### Parameters" is `| name | default | default.yaml | thor.yaml | range | description |`.
The three value columns come from :data:`flashrt_ros.params.PARAMETERS` and ``config/*.yaml``, so they cannot drift:
``python3 scripts/readme_param_table.py`` rewrites them in place (ranges and descriptions stay as written), and
``test/packaging/test_readme_parameters.py`` fails while they differ.
"""
from __future__ import annotations

import pathlib
import re
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PARAMETER_FILES = ("default.yaml", "thor.yaml")
HEADER = "| parameter | default | " + " | ".join(f"`{name}`" for name in PARAMETER_FILES) + " | range / values | description |"
CELL_SEPARATOR = re.compile(r"(?<!\\)\|")   # a pipe that is not escaped (`a \| b` stays one cell)
NOT_SET = "—"   # a parameter file that does not set it: the node's default applies


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(_flatten(value, f"{name}.") if isinstance(value, dict) else {name: value})
    return out


def file_values(name: str) -> dict:
    """The parameters a shipped file sets, by dotted name."""
    tree = yaml.safe_load((ROOT / "config" / name).read_text())
    return _flatten(tree["/**"]["ros__parameters"])


def cell(value) -> str:
    """How the table writes a value."""
    if value is None:
        return NOT_SET
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{value}`"


def expected_rows() -> dict[str, list[str]]:
    """name -> [default, default.yaml, thor.yaml] cells, in declaration order."""
    sys.path.insert(0, str(ROOT))
    from flashrt_ros.params import PARAMETERS

    files = [file_values(name) for name in PARAMETER_FILES]
    return {name: [cell(default)] + [cell(values.get(name)) for values in files]
            for name, default, *_ in PARAMETERS}


def table_lines(text: str) -> tuple[int, int]:
    """The [start, end) line span of the parameter table (header included)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| parameter | default |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return start, end


def rows(text: str) -> dict[str, list[str]]:
    """name -> every cell after the name, as the README has them."""
    start, end = table_lines(text)
    found = {}
    for line in text.splitlines()[start + 2:end]:
        name, *cells = [c.strip() for c in CELL_SEPARATOR.split(line)[1:-1]]
        found[name.strip("`")] = cells
    return found


def rewrite(text: str) -> str:
    """The README with the table's value columns set from the sources (rows in declaration order)."""
    start, end = table_lines(text)
    lines = text.splitlines()
    current = rows(text)
    values = len(PARAMETER_FILES) + 1
    body = []
    for name, cells in expected_rows().items():
        rest = current.get(name, [""] * (values + 2))[-2:]     # range, description
        body.append(("| " + " | ".join([f"`{name}`", *cells, *rest]) + " |").replace("|  |", "| |"))
    new = lines[:start] + [HEADER, "|" + "---|" * (values + 3)] + body + lines[end:]
    return "\n".join(new) + ("\n" if text.endswith("\n") else "")


if __name__ == "__main__":
    README.write_text(rewrite(README.read_text()))
