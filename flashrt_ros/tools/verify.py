"""The paper's capsule checks on one engine: byte-exact restore and token-identical continuations.

prefix -> snapshot; A: suffix + continue; dirty the state; B: restore + suffix + continue; C: cold prefill of
prefix + suffix + continue; D1/D2: two forks of the capsule, each switched to, + suffix + continue. A == B == C and
D1 == D2 must hold. With ``kv_only`` the restore brings back only the KV cache (what KV-block reuse would do) and the
first index where its continuation departs from A is reported.
"""
from __future__ import annotations


import torch

from flashrt_ros.runtime import rng
from flashrt_ros.runtime.engine import Engine

from .timing import timed


def prompt_tokens(vocab_size: int, count: int, stream: str, seed: int = 0) -> list[int]:
    """Reproducible pseudo-random token ids (the same on every machine)."""
    index = torch.arange(count)
    return (rng.uniform(seed, rng.stream_key(stream), index) * vocab_size).long().clamp_(max=vocab_size - 1).tolist()


def _continue(engine: Engine, suffix: list[int], gen: int) -> list[int]:
    engine.ingest(suffix)
    return list(engine.generate(gen, stop_token_ids=()))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def verify(engine: Engine, prefix_len: int, suffix_len: int, gen: int, kv_only: bool = False) -> dict:
    vocab = engine.vocab_size
    prefix = prompt_tokens(vocab, prefix_len, "verify-prefix")
    suffix = prompt_tokens(vocab, suffix_len, "verify-suffix")
    dirt = prompt_tokens(vocab, max(8, suffix_len), "verify-dirt")

    engine.reset()
    engine.ingest(prefix)
    capsule, snapshot_ms = timed(engine.device, lambda: engine.snapshot(label="verify"))
    a = _continue(engine, suffix, gen)

    engine.ingest(dirt[: max(0, engine.max_context - engine.position - gen)])
    list(engine.generate(min(gen, engine.max_context - engine.position), stop_token_ids=()))
    _, restore_ms = timed(engine.device, lambda: engine.restore(capsule.id, verify_checksum=True))
    byte_exact = bool(torch.equal(engine.live_bytes(), engine.capsule_bytes(capsule.id)))
    b = _continue(engine, suffix, gen)

    engine.reset()
    c = _continue(engine, prefix + suffix, gen)

    branches = []
    for _ in range(2):
        fork = engine.fork(capsule.id, switch=True)
        branches.append(_continue(engine, suffix, gen))
        engine.drop(fork.id)

    report = {
        "prefix_len": prefix_len, "suffix_len": suffix_len, "gen": gen,
        "byte_exact": byte_exact,
        "token_identical": a == b == c and branches[0] == branches[1] == a,
        "a_eq_b": a == b, "a_eq_c": a == c, "d1_eq_d2": branches[0] == branches[1],
        "capsule_bytes": capsule.nbytes, "snapshot_ms": snapshot_ms, "restore_ms": restore_ms,
        "tokens_a": a,
    }
    if kv_only:
        engine.ingest(dirt[: max(0, engine.max_context - engine.position - gen - suffix_len)])
        engine.restore(capsule.id, kv_only=True)
        ablated = _continue(engine, suffix, gen)
        report["kv_only_first_divergence"] = first_divergence(a, ablated)
        report["kv_only_tokens"] = ablated
    engine.drop(capsule.id)
    return report
