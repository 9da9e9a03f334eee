"""The README's parameter table says what the node declares and what each shipped parameter file sets.

Its value columns are written by scripts/readme_param_table.py from flashrt_ros/params.py and config/*.yaml; these
tests fail when a default, a shipped value or a range changes without the table (run the script to update it).
"""
import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("readme_param_table", ROOT / "scripts" / "readme_param_table.py")
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)


def readme_rows() -> dict[str, list[str]]:
    return table.rows(table.README.read_text())


def test_the_table_has_a_row_for_every_declared_parameter_and_no_other():
    assert list(readme_rows()) == list(table.expected_rows())


def test_each_default_and_each_shipped_value_is_the_one_the_table_gives():
    rows = readme_rows()
    for name, expected in table.expected_rows().items():
        assert rows[name][:len(expected)] == expected, f"{name}: run python3 scripts/readme_param_table.py"


def test_the_shipped_files_set_only_declared_parameters():
    declared = set(table.expected_rows())
    for name in table.PARAMETER_FILES:
        assert set(table.file_values(name)) <= declared, name


def test_each_closed_range_is_the_one_the_node_enforces():
    """Every bounded parameter's README range is its declared range; top_p excludes 0, as the sampler does."""
    from flashrt_ros.params import PARAMETERS

    ranges = {name: cells[-2] for name, cells in readme_rows().items()}
    assert ranges["sampling.top_p"] == "(0, 1]"
    checked = 0
    for name, _, _, bounds, _ in PARAMETERS:
        closed = re.fullmatch(r"\[([-\d.]+), ([-\d.]+)\]", ranges[name])  # not 2^63-1, "0 or [..]"
        if bounds is not None and closed:
            assert tuple(map(float, closed.groups())) == tuple(map(float, bounds)), name
            checked += 1
    assert checked >= 10


def test_a_changed_default_is_caught(monkeypatch):
    """The check reads the sources: a default that moves without the table makes the rows differ."""
    rows = readme_rows()
    monkeypatch.setattr(table, "file_values", lambda name: {"max_context": 123} if name == "thor.yaml" else {})
    assert table.expected_rows()["max_context"][2] == "`123`" != rows["max_context"][2]
