"""Does a capsule operation cost more when more capsules are stored? A diagnostic run:
``python3 bench/store_scaling.py [PRESET] [DEVICE] [COUNTS]`` stores COUNTS capsules (comma-separated, e.g.
10,100,1000) of one stream in turn and prints, for each count, the mean wall milliseconds of a snapshot and of a drop
with that many capsules stored (synchronised around each batch). The store's budget check is read on every
snapshot and fork, so its cost must not grow with the count."""
import sys

import torch

from flashrt_ros.runtime import Engine, EngineConfig
from flashrt_ros.tools.timing import timed

preset = sys.argv[1] if len(sys.argv) > 1 else "tiny"
device = sys.argv[2] if len(sys.argv) > 2 else ("cuda" if torch.cuda.is_available() else "cpu")
counts = [int(n) for n in (sys.argv[3] if len(sys.argv) > 3 else "10,100,1000").split(",")]
BATCH = 50
engine = Engine(EngineConfig(model=preset, device=device, dtype="bfloat16" if device == "cuda" else "float32",
                             max_context=1024, checksum_on_snapshot=False, max_capsules=max(counts) + BATCH,
                             capsule_budget_bytes=64 << 30))
engine.ingest([1 + i % (engine.vocab_size - 1) for i in range(512)])


def timed_batch(operation) -> float:
    """Mean wall milliseconds of BATCH calls of ``operation(i)``, synchronised before and after."""
    return timed(engine.device, lambda: [operation(i) for i in range(BATCH)])[1] / BATCH


stored = 0
print("| capsules stored | snapshot ms | drop ms |\n|---|---|---|")
for count in counts:
    while stored < count:
        engine.snapshot()
        stored += 1
    ids = []
    snapshot_ms = timed_batch(lambda i: ids.append(engine.snapshot().id))
    drop_ms = timed_batch(lambda i: engine.drop(ids[i]))
    print(f"| {count} | {snapshot_ms:.4f} | {drop_ms:.4f} |")
