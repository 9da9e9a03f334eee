"""``flashrt-runtime`` (also ``python -m flashrt_ros.tools``): generate, verify, bench, bench-quant, bench-spec,
bench-capsules, bench-constraint, bench-vision, plan. JSON on stdout."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time

import torch

from flashrt_ros.runtime import quant
from flashrt_ros.runtime.config import PRESETS
from flashrt_ros.runtime.engine import _DTYPES, Engine, EngineConfig
from flashrt_ros.runtime.errors import ErrorCode, FlashRTError
from flashrt_ros.runtime.kernels import DENSE_GEMV_CHOICES
from flashrt_ros.runtime.sampler import SamplingParams
from flashrt_ros.runtime.vision.preprocess import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS

from . import (bench_capsules, bench_constraint, bench_image_ttft, bench_quant, bench_spec, bench_vision, plan,
               provenance, ttft)
from .bench import bench_context, cold_prefill_profile, decode_paths, markdown_table
from .verify import verify


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="tiny, a preset name, or a local HF folder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-context", type=int, default=None)
    parser.add_argument("--prefill-chunk", type=int, default=None)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--no-fla", action="store_true", help="use the reference delta-rule kernel on CUDA")
    parser.add_argument("--kernels", default="auto", choices=["auto", "triton", "reference"],
                        help="kernel set (auto: Triton where a start-up probe passes)")
    parser.add_argument("--dense-gemv", default=EngineConfig.dense_gemv, choices=DENSE_GEMV_CHOICES,
                        help="dense projections of decode and verify with the Triton kernel set: cuBLAS or its GEMV")
    parser.add_argument("--capsule-budget-mb", type=int, default=None)
    parser.add_argument("--weights-seed", type=int, default=0, help="weights seed for presets")
    parser.add_argument("--weights-format", default="dense", choices=quant.FORMATS, help="weight quantization")
    parser.add_argument("--weights-exclude", default="",
                        help="comma-separated patterns of projections kept dense, e.g. '*.linear_attn.*,lm_head'")
    parser.add_argument("--speculative-tokens", type=int, default=0, help="MTP drafts per decode step (0 = off)")
    parser.add_argument("--draft-vocab", type=int, default=0,
                        help="MTP drafts among the first N token ids (0 = all; with speculative decoding)")


def _config(args, max_context: int, chunk: int, budget_mb: int, checksum: bool = True) -> EngineConfig:
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                        max_context=args.max_context or max_context, prefill_chunk=args.prefill_chunk or chunk,
                        cuda_graphs=not args.no_cuda_graphs, use_fla=not args.no_fla, kernels=args.kernels,
                        dense_gemv=args.dense_gemv,
                        capsule_budget_bytes=(args.capsule_budget_mb or budget_mb) << 20, seed=args.weights_seed,
                        checksum_on_snapshot=checksum, weights_format=args.weights_format,
                        weights_exclude=quant.parse_patterns(args.weights_exclude), draft_vocab=args.draft_vocab,
                        speculative_tokens=args.speculative_tokens)


def cmd_generate(args) -> dict:
    engine = Engine(_config(args, 4096, 64, 256))
    prompt = ([int(t) for t in args.prompt_ids.split(",") if t.strip()] if args.prompt_ids is not None
              else engine.tokenizer.encode(args.prompt))
    if args.seed is not None:
        engine.reseed(args.seed)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    started = time.perf_counter()
    engine.ingest(prompt)
    tokens, stamps = [], []
    for token in engine.generate(args.max_new_tokens, sampling):
        tokens.append(token)
        stamps.append(time.perf_counter())
    ttft = 1000.0 * (stamps[0] - started) if stamps else None
    per_token = 1000.0 * (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return {"tokens": tokens, "text": engine.tokenizer.decode(tokens), "ttft_ms": ttft,
            "decode_ms_per_token": per_token, "prompt_tokens": len(prompt)}


def cmd_verify(args) -> dict:
    needed = args.prefix_len + 2 * (args.suffix_len + args.gen) + 64
    engine = Engine(_config(args, needed, 64, 1024))
    return provenance.stamp(verify(engine, args.prefix_len, args.suffix_len, args.gen, kv_only=args.kv_only),
                            args.device)


def _report(result: dict, table: str, out: str | None) -> dict:
    """A benchmark's table on stderr, its JSON (with its provenance) to ``out`` too when given (stdout gets it from
    main)."""
    print(table, file=sys.stderr)
    provenance.stamp(result, result["device"])
    if out:
        provenance.write_result(out, result, result["device"])
    return result


def cmd_bench(args) -> dict:
    if args.compare_hf and args.weights_format != "dense":
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "--compare-hf runs transformers on the dense weights: use "
                                                       "--weights-format dense (bench-quant compares the formats)")
    contexts = [int(c) for c in args.contexts.split(",")]
    paths = [p for p in args.dense_gemv_paths.split(",") if p]
    if set(paths) - set(DENSE_GEMV_CHOICES) or (args.decode_only and not paths):
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"--dense-gemv-paths takes some of {DENSE_GEMV_CHOICES} "
                                                       f"(needed with --decode-only), got {args.dense_gemv_paths!r}")
    config = _config(args, max(contexts) + 24 + args.decode_tokens + 8, ttft.BENCH_PREFILL_CHUNK, 8192,
                     checksum=False)
    result, tables = {"model": args.model, "device": args.device, "dtype": args.dtype}, []
    if not args.decode_only:
        engine = Engine(config)
        rows = [bench_context(engine, c, args.repeats, args.decode_tokens, args.compare_hf) for c in contexts]
        result.update({"kernels": engine.kernel_name, "kernel_reason": engine.kernel_reason,
                       "cuda_graphs": len(engine.graphs.graphs), "arena_bytes": engine.arena_bytes,
                       "weights_format": engine.weights_format, "platform": engine.platform.diagnostics(),
                       "rows": rows})
        if args.profile:
            result["cold_prefill_profile"] = {"context": max(contexts),
                                              "top": cold_prefill_profile(engine, max(contexts))}
        tables.append(markdown_table(rows))
        del engine
    if paths:
        result["dense_gemv_decode"] = decode_paths(config, paths, contexts, args.decode_tokens, args.repeats)
        tables.append(markdown_table(result["dense_gemv_decode"]))
    return _report(result, "\n\n".join(tables), args.out)


def cmd_bench_quant(args) -> dict:
    cfg = bench_quant.QuantBenchConfig(
        engine=_config(args, 1, ttft.BENCH_PREFILL_CHUNK, 0, checksum=False), formats=tuple(args.formats.split(",")),
        context=args.context, decode_tokens=args.decode_tokens, prefill_tokens=args.prefill_tokens,
        fidelity_tokens=args.fidelity_tokens, fidelity_text=args.fidelity_text, repeats=args.repeats)
    result = bench_quant.run(cfg)
    return _report(result, bench_quant.markdown(result), args.out)


def cmd_bench_spec(args) -> dict:
    cfg = bench_spec.SpecBenchConfig(
        engine=_config(args, args.context + args.decode_tokens + 8, 64, 64, checksum=False),
        drafts=tuple(int(d) for d in args.drafts.split(",")), prompts=args.prompts, context=args.context,
        decode_tokens=args.decode_tokens, repeats=args.repeats, text=args.text,
        assumed_acceptance=args.assumed_acceptance, acceptance_from=args.acceptance_from)
    result = bench_spec.run(cfg)
    return _report(result, bench_spec.markdown(result), args.out)


def cmd_bench_capsules(args) -> dict:
    folder = args.capsule_dir or tempfile.mkdtemp(prefix="flashrt-bench-capsules-")
    config = dataclasses.replace(_config(args, args.context + args.branch_tokens + 8, 256, 1 << 20),
                                 capsule_dir=folder, capsule_host_budget_bytes=args.host_budget_mb << 20)
    engine = Engine(config)
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "capsule_dir": folder,
              **bench_capsules.run(engine, args.context, args.branches, args.branch_tokens, args.repeats)}
    return _report(result, bench_capsules.markdown(result), args.out)


def cmd_bench_constraint(args) -> dict:
    engine = Engine(_config(args, 4 * args.decode_tokens + 256, 256, 64, checksum=False))
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "kernels": engine.kernel_name,
              "cuda_graphs": len(engine.graphs.graphs),
              **bench_constraint.run(engine, args.decode_tokens, args.repeats, args.temperature)}
    return _report(result, bench_constraint.markdown(result), args.out)


def cmd_bench_vision(args) -> dict:
    result = bench_vision.run(args.model, torch.device(args.device), _DTYPES[args.dtype], args.weights_seed,
                              bench_vision.parse_resolutions(args.resolutions), args.repeats, args.min_pixels,
                              args.max_pixels)
    return _report(result, bench_vision.markdown(result), args.out)
def cmd_bench_image_ttft(args) -> dict:
    engine = Engine(_config(args, 4096, 64, 256))
    height, width = (int(n) for n in args.grid.split("x"))
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "kernels": engine.kernel_name,
              **bench_image_ttft.run(engine, bench_image_ttft.random_image(engine, height, width), args.repeats)}
    return _report(result, bench_image_ttft.markdown(result), args.out)


def cmd_plan(args) -> dict:
    rows = []
    for preset in args.presets.split(","):
        if preset not in PRESETS:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
        for fmt in args.formats.split(","):
            rows.append({"preset": preset, **plan.memory_plan(
                PRESETS[preset], fmt, _DTYPES[args.dtype], args.max_context, args.capsule_budget_mb << 20,
                args.history_depth, int(args.memory_gb * 10**9), quant.parse_patterns(args.weights_exclude))})
    columns = ("weights", "arena", "history", "capsule_budget", "total", "left")
    shown = [{"preset": r["preset"], "format": r["format"], "fits": r["fits"],
              **{f"{c}_gb": r[f"{c}_bytes"] / 10**9 for c in columns}} for r in rows]
    print(bench_quant._table(shown, [("preset", "{}"), ("format", "{}")] + [(f"{c}_gb", "{:.2f}") for c in columns]
                             + [("fits", "{}")]), file=sys.stderr)
    return {"memory_gb": args.memory_gb, "dtype": args.dtype, "max_context": args.max_context, "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashrt-runtime", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="prompt in, tokens out")
    _engine_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="sampler RNG seed (default: the weights seed)")
    gen.set_defaults(func=cmd_generate)
    ver = sub.add_parser("verify", help="byte-exact restore and token-identical continuation checks")
    _engine_args(ver)
    ver.add_argument("--prefix-len", type=int, default=128)
    ver.add_argument("--suffix-len", type=int, default=24)
    ver.add_argument("--gen", type=int, default=32)
    ver.add_argument("--kv-only", action="store_true", help="also run the KV-only restore ablation")
    ver.set_defaults(func=cmd_verify)
    ben = sub.add_parser("bench", help="capsule and TTFT benchmark")
    _engine_args(ben)
    ben.add_argument("--contexts", default="256,1024")
    ben.add_argument("--repeats", type=int, default=20)
    ben.add_argument("--decode-tokens", type=int, default=32)
    ben.add_argument("--compare-hf", action="store_true", help="also time transformers on the same weights")
    ben.add_argument("--profile", action="store_true", help="also profile one cold prefill at the largest context")
    ben.add_argument("--dense-gemv-paths", default="", help="also decode with each of these dense GEMV paths, "
                     "e.g. cublas,triton: ms/token side by side against the weight floor")
    ben.add_argument("--decode-only", action="store_true", help="only the --dense-gemv-paths decode comparison")
    ben.add_argument("--out", help="write the JSON result here too")
    ben.set_defaults(func=cmd_bench)
    bq = sub.add_parser("bench-quant", help="weight formats side by side: decode, TTFT, GEMVs, fidelity")
    _engine_args(bq)
    bq.add_argument("--formats", default=",".join(quant.FORMATS), help="dense always runs first (the reference)")
    bq.add_argument("--context", type=int, default=512, help="tokens before the decode measurement")
    bq.add_argument("--decode-tokens", type=int, default=64)
    bq.add_argument("--prefill-tokens", type=int, default=2048, help="cold prefill for TTFT")
    bq.add_argument("--fidelity-tokens", type=int, default=32, help="tokens teacher-forced and compared with dense")
    bq.add_argument("--fidelity-text", help="a text file: the prompt and the forced tokens come from its start, in "
                    "the model's tokenizer (else: random prompt ids, forced along dense's greedy continuation)")
    bq.add_argument("--repeats", type=int, default=10)
    bq.add_argument("--out", help="write the JSON result here too")
    bq.set_defaults(func=cmd_bench_quant)
    bs = sub.add_parser("bench-spec", help="MTP speculative decoding against plain: acceptance, tokens/s")
    _engine_args(bs)
    bs.add_argument("--drafts", default="0,1,2,3,4", help="speculative_tokens values; 0 (plain) is the baseline")
    bs.add_argument("--prompts", type=int, default=4)
    bs.add_argument("--context", type=int, default=64, help="prompt tokens")
    bs.add_argument("--decode-tokens", type=int, default=64)
    bs.add_argument("--repeats", type=int, default=3)
    bs.add_argument("--text", default="", help="prompts from this text file (a trained model's heldout.txt); else "
                    "random ids")
    bs.add_argument("--assumed-acceptance", type=float, default=0.0,
                    help="also project tok/s at this per-draft acceptance (for random-weight shape presets)")
    bs.add_argument("--acceptance-from", default="",
                    help="also project tok/s at the tokens per step of this bench-spec result (a trained model's)")
    bs.add_argument("--out", help="write the JSON result here too")
    bs.set_defaults(func=cmd_bench_spec)
    bc = sub.add_parser("bench-capsules", help="delta capsules, sibling restore, spill/fetch per tier, files")
    _engine_args(bc)
    bc.add_argument("--context", type=int, default=1024, help="tokens of the planner's root")
    bc.add_argument("--branches", type=int, default=8)
    bc.add_argument("--branch-tokens", type=int, default=64, help="tokens each branch adds to the root")
    bc.add_argument("--repeats", type=int, default=10)
    bc.add_argument("--capsule-dir", default="", help="the disk tier (default: a new temporary folder)")
    bc.add_argument("--host-budget-mb", type=int, default=8192, help="pinned host tier (discrete GPUs)")
    bc.add_argument("--out", help="write the JSON result here too")
    bc.set_defaults(func=cmd_bench_capsules)
    bk = sub.add_parser("bench-constraint", help="decode with and without a JSON schema constraint; mask time per token")
    _engine_args(bk)
    bk.add_argument("--decode-tokens", type=int, default=128)
    bk.add_argument("--repeats", type=int, default=5)
    bk.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    bk.add_argument("--out", help="write the JSON result here too")
    bk.set_defaults(func=cmd_bench_constraint)
    bv = sub.add_parser("bench-vision", help="the vision tower: image tokens, preprocess and encoder ms per image")
    bv.add_argument("--model", default="tiny-vl", help="a preset or a local HF folder with a vision tower")
    bv.add_argument("--device", default="cpu")
    bv.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    bv.add_argument("--weights-seed", type=int, default=0, help="weights seed for presets")
    bv.add_argument("--resolutions", default=bench_vision.RESOLUTIONS, help="camera frames, HEIGHTxWIDTH[,...]")
    bv.add_argument("--repeats", type=int, default=10)
    bv.add_argument("--min-pixels", type=int, default=DEFAULT_MIN_PIXELS)
    bv.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS)
    bv.add_argument("--out", help="write the JSON result here too")
    bv.set_defaults(func=cmd_bench_vision)
    bi = sub.add_parser("bench-image-ttft", help="image-to-first-token latency: cold vs from a post-image capsule")
    _engine_args(bi)
    bi.add_argument("--grid", default="16x16", help="the image in patches, HxW (16x16: 256x256 pixels, 64 tokens)")
    bi.add_argument("--repeats", type=int, default=10)
    bi.add_argument("--out", help="write the JSON result here too")
    bi.set_defaults(func=cmd_bench_image_ttft)
    pl = sub.add_parser("plan", help="weights + arena + history + capsule budget per preset and format, against a "
                                     "memory size (default: Thor's 128 GB); nothing is loaded")
    pl.add_argument("--presets", default=",".join(p for p in PRESETS if not p.startswith("tiny")))
    pl.add_argument("--formats", default=",".join(quant.FORMATS))
    pl.add_argument("--memory-gb", type=float, default=plan.THOR_MEMORY_BYTES / 10**9)
    pl.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    pl.add_argument("--max-context", type=int, default=16384)
    pl.add_argument("--capsule-budget-mb", type=int, default=8192)
    pl.add_argument("--history-depth", type=int, default=32)
    pl.add_argument("--weights-exclude", default="")
    pl.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except FlashRTError as err:
        print(json.dumps({"error": err.code.name, "error_code": int(err.code), "message": err.message}))
        return 2
    print(json.dumps(result))
    ok = result.get("token_identical", True) and result.get("byte_exact", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
