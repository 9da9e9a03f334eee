"""Where does a sibling restore's host time go? A diagnostic run on the device:
``python3 bench/profile_restore.py PRESET CONTEXT [BRANCHES] [BRANCH_TOKENS] [RESTORES]`` builds
``bench-capsules``' planner tree, then restores sibling after sibling and prints the mean wall time, the host
operations by self time (torch.profiler: aten ops and CUDA runtime calls) and the Python functions by total time
(cProfile). The bench's ``sibling_restore_host_p50_ms`` above its device time says the device waits on these."""
import cProfile
import pstats
import sys

import torch
from torch.profiler import ProfilerActivity, profile

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
