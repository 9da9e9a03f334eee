"""Loading a model within its own memory: time, disk throughput and peak memory of ``weights.load`` + the arena.

    python3 bench/load_memory.py --model qwen3.6-27b --format nvfp4 --device cuda --out $OUT/load.json
    python3 bench/load_memory.py --write-checkpoint /data/q08-fp8 --model qwen3.5-0.8b --checkpoint-format fp8 \
        --device cuda                  # a synthetic folder of the preset's shape (no compressed-tensors needed)
    python3 bench/load_memory.py --model /data/q08-fp8 --format fp8 --device cuda --out $OUT/load-folder.json

``--model`` is a preset (seeded weights generated on the device) or a checkpoint folder. ``--write-checkpoint``
writes the preset's seeded weights as a sharded folder (``flashrt_ros.tools.checkpoint_writer``: dense bf16,
Qwen's FP8 block layout, or compressed-tensors NVFP4), generated on ``--device``, and evicts its files from the page
cache so the next load reads the disk. Measured: load time (weights, then the arena), GB/s from disk (the folder's
safetensors bytes / load time), peak device memory (``torch.cuda.max_memory_allocated``, reset before; on the CPU the
peak of live tensor bytes), peak process RSS (VmHWM, reset before), the final weight and arena bytes, and
peak / (final weights + arena). The JSON records the git commit, date, device and torch version.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flashrt_ros.runtime import quant, weights  # noqa: E402
from flashrt_ros.tools import checkpoint_writer, memory_peak, provenance  # noqa: E402
from flashrt_ros.runtime.arena import Arena, buffer_specs  # noqa: E402
from flashrt_ros.runtime.checkpoint import read_scheme  # noqa: E402
from flashrt_ros.runtime.config import PRESETS, read_config  # noqa: E402
from flashrt_ros.runtime.engine import _DTYPES  # noqa: E402


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def evict_from_page_cache(folder: Path) -> bool:
    """Drop the folder's files from the page cache (clean pages, no root needed) so the next read hits the disk."""
    done = True
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            try:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            except (AttributeError, OSError):
                done = False
    return done


def scheme_label(folder: Path | None) -> str | None:
    """How the folder stores its projections (None for a preset)."""
    if folder is None:
        return None
    scheme = read_scheme(folder, read_config(folder))
    return scheme.label if scheme else "dense"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def measure(model: str, fmt: str, device: torch.device, dtype: torch.dtype, max_context: int,
            exclude: tuple[str, ...] = (), seed: int = 0) -> dict:
    folder = None if model in PRESETS else Path(model)
    disk_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors")) if folder else 0
    cold = evict_from_page_cache(folder) if folder else None
    built = {}

    def load():
        start = time.perf_counter()
        built["model"], _ = weights.load(model, device, dtype, seed, fmt, exclude)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        built["load_s"] = time.perf_counter() - start
        built["arena"] = Arena(buffer_specs(built["model"].cfg, max_context, dtype), device)

    _, peak, peak_rss, rss_before = memory_peak.measure(load, device)
    final = sum(p.numel() * p.element_size() for p in built["model"].parameters())
    arena = built["arena"].nbytes
    return {"model": model, "format": fmt, "source": "folder" if folder else "preset",
            "checkpoint_scheme": scheme_label(folder),
            "device": device_name(device), "dtype": str(dtype).removeprefix("torch."), "max_context": max_context,
            "torch": torch.__version__, "git_commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_s": built["load_s"], "disk_bytes": disk_bytes, "page_cache_evicted": cold,
            "disk_gb_per_s": disk_bytes / built["load_s"] / 1e9 if folder else None,
            "peak_device_bytes": peak, "peak_rss_bytes": peak_rss, "rss_before_bytes": rss_before,
            "final_weight_bytes": final, "arena_bytes": arena, "peak_over_final": peak / (final + arena)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="a preset or a checkpoint folder")
    parser.add_argument("--format", default="dense", choices=quant.FORMATS, help="weights_format to load in")
    parser.add_argument("--weights-exclude", default="")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    parser.add_argument("--max-context", type=int, default=16384, help="sizes the arena")
    parser.add_argument("--write-checkpoint", help="write the preset --model as a synthetic folder here, then exit")
    parser.add_argument("--checkpoint-format", default="dense", choices=sorted(checkpoint_writer.FORMATS))
    parser.add_argument("--shard-gb", type=float, default=4.0)
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.write_checkpoint:
        start = time.perf_counter()
        folder = checkpoint_writer.write(args.model, Path(args.write_checkpoint), args.checkpoint_format,
                                         shard_bytes=int(args.shard_gb * 1e9), device=device)
        result = {"written": str(folder), "preset": args.model, "format": args.checkpoint_format,
                  "bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors")),
                  "write_s": time.perf_counter() - start, "page_cache_evicted": evict_from_page_cache(folder)}
    else:
        result = measure(args.model, args.format, device, _DTYPES[args.dtype], args.max_context,
                         quant.parse_patterns(args.weights_exclude))
    print(json.dumps(result, indent=1))
    if args.out:
        provenance.write_result(args.out, result, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
