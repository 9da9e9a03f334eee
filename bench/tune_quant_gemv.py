"""Sweep the fused GEMVs' launch configurations on this device and write the table they then use.

    python3 bench/tune_quant_gemv.py --out $OUT/tune.json --write-table $OUT/quant_gemv_configs.py
           [--presets qwen3.5-0.8b,qwen3.6-27b] [--rows 1,8,16,24,32,64] [--kinds fp8,fp8-block,nvfp4]
           [--budget-s 200] [--repeats 5]
    python3 bench/tune_quant_gemv.py --kinds dense --rows 1,2,3,4,5 ...     (the dense GEMV of decode and verify)

For each weight kind (fp8 per channel, fp8 with 128-wide block scales, nvfp4, or ``dense``: the model dtype's
weights through :mod:`~flashrt_ros.runtime.kernels.dense_gemv`), each projection shape of the presets
(after fusion, and the LM head) and each row count, every candidate configuration is timed inside CUDA graphs
(``timing.time_calls_us``), cycling through copies of the weight so that each call reads it from device memory as a
decode step does (``timing.weight_copies``: timed on one L2-resident weight, a kernel tuned for cache latency loses
in the step), and its output checked against the reference (wrong ones are skipped and reported); beside them
cuBLAS bf16 ``F.linear`` on the dense weights and the long-piece path (dequantise + cuBLAS).
Per (kind, N, K, rows bucket) the fastest correct configuration over the bucket's row counts is chosen (dense has
one bucket: its rows share one configuration, so one reduction order); per quantized kind, ``fused_max_rows`` is
the largest row count up to which the fused GEMV beats dequantise + cuBLAS summed over the shapes. The JSON has every timing; ``--write-table`` writes the module ``quant_gemv_configs.py`` with this device's
entries merged into the table already in the tree: swept keys replace theirs, the others are kept, and
``fused_max_rows`` is replaced only by a sweep of more than one row count (copy it over
flashrt_ros/runtime/kernels/quant_gemv_configs.py and commit it).
Row counts are swept in order, 1 first, and each shape's candidates only while ``--budget-s``
lasts; what it leaves untimed keeps the default configuration (listed under ``untuned``).
"""
from __future__ import annotations

import argparse
import json
import pprint
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashrt_ros.runtime import quant  # noqa: E402
from flashrt_ros.runtime.kernels import dense_gemv  # noqa: E402
from flashrt_ros.runtime.kernels import quant_gemv as kq  # noqa: E402
from flashrt_ros.runtime.kernels import quant_gemv_configs  # noqa: E402
from flashrt_ros.tools import provenance  # noqa: E402
from flashrt_ros.tools.bench_quant import preset_projection_shapes  # noqa: E402
from flashrt_ros.tools.timing import time_calls_us, weight_copies  # noqa: E402

ROWS = (1, 8, 16, 24, 32, 64)        # decode, the small-piece buckets up to SMALL_PIECE (model.py)
FP8_BLOCK = 128                      # compressed-tensors' block-scaled FP8 checkpoints
TOLERANCE = 2e-2                     # bf16 activations: relative to the largest output


def candidates(kind: str, bucket: int) -> list[kq.GemvConfig]:
    """The configurations swept (splits resolved per shape by :func:`split_choices`)."""
    if kind == kq.DENSE:
        return [kq.GemvConfig(bn, bk, w, s) for bn in (16, 32, 64) for bk in (64, 128, 256) for w in (4, 8)
                for s in (3, 5) if bn * bk <= 8192]     # 5 stages: more weight bytes in flight from memory
    if bucket == 1:
        return [kq.GemvConfig(bn, bk, w, s) for bn in (16, 32, 64) for bk in (256, 512) for w in (4, 8)
                for s in (1, 3)] + [kq.GemvConfig(bn, 1024, 8, 1) for bn in (16, 32, 64)]
    return [kq.GemvConfig(bn, bk, w, 3) for bn in (32, 64) for bk in (128, 256) for w in (4, 8)]


def split_choices(config: kq.GemvConfig, n: int, k: int, rows: int, device: torch.device,
                  kind: str = "") -> list[kq.GemvConfig]:
    """The configuration with one to four K slices, with the default's count (~4 programs per SM) and half of it
    (the few-slice counts let a grid that fills the GPU a little over a whole number of times be cut finer)."""
    programs = -(-n // config.block_n) * -(-rows // kq.rows_bucket(rows, kind))
    k_blocks = -(-k // config.block_k)
    default = kq._splits(device, programs, k_blocks, 0)
    counts = sorted({min(s, k_blocks) for s in (1, 2, 3, 4, default, max(1, default // 2))})
    return [config._replace(splits=s) for s in counts]


class DenseWeight(NamedTuple):
    """The dense kind's weight, as the sweep handles a quantized one."""
    w: torch.Tensor
    fmt: str = kq.DENSE

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"w": self.w}


def make_weight(kind: str, w: torch.Tensor, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16):
    if kind == kq.DENSE:
        return DenseWeight(w.to(dtype))
    if kind == "fp8-block":
        n, k = w.shape
        scale = torch.rand(-(-n // FP8_BLOCK), k // FP8_BLOCK, device=w.device, generator=generator) / k ** 0.5
        return quant.fp8_from_blocks((w * k ** 0.5 * 50).to(torch.float8_e4m3fn), scale, FP8_BLOCK, FP8_BLOCK)
    return quant.QUANTIZERS[kind](w)


def _linears(weight):
    """(fused, reference) of ``weight``'s kind."""
    if weight.fmt == kq.DENSE:
        return dense_gemv.dense_linear_triton, F.linear
    if weight.fmt == "fp8":
        return kq.fp8_linear_triton, kq.fp8_linear_reference
    return kq.nvfp4_linear_triton, kq.nvfp4_linear_reference


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(torch.isfinite(got).all()) and torch.allclose(
        got.float(), want.float(), rtol=TOLERANCE, atol=TOLERANCE * float(want.abs().max()))


def _try(fused, x, copies, config, want, device, repeats) -> dict:
    """``us`` and ``correct`` of one candidate (``copies``: the weight's tensors, once per copy timed in turn); one
    that does not compile on this device (too many registers or too much shared memory for its tile) is recorded
    with its error and skipped, not the end of the sweep."""
    try:
        correct = _close(fused(x, *copies[0], config=config), want)
    except triton.runtime.errors.OutOfResources as error:
        return {"us": None, "correct": False, "error": str(error)}
    calls = [lambda c=c: fused(x, *c, config=config) for c in copies]
    return {"us": time_calls_us(device, calls, repeats) if correct else None, "correct": correct}


def sweep(shapes: list[tuple[int, int]], rows: tuple[int, ...], device: torch.device, dtype: torch.dtype,
          repeats: int, budget_s: float, candidates_of=candidates, kinds=kq.WEIGHT_KINDS) -> dict:
    """Every timing, as JSON-ready records; ``entries``: kind, N, K, rows, config, us, correct."""
    started = time.perf_counter()
    generator = torch.Generator(device=device).manual_seed(0)
    entries, baselines, untuned = [], [], []
    setup = {}
    for n, k in shapes:
        dense = torch.randn(n, k, device=device, dtype=dtype, generator=generator) / k ** 0.5
        x = torch.randn(max(rows), k, device=device, dtype=dtype, generator=generator)
        for kind in kinds:
            if kind == "fp8-block" and k % FP8_BLOCK:
                continue
            weight = make_weight(kind, dense.float(), generator, dtype)
            copies = weight_copies(device, tuple(weight.tensors().values()))
            setup[kind, n, k] = (weight, copies, x, _linears(weight)[1](x, *copies[0]))
        dense_copies = weight_copies(device, (dense,))
        for r in rows:
            baselines.append({"N": n, "K": k, "rows": r, "kind": "dense", "us": time_calls_us(
                device, [lambda w=w: F.linear(x[:r], w) for w, in dense_copies], repeats)})
        del dense, dense_copies
    for r in rows:
        for (kind, n, k), (weight, copies, x, want) in setup.items():
            fused, _ = _linears(weight)
            xr = x[:r].contiguous()
            if kind != kq.DENSE:    # dense is measured against cuBLAS itself (the "dense" baselines)
                nvfp4 = weight.fmt == "nvfp4"
                baselines.append({"N": n, "K": k, "rows": r, "kind": f"{kind} dequantise+gemm", "us": time_calls_us(
                    device, [lambda c=c: F.linear(xr, kq.dequantize_triton(c[0], c[1], c[2] if nvfp4 else None, dtype))
                             for c in copies], repeats)})
            for base in candidates_of(kind, kq.rows_bucket(r, kind)):
                for config in split_choices(base, n, k, r, device, kind):
                    if time.perf_counter() - started > budget_s:
                        untuned.append({"kind": kind, "N": n, "K": k, "rows": r})
                        break
                    entries.append({"kind": kind, "N": n, "K": k, "rows": r, "config": list(config),
                                    **_try(fused, xr, copies, config, want[:r], device, repeats)})
                else:
                    continue
                break
    return {"entries": entries, "baselines": baselines, "untuned": untuned,
            "seconds": round(time.perf_counter() - started, 1)}


def select(entries: list[dict], baselines: list[dict]) -> dict:
    """The table entry of one device: per (kind, N, K, bucket) the correct configuration of least total time over
    the bucket's row counts (only configurations timed at all of them; ties: the first swept), and per kind
    ``fused_max_rows``. Wrong configurations are never chosen."""
    times: dict[tuple, dict[tuple, list[float]]] = {}
    wanted: dict[tuple, set[int]] = {}
    for e in entries:
        key = (e["kind"], e["N"], e["K"], kq.rows_bucket(e["rows"], e["kind"]))
        wanted.setdefault(key, set()).add(e["rows"])
        per_config = times.setdefault(key, {}).setdefault(tuple(e["config"]), [])
        per_config.append(e["us"] if e["correct"] else float("nan"))
    configs = {}
    for key, per_config in times.items():
        complete = {c: sum(t) for c, t in per_config.items() if len(t) == len(wanted[key]) and sum(t) == sum(t)}
        if complete:
            configs[key] = min(complete, key=lambda c: (complete[c], list(per_config).index(c)))
    best = {}   # (kind, N, K, rows) -> fastest correct fused us
    for e in entries:
        if e["correct"]:
            k = (e["kind"], e["N"], e["K"], e["rows"])
            best[k] = min(best.get(k, float("inf")), e["us"])
    gemm = {(b["kind"].split()[0], b["N"], b["K"], b["rows"]): b["us"] for b in baselines if " " in b["kind"]}
    fused_max_rows = {}
    for kind in sorted({k[0] for k in best} - {kq.DENSE}):   # dense: the model's fixed dense_gemv.MAX_ROWS
        limit = 1
        for r in sorted({k[3] for k in best if k[0] == kind}):
            keys = [k for k in best if k[0] == kind and k[3] == r]
            if r > 1 and (not all(k in gemm for k in keys) or sum(best[k] for k in keys) > sum(gemm[k] for k in keys)):
                break
            limit = r
        fused_max_rows[kind] = limit
    return {"fused_max_rows": fused_max_rows, "configs": dict(sorted(configs.items()))}


def merged_entry(existing: dict, chosen: dict, rows: tuple[int, ...]) -> dict:
    """This device's table entry after a sweep: the swept keys' configurations over the existing ones; the fused
    threshold from the sweep only when it compared row counts (a decode-only sweep keeps the existing one)."""
    configs = {**existing.get("configs", {}), **chosen["configs"]}
    limits = dict(existing.get("fused_max_rows", {}))
    if len(rows) > 1:
        limits.update(chosen["fused_max_rows"])
    return {"configs": dict(sorted(configs.items())), "fused_max_rows": limits}


def table_source(table: dict) -> str:
    """The config module with ``table`` as its TABLE (its docstring and default kept from the tree's module)."""
    head = Path(quant_gemv_configs.__file__).read_text().split("\nTABLE", 1)[0]
    return f"{head}\nTABLE: dict[str, dict] = {pprint.pformat(table, width=120, sort_dicts=True)}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="qwen3.5-0.8b,qwen3.6-27b")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--kinds", default=",".join(kq.WEIGHT_KINDS),
                        help=f"weight kinds to sweep, of {','.join(kq.WEIGHT_KINDS + (kq.DENSE,))}")
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop timing candidates after this long")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True, help="JSON of every timing")
    parser.add_argument("--write-table", type=Path, help="write the config module here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shapes = sorted({s for p in reversed(args.presets.split(",")) for s in preset_projection_shapes(p)},
                    key=lambda s: -s[0] * s[1])                       # the big (27B) shapes first
    rows = tuple(int(r) for r in args.rows.split(","))
    with torch.inference_mode():
        result = sweep(shapes, rows, device, torch.bfloat16, args.repeats, args.budget_s,
                       kinds=tuple(args.kinds.split(",")))
    name = kq.device_name(device)
    chosen = select(result["entries"], result["baselines"])
    wrong = [e for e in result["entries"] if not e["correct"]]
    result.update(device=name, torch=torch.__version__, triton=kq.triton.__version__, shapes=shapes,
                  fused_max_rows=chosen["fused_max_rows"], wrong=wrong,
                  chosen=[{"kind": key[0], "N": key[1], "K": key[2], "bucket": key[3], "config": list(c)}
                          for key, c in chosen["configs"].items()])
    provenance.write_result(args.out, result, args.device)
    if args.write_table:
        entry = merged_entry(quant_gemv_configs.TABLE.get(name, {}), chosen, rows)
        args.write_table.write_text(table_source({**quant_gemv_configs.TABLE, name: entry}))
    print(f"{name}: {len(result['entries'])} timings in {result['seconds']} s, {len(wrong)} wrong, "
          f"{len(result['untuned'])} untuned; fused_max_rows {chosen['fused_max_rows']}")
    report(result)
    return 0


def report(result: dict) -> None:
    """Per shape and row count: cuBLAS bf16, the chosen kind's fastest fused time and its GB/s."""
    dense = {(b["N"], b["K"], b["rows"]): b["us"] for b in result["baselines"] if b["kind"] == "dense"}
    best = {}
    for e in result["entries"]:
        if e["correct"]:
            key = (e["kind"], e["N"], e["K"], e["rows"])
            best[key] = min(best.get(key, float("inf")), e["us"])
    for (kind, n, k, r), us in sorted(best.items()):
        gbps = quant.weight_bytes(kind.split("-")[0], n, k, 2) / us / 1e3
        print(f"{kind:9s} {n:>6}x{k:<6} rows {r:>2}: {us:8.1f} us ({gbps:6.0f} GB/s), "
              f"bf16 cuBLAS {dense[n, k, r]:8.1f} us, x{dense[n, k, r] / us:.2f}")


if __name__ == "__main__":
    sys.exit(main())
