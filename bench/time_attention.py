"""The decode attention kernel's device time per launch (split kernel and combine), at the decode step's length
(1 row) and the capsule suffix piece's (24 rows), the rows' positions at the end of a long context, for a preset's
attention shape:

    python3 bench/time_attention.py [PRESET] [LENGTHS] [--context N] [--sweep] [--budget-s S] [--out FILE]

(default qwen3.5-0.8b 1,24 at 16384), one line per length with the kernel's own launch configuration
(``attention.launch_config``), the keys and values read from device memory as in a step (copies of the cache past
the L2). ``--sweep`` also times tiles of 16..128 query rows x heads, 32 or 64 keys a block, 128..1024 split
programs and 4, 8 or 16 warps, each checked against the default configuration's output, and prints the fastest per
length (a 24-row piece of the 0.8B fits one 128-row tile: its keys are then read once, not once per 8 rows)."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flashrt_ros.runtime.config import PRESETS  # noqa: E402
from flashrt_ros.runtime.kernels import attention  # noqa: E402
from flashrt_ros.tools import provenance  # noqa: E402
from flashrt_ros.tools.timing import (fastest_line, print_sweep_row, sweep_arguments, sweep_launches,  # noqa: E402
                                      weight_copies)

TOLERANCE = 2e-2                     # bf16 outputs of another summation order, relative to the largest


def sweep_configs(length: int, groups: int, dim: int) -> list[attention.AttentionLaunch]:
    """Tiles that hold one row's heads and no more rows than the piece has, with warps enough for the tile; the
    largest tiles first (they read the keys the fewest times), so a sweep cut short by its time limit has timed them."""
    most = max(16, 1 << (length * groups - 1).bit_length())
    return [attention.AttentionLaunch(*c) for c in itertools.product((128, 64, 32, 16), (32, 64),
                                                                       (128, 256, 512, 1024), (4, 8, 16))
            if groups <= c[0] <= most and c[0] * dim <= attention.TILE_ELEMENTS_PER_WARP * c[3]]


def main(argv: list[str] | None = None) -> int:
    args, device, dtype = sweep_arguments(
        __doc__, argv, lambda parser: parser.add_argument("--context", type=int, default=16384))
    cfg = PRESETS[args.preset]
    generator = torch.Generator(device=device).manual_seed(0)
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    groups = heads // kv_heads
    rows = []
    for length in map(int, args.lengths.split(",")):
        span = -(-(args.context + length) // 64) * 64                   # a KV bucket holding every row's position
        q, gate = (torch.randn(length, heads, dim, device=device, generator=generator).to(dtype) for _ in range(2))
        cache = torch.randn(span, 2, kv_heads, dim, device=device, generator=generator).to(dtype)
        caches = weight_copies(device, (cache,))             # each timed call reads its keys from device memory
        positions = torch.arange(args.context, args.context + length, device=device)
        default = attention.launch_config(length, groups, dim)

        def attend(cache, launch):
            return attention.attention_decode_triton(q, cache[:, 0], cache[:, 1], positions, gate, launch=launch)
        found = sweep_launches(
            device, default, sweep_configs(length, groups, dim) if args.sweep else [], lambda c: attend(cache, c),
            lambda c: [lambda k=k: attend(k, c) for k, in caches], args.repeats, TOLERANCE,
            print_sweep_row, args.budget_s)
        us = found[0]["us"]
        print(f"{args.preset} attention {length:3d} rows at {args.context}: {us:8.2f} us a launch "
              f"({tuple(default)})", flush=True)
        if args.sweep:
            print(fastest_line(found))
        rows += [{"length": length, "context": args.context, **row} for row in found]
    if args.out:
        provenance.write_result(args.out, {"preset": args.preset, "rows": rows}, device.type)
    return 0


if __name__ == "__main__":
    sys.exit(main())
