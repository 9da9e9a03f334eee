"""Our side of the peer run: the rows of ``flashrt-runtime bench`` (same flags, same engine configuration, same
``bench_context``), plus the like-for-like figures for llama.cpp's ``set_data``, which always writes every byte.

Our restore is a delta restore: it copies the fixed state and only the KV rows the live arena does not already hold, so
``bench``'s restore (the capsule was just taken, or its rows are still live under a suffix) copies far less than the
capsule. ``restore_full_p50_ms`` and ``capsule_ttft_full_ms`` restore into a cleared arena (``reset``, untimed), where
every KV row differs and all the capsule's bytes are copied.

    python3 bench/peer_llamacpp/ours.py --model qwen3.5-0.8b --device cuda --dtype bfloat16 --contexts 2048,8192 \
        --repeats 10 --decode-tokens 64 --out ours.json
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flashrt_ros.runtime import cli  # noqa: E402
from flashrt_ros.runtime.bench import SUFFIX_LEN, bench_context, markdown_table  # noqa: E402
from flashrt_ros.runtime.engine import Engine  # noqa: E402
from flashrt_ros.runtime.timing import timed  # noqa: E402
from flashrt_ros.runtime.verify import prompt_tokens  # noqa: E402

CAPSULE = "peer-full"


def full_restore(engine: Engine, context: int, repeats: int) -> dict:
    """Restore (and restore + suffix + first token) of a ``context``-token capsule into a cleared arena."""
    device = engine.device
    prefix = prompt_tokens(engine.vocab_size, context, "bench-prefix")
    suffix = prompt_tokens(engine.vocab_size, SUFFIX_LEN, "bench-suffix")
    engine.reset()
    engine.ingest(prefix)
    engine.snapshot(capsule_id=CAPSULE)

    def resume():
        engine.restore(CAPSULE)
        engine.ingest(suffix)
        return engine.peek_token()

    restore, ttft = [], []
    for _ in range(repeats):
        engine.reset()
        restore.append(timed(device, lambda: engine.restore(CAPSULE))[1])
        engine.reset()
        ttft.append(timed(device, resume)[1])
    engine.drop(CAPSULE)
    return {"restore_full_p50_ms": statistics.median(restore), "capsule_ttft_full_ms": statistics.median(ttft)}


def main(argv: list[str] | None = None) -> int:
    args = cli.build_parser().parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    contexts = [int(c) for c in args.contexts.split(",")]
    # As cmd_bench configures its engine.
    engine = Engine(cli._config(args, max(contexts) + SUFFIX_LEN + args.decode_tokens + 8, 16384, 8192,
                                checksum=False))
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "kernels": engine.kernel_name,
              "cuda_graphs": len(engine.graphs.graphs), "arena_bytes": engine.arena_bytes, "rows": []}
    for context in contexts:
        row = bench_context(engine, context, args.repeats, args.decode_tokens, compare_hf=False)
        row.update(full_restore(engine, context, args.repeats))
        result["rows"].append(row)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(markdown_table(result["rows"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
