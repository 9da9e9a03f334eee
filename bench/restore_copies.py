"""How should a sibling restore issue its copies? A diagnostic run on the device:
``python3 bench/restore_copies.py [FIXED_BYTES] [ROW_RANGES]`` lays out a 0.8B-shaped sibling restore at 16k (one
fixed-state range of FIXED_BYTES, the metadata's 64 bytes, and ROW_RANGES: the comma-separated byte lengths of the
divergent KV rows' ranges) between two device buffers and issues it several ways:

* ``memcpy+foreach`` (the restore before ``4fa6b82``): ranges of 1 MiB or more alone through ``cudaMemcpyAsync``,
  the rest in one ``torch._foreach_copy_`` over 8-byte words;
* ``foreach int32`` (``live.RestoreCopies``, the restore since): every range in one ``_foreach_copy_`` over 4-byte
  words (torch's multi-tensor apply gives a block 64 Ki words, so narrower words spread a large range over more
  blocks), and ``foreach int16`` over 2-byte words;
* ``graph``: the first way captured once in a CUDA graph and replayed (tried in ``c529386`` and removed), and
  ``graph of foreach int32``: the current way captured so (one kernel node: the replay's host time for the call's).

For each it prints the host's time per restore issued back to back (what a planner's loop of restores costs when
the host is the bound), the device's time per restore (a queue of them issued behind a sleeping kernel, timed with
events), and the p50 wall time of one restore synchronised before and after, beside one plain copy of the same
bytes; and checks that each way wrote the right bytes."""
import statistics
import sys
import time

import torch

from flashrt_ros.runtime.capsule.live import RestoreCopies, RestoreGraphs, write

assert torch.cuda.is_available(), "a CUDA device is needed"
fixed_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 19_539_968
row_ranges = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "786432,131072").split(",")]
QUEUED, SINGLE = 200, 50
lengths = [64, fixed_bytes] + row_ranges
total = sum(lengths)
src = torch.randint(0, 256, (total + 4096 * len(lengths),), dtype=torch.uint8, device="cuda")
dst = torch.zeros_like(src)
ranges, offset = [], 0
for length in lengths:               # ranges 4 KiB apart, as an arena's buffers are
    ranges.append((dst[offset:offset + length], src[offset:offset + length]))
    offset += length + 4096


def words(dtype):
    return [(d.view(dtype), s.view(dtype)) for d, s in ranges]


def foreach(pairs):
    dsts, srcs = zip(*pairs)
    return lambda: torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)


def memcpy_and_foreach(alone_bytes: int = 1 << 20):
    """The restore's copies before 4fa6b82: large ranges alone, the rest over 8-byte words in one batched copy."""
    alone = [(d, s) for d, s in ranges if d.numel() >= alone_bytes]
    batched = foreach([(d.view(torch.int64), s.view(torch.int64)) for d, s in ranges if d.numel() < alone_bytes])

    def issue():
        for d, s in alone:
            d.copy_(s, non_blocking=True)
        batched()
    return issue


ways = {"memcpy+foreach": memcpy_and_foreach(), "foreach int16": foreach(words(torch.int16)),
        "foreach int32": RestoreCopies([write(d, s) for d, s in ranges]).issue}
graphs = RestoreGraphs(torch.device("cuda"))       # the restore's own capture
ways["graph"] = graphs.capture(ways["memcpy+foreach"]).replay
ways["graph of foreach int32"] = graphs.capture(ways["foreach int32"]).replay
plain_dst, plain_src = dst[:total], src[:total]
ways["one plain copy of as many bytes"] = lambda: plain_dst.copy_(plain_src)


def host_back_to_back(issue) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(QUEUED):
        issue()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1000 * host / QUEUED


def device_each(issue) -> float:
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)            # the host queues every restore before the device reaches the first
    events[0].record()
    for _ in range(QUEUED):
        issue()
    events[1].record()
    torch.cuda.synchronize()
    return events[0].elapsed_time(events[1]) / QUEUED


def single_wall(issue) -> float:
    walls = []
    for _ in range(SINGLE):
        torch.cuda.synchronize()
        start = time.perf_counter()
        issue()
        torch.cuda.synchronize()
        walls.append(1000 * (time.perf_counter() - start))
    return statistics.median(walls)


print(f"{torch.cuda.get_device_name()}: ranges {lengths} bytes ({total} in all)")
print("| way | host per restore, back to back ms | device per restore ms | one restore, wall p50 ms | bytes right |")
print("|---|---|---|---|---|")
for name, issue in ways.items():
    for _ in range(3):
        issue()                              # warm: kernels loaded, graph uploaded
    host, device, wall = host_back_to_back(issue), device_each(issue), single_wall(issue)
    right = "-"
    if name != "one plain copy of as many bytes":
        dst.zero_()
        issue()
        right = str(all(torch.equal(d, s) for d, s in ranges))
    print(f"| {name} | {host:.4f} | {device:.4f} | {wall:.4f} | {right} |")
