"""Which of the dense GEMV's fusions costs what, one projection at a time: in the 0.8B decode step the Triton GEMVs
took 15.5 us a launch on average (h100_8fe1adb/profile_..._triton.txt) where the same shapes, timed alone without
fusions, took ~8 us (tune_dense_0.8b.json), so something the step adds costs ~7 us a launch.

    python3 bench/gemv_fusions.py [PRESET] [--out FILE]

For each dense projection shape of the preset and each fusion of :func:`dense_linear_triton` (none, the input's
RMSNorm, the input's SiLU gate, the residual add), the fused kernel (with this device's table configuration) against
what the cuBLAS path launches for the same result (the Triton norm / gate kernel, then ``F.linear``, then the add),
each timed in CUDA graphs over copies of the weight read from device memory (``timing.weight_copies``)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashrt_ros.runtime.config import PRESETS  # noqa: E402
from flashrt_ros.runtime.kernels import TRITON  # noqa: E402
from flashrt_ros.runtime.kernels.dense_gemv import dense_linear_triton  # noqa: E402
from flashrt_ros.tools import provenance  # noqa: E402
from flashrt_ros.tools.bench_quant import preset_projection_shapes  # noqa: E402
from flashrt_ros.tools.timing import time_calls_us, weight_copies  # noqa: E402

FUSIONS = ("none", "norm", "gated", "residual")


def fused_and_unfused(fusion: str, x, gate_up, scale, residual):
    """(the fused call, the cuBLAS path's calls) of one weight ``w`` for ``fusion``, as functions of ``w``."""
    if fusion == "norm":
        return (lambda w: dense_linear_triton(x, w, scale, 1e-6),
                lambda w: F.linear(TRITON.rms_norm(x, scale, 1e-6), w))
    if fusion == "gated":
        return lambda w: dense_linear_triton(gate_up, w, gated=True), lambda w: F.linear(TRITON.silu_mul(gate_up), w)
    if fusion == "residual":
        return lambda w: dense_linear_triton(x, w, residual=residual), lambda w: residual + F.linear(x, w)
    return lambda w: dense_linear_triton(x, w), lambda w: F.linear(x, w)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", nargs="?", default="qwen3.5-0.8b")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)
    rows = []
    for n, k in preset_projection_shapes(args.preset):
        w = torch.randn(n, k, device=device, dtype=dtype, generator=generator) / k ** 0.5
        weights = [copy for copy, in weight_copies(device, (w,))]
        x = torch.randn(1, k, device=device, dtype=dtype, generator=generator)
        gate_up = torch.randn(1, 2 * k, device=device, dtype=dtype, generator=generator)
        scale = 1.0 + 0.1 * torch.randn(k, device=device, generator=generator)
        residual = torch.randn(1, n, device=device, dtype=dtype, generator=generator)
        for fusion in FUSIONS:
            fused, unfused = fused_and_unfused(fusion, x, gate_up, scale, residual)
            row = {"N": n, "K": k, "fusion": fusion,
                   "triton_us": time_calls_us(device, [lambda c=c: fused(c) for c in weights], args.repeats),
                   "cublas_path_us": time_calls_us(device, [lambda c=c: unfused(c) for c in weights], args.repeats)}
            row["triton_over_cublas_path"] = row["triton_us"] / row["cublas_path_us"]
            rows.append(row)
            print(f"{n:7d}x{k:<5d} {fusion:9s} triton {row['triton_us']:8.2f} us   cuBLAS path "
                  f"{row['cublas_path_us']:8.2f} us   x{row['triton_over_cublas_path']:.2f}", flush=True)
        del w, weights
    if args.out:
        provenance.write_result(args.out, {"preset": args.preset, "rows": rows}, device.type)
    return 0


if __name__ == "__main__":
    sys.exit(main())
