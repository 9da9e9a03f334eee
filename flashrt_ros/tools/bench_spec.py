"""Speculative decoding against plain decoding: acceptance rate, tokens per step, tokens/s and ms/token for each
number of MTP drafts, on the same prompts, with the tokens checked identical to plain decoding's (k = 0: the plain
one-row plan; k > 0 runs the 5-row plan, whose greedy tokens may differ from it at a near tie, shown as "NO").

Prompts come from a text file in the model's tokenizer (a trained model's held-out text: its MTP head then drafts
tokens the model accepts) or are random ids. Each row decodes ``decode_tokens`` greedy tokens after each prompt; its
time is the median over ``repeats`` of the whole decode (every step synchronised, as a robot would stream it).

Seeded random weights (the 0.8B / 27B shape presets) accept almost no drafts, so their rows measure what a step
with k drafts costs. A projection then adds the tok/s such a step would give: ``assumed_acceptance`` a, each draft
accepted with probability a independently ((1 - a^(k+1)) / (1 - a) tokens per step); or ``acceptance_from``, the
tokens per step a trained model measured at each k (another bench-spec result, e.g. on the same GPU), over the
measured step time, and its ratio to plain decoding.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch

from flashrt_ros.runtime.engine import Engine, EngineConfig
from flashrt_ros.runtime.errors import ErrorCode, FlashRTError
from flashrt_ros.runtime.speculative import MAX_SPECULATIVE_TOKENS

from .timing import release_engine_memory, sync


@dataclasses.dataclass(frozen=True)
class SpecBenchConfig:
    engine: EngineConfig
    drafts: tuple[int, ...] = tuple(range(MAX_SPECULATIVE_TOKENS + 1))    # 0 = plain decoding, the baseline
    prompts: int = 4
    context: int = 64
    decode_tokens: int = 64
    repeats: int = 3
    text: str = ""
    assumed_acceptance: float = 0.0     # > 0: also project tok/s at this per-draft acceptance (random weights)
    acceptance_from: str = ""           # a bench-spec JSON: project tok/s at its measured tokens per step


def _prompts(engine: Engine, cfg: SpecBenchConfig) -> list[list[int]]:
    if cfg.text:
        try:
            ids = engine.tokenizer.encode(Path(cfg.text).read_text(encoding="utf-8"))
        except OSError as err:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"cannot read --text {cfg.text}: {err}") from None
        stride = cfg.context + cfg.decode_tokens
        if len(ids) < cfg.prompts * stride:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"--text has {len(ids)} tokens, need "
                                                           f"{cfg.prompts * stride}")
        return [ids[i * stride:i * stride + cfg.context] for i in range(cfg.prompts)]
    rng = random.Random(0)
    return [[rng.randrange(engine.vocab_size) for _ in range(cfg.context)] for _ in range(cfg.prompts)]


def _decode(engine: Engine, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    engine.reset()
    engine.ingest(prompt)
    sync(engine.device)
    started = time.perf_counter()
    out = list(engine.generate(tokens, stop_token_ids=[]))
    sync(engine.device)
    return out, time.perf_counter() - started


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _projection(cfg: SpecBenchConfig) -> tuple[str, dict[int, float]]:
    """The projection's label and tokens per step by drafts (empty: none)."""
    if cfg.acceptance_from:
        try:
            measured = json.loads(Path(cfg.acceptance_from).read_text(encoding="utf-8"))
            per_step = {r["speculative_tokens"]: r["tokens_per_step"] for r in measured["rows"]}
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"--acceptance-from {cfg.acceptance_from}: not a "
                                                           f"bench-spec result ({err})") from None
        missing = sorted(set(cfg.drafts) - set(per_step))
        if missing:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"--acceptance-from {cfg.acceptance_from} has no row for "
                                                           f"drafts {missing}")
        return f"{Path(measured['model']).name}'s tokens/step", {k: max(1.0, per_step[k]) for k in cfg.drafts}
    a = cfg.assumed_acceptance
    if not a:
        return "", {}
    return f"{a:.0%}", {k: sum(a ** i for i in range(k + 1)) for k in cfg.drafts}


def run(cfg: SpecBenchConfig) -> dict:
    rows, baseline = [], None
    label, per_step = _projection(cfg)
    prompts = None
    for drafts in cfg.drafts:
        engine = Engine(dataclasses.replace(cfg.engine, speculative_tokens=drafts))
        prompts = prompts or _prompts(engine, cfg)
        outputs, seconds = [], []
        for _ in range(cfg.repeats):
            engine.speculative_stats = type(engine.speculative_stats)()
            results = [_decode(engine, p, cfg.decode_tokens) for p in prompts]
            outputs = [r[0] for r in results]
            seconds.append(sum(r[1] for r in results))
        tokens = sum(len(o) for o in outputs)
        wall = statistics.median(seconds)
        stats = engine.speculative_stats
        row = {"speculative_tokens": drafts, "acceptance_rate": stats.acceptance_rate,
               "tokens_per_step": stats.tokens_per_step, "tokens_per_s": tokens / wall,
               "ms_per_token": 1000.0 * wall / tokens, "tokens": tokens}
        row["step_ms"] = row["ms_per_token"] * row["tokens_per_step"]
        if per_step:
            row["projected_tokens_per_s"] = 1000.0 * per_step[drafts] / row["step_ms"]
        if baseline is None:
            baseline = (outputs, row)
        row["token_identical"] = outputs == baseline[0]
        row["speedup"] = row["tokens_per_s"] / baseline[1]["tokens_per_s"]
        if per_step:
            row["projected_speedup"] = row["projected_tokens_per_s"] / baseline[1]["projected_tokens_per_s"]
        rows.append(row)
        del engine
        release_engine_memory(torch.device(cfg.engine.device))
    return {"model": cfg.engine.model, "device": cfg.engine.device,
            "device_name": (torch.cuda.get_device_name(cfg.engine.device) if cfg.engine.device.startswith("cuda")
                            else "cpu"),
            "dtype": cfg.engine.dtype, "kernels": cfg.engine.kernels, "draft_vocab": cfg.engine.draft_vocab,
            "dense_gemv": cfg.engine.dense_gemv, "prompts": cfg.prompts, "context": cfg.context,
            "decode_tokens": cfg.decode_tokens, "repeats": cfg.repeats, "text": cfg.text,
            "assumed_acceptance": cfg.assumed_acceptance, "acceptance_from": cfg.acceptance_from,
            "projection": label, "commit": _commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch_threads": torch.get_num_threads(), "rows": rows,
            "token_identical": all(r["token_identical"] for r in rows)}


def markdown(result: dict) -> str:
    label = result.get("projection") or (f"{result['assumed_acceptance']:.0%}" if result["assumed_acceptance"]
                                         else "")          # older results: no label, the assumed acceptance
    with_ratio = "projected_speedup" in result["rows"][0]
    lines = ["| drafts | acceptance | tokens/step | step ms | tok/s | ms/token | vs plain | same tokens |"
             + (f" tok/s at {label} |" if label else "") + (" vs plain there |" if with_ratio else ""),
             "|---:|---:|---:|---:|---:|---:|---:|:---:|" + ("---:|" if label else "")
             + ("---:|" if with_ratio else "")]
    for r in result["rows"]:
        lines.append(f"| {r['speculative_tokens']} | {r['acceptance_rate']:.1%} | {r['tokens_per_step']:.2f} | "
                     f"{r['step_ms']:.2f} | {r['tokens_per_s']:.1f} | {r['ms_per_token']:.2f} | {r['speedup']:.2f}x | "
                     f"{'yes' if r['token_identical'] else 'NO'} |"
                     + (f" {r['projected_tokens_per_s']:.1f} |" if label else "")
                     + (f" {r['projected_speedup']:.2f}x |" if with_ratio else ""))
    return "\n".join(lines)
