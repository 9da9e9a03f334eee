"""The BENCHMARKS table of model loading, printed from the JSON files bench/load_memory.py wrote (one folder per run).
(The JSON's ``git_commit`` is the device copy's git HEAD, which need not be the working tree that ran; the run's
``gpu.txt`` records the commit the coordinator sent.)

    python3 bench/load_table.py bench/results/h100_6810d87
"""
import json
import sys
from pathlib import Path

COLUMNS = ("model", "stored as", "loaded as", "load (s)", "from disk (GB/s)", "peak device (GB)", "weights + arena (GB)",
           "peak / (weights + arena)", "peak RSS (GB)")


def row(result: dict) -> list[str]:
    final = result["final_weight_bytes"] + result["arena_bytes"]
    disk = result["disk_gb_per_s"]
    return [Path(result["model"]).name, result["checkpoint_scheme"] or "preset (generated on the device)",
            result["format"], f"{result['load_s']:.1f}", f"{disk:.2f}" if disk else "—",
            f"{result['peak_device_bytes'] / 1e9:.2f}", f"{final / 1e9:.2f}", f"{result['peak_over_final']:.4f}",
            f"{result['peak_rss_bytes'] / 1e9:.2f}"]


def table(folder: Path) -> str:
    return results_table([json.loads(path.read_text()) for path in sorted(folder.glob("load_*.json"))])


def results_table(results: list[dict]) -> str:
    """The table of these load results (scripts/benchmarks_tables.py renders BENCHMARKS' section with it)."""
    results = sorted(results, key=lambda r: (r["final_weight_bytes"] > 5e9, r["source"], -r["final_weight_bytes"]))
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in results]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
