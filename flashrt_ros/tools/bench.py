"""Benchmark: capsule size, snapshot/restore vs the copy floor, cold vs capsule TTFT, decode, and optionally HF.

Every ratio is measured side by side in one run on one engine. Times are host wall-clock around synchronised
device work (what a caller sees), medians and 99th percentiles over repeated runs.
"""
from __future__ import annotations

import dataclasses
import statistics

import torch

from flashrt_ros.runtime.checksum import checksum
from flashrt_ros.runtime.engine import Engine, EngineConfig
from flashrt_ros.runtime.model import rope_inv_freq
from flashrt_ros.runtime.vision.config import VISUAL

from . import floors, ttft
from .timing import release_engine_memory, timed
from .verify import prompt_tokens

SUFFIX_LEN = 24


def _time_ms(device, fn, repeats: int, setup=None) -> list[float]:
    """``fn``'s wall-clock ms per repeat; ``setup`` (untimed) runs before each."""
    out = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        out.append(timed(device, fn)[1])
    return out


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _hf_model(engine: Engine):
    """HF's Qwen3_5ForCausalLM sharing the engine's weight tensors (no second copy of the weights)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = engine.model_config
    hf_cfg = Qwen3_5TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, layer_types=list(cfg.layer_types),
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads, linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim, linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor})
    with torch.device("meta"):
        hf = Qwen3_5ForCausalLM(hf_cfg)
    weights = {k: v for k, v in engine.model.hf_state_dict().items() if not k.startswith(("mtp.", VISUAL))}
    if cfg.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    hf.load_state_dict(weights, assign=True, strict=True)
    hf.requires_grad_(False)
    hf.model.rotary_emb.to_empty(device=engine.device)
    hf.model.rotary_emb.inv_freq = rope_inv_freq(cfg).to(engine.device)
    hf.model.rotary_emb.original_inv_freq = hf.model.rotary_emb.inv_freq.clone()
    return hf.eval()


def _hf_figures(engine: Engine, prompt: list[int], repeats: int) -> dict:
    hf = _hf_model(engine)
    ids = torch.tensor([prompt], device=engine.device)

    def cold():
        return int(hf(ids, logits_to_keep=1).logits[0, -1].argmax())

    with torch.inference_mode():
        ttft = _time_ms(engine.device, cold, repeats)
        out = hf(ids, use_cache=True, logits_to_keep=1)
        cache, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
        steps = _time_ms(engine.device, lambda: hf(token, past_key_values=cache, use_cache=True, logits_to_keep=1),
                         repeats + 2)
    return {"hf_cold_ttft_ms": statistics.median(ttft), "hf_decode_step_ms": statistics.median(steps[2:])}


def bench_context(engine: Engine, context: int, repeats: int, decode_tokens: int, compare_hf: bool) -> dict:
    device = engine.device
    # The prefix is prefill-chunk aligned, so cold prefill of prefix + suffix folds exactly like capsule + suffix.
    prefix = prompt_tokens(engine.vocab_size, context, "bench-prefix")
    suffix = prompt_tokens(engine.vocab_size, SUFFIX_LEN, "bench-suffix")

    cold = ttft.cold_ttft(engine, prefix + suffix, repeats)

    # Full copies: the live rows share nothing stored (a fresh prefill; a reset before each restore). The delta and
    # lineage-aware paths (live rows already held by a stored capsule) are timed beside them.
    def fresh_prefix():
        if "bench-s" in engine.store:
            engine.drop("bench-s")
        engine.reset()
        engine.ingest(prefix)

    snapshot_ms = _time_ms(device, lambda: engine.snapshot(capsule_id="bench-s"), repeats, setup=fresh_prefix)
    fresh_prefix()
    nbytes = engine.snapshot(capsule_id="bench").nbytes

    def delta_snapshot():
        engine.snapshot(capsule_id="bench-s")
        engine.drop("bench-s")

    delta_snapshot_ms = _time_ms(device, delta_snapshot, repeats)

    def fork_capsule():
        engine.fork("bench", capsule_id="bench-f")
        engine.drop("bench-f")

    fork_ms = _time_ms(device, fork_capsule, repeats)

    def one_step_further():
        list(engine.generate(1, stop_token_ids=()))

    rollback_step_ms = _time_ms(device, lambda: engine.rollback(steps=1), repeats, setup=one_step_further)

    def descendant_of_bench():
        engine.restore("bench")
        list(engine.generate(4, stop_token_ids=()))

    rollback_capsule_ms = _time_ms(device, lambda: engine.rollback(capsule_id="bench"), repeats,
                                   setup=descendant_of_bench)
    if not torch.equal(engine.live_bytes(), engine.capsule_bytes("bench")):
        raise RuntimeError("rollback to the capsule left live bytes that differ from the capsule's")
    restore_ms = _time_ms(device, lambda: engine.restore("bench"), repeats, setup=engine.reset)
    lineage_restore_ms = _time_ms(device, lambda: engine.restore("bench"), repeats)
    src = engine.capsule_bytes("bench")
    dst = torch.empty_like(src)
    floor_ms = _time_ms(device, lambda: dst.copy_(src), repeats)
    checksum_ms = _time_ms(device, lambda: checksum(src), max(3, repeats // 4))

    capsule = ttft.capsule_ttft(engine, "bench", suffix, repeats)
    if capsule.pop("capsule_first_token") != cold.pop("cold_first_token"):
        raise RuntimeError("capsule TTFT path produced a different first token than cold prefill")

    list(engine.generate(2, stop_token_ids=()))                   # warm (the stream: the capsule + the suffix)
    steps, total_ms = timed(device, lambda: list(engine.generate(decode_tokens, stop_token_ids=())))
    decode_ms = total_ms / max(1, len(steps))
    engine.drop("bench")

    row = {
        "context": context, "capsule_bytes": nbytes,
        "snapshot_p50_ms": statistics.median(snapshot_ms), "snapshot_p99_ms": _p(snapshot_ms, 0.99),
        "restore_p50_ms": statistics.median(restore_ms), "restore_p99_ms": _p(restore_ms, 0.99),
        "delta_snapshot_p50_ms": statistics.median(delta_snapshot_ms),
        "lineage_restore_p50_ms": statistics.median(lineage_restore_ms),
        "fork_p50_ms": statistics.median(fork_ms), "fork_p99_ms": _p(fork_ms, 0.99),
        "rollback_step_p50_ms": statistics.median(rollback_step_ms),
        "rollback_step_p99_ms": _p(rollback_step_ms, 0.99),
        "rollback_capsule_p50_ms": statistics.median(rollback_capsule_ms),
        "rollback_capsule_p99_ms": _p(rollback_capsule_ms, 0.99),
        "copy_floor_p50_ms": statistics.median(floor_ms),
        "checksum_p50_ms": statistics.median(checksum_ms),
        **cold, **capsule, "decode_ms_per_token": decode_ms,
    }
    row["snapshot_over_floor"] = row["snapshot_p50_ms"] / row["copy_floor_p50_ms"]
    row["restore_over_floor"] = row["restore_p50_ms"] / row["copy_floor_p50_ms"]
    row["ttft_speedup"] = row["cold_ttft_ms"] / row["capsule_ttft_ms"]
    row.update(_decode_floors(engine, context, row["decode_ms_per_token"], repeats))
    if compare_hf:
        row.update(_hf_figures(engine, prefix + suffix, max(3, repeats // 4)))
        row["cold_ttft_over_hf"] = row["cold_ttft_ms"] / row["hf_cold_ttft_ms"]
        row["decode_speedup_vs_hf"] = row["hf_decode_step_ms"] / row["decode_ms_per_token"]
    return row


def _decode_floors(engine: Engine, context: int, decode_ms: float, repeats: int) -> dict:
    """Decode against the bandwidth floor and the GEMV-only graph, both measured now on this device."""
    moved = floors.decode_bytes(engine, context)
    bandwidth = floors.copy_bandwidth_bytes_per_s(engine.device)
    out = {**moved, "copy_bandwidth_gb_s": bandwidth / 1e9,
           "decode_floor_ms": 1000.0 * moved["total_bytes"] / bandwidth}
    out["decode_over_floor"] = decode_ms / out["decode_floor_ms"]
    gemv_ms = floors.gemv_graph_ms(engine, repeats)
    if gemv_ms is not None:
        out["gemv_graph_ms"] = gemv_ms
        out["decode_over_gemv_graph"] = decode_ms / gemv_ms
    return out


def decode_paths(config: EngineConfig, paths: list[str], contexts: list[int], decode_tokens: int,
                 repeats: int) -> list[dict]:
    """Decode ms/token of each dense GEMV path (``EngineConfig.dense_gemv``; one engine each, built in turn in this
    process) after each context, against the weight floor (the decode step's weight bytes at the copy bandwidth,
    both measured now) and the full floor (weights, state and KV). ``same_tokens``: its greedy tokens equal the
    first path's (bf16 rounding may tip a near tie)."""
    rows, bandwidth, first = [], None, {}
    for path in paths:
        engine = Engine(dataclasses.replace(config, dense_gemv=path))
        bandwidth = bandwidth or floors.copy_bandwidth_bytes_per_s(engine.device)
        for context in contexts:
            engine.reset()
            engine.ingest(prompt_tokens(engine.vocab_size, context, "bench-prefix"))
            engine.snapshot(capsule_id="bench-decode")
            list(engine.generate(2, stop_token_ids=()))                 # warm
            times, tokens = [], []
            for _ in range(repeats):
                engine.restore("bench-decode")
                tokens, ms = timed(engine.device, lambda: list(engine.generate(decode_tokens, stop_token_ids=())))
                times.append(ms / max(1, len(tokens)))
            engine.drop("bench-decode")
            moved = floors.decode_bytes(engine, context)
            weight_floor_ms = 1000.0 * moved["weight_bytes"] / bandwidth
            decode_ms = statistics.median(times)
            rows.append({"dense_gemv": path, "kernels": engine.kernel_name, "context": context,
                         "decode_ms_per_token": decode_ms, "weight_floor_ms": weight_floor_ms,
                         "decode_over_weight_floor": decode_ms / weight_floor_ms,
                         "decode_floor_ms": 1000.0 * moved["total_bytes"] / bandwidth,
                         "decode_over_floor": decode_ms * bandwidth / (1000.0 * moved["total_bytes"]),
                         "same_tokens": first.setdefault(context, tokens) == tokens})
        del engine
        release_engine_memory(torch.device(config.device))
    return rows


def cold_prefill_profile(engine: Engine, context: int, top: int = 12) -> list[dict]:
    """The device-time top entries of one cold prefill of ``context`` tokens (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    prompt = prompt_tokens(engine.vocab_size, context, "bench-prefix")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_is_cuda(engine) else [])
    engine.reset()
    engine.ingest(prompt)                                           # warm
    engine.reset()
    with profile(activities=activities) as prof:
        engine.ingest(prompt)
        engine.peek_token()
    engine.reset()
    attr = "device_time_total" if device_is_cuda(engine) else "cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr, 0.0), reverse=True)[:top]
    return [{"name": e.key, "ms": getattr(e, attr, 0.0) / 1000.0, "calls": e.count} for e in events]


def device_is_cuda(engine: Engine) -> bool:
    return engine.device.type == "cuda"


COLUMNS = [("dense_gemv", "{}"), ("context", "{}"),
           ("capsule_bytes", "{:,}"), ("snapshot_p50_ms", "{:.3f}"), ("snapshot_p99_ms", "{:.3f}"),
           ("restore_p50_ms", "{:.3f}"), ("restore_p99_ms", "{:.3f}"), ("copy_floor_p50_ms", "{:.3f}"),
           ("restore_over_floor", "{:.2f}"), ("delta_snapshot_p50_ms", "{:.3f}"), ("lineage_restore_p50_ms", "{:.3f}"),
           ("fork_p50_ms", "{:.3f}"), ("rollback_step_p50_ms", "{:.3f}"), ("rollback_capsule_p50_ms", "{:.3f}"),
           ("checksum_p50_ms", "{:.3f}"), ("cold_ttft_ms", "{:.2f}"), ("prefill_chunk", "{}"),
           ("capsule_ttft_ms", "{:.2f}"),
           ("capsule_ttft_restore_ms", "{:.3f}"), ("capsule_ttft_suffix_prefill_ms", "{:.3f}"),
           ("capsule_ttft_first_token_ms", "{:.3f}"), ("capsule_ttft_host_overhead_ms", "{:.3f}"),
           ("ttft_speedup", "{:.1f}x"), ("decode_ms_per_token", "{:.2f}"), ("decode_floor_ms", "{:.3f}"),
           ("decode_over_floor", "{:.2f}"), ("weight_floor_ms", "{:.3f}"), ("decode_over_weight_floor", "{:.2f}"),
           ("same_tokens", "{}"), ("gemv_graph_ms", "{:.3f}"), ("decode_over_gemv_graph", "{:.2f}"),
           ("hf_cold_ttft_ms", "{:.2f}"), ("cold_ttft_over_hf", "{:.2f}"), ("hf_decode_step_ms", "{:.2f}"),
           ("decode_speedup_vs_hf", "{:.2f}x")]


def markdown_table(rows: list[dict]) -> str:
    cols = [(c, f) for c, f in COLUMNS if any(c in r for r in rows)]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f.format(r[c]) if c in r else "" for c, f in cols) + " |")
    return "\n".join(lines)
