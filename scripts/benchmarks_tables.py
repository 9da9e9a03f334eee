"""BENCHMARKS.md's generated sections, written from the result JSON files (no hand-copied numbers).

A generated section is delimited in BENCHMARKS.md by

    <!-- generated: KIND PATH [PATH ...] -->
    ...
    <!-- end generated -->

and holds the table of KIND (below) over the JSON files PATH (relative to the repository), each table made by the
benchmark's own markdown function (one definition of every table), then a line per file saying where it came from
(its provenance block: commit, device, driver/CUDA, versions, date, command). A PATH may start with ``{run}/``: the
folder of the latest GPU run, named once in the file by ``<!-- latest-gpu-run: bench/results/<card>_<commit> -->``.

    python3 scripts/benchmarks_tables.py                      # rewrite the generated sections
    python3 scripts/benchmarks_tables.py --run bench/results/h100_abc1234   # point {run} at a new run, rewrite
    python3 scripts/benchmarks_tables.py --check              # exit 1 if a section differs from its JSON

test/packaging/test_benchmarks_tables.py checks that every generated section matches its JSON files.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
SECTION = re.compile(r"(?P<head><!-- generated: (?P<kind>[\w-]+) (?P<paths>[^>]*?) -->\n)(?P<body>.*?)"
                     r"(?P<end><!-- end generated -->)", re.S)
RUN = re.compile(r"<!-- latest-gpu-run: (?P<folder>\S+) -->")
sys.path.insert(0, str(ROOT))


def _module(relative: str):
    """A script of the repository (not a package module) by path."""
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench(results: list[dict]) -> str:
    from flashrt_ros.tools.bench import markdown_table
    return "\n\n".join(f"`{r['model']}`, {r.get('weights_format', 'dense')}, {r['dtype']}, kernels "
                       f"`{r.get('kernels', r.get('kernel'))}`:\n\n{markdown_table(r['rows'])}" for r in results)


def _bench_quant(results: list[dict]) -> str:
    from flashrt_ros.tools.bench_quant import formats_markdown
    return "\n\n".join(f"`{r['model']}`, {r['dtype']}, kept dense: {', '.join(r.get('exclude') or []) or 'nothing'}:"
                         f"\n\n{formats_markdown(r)}" for r in results)


def _bench_quant_gemv(results: list[dict]) -> str:
    from flashrt_ros.tools.bench_quant import gemv_markdown
    return "\n\n".join(f"`{r['model']}`, {r['dtype']}:\n\n{gemv_markdown(r)}" for r in results)


def _bench_capsules(results: list[dict]) -> str:
    from flashrt_ros.tools.bench_capsules import markdown
    return markdown(*results)


def _load(results: list[dict]) -> str:
    return _module("bench/load_table.py").results_table(results)


def _peer(results: list[dict]) -> str:
    """Two files: our bench JSON, then llama.cpp's (bench/peer_llamacpp), ratios per context."""
    peer = _module("bench/peer_llamacpp/results.py")
    ours, theirs = results
    return peer.table(peer.paired(ours, theirs))


def _gemv_sass(results: list[dict]) -> str:
    """bench/gemv_sass.py's counts, a row per file: the GEMV loop's instructions, per weight, and the registers."""
    lines = ["| kernel | N x K | rows | config | arch | loop instructions | per weight | registers | commit |",
             "|---|---|---:|---|---|---:|---:|---:|---|"]
    for r in results:
        kernel = r["kind"] + (f", {r['fusion']}" if r.get("fusion") else "")
        commit = r["provenance"]["commit"][:7] + (" (dirty)" if r["provenance"].get("dirty") else "")
        lines.append(f"| {kernel} | {r['N']} x {r['K']} | {r['rows']} | {tuple(r['config'])} | {r['arch']} | "
                     f"{r['instructions']} | {r['per_weight']:.2f} | {r['registers']} | `{commit}` |")
    return "\n".join(lines)


def _gemv_fusions(results: list[dict]) -> str:
    """bench/gemv_fusions.py's timings, a row per projection and fusion: the Triton GEMV with its input formed or its
    residual added inside against the cuBLAS path's launches for the same product."""
    lines = ["| preset | N x K | fusion | Triton GEMV us | cuBLAS path us | Triton / cuBLAS path |",
             "|---|---|---|---:|---:|---:|"]
    for r in results:
        lines += [f"| {r['preset']} | {row['N']} x {row['K']} | {row['fusion']} | {row['triton_us']:.2f} | "
                  f"{row['cublas_path_us']:.2f} | {row['triton_over_cublas_path']:.2f} |" for row in r["rows"]]
    return "\n".join(lines)


def _delta_rule_sass(results: list[dict]) -> str:
    """bench/delta_rule_sass.py's counts, a row per launch: the serial loop's instructions a row, its MUFU, shuffles
    (how many next to another, where recorded) and exchanges through shared memory, and the loop of the factors
    computed ahead where there is one."""
    lines = ["| preset | rows | launch (DeltaRuleConfig) | serial loop instructions a row | "
             "MUFU | SHFL | shared-memory exchanges | registers | factors' loop instructions | target, triton |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        for row in r["results"]:
            loop, factors = row["serial_loop"], row["factors_loop"]
            lines.append(f"| {r['preset']} | {r['rows']} | {tuple(row['config'])} | {loop['instructions']} | "
                         f"{loop['mufu']} | {loop['shfl']}"
                         + (f" ({loop['shfl_adjacent']} adjacent)" if "shfl_adjacent" in loop else "")
                         + f" | {loop['exchanges']} | {row['registers']} | "
                         f"{factors['instructions'] if factors else '-'} | {r['arch']}, "
                         f"{r['provenance']['versions']['triton']} |")
    return "\n".join(lines)


def _launch_sweep(results: list[dict]) -> str:
    """bench/time_delta_rule.py's and bench/time_attention.py's sweeps, a row per file and length: the kernel's own
    launch against the fastest correct one, and the own launch on inputs laid out as in a step where it was timed
    (and, where they were timed, on each of the step layout's two parts alone: the views, the device count)."""
    lines = ["| kernel | preset | rows | own launch | us | as in a step, us (the views alone, the count alone) | "
             "fastest launch | us | own / fastest | "
             "wrong | commit |",
             "|---|---|---:|---|---:|---:|---|---:|---:|---:|---|"]
    for r in results:
        kernel = "attention" if "time_attention" in r["provenance"]["command"] else "delta rule"
        commit = r["provenance"]["commit"][:7] + (" (dirty)" if r["provenance"].get("dirty") else "")
        for length in sorted({row["length"] for row in r["rows"]}):
            rows = [row for row in r["rows"] if row["length"] == length]
            own = next(row for row in rows if row["default"])
            best = min((row for row in rows if row["us"] is not None), key=lambda row: row["us"])
            in_a_step = next((_in_a_step(s) for s in r.get("in_a_step", ()) if s["length"] == length), "-")
            lines.append(f"| {kernel} | {r['preset']} | {length} | {tuple(own['config'])} | {own['us']:.2f} | "
                         f"{in_a_step} | "
                         f"{tuple(best['config'])} | {best['us']:.2f} | {own['us'] / best['us']:.2f} | "
                         f"{sum(not row['correct'] for row in rows)} of {len(rows)} | `{commit}` |")
    return "\n".join(lines)


def _in_a_step(timed: dict) -> str:
    parts = f" ({timed['views_us']:.2f}, {timed['count_us']:.2f})" if "views_us" in timed else ""
    return f"{timed['us']:.2f}{parts}"


def _engine_option(result: dict, flag: str, default: str) -> str:
    """An engine option a result was made with, read from its recorded command line."""
    words = result.get("provenance", {}).get("command", "").split()
    return words[words.index(flag) + 1] if flag in words[:-1] else default


def _captioned(markdown_of):
    """Each result's own markdown table under a caption of what ran (model, dtype, kernels, projection path,
    speculative drafts and draft vocabulary where set)."""
    def section(results: list[dict]) -> str:
        parts = []
        for r in results:
            caption = f"`{r['model']}`, {r['dtype']}, kernels `{r.get('kernels', 'auto')}`, projections " \
                      f"`{_engine_option(r, '--dense-gemv', 'cublas')}`"
            drafts, vocab = _engine_option(r, "--speculative-tokens", "0"), _engine_option(r, "--draft-vocab", "0")
            caption += (f", {drafts} MTP drafts per step" if drafts != "0" else "") + \
                       (f", drafts among the first {vocab} ids" if vocab != "0" else "")
            parts.append(f"{caption}:\n\n{markdown_of(r)}")
        return "\n\n".join(parts)
    return section


def _markdown_of(module: str):
    def table(result: dict) -> str:
        return importlib.import_module(f"flashrt_ros.tools.{module}").markdown(result)
    return table


def _dense_gemv_decode(result: dict) -> str:
    from flashrt_ros.tools.bench import markdown_table
    return markdown_table(result["dense_gemv_decode"])


KINDS = {"bench": _bench, "bench-quant": _bench_quant, "bench-quant-gemv": _bench_quant_gemv,
         "bench-capsules": _bench_capsules, "load": _load, "peer": _peer,
         "bench-vision": _captioned(_markdown_of("bench_vision")),
         "bench-image-ttft": _captioned(_markdown_of("bench_image_ttft")),
         "bench-constraint": _captioned(_markdown_of("bench_constraint")),
         "bench-spec": _captioned(_markdown_of("bench_spec")),
         "dense-gemv-decode": _captioned(_dense_gemv_decode), "gemv-sass": _gemv_sass,
         "delta-rule-sass": _delta_rule_sass,
         "launch-sweep": _launch_sweep, "gemv-fusions": _gemv_fusions}
ALL_FILES_NEEDED = {"peer"}


def provenance_line(path: str, result: dict) -> str:
    """Where a file's figures came from: its provenance block, or what a file from before issue 26 recorded."""
    p = result.get("provenance")
    if p is None:
        legacy = {k: result[k] for k in ("git_commit", "commit", "date", "device_name", "torch") if k in result}
        known = ", ".join(f"{k} {v}" for k, v in legacy.items()) or "nothing"
        return (f"- `{path}`: no provenance block (written before issue 26; it records {known}; the section's text "
                f"gives its commit, card and command)")
    commit = f"`{p['commit'][:10]}`" + (" (dirty tree)" if p.get("dirty") else "")
    device = p["device_name"] + (f", driver {p['driver']}, CUDA {p['cuda_runtime']}" if p.get("driver") or
                                 p.get("cuda_runtime") else "")
    versions = ", ".join(f"{k} {v}" for k, v in p["versions"].items() if v)
    return (f"- `{path}`: commit {commit}, {device}, host `{p['host']}`, {p['date_utc']}; {versions}; "
            f"command `{p['command']}`")


def render(kind: str, paths: list[str], run: str | None) -> str:
    """The section of ``kind`` over the files that exist (a run may lack some: they are named, not invented)."""
    resolved = [p.replace("{run}", run) if run else p for p in paths]
    present = [p for p in resolved if (ROOT / p).is_file()]
    missing = [f"`{p}`" for p in resolved if p not in present]
    if not present or (missing and kind in ALL_FILES_NEEDED):
        return f"*(not measured: no {', '.join(missing)})*\n"
    results = [json.loads((ROOT / p).read_text()) for p in present]
    lines = [KINDS[kind](results), "", "Made by:"] + [provenance_line(p, r) for p, r in zip(present, results)]
    if missing:
        lines.append(f"- not in this run: {', '.join(missing)}")
    return "\n".join(lines) + "\n"


def regenerate(text: str, run: str | None = None) -> str:
    """``text`` with every generated section rewritten from its JSON files (and {run} pointed at ``run``)."""
    if run is not None:
        text = RUN.sub(f"<!-- latest-gpu-run: {run} -->", text)
    found = RUN.search(text)
    folder = found["folder"] if found else None

    def section(m: re.Match) -> str:
        if m["kind"] not in KINDS:
            raise ValueError(f"unknown generated section kind {m['kind']!r} (known: {', '.join(KINDS)})")
        return m["head"] + render(m["kind"], m["paths"].split(), folder) + m["end"]
    return SECTION.sub(section, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    parser.add_argument("--run", help="the latest GPU run's folder, e.g. bench/results/h100_abc1234")
    args = parser.parse_args(argv)
    text = BENCHMARKS.read_text()
    new = regenerate(text, args.run)
    if args.check:
        if new != text:
            print("BENCHMARKS.md's generated sections differ from their JSON files: run "
                  "python3 scripts/benchmarks_tables.py", file=sys.stderr)
            return 1
        return 0
    BENCHMARKS.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
