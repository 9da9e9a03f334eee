"""Constrained decoding benchmark (``flashrt-runtime bench-constraint``): decode ms/token with and without a JSON
schema constraint on the same engine and prompt, and the CPU mask work per token (llguidance's bitmask + its copy
into the device buffer, and feeding the sampled token to the matcher), timed apart on the constrained run's tokens.

On the plain plan on CUDA the mask of the next token is computed while the device runs the step's forward
(``Engine._plain_step``): the ratio then shows what the mask still costs beyond that (``mask_overlapped``). On the
CPU, or on the speculative plan, it is computed between steps.
"""
from __future__ import annotations

import json
import statistics
import time

from flashrt_ros.runtime.constraint import Constraint
from flashrt_ros.runtime.engine import Engine
from flashrt_ros.runtime.sampler import SamplingParams

from .timing import sync

# A list of waypoints: open-ended (no maxItems), so a random-weight model keeps generating to max_new_tokens.
SCHEMA = json.dumps({"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "x": {"type": "number"}, "y": {"type": "number"},
    "mode": {"enum": ["drive", "turn", "stop"]}}, "required": ["name", "x", "y", "mode"]}})
PROMPT = "Plan the waypoints as JSON: "


def _decode_ms(engine: Engine, tokens: int, constraint, sampling: SamplingParams) -> tuple[list[float], list[int]]:
    """Per-token wall ms after the first token (sync'd), and the tokens."""
    engine.reset()
    engine.ingest(engine.tokenizer.encode(PROMPT))
    engine.constrain(constraint)
    stamps, out = [], []
    for token in engine.generate(tokens, sampling, stop_token_ids=[]):
        sync(engine.device)
        stamps.append(time.perf_counter())
        out.append(token)
    return [1000.0 * (b - a) for a, b in zip(stamps, stamps[1:])], out


def _mask_ms(engine: Engine, constraint, tokens: list[int]) -> tuple[list[float], list[float]]:
    """The mask (bitmask + copy to the device) and the accept of each token, replayed on a fresh matcher."""
    live = Constraint(engine._llg(), constraint)
    words = engine._mask_words[0]
    masks, accepts = [], []
    for token in tokens:
        started = time.perf_counter()
        live.fill_mask(words)
        sync(engine.device)
        masks.append(1000.0 * (time.perf_counter() - started))
        started = time.perf_counter()
        live.accept(token)
        accepts.append(1000.0 * (time.perf_counter() - started))
    engine.constrain(None)
    return masks, accepts


def _summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"p50": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "mean": statistics.fmean(ordered), "n": len(ordered)}


def run(engine: Engine, decode_tokens: int, repeats: int, temperature: float) -> dict:
    sampling = SamplingParams(temperature=temperature)
    constraint = engine.compile_constraint("json_schema", SCHEMA)
    free, bound, masks, accepts, lengths = [], [], [], [], []
    for _ in range(repeats):                               # interleaved, so drift hits both alike
        free += _decode_ms(engine, decode_tokens, None, sampling)[0]
        times, tokens = _decode_ms(engine, decode_tokens, constraint, sampling)
        bound += times
        lengths.append(len(tokens))
        mask, accept = _mask_ms(engine, constraint, tokens)
        masks += mask
        accepts += accept
    result = {"schema": json.loads(SCHEMA), "decode_tokens": decode_tokens, "repeats": repeats,
              "temperature": temperature, "constrained_tokens": lengths,
              "decode_ms_per_token": {"unconstrained": _summary(free), "constrained": _summary(bound)},
              "mask_ms_per_token": _summary(masks), "accept_ms_per_token": _summary(accepts),
              "mask_overlapped": engine.stepper is None and engine.device.type == "cuda"}
    result["constrained_over_unconstrained_p50"] = (result["decode_ms_per_token"]["constrained"]["p50"]
                                                    / result["decode_ms_per_token"]["unconstrained"]["p50"])
    return result


def markdown(result: dict) -> str:
    d = result["decode_ms_per_token"]
    rows = [("decode, unconstrained", d["unconstrained"]), ("decode, constrained", d["constrained"]),
            ("mask (bitmask + copy)", result["mask_ms_per_token"]), ("matcher accept", result["accept_ms_per_token"])]
    lines = ["| ms per token | p50 | p90 | mean |", "|---|---|---|---|"]
    lines += [f"| {name} | {s['p50']:.3f} | {s['p90']:.3f} | {s['mean']:.3f} |" for name, s in rows]
    lines.append(f"constrained / unconstrained (p50): {result['constrained_over_unconstrained_p50']:.3f}x; the mask "
                 + ("computed while the device runs the forward" if result["mask_overlapped"] else
                    "computed between steps"))
    return "\n".join(lines)
