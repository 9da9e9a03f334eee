"""Benchmark of the weight formats, side by side in one run on one device (``flashrt-runtime bench-quant``).

Per format: decode ms/token against that format's weight-bytes floor (weights read per token / the device's
measured copy bandwidth), prefill TTFT, and fidelity against the dense engine (same weights): logits error, greedy
(top-1) agreement and the mean cross-entropy of the forced tokens, teacher-forced along the dense engine's greedy
continuation or, with a text file (``fidelity_text``), along that text after a prompt from its start, plus the first
index where the free-running greedy continuations part. Random weights have nearly flat logits, so only a trained
model's figures say how much a format loses (``bench/train_tiny_lm.py`` trains one on the CPU). Beside it: the fused
quantized GEMVs against the dense ``F.linear`` (cuBLAS on CUDA) on the model's own projection shapes, and a
projected Thor table (bytes per token / 273 GB/s), which is a projection from shapes, not a measurement.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from flashrt_ros.runtime import quant
from flashrt_ros.runtime.config import PRESETS, ModelConfig
from flashrt_ros.runtime.engine import Engine, EngineConfig
from flashrt_ros.runtime.errors import ErrorCode, FlashRTError
from flashrt_ros.runtime.model import Qwen35
from flashrt_ros.runtime.vision.config import VISUAL

from . import floors, ttft
from .timing import release_engine_memory, time_calls_us, timed, weight_copies
from .verify import first_divergence, prompt_tokens

THOR_BYTES_PER_S = 273e9
EMBEDDING = "model.embed_tokens.weight"


def weights_read_per_token(model: Qwen35) -> int:
    """Bytes of weights one decode step reads: every parameter once, except the embedding table (one row is looked
    up) unless it is also the dense LM head, and not the vision tower's. (The MTP head's unused projections are
    counted: an upper bound.)"""
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if n != EMBEDDING and not n.startswith(VISUAL))
    if getattr(model, "quantized_head", None) is None and model.cfg.tie_word_embeddings:
        total += model.output_weight().numel() * model.output_weight().element_size()
    return total


def projected_bytes_per_token(cfg: ModelConfig, fmt: str, exclude: tuple[str, ...] = (),
                              dense_element_size: int = 2) -> int:
    """:func:`weights_read_per_token` from shapes alone (a meta-device model), for presets too large to build."""
    with torch.device("meta"):
        model = Qwen35(cfg)
    model.fuse_projections()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != quant.LM_HEAD}
    covered = {f"{n}.weight" for n in linears} | {EMBEDDING, f"{quant.LM_HEAD}.weight"}
    total = sum(p.numel() for n, p in model.named_parameters() if n not in covered) * dense_element_size
    for name, module in linears.items():
        kept = fmt == "dense" or quant.is_excluded(name, exclude)
        total += quant.weight_bytes("dense" if kept else fmt, *module.weight.shape, dense_element_size)
    head_fmt = "dense" if fmt == "dense" or quant.is_excluded(quant.LM_HEAD, exclude) else fmt
    return total + quant.weight_bytes(head_fmt, cfg.vocab_size, cfg.hidden_size, dense_element_size)


def projection_shapes(model: Qwen35) -> list[tuple[str, int, int]]:
    """(name, N, K) of each distinct projection shape of the dense text model, the LM head last (once, whether it
    is the embedding or its own ``lm_head`` projection)."""
    head = tuple(model.output_weight().shape)
    seen, shapes = {head}, []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not name.startswith(VISUAL) and tuple(module.weight.shape) not in seen:
            seen.add(tuple(module.weight.shape))
            shapes.append((name, *module.weight.shape))
    return shapes + [(quant.LM_HEAD, *head)]


def preset_projection_shapes(preset: str) -> list[tuple[int, int]]:
    """(N, K) of :func:`projection_shapes` for a preset, from a meta-device model with fused projections (nothing
    allocated: the GEMV sweeps and compile checks of presets too large to build here)."""
    with torch.device("meta"):
        model = Qwen35(PRESETS[preset])
    model.fuse_projections()
    return [(n, k) for _, n, k in projection_shapes(model)]


def gemv_table(model: Qwen35, device: torch.device, dtype: torch.dtype, use_triton: bool, repeats: int) -> list:
    """Each projection shape at one row (decode): dense ``F.linear`` against the fp8 and nvfp4 GEMVs, in time and in
    error: ``*_rel_err`` is one layer's relative L2 error against the fp32 product of the same Gaussian weights and
    input, the quantisation error itself (the end-to-end figures of random weights compound it through every layer).
    Each timing cycles through copies of its weight, read from device memory as in a decode step
    (:func:`~.timing.weight_copies`)."""
    rows = []
    generator = torch.Generator(device=device).manual_seed(0)
    for name, n, k in projection_shapes(model):
        w = torch.randn(n, k, device=device, dtype=dtype, generator=generator) / k ** 0.5
        x = torch.randn(1, k, device=device, dtype=dtype, generator=generator)
        exact = F.linear(x.float(), w.float())

        def rel_err(y: torch.Tensor) -> float:
            return float((y.float() - exact).norm() / exact.norm())
        row = {"shape": name, "N": n, "K": k, "dense_rel_err": rel_err(F.linear(x, w)),
               "dense_us": time_calls_us(device, [lambda c=c: F.linear(x, c) for c, in weight_copies(device, (w,))],
                                         repeats)}
        for fmt in ("fp8", "nvfp4"):
            weight = quant.QUANTIZERS[fmt](w)
            layers = [quant.QuantLinear(quant.QuantizedWeight(fmt, *copy), use_triton)
                      for copy in weight_copies(device, tuple(weight.tensors().values()))]
            layer = layers[0]
            row[f"{fmt}_us"] = time_calls_us(device, [lambda c=c: c(x) for c in layers], repeats)
            row[f"{fmt}_speedup"] = row["dense_us"] / row[f"{fmt}_us"]
            row[f"{fmt}_GBps"] = quant.weight_bytes(fmt, n, k, 0) / row[f"{fmt}_us"] / 1000.0
            row[f"{fmt}_rel_err"] = rel_err(layer(x))
        row["dense_GBps"] = n * k * w.element_size() / row["dense_us"] / 1000.0
        rows.append(row)
        del w
    return rows


@torch.inference_mode()
def teacher_forced(engine: Engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens) + 1, vocab] fp32 logits after the prompt and after each of ``tokens`` (fed one at a time)."""
    engine.reset()
    engine.ingest(prompt)
    out = [engine.next_token_logits()]
    for token in tokens:
        engine.ingest([token])
        out.append(engine.next_token_logits())
    return torch.stack(out)


def token_nll(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Cross-entropy (nats) of each of ``tokens`` under teacher-forced ``logits`` (row i predicts tokens[i])."""
    return F.cross_entropy(logits[:len(tokens)], torch.tensor(tokens, device=logits.device), reduction="none")


def nll_against_dense(nll: torch.Tensor, dense_nll: torch.Tensor) -> dict:
    """Perplexity relative to dense over the same forced tokens, and the standard error of the mean per-token
    cross-entropy difference behind it: a difference within about two of those is the sample's noise."""
    delta = (nll - dense_nll).double()
    return {"perplexity_vs_dense": math.exp(float(delta.mean())),
            "nll_delta_stderr": float(delta.std() / math.sqrt(delta.numel())) if delta.numel() > 1 else None}


def fidelity(reference: torch.Tensor, logits: torch.Tensor, free_ref: list[int], free: list[int]) -> dict:
    """Logits error of ``logits`` against ``reference`` (both [T, vocab], teacher-forced) and greedy agreement."""
    diff = logits - reference
    rel = diff.norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-30)
    return {"logits_max_abs_err": float(diff.abs().max()), "logits_rel_l2_mean": float(rel.mean()),
            "logits_rel_l2_max": float(rel.max()),
            "greedy_agreement": float((logits.argmax(-1) == reference.argmax(-1)).float().mean()),
            "free_run_first_divergence": first_divergence(free_ref, free)}


@dataclasses.dataclass(frozen=True)
class QuantBenchConfig:
    engine: EngineConfig = EngineConfig()   # model, device, dtype, kernels, exclude patterns...; format set per run
    formats: tuple[str, ...] = quant.FORMATS
    context: int = 256               # tokens before the decode measurement
    decode_tokens: int = 32
    prefill_tokens: int = 256        # cold prefill for TTFT
    fidelity_tokens: int = 16
    fidelity_text: str | None = None  # a text file: prompt and forced tokens from it, in the model's tokenizer
    repeats: int = 5


def _engine(cfg: QuantBenchConfig, fmt: str) -> Engine:
    needed = max(cfg.context + cfg.decode_tokens, cfg.prefill_tokens, cfg.context + cfg.fidelity_tokens) + 8
    return Engine(dataclasses.replace(cfg.engine, weights_format=fmt, max_context=needed, capsule_budget_bytes=0,
                                      checksum_on_snapshot=False))


def text_tokens(engine: Engine, cfg: QuantBenchConfig) -> tuple[list[int], list[int]]:
    """The prompt (``context`` tokens) and the forced tokens (``fidelity_tokens``) from the start of the text file."""
    try:
        with open(cfg.fidelity_text, encoding="utf-8") as f:
            ids = engine.tokenizer.encode(f.read())
    except (OSError, UnicodeDecodeError) as err:
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"cannot read the fidelity text: {err}") from err
    needed = cfg.context + cfg.fidelity_tokens
    if len(ids) < needed:
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"{cfg.fidelity_text} is {len(ids)} tokens in this model's "
                           f"tokenizer; --context + --fidelity-tokens need {needed}")
    return ids[:cfg.context], ids[cfg.context:needed]


def _format_row(engine: Engine, cfg: QuantBenchConfig, bandwidth: float, prompt: list[int]) -> dict:
    device = engine.device
    prefill = prompt_tokens(engine.vocab_size, cfg.prefill_tokens, "quant-prefill")

    cold = ttft.cold_ttft(engine, prefill, cfg.repeats)
    del cold["cold_first_token"]
    engine.reset()
    engine.ingest(prompt)
    list(engine.generate(2, stop_token_ids=()))
    steps, total_ms = timed(device, lambda: list(engine.generate(cfg.decode_tokens, stop_token_ids=())))
    nbytes = weights_read_per_token(engine.model)
    decode_ms = total_ms / max(1, len(steps))
    floor_ms = 1000.0 * nbytes / bandwidth
    return {"format": engine.weights_format, "weight_bytes_per_token": nbytes, "decode_ms_per_token": decode_ms,
            "floor_ms": floor_ms, "decode_over_floor": decode_ms / floor_ms,
            "prefill_tokens": cfg.prefill_tokens, **cold}


def run(cfg: QuantBenchConfig) -> dict:
    """Every format of ``cfg.formats`` (``dense`` first: the others are compared with it), one engine at a time."""
    formats = ("dense",) + tuple(f for f in cfg.formats if f != "dense")
    device = torch.device(cfg.engine.device)
    bandwidth = floors.copy_bandwidth_bytes_per_s(device)
    rows, platform_info, gemvs = [], {}, []
    # from the dense engine: the prompt, its greedy tokens, the forced tokens, its logits and cross-entropies
    prompt = ref_free = forced = ref_logits = ref_nll = None
    for fmt in formats:
        engine = _engine(cfg, fmt)
        if prompt is None:      # the same weights and tokenizer in every format: read the text once
            prompt, text_forced = (text_tokens(engine, cfg) if cfg.fidelity_text else
                                   (prompt_tokens(engine.vocab_size, cfg.context, "quant-prompt"), None))
        row = _format_row(engine, cfg, bandwidth, prompt)
        engine.reset()
        engine.ingest(prompt)
        free = list(engine.generate(cfg.fidelity_tokens, stop_token_ids=()))
        if ref_logits is None:
            platform_info = engine.platform.diagnostics()
            gemvs = gemv_table(engine.model, device, engine.arena["hidden"].dtype, engine.platform.quant_triton,
                               cfg.repeats)
            ref_free, forced = free, (free if text_forced is None else text_forced)
            ref_logits = teacher_forced(engine, prompt, forced)
            ref_nll = nll = token_nll(ref_logits, forced)
        else:
            logits = teacher_forced(engine, prompt, forced)
            row.update(fidelity(ref_logits, logits, ref_free, free))
            nll = token_nll(logits, forced)
            row.update(nll_against_dense(nll, ref_nll))
        row["forced_nll"] = float(nll.mean())
        rows.append(row)
        del engine
        release_engine_memory(device)
    dense_ms = rows[0]["decode_ms_per_token"]
    for row in rows:
        row["decode_speedup_vs_dense"] = dense_ms / row["decode_ms_per_token"]
    engine = cfg.engine
    return {"model": engine.model, "device": engine.device, "dtype": engine.dtype, "kernels": engine.kernels,
            "exclude": list(engine.weights_exclude), "fidelity_text": cfg.fidelity_text,
            "copy_bandwidth_GBps": bandwidth / 1e9, "platform": platform_info,
            "formats": rows, "gemv": gemvs, "thor_projection": thor_projection(engine.weights_exclude)}


def thor_projection(exclude: tuple[str, ...] = ()) -> list[dict]:
    """Decode floors on Jetson AGX Thor: projected bytes per token / 273 GB/s (a projection, never a measurement)."""
    out = []
    for preset in ("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.6-27b"):
        for fmt in quant.FORMATS:
            nbytes = projected_bytes_per_token(PRESETS[preset], fmt, exclude)
            out.append({"preset": preset, "format": fmt, "bytes_per_token": nbytes,
                        "projected_floor_ms": 1000.0 * nbytes / THOR_BYTES_PER_S,
                        "projected_max_tokens_per_s": THOR_BYTES_PER_S / nbytes})
    return out


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(c for c, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join("" if r.get(c) is None else f.format(r[c]) for c, f in columns) + " |")
    return "\n".join(lines)


def formats_markdown(result: dict) -> str:
    """The formats side by side: speed against the floor and dense, cold TTFT, fidelity against dense."""
    return _table(result["formats"], [
        ("format", "{}"), ("weight_bytes_per_token", "{:,}"), ("decode_ms_per_token", "{:.3f}"), ("floor_ms", "{:.3f}"),
        ("decode_over_floor", "{:.2f}"), ("decode_speedup_vs_dense", "{:.2f}x"), ("cold_ttft_ms", "{:.2f}"),
        ("prefill_tokens", "{}"), ("prefill_chunk", "{}"),
        ("logits_rel_l2_mean", "{:.4f}"), ("logits_max_abs_err", "{:.4f}"), ("greedy_agreement", "{:.3f}"),
        ("forced_nll", "{:.4f}"), ("perplexity_vs_dense", "{:.4f}"), ("nll_delta_stderr", "{:.4f}"),
        ("free_run_first_divergence", "{}")])


def gemv_markdown(result: dict) -> str:
    """Each projection shape's GEMV per format against dense ``F.linear``: time, bandwidth, one layer's error."""
    return _table(result["gemv"], [
        ("shape", "{}"), ("N", "{}"), ("K", "{}"), ("dense_us", "{:.2f}"), ("fp8_us", "{:.2f}"),
        ("nvfp4_us", "{:.2f}"), ("fp8_speedup", "{:.2f}x"), ("nvfp4_speedup", "{:.2f}x"), ("dense_GBps", "{:.0f}"),
        ("fp8_GBps", "{:.0f}"), ("nvfp4_GBps", "{:.0f}"), ("dense_rel_err", "{:.4f}"), ("fp8_rel_err", "{:.4f}"),
        ("nvfp4_rel_err", "{:.4f}")])


def markdown(result: dict) -> str:
    thor = _table(result["thor_projection"], [
        ("preset", "{}"), ("format", "{}"), ("bytes_per_token", "{:,}"), ("projected_floor_ms", "{:.1f}"),
        ("projected_max_tokens_per_s", "{:.0f}")])
    return f"{formats_markdown(result)}\n\n{gemv_markdown(result)}\n\nProjected for Jetson AGX Thor (273 GB/s; a projection, not a measurement):\n{thor}"
