"""Benchmark (``flashrt-runtime bench-capsules``): what delta capsules, lineage-aware restore and the tiers buy.

A planner's tree: a root at ``context`` tokens, then ``branches`` siblings, each restored from the root and
``branch_tokens`` further. Measured on one engine, side by side, in one run:

* memory held: the delta store's used bytes vs what full copies would hold (every capsule's full size), and both
  over one full capsule (the issue's target: 8 branches of the 27B shape at 16k under 2x one full capsule);
* restore: a sibling after a sibling (lineage-aware: the fixed state and the divergence), a full restore (after a
  reset nothing is live), and the copy floor (one device copy of the full capsule's bytes), p50 over repeats. A
  sibling's restore is timed three ways, since a capsule keeps the writes of its restores: each branch's first
  restore since it was stored, its second (with the writes its first kept; on CUDA it captures them into a graph),
  and the restores after those (``sibling_restore_p50_ms``: a planner going back to its branches; each wall time
  synchronised before and after, as the floor's; the host / device split from separate samples, as its events cost
  time); and
  sibling restores back to back, as a planner's search issues them (each round restores every branch in turn,
  synchronised once), beside full copies issued the same way: the time a restore costs a stream of them, where
  the p50 figures are each one synchronised round trip;
* spill and fetch per tier (pinned host where the device has one, disk where ``--capsule-dir`` is given or a
  temporary folder) against the link's floor measured on the same bytes: a plain device-to-pinned-host copy and
  back, and a plain write + fsync / read of the same bytes;
* export and import of a branch through the capsule directory (bytes/s).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from flashrt_ros.runtime.capsule.capsule import DISK, HOST
from flashrt_ros.runtime.engine import Engine

from . import bench_files
from .timing import timed, timed_split
from .verify import prompt_tokens


def _p50(values: list[float]) -> float:
    return statistics.median(values)


def build_tree(engine: Engine, context: int, branches: int, branch_tokens: int) -> list[str]:
    engine.reset()
    engine.ingest(prompt_tokens(engine.vocab_size, context, "bench-capsules-root"))
    engine.snapshot("root")
    ids = []
    for i in range(branches):
        engine.restore("root")
        engine.ingest(prompt_tokens(engine.vocab_size, branch_tokens, f"bench-capsules-branch-{i}"))
        ids.append(engine.snapshot(f"branch{i}").id)
    return ids


def memory_figures(engine: Engine, ids: list[str]) -> dict:
    full_one = engine.capsule("root").nbytes
    full_copies = sum(c.nbytes for c in engine.capsules())
    held = engine.capsule_bytes_used
    return {"one_full_capsule_bytes": full_one, "full_copies_bytes": full_copies, "delta_bytes": held,
            "full_copies_over_one": full_copies / full_one, "delta_over_one": held / full_one,
            "branch_own_bytes": engine.capsule(ids[0]).own_bytes,
            "branch_shared_bytes": engine.capsule(ids[0]).shared_bytes}


def restore_figures(engine: Engine, ids: list[str], repeats: int) -> dict:
    """Sibling restores (each branch's first, its second, and later ones: wall, and the later ones split into the
    host's time to issue them and the device's time), full restore, the copy floor of one full capsule and that of
    the bytes a sibling restore writes (one plain copy of as many)."""
    device = engine.device
    first = [timed(device, lambda: engine.restore(capsule_id))[1] for capsule_id in ids]
    second = [timed(device, lambda: engine.restore(capsule_id))[1] for capsule_id in ids]
    copied = engine.last_restore_bytes
    sibling = [timed(device, lambda: engine.restore(ids[n % len(ids)]))[1] for n in range(repeats)]
    split = [timed_split(device, lambda: engine.restore(ids[n % len(ids)]))[1] for n in range(repeats)]
    full = []
    for n in range(repeats):
        engine.reset()
        full.append(timed(device, lambda: engine.restore(ids[n % len(ids)]))[1])
    src = engine.capsule_bytes(ids[0])
    dst = torch.empty_like(src)
    floor = [timed(device, lambda: dst.copy_(src))[1] for _ in range(repeats)]
    part_src, part_dst = src[:copied], dst[:copied]
    bytes_floor = [timed(device, lambda: part_dst.copy_(part_src))[1] for _ in range(repeats)]
    out = {"sibling_first_restore_p50_ms": _p50(first), "sibling_second_restore_p50_ms": _p50(second),
           "sibling_restore_p50_ms": _p50(sibling),
           "sibling_restore_host_p50_ms": _p50([s["host"] for s in split]),
           "sibling_restore_device_p50_ms": _p50([s["device"] for s in split]), "sibling_restore_bytes": copied,
           "sibling_bytes_floor_p50_ms": _p50(bytes_floor),
           "full_restore_p50_ms": _p50(full), "full_restore_bytes": src.numel(), "copy_floor_p50_ms": _p50(floor)}
    out["sibling_first_over_floor"] = out["sibling_first_restore_p50_ms"] / out["copy_floor_p50_ms"]
    out["sibling_over_floor"] = out["sibling_restore_p50_ms"] / out["copy_floor_p50_ms"]
    out["sibling_over_bytes_floor"] = out["sibling_restore_p50_ms"] / out["sibling_bytes_floor_p50_ms"]
    out["full_over_floor"] = out["full_restore_p50_ms"] / out["copy_floor_p50_ms"]
    engine.restore(ids[-1])
    rounds = [timed(device, lambda: [engine.restore(i) for i in ids])[1] / len(ids) for _ in range(repeats)]
    floors = [timed(device, lambda: [dst.copy_(src) for _ in ids])[1] / len(ids) for _ in range(repeats)]
    out["sibling_back_to_back_ms"], out["copy_floor_back_to_back_ms"] = _p50(rounds), _p50(floors)
    out["sibling_back_to_back_over_floor"] = out["sibling_back_to_back_ms"] / out["copy_floor_back_to_back_ms"]
    return out


def _link_floors(engine: Engine, nbytes: int, folder: Path, repeats: int) -> dict:
    """Plain copies of ``nbytes`` over each link: device <-> pinned host; device -> host + write + fsync, and read
    (bench_files' floors, on the same folder)."""
    device = engine.device
    out = {}
    if HOST in engine.tiers.names:
        data = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out["host_spill_floor_ms"] = _p50([timed(device, lambda: host.copy_(data))[1] for _ in range(repeats)])
        out["host_fetch_floor_ms"] = _p50([timed(device, lambda: data.copy_(host))[1] for _ in range(repeats)])
    files = bench_files.file_figures(nbytes, device, folder, None, repeats)
    out["disk_spill_floor_ms"] = files["device_to_host_ms"] + files["write_fsync_floor_ms"]
    out["disk_fetch_floor_ms"] = files["read_floor_ms"]
    return out


def tier_figures(engine: Engine, capsule_id: str, folder: Path, repeats: int) -> dict:
    device, nbytes = engine.device, engine.capsule(capsule_id).nbytes
    out = {"spilled_bytes": nbytes, **_link_floors(engine, nbytes, folder, repeats)}
    for tier in (t for t in (HOST, DISK) if t in engine.tiers.names):
        engine.spill(capsule_id, tier)                 # warm: the first pinned allocation, the file's first write
        engine.fetch(capsule_id)
        spills, fetches = [], []
        for _ in range(repeats):
            spills.append(timed(device, lambda: engine.spill(capsule_id, tier))[1])
            fetches.append(timed(device, lambda: engine.fetch(capsule_id))[1])
        out[f"{tier}_spill_p50_ms"], out[f"{tier}_fetch_p50_ms"] = _p50(spills), _p50(fetches)
        out[f"{tier}_spill_over_floor"] = out[f"{tier}_spill_p50_ms"] / out[f"{tier}_spill_floor_ms"]
        out[f"{tier}_fetch_over_floor"] = out[f"{tier}_fetch_p50_ms"] / out[f"{tier}_fetch_floor_ms"]
    return out


def engine_file_figures(engine: Engine, capsule_id: str, repeats: int) -> dict:
    nbytes, exports, imports = engine.capsule(capsule_id).nbytes, [], []
    for _ in range(repeats):
        exports.append(timed(engine.device, lambda: engine.export_capsule(capsule_id))[1])
        engine.drop(capsule_id)
        imports.append(timed(engine.device, lambda: engine.import_capsule(capsule_id))[1])
        engine.capsule_file(capsule_id).unlink()
    return {"export_p50_ms": _p50(exports), "import_p50_ms": _p50(imports),
            "export_gb_s": nbytes / _p50(exports) / 1e6, "import_gb_s": nbytes / _p50(imports) / 1e6}


def run(engine: Engine, context: int, branches: int, branch_tokens: int, repeats: int) -> dict:
    if engine.capsule_dir is None:
        raise ValueError("bench-capsules needs an engine with a capsule_dir")
    started = time.perf_counter()
    ids = build_tree(engine, context, branches, branch_tokens)
    result = {"context": context, "branches": branches, "branch_tokens": branch_tokens,
              "tiers": list(engine.tiers.names), **memory_figures(engine, ids),
              **restore_figures(engine, ids, repeats)}
    result.update(tier_figures(engine, ids[-1], engine.capsule_dir, repeats))
    result.update(engine_file_figures(engine, ids[-2], repeats))
    result["bench_s"] = time.perf_counter() - started
    return result


COLUMNS = ["context", "branches", "one_full_capsule_bytes", "full_copies_over_one", "delta_over_one",
           "sibling_first_restore_p50_ms", "sibling_second_restore_p50_ms", "sibling_restore_p50_ms",
           "sibling_restore_host_p50_ms", "sibling_restore_device_p50_ms", "sibling_bytes_floor_p50_ms",
           "full_restore_p50_ms", "copy_floor_p50_ms", "sibling_first_over_floor", "sibling_over_floor",
           "sibling_over_bytes_floor", "sibling_back_to_back_ms", "copy_floor_back_to_back_ms",
           "sibling_back_to_back_over_floor",
           "full_over_floor", "host_spill_p50_ms", "host_spill_over_floor", "host_fetch_p50_ms",
           "host_fetch_over_floor", "disk_spill_p50_ms", "disk_spill_over_floor", "disk_fetch_p50_ms",
           "disk_fetch_over_floor", "export_gb_s", "import_gb_s"]


def markdown(*results: dict) -> str:
    """One row per result (several runs, e.g. per context, in one table)."""
    cols = [c for c in COLUMNS if any(c in r for r in results)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for result in results:
        cells = ["" if c not in result else f"{result[c]:.3g}" if isinstance(result[c], float) else f"{result[c]:,}"
                 for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
