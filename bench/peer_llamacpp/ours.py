"""Our side of the peer run: the rows of ``flashrt-runtime bench`` (same flags, same engine configuration, same
``bench_context``: restore and capsule TTFT as full copies into a reset arena, like llama.cpp's set_data, and the
lineage-aware delta restore beside them), then, with --fidelity, fidelity.py's check against llama.cpp on the same
engine (one engine start instead of two on the GPU).

    python3 bench/peer_llamacpp/ours.py --model qwen3.5-0.8b --device cuda --dtype bfloat16 --contexts 2048,8192 \
        --repeats 10 --decode-tokens 64 --out ours.json [--fidelity fidelity.json --gguf M.gguf --binary peer_timing]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from flashrt_ros.tools import cli, provenance, ttft  # noqa: E402
from flashrt_ros.tools.bench import SUFFIX_LEN, bench_context, markdown_table  # noqa: E402
from flashrt_ros.runtime.engine import Engine  # noqa: E402
import fidelity  # noqa: E402


def _fidelity_args() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--fidelity", type=Path, help="also run the fidelity check, its JSON here")
    parser.add_argument("--gguf", type=Path, help="the GGUF of these weights (gguf_writer.py)")
    parser.add_argument("--binary", type=Path, help="peer_timing")
    parser.add_argument("--ngl", type=int, default=99)
    parser.add_argument("--kv", default="bf16")
    parser.add_argument("--fidelity-prompt", type=int, default=256)
    parser.add_argument("--fidelity-gen", type=int, default=64)
    parser.add_argument("--fidelity-work", type=Path, help="scratch folder (token files, llama.cpp's logits)")
    return parser


def main(argv: list[str] | None = None) -> int:
    extra, rest = _fidelity_args().parse_known_args(sys.argv[1:] if argv is None else argv)
    args = cli.build_parser().parse_args(["bench", *rest])
    contexts = [int(c) for c in args.contexts.split(",")]
    # As cmd_bench configures its engine.
    engine = Engine(cli._config(args, max(contexts) + SUFFIX_LEN + args.decode_tokens + 8, ttft.BENCH_PREFILL_CHUNK,
                                8192, checksum=False))
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "kernels": engine.kernel_name,
              "cuda_graphs": len(engine.graphs.graphs), "arena_bytes": engine.arena_bytes, "rows": []}
    for context in contexts:
        result["rows"].append(bench_context(engine, context, args.repeats, args.decode_tokens, compare_hf=False))
        if args.out:
            provenance.write_result(args.out, result, args.device)
    print(markdown_table(result["rows"]), file=sys.stderr)
    if extra.fidelity:
        workdir = extra.fidelity_work or extra.fidelity.with_suffix(".work")
        workdir.mkdir(parents=True, exist_ok=True)
        check = fidelity.run(engine, extra.binary, extra.fidelity_prompt, extra.fidelity_gen, workdir, extra.ngl,
                             extra.kv, threads=os.cpu_count() or 1, gguf_path=extra.gguf, reference=True)
        provenance.write_result(extra.fidelity, check, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
