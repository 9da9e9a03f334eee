"""``flashrt-runtime bench-image-ttft`` on tiny-vl before the runtime's own vision encoder is merged: the tower is
transformers' ``Qwen3_5VisionModel`` in tiny-vl's vision shape (seeded random), attached as ``model.visual`` (the
contract the encoder fills). Needs transformers (a test dependency). Once the encoder is in, run
``python -m flashrt_ros.tools bench-image-ttft --model tiny-vl --grid HxW`` instead.

    python bench/image_ttft_hf_tower.py --grid 16x16 --grid 32x32 --repeats 10 --out bench/results/x.json
"""
import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "test")]

import hf_vision  # noqa: E402
from flashrt_ros.runtime import Engine, EngineConfig  # noqa: E402
from flashrt_ros.tools import bench_image_ttft  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--grid", action="append", default=[], help="HxW patches (repeatable)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args()
    engine = Engine(EngineConfig(model="tiny-vl", max_context=4096))
    engine.model.visual = hf_vision.preset_tower(engine.model_config.vision)
    results = []
    for grid in args.grid or ["16x16"]:
        height, width = (int(n) for n in grid.split("x"))
        result = bench_image_ttft.run(engine, bench_image_ttft.random_image(engine, height, width), args.repeats)
        print(bench_image_ttft.markdown(result), file=sys.stderr)
        results.append({"model": "tiny-vl", "device": "cpu", "tower": "transformers Qwen3_5VisionModel", **result})
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
