"""BENCHMARKS.md's generated sections are what scripts/benchmarks_tables.py writes from the result JSON files.

A figure changed in a JSON file, or a table edited by hand, fails here until the script is run again."""
import copy
import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("benchmarks_tables", ROOT / "scripts" / "benchmarks_tables.py")
tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tables)


def sections() -> list:
    return list(tables.SECTION.finditer(tables.BENCHMARKS.read_text()))


def test_every_generated_section_matches_its_json_files():
    text = tables.BENCHMARKS.read_text()
    assert tables.regenerate(text) == text, "run python3 scripts/benchmarks_tables.py"


def test_sections_name_files_that_exist_except_those_a_gpu_run_may_lack():
    assert len(sections()) >= 8
    for m in sections():
        assert m["kind"] in tables.KINDS
        for path in m["paths"].split():
            assert path.startswith("{run}/") or (ROOT / path).is_file(), path
    assert (ROOT / tables.RUN.search(tables.BENCHMARKS.read_text())["folder"]).is_dir()


def _bench_json(tmp_path, decode_ms: float, provenance=None) -> str:
    result = json.loads((ROOT / "bench/results/bench_tiny_cpu.json").read_text())
    result["rows"][0]["decode_ms_per_token"] = decode_ms
    if provenance is not None:
        result["provenance"] = provenance
    path = tmp_path / f"bench_{decode_ms}.json"
    path.write_text(json.dumps(result))
    return str(path)


def test_a_changed_figure_changes_the_section(tmp_path):
    one, other = (tables.render("bench", [_bench_json(tmp_path, ms)], None) for ms in (1.25, 9.75))
    assert "| 1.25 |" in one and "| 9.75 |" in other and one.replace("1.25", "9.75") == other.replace(
        "bench_1.25.json", "bench_9.75.json")


def test_the_made_by_line_comes_from_the_provenance_block(tmp_path):
    from flashrt_ros.tools import provenance
    block = provenance.collect("cpu", argv=["python3", "-m", "flashrt_ros.tools", "bench"],
                               environ={provenance.COMMIT_ENV: "0123456789abcdef-dirty"})
    text = tables.render("bench", [_bench_json(tmp_path, 2.0, copy.deepcopy(block))], None)
    assert "commit `0123456789` (dirty tree)" in text and block["device_name"] in text
    assert "command `python3 -m flashrt_ros.tools bench`" in text and f"torch {block['versions']['torch']}" in text


def test_the_latest_run_folder_is_substituted_and_missing_files_are_named(tmp_path):
    text = ("<!-- latest-gpu-run: bench/results/h100_6810d87 -->\n"
            "<!-- generated: bench-capsules {run}/bench_capsules_qwen3.5-0.8b.json -->\nstale\n<!-- end generated -->")
    out = tables.regenerate(text, run="bench/results/h200_98fafab")
    assert "latest-gpu-run: bench/results/h200_98fafab" in out and "| 16,384 | 8 |" in out and "stale" not in out
    out = tables.regenerate(text)
    assert "not measured: no `bench/results/h100_6810d87/bench_capsules_qwen3.5-0.8b.json`" in out
