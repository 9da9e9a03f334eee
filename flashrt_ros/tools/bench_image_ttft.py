"""Image-to-first-token latency (``flashrt-runtime bench-image-ttft``): a camera frame arrives and a question about it.

Cold: from an empty stream, one ingest of [preamble, image, question] (the vision tower runs, every image token is
prefilled), then the first token. From a capsule: the capsule taken right after the frame was ingested is restored,
the question ingested, then the first token (the tower and the image's prefill are in the capsule). The two are
interleaved per repeat, each timed with its device work, so drift hits both alike.
"""
from __future__ import annotations

import torch

from flashrt_ros.runtime.engine import Engine
from flashrt_ros.runtime.errors import ErrorCode, FlashRTError
from flashrt_ros.runtime.vision.layout import ingest_length
from flashrt_ros.runtime.vision.prepared import PreparedImage

from .bench_constraint import _summary
from .timing import timed

PREAMBLE, QUESTION = "Camera frame: ", " Where is the cup? Answer:"


def random_image(engine: Engine, height: int, width: int, seed: int = 0) -> PreparedImage:
    """A prepared image of height x width patches with random pixels (the tower's cost depends on the size alone)."""
    vision = engine.model_config.vision
    if vision is None or engine.visual is None:
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"model {engine.config.model!r} has no vision tower loaded")
    columns = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    patches = torch.randn(height * width, columns, generator=torch.Generator().manual_seed(seed))
    return PreparedImage(patches, (1, height, width), vision.spatial_merge_size)


def run(engine: Engine, image: PreparedImage, repeats: int) -> dict:
    preamble, question = engine.tokenizer.encode(PREAMBLE), engine.tokenizer.encode(QUESTION)

    def first_token():
        return next(engine.generate(1, stop_token_ids=()))

    def cold():
        engine.reset()
        engine.ingest(preamble + [image] + question)
        return first_token()

    def from_capsule():
        engine.restore("frame")
        engine.ingest(question)
        return first_token()

    engine.reset()
    engine.ingest(preamble + [image])
    capsule = engine.snapshot("frame")
    cold()                                                     # warm-up of both paths
    from_capsule()
    cold_ms, capsule_ms, tower_ms, same = [], [], [], True
    for _ in range(repeats):
        cold_token, elapsed = timed(engine.device, cold)
        cold_ms.append(elapsed)
        capsule_token, elapsed = timed(engine.device, from_capsule)
        capsule_ms.append(elapsed)
        same &= cold_token == capsule_token
        tower_ms.append(timed(engine.device, lambda: engine._encode(image))[1])
    engine.drop("frame")
    result = {"grid": list(image.grid), "image_tokens": image.token_count,
              "prompt_positions": ingest_length(preamble + [image] + question), "question_tokens": len(question),
              "capsule_bytes": capsule.nbytes, "repeats": repeats, "same_first_token": same,
              "cold_ms": _summary(cold_ms), "from_capsule_ms": _summary(capsule_ms), "tower_ms": _summary(tower_ms)}
    result["speedup_p50"] = result["cold_ms"]["p50"] / result["from_capsule_ms"]["p50"]
    return result


def markdown(result: dict) -> str:
    rows = [("cold: tower + prefill + first token", result["cold_ms"]),
            ("from the post-image capsule: restore + question + first token", result["from_capsule_ms"]),
            ("the tower alone", result["tower_ms"])]
    lines = ["| image-to-first-token, ms | p50 | p90 | mean |", "|---|---|---|---|"]
    lines += [f"| {name} | {s['p50']:.2f} | {s['p90']:.2f} | {s['mean']:.2f} |" for name, s in rows]
    lines.append(f"speedup (p50): {result['speedup_p50']:.1f}x; {result['image_tokens']} image tokens, "
                 f"{result['prompt_positions']} positions, capsule {result['capsule_bytes']} bytes")
    return "\n".join(lines)
