"""The recurrent gated delta rule's device time per launch, at the decode step's length (1 row) and the capsule
suffix piece's (24 rows), for a preset's DeltaNet shape:

    python3 bench/time_delta_rule.py [PRESET] [LENGTHS] [--sweep] [--budget-s S] [--out FILE]

(default qwen3.5-0.8b 1,24), one line per length with the kernels' own launch configuration
(``delta_rule.launch_config``: a piece's, or decode's for one row), the state read from device memory as in a step
(copies of it past the L2), and the own launch again on the inputs laid out as a step passes them
(:func:`as_in_a_step`: views of the projections and a device count, then each of the two alone). ``--sweep`` also
times every value block (1..64 columns), warp count (1..8) and reduction (one joint or two in turn) and, for a
piece, the factors ahead of the serial loop or in it (``delta_rule.DeltaRuleConfig``), each checked against the
default configuration's output, nearest the default first (``--budget-s``: the seconds a length's sweep may take;
those timed by then are reported), and prints the fastest per length. A/B two versions of the kernel in one sitting by
running it before and after swapping the module."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flashrt_ros.runtime.config import PRESETS  # noqa: E402
from flashrt_ros.runtime.kernels import delta_rule  # noqa: E402
from flashrt_ros.runtime.kernels._triton import INTERPRETED  # noqa: E402
from flashrt_ros.tools import provenance  # noqa: E402
from flashrt_ros.tools.timing import (fastest_line, print_sweep_row, sweep_arguments, sweep_launches,  # noqa: E402
                                      time_calls_us, weight_copies)

TOLERANCE = 2e-2                     # bf16 outputs of another summation order, relative to the largest


def sweep_configs(dv: int, length: int, interpreted: bool = INTERPRETED) -> list[delta_rule.DeltaRuleConfig]:
    """Every value block, warp count and reduction; a piece's also with its factors ahead of the loop or in it.
    Under Triton's interpreter (which runs a program's lanes as one, whatever its warps) one warp count."""
    return [delta_rule.DeltaRuleConfig(block, warps, joint, ahead)
            for block, warps, joint, ahead in itertools.product((1, 2, 4, 8, 16, 32, 64),
                                                                (1,) if interpreted else (1, 2, 4, 8), (True, False),
                                                                (False, True) if length > 1 else (False,))
            if block <= max(4, 1 << (dv - 1).bit_length())]


def nearest_first(default: delta_rule.DeltaRuleConfig,
                  configs: list[delta_rule.DeltaRuleConfig]) -> list[delta_rule.DeltaRuleConfig]:
    """The configurations ordered by how many of their fields differ from the default's."""
    return sorted(configs, key=lambda c: sum(a != b for a, b in zip(c, default)))


def as_in_a_step(q, k, v, a, b, *rest):
    """The same values as a step passes them: q, k, v views of one conv output, a and b the last columns of one
    projection output (after the z gate's), and the real-row count as a device tensor."""
    mixed = torch.cat([x.flatten(1) for x in (q, k, v)], dim=1)
    projected = torch.cat([mixed, torch.zeros_like(v.flatten(1)), b, a], dim=1)
    q, k, v = (part.unflatten(-1, x.shape[1:]) for part, x in zip(mixed.split([q[0].numel(), k[0].numel(),
                                                                                v[0].numel()], 1), (q, k, v)))
    heads = a.shape[1]
    return (q, k, v, projected[:, -heads:], projected[:, -2 * heads:-heads], *rest,
            torch.tensor(q.shape[0], device=q.device))


def main(argv: list[str] | None = None) -> int:
    args, device, dtype = sweep_arguments(__doc__, argv)
    cfg = PRESETS[args.preset]
    generator = torch.Generator(device=device).manual_seed(0)
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    rows, in_a_step = [], []
    for length in map(int, args.lengths.split(",")):
        default = delta_rule.launch_config(hv, dk, dv, piece=length > 1)
        def rand(*shape):
            return torch.randn(*shape, device=device, generator=generator).to(dtype)
        inputs = (rand(length, hk, dk), rand(length, hk, dk), rand(length, hv, dv), rand(length, hv),
                  rand(length, hv), torch.zeros(hv, device=device), torch.ones(hv, device=device))
        state = torch.zeros(hv, dk, dv, device=device)
        scratch = weight_copies(device, (state.clone(),))  # the timed calls update them, each from device memory
        *stepped, count = as_in_a_step(*inputs)          # timed first, so a sweep cut short still reports it
        if not torch.equal(delta_rule.gated_delta_rule_triton(*stepped, state.clone(), count),
                           delta_rule.gated_delta_rule_triton(*inputs, state.clone())):
            raise SystemExit("the inputs laid out as in a step gave other bytes")
        step_us = {name: time_calls_us(device, [lambda s=s, x=x, n=n: delta_rule.gated_delta_rule_triton(*x, s, n)
                                                for s, in scratch], args.repeats)
                   for name, x, n in (("us", stepped, count), ("views_us", stepped, None), ("count_us", inputs, count))}
        in_a_step.append({"length": length, "config": list(default), **step_us})
        print(f"{args.preset} delta rule {length:3d} rows laid out as in a step: {step_us['us']:8.2f} us a launch "
              f"({tuple(default)}; the views alone {step_us['views_us']:.2f}, the device count alone "
              f"{step_us['count_us']:.2f})", flush=True)
        found = sweep_launches(
            device, default, nearest_first(default, sweep_configs(dv, length)) if args.sweep else [],
            lambda c: delta_rule.gated_delta_rule_triton(*inputs, state.clone(), config=c),
            lambda c: [lambda s=s: delta_rule.gated_delta_rule_triton(*inputs, s, config=c) for s, in scratch],
            args.repeats, TOLERANCE, print_sweep_row, args.budget_s)
        us = found[0]["us"]
        print(f"{args.preset} delta rule {length:3d} rows: {us:8.2f} us a launch, {us / length:6.3f} us a row "
              f"({tuple(default)})", flush=True)
        if args.sweep:
            print(fastest_line(found))
        rows += [{"length": length, **row} for row in found]
    if args.out:
        provenance.write_result(args.out, {"preset": args.preset, "rows": rows, "in_a_step": in_a_step}, device.type)
    return 0


if __name__ == "__main__":
    sys.exit(main())
