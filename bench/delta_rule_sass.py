"""The recurrent delta rule's serial loop in SASS, compiled for a CUDA target on any machine: what one row of a piece
costs in instructions, long-latency MUFU and exchanges through shared memory, per launch configuration.

    python bench/delta_rule_sass.py [PRESET] [--rows 24] [--config 4,1,1,1 ...] [--arch 90] [--json out.json]

A piece's rows are serial, each program one warp by default: a row's time is the latency of its chain of dependent
instructions, so the loop's length, its MUFU (exp, log, rsqrt, reciprocal: the gates and the norms), its
exchanges through shared memory (a ``STS`` then a barrier then a load, to change a tensor's layout) and whether its
reduction trees are interleaved (SHFLs issued next to each other) or one after another are what the launch
configurations trade. The launch is recorded as the engine makes it (q, k, v views of one conv output, a and b
of one projection, a device count) and compiled as ``compile_kernels.py`` does; ``--config`` takes
``block_v,warps,joint,ahead`` (see ``delta_rule.DeltaRuleConfig``; default: the piece's own launch). The
serial loop is the last loop in program order that shuffles (SHFL: its sums over the keys); with the factors ahead
(``ahead``) the loop before it computes them, ``delta_rule.AHEAD_ROWS`` rows an iteration.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compile_kernels as ck  # noqa: E402  (sets a fresh Triton cache and the repository path)
import gemv_sass  # noqa: E402
import torch  # noqa: E402

from flashrt_ros.runtime.config import PRESETS  # noqa: E402
from flashrt_ros.runtime.kernels import delta_rule  # noqa: E402
from flashrt_ros.tools import provenance  # noqa: E402

def record(preset: str, rows: int, config: delta_rule.DeltaRuleConfig | None) -> ck.Launch:
    """The piece's launch as a step makes it, recorded on CPU tensors (nothing runs)."""
    cfg = PRESETS[preset]
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    mixed = torch.empty(rows, 2 * hk * dk + hv * dv, dtype=torch.bfloat16)
    projected = torch.empty(rows, mixed.shape[1] + hv * dv + 2 * hv, dtype=torch.bfloat16)
    q, k, v = (part.unflatten(-1, shape) for part, shape in
               zip(mixed.split([hk * dk, hk * dk, hv * dv], 1), ((hk, dk), (hk, dk), (hv, dv))))
    recorder = ck._Recorder()
    with recorder.recording():
        delta_rule.gated_delta_rule_triton(q, k, v, projected[:, -hv:], projected[:, -2 * hv:-hv], torch.empty(hv),
                                           torch.empty(hv), torch.empty(hv, dk, dv), torch.tensor(rows),
                                           config=config)
    return recorder.launches[0]


def summary(body: list[str]) -> dict:
    """A loop's counts; ``shfl_adjacent``: its SHFLs issued next to another SHFL (its reduction trees interleaved,
    where none means one tree after another: each row waits on their latencies in turn)."""
    counts = collections.Counter(body)
    shfl = [i for i, opcode in enumerate(body) if opcode == "SHFL"]
    return {"instructions": len(body), "mufu": counts["MUFU"], "shfl": len(shfl),
            "shfl_adjacent": sum(1 for i in shfl if i - 1 in shfl or i + 1 in shfl),
            "exchanges": counts["STS"], "barriers": counts["BAR"]}


def measure(preset: str, rows: int, config: delta_rule.DeltaRuleConfig | None, arch: int) -> dict:
    """The serial loop's (and the factors' loop's, where there is one) counts and the kernel's registers."""
    launch = record(preset, rows, config)
    text, registers, spills = gemv_sass.sass(launch, arch)
    bodies = gemv_sass.loop_bodies(text)
    serial_at = max(i for i, body in enumerate(bodies) if "SHFL" in body)
    used = config or delta_rule.launch_config(PRESETS[preset].linear_num_value_heads,
                                              PRESETS[preset].linear_key_head_dim,
                                              PRESETS[preset].linear_value_head_dim, piece=True, interpreted=False)
    return {"config": list(used), "registers": registers, "local_memory_accesses": spills,
            "serial_loop": summary(bodies[serial_at]),
            "factors_loop": summary(bodies[serial_at - 1]) if used.ahead and serial_at > 0 else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", nargs="?", default="qwen3.5-0.8b")
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--config", action="append", help="block_v,warps,joint,ahead (repeatable)")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    configs = [delta_rule.DeltaRuleConfig(*(int(x) if i < 2 else x == "1" for i, x in enumerate(c.split(","))))
               for c in args.config] if args.config else [None]
    results = []
    for config in configs:
        result = measure(args.preset, args.rows, config, args.arch)
        results.append(result)
        loop, factors = result["serial_loop"], result["factors_loop"]
        print(f"{args.preset} {args.rows} rows {tuple(result['config'])} sm_{args.arch}: serial loop "
              f"{loop['instructions']} instructions a row, {loop['mufu']} MUFU, {loop['shfl']} SHFL "
              f"({loop['shfl_adjacent']} next to another), "
              f"{loop['exchanges']} shared-memory exchanges; {result['registers']} registers, "
              f"{result['local_memory_accesses']} local-memory accesses"
              + (f"; factors {factors['instructions']} instructions per {delta_rule.AHEAD_ROWS} rows" if factors
                 else ""), flush=True)
    if args.json:
        provenance.write_result(args.json, {"preset": args.preset, "rows": args.rows, "arch": f"sm_{args.arch}",
                                            "results": results}, "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
