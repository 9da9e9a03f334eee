"""Where does a sibling restore's host time go? A diagnostic run on the device:
``python3 bench/profile_restore.py PRESET CONTEXT [BRANCHES] [BRANCH_TOKENS] [RESTORES]`` builds
``bench-capsules``' planner tree, then restores sibling after sibling and prints the mean wall time, the host
operations by self time (torch.profiler: aten ops and CUDA runtime calls) and the Python functions by total time
(cProfile). The bench's ``sibling_restore_host_p50_ms`` above its device time says the device waits on these.
Before those, single restores as the bench times them (synchronised before and after): each branch's first restore
since it was stored, then later ones, with the host's time split at the copies' issue (Python before them, the
copies' calls, Python after)."""
import cProfile
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flashrt_ros.runtime.capsule.live as live
from flashrt_ros.runtime import Engine, EngineConfig
from flashrt_ros.tools.bench_capsules import build_tree
from flashrt_ros.tools.timing import timed

preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3.5-0.8b"
context = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
branches = int(sys.argv[3]) if len(sys.argv) > 3 else 8
branch_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 64
restores = int(sys.argv[5]) if len(sys.argv) > 5 else 200
device = "cuda" if torch.cuda.is_available() else "cpu"
engine = Engine(EngineConfig(model=preset, device=device, dtype="bfloat16" if device == "cuda" else "float32",
                             max_context=context + branch_tokens + 64, prefill_chunk=2048,
                             checksum_on_snapshot=False, capsule_budget_bytes=64 << 30))
ids = build_tree(engine, context, branches, branch_tokens)


def siblings(count: int) -> float:
    """Restore ``count`` siblings in turn; the mean wall milliseconds of one, synchronised before and after."""
    engine.restore(ids[0])
    return timed(engine.device, lambda: [engine.restore(ids[(n + 1) % len(ids)]) for n in range(count)])[1] / count


def single_shots(rounds: int) -> None:
    """Restore each branch in turn, ``rounds`` times, each synchronised alone; per round the p50 wall time and the
    host's time before the copies' calls, in them and after them (``live.RestoreCopies.issue`` stamped; in a tree
    before it, for a side-by-side run, ``live.copy_ranges``)."""
    stamps = []
    owner, name = (live.RestoreCopies, "issue") if hasattr(live, "RestoreCopies") else (live, "copy_ranges")
    issue = getattr(owner, name)

    def stamped(*args):
        stamps.append(time.perf_counter())
        issue(*args)
        stamps.append(time.perf_counter())

    setattr(owner, name, stamped)
    try:
        for r in range(rounds):
            walls, parts = [], []
            for capsule_id in ids:
                stamps.clear()
                torch.cuda.synchronize() if device == "cuda" else None
                start = time.perf_counter()
                engine.restore(capsule_id)
                end = time.perf_counter()
                torch.cuda.synchronize() if device == "cuda" else None
                walls.append(1000 * (time.perf_counter() - start))
                parts.append([1000 * (b - a) for a, b in zip([start] + stamps, stamps + [end])])
            split = [statistics.median(p[i] for p in parts) for i in range(3)]
            label = ("first restores", "again: on CUDA each records its graph", "again")[min(r, 2)]
            print(f"round {r} ({label}): wall p50 {statistics.median(walls):.4f} ms, "
                  f"host before the copies {split[0]:.4f}, the copies' calls {split[1]:.4f}, after {split[2]:.4f} ms")
    finally:
        setattr(owner, name, issue)


engine.restore("root")
single_shots(3)
siblings(restores)   # warm
print(f"{preset} at {context}, {branches} branches of {branch_tokens}: sibling restore {siblings(restores):.4f} ms "
      f"(mean of {restores}, back to back), {engine.last_restore_bytes} bytes each")
with profile(activities=[ProfilerActivity.CPU]) as prof:
    siblings(restores)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
python_profile = cProfile.Profile()
python_profile.enable()
siblings(restores)
python_profile.disable()
pstats.Stats(python_profile).sort_stats("tottime").print_stats(20)
