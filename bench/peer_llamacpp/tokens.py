"""Token files for peer_timing (little-endian int32): the benchmark's prompt is the one `flashrt-runtime bench` uses
(its seeded "bench-prefix" stream, whose first c tokens are the c-token prefix, then the 24-token "bench-suffix")."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flashrt_ros.tools.bench import SUFFIX_LEN  # noqa: E402
from flashrt_ros.tools.verify import prompt_tokens  # noqa: E402


def write_tokens(path: Path, tokens) -> Path:
    np.asarray(tokens, dtype="<i4").tofile(path)
    return Path(path)


def read_tokens(path: Path) -> list[int]:
    return np.fromfile(path, dtype="<i4").tolist()


def bench_tokens(vocab_size: int, longest: int) -> list[int]:
    """The longest prefix, then the suffix: peer_timing takes the first c tokens and the last SUFFIX_LEN."""
    return prompt_tokens(vocab_size, longest, "bench-prefix") + prompt_tokens(vocab_size, SUFFIX_LEN, "bench-suffix")


if __name__ == "__main__":
    import argparse

    from flashrt_ros.runtime.config import PRESETS

    parser = argparse.ArgumentParser(description="write the benchmark's prompt tokens for peer_timing")
    parser.add_argument("--model", default="qwen3.5-0.8b")
    parser.add_argument("--longest", type=int, default=16384)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    write_tokens(args.out, bench_tokens(PRESETS[args.model].vocab_size, args.longest))
