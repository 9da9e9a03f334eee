"""The recurrent gated delta rule's device time per launch, at the decode step's length (1 row) and the capsule
suffix piece's (24 rows), for a preset's DeltaNet shape:

    python3 bench/time_delta_rule.py [PRESET] [LENGTHS] [--sweep] [--out FILE]

(default qwen3.5-0.8b 1,24), one line per length with the kernels' own launch configuration
(``delta_rule.launch_config``: a piece's, or decode's for one row), the state read from device memory as in a step
(copies of it past the L2). ``--sweep`` also times every value block (1..64 columns), warp count (1..8) and
reduction (one joint or two in turn), each checked against the default configuration's output, and prints the
fastest per length. A/B two versions of the kernel in one sitting by running it before and after swapping the
module."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flashrt_ros.runtime.config import PRESETS  # noqa: E402
from flashrt_ros.runtime.kernels import delta_rule  # noqa: E402
from flashrt_ros.tools import provenance  # noqa: E402
from flashrt_ros.tools.timing import (fastest_line, print_sweep_row, sweep_arguments, sweep_launches,  # noqa: E402
                                      weight_copies)

TOLERANCE = 2e-2                     # bf16 outputs of another summation order, relative to the largest


def sweep_configs(dv: int) -> list[delta_rule.DeltaRuleConfig]:
    return [delta_rule.DeltaRuleConfig(block, warps, joint)
            for block, warps, joint in itertools.product((1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8), (True, False))
            if block <= max(4, 1 << (dv - 1).bit_length())]


def main(argv: list[str] | None = None) -> int:
    args, device, dtype = sweep_arguments(__doc__, argv)
    cfg = PRESETS[args.preset]
    generator = torch.Generator(device=device).manual_seed(0)
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    rows = []
    for length in map(int, args.lengths.split(",")):
        default = delta_rule.launch_config(hv, dk, dv, piece=length > 1)
        def rand(*shape):
            return torch.randn(*shape, device=device, generator=generator).to(dtype)
        inputs = (rand(length, hk, dk), rand(length, hk, dk), rand(length, hv, dv), rand(length, hv),
                  rand(length, hv), torch.zeros(hv, device=device), torch.ones(hv, device=device))
        state = torch.zeros(hv, dk, dv, device=device)
        scratch = weight_copies(device, (state.clone(),))  # the timed calls update them, each from device memory
        found = sweep_launches(
            device, default, sweep_configs(dv) if args.sweep else [],
            lambda c: delta_rule.gated_delta_rule_triton(*inputs, state.clone(), config=c),
            lambda c: [lambda s=s: delta_rule.gated_delta_rule_triton(*inputs, s, config=c) for s, in scratch],
            args.repeats, TOLERANCE, print_sweep_row)
        us = found[0]["us"]
        print(f"{args.preset} delta rule {length:3d} rows: {us:8.2f} us a launch, {us / length:6.3f} us a row "
              f"({tuple(default)})", flush=True)
        if args.sweep:
            print(fastest_line(found))
        rows += [{"length": length, **row} for row in found]
    if args.out:
        provenance.write_result(args.out, {"preset": args.preset, "rows": rows}, device.type)
    return 0


if __name__ == "__main__":
    sys.exit(main())
