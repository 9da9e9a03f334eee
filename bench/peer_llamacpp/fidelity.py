"""Fidelity cross-check: our engine and llama.cpp on the same weights and prompt.

Our engine runs greedy for N tokens from a seeded prompt, keeping its logits after the prompt and after each token.
llama.cpp (``peer_timing fidelity``) is then teacher-forced along our tokens, so each of its N+1 logit rows is computed
on exactly the context of ours (one early flip cannot cascade), and it also runs its own free greedy continuation.
Reported: top-1 agreement per row, llama.cpp's free-run agreement with our tokens, the Pearson correlation of the
logit rows, the largest logit difference, and our top-1 margin where the argmaxes differ (near-ties flip by rounding).

    python3 bench/peer_llamacpp/fidelity.py --model tiny --dtype float32 --gen 16 --out /tmp/fid.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from gguf_writer import write_gguf  # noqa: E402
from tokens import write_tokens  # noqa: E402

from flashrt_ros.tools import provenance  # noqa: E402

PROMPT_STREAM = "peer-fidelity"


def our_run(engine, prompt: list[int], gen: int) -> tuple[list[int], np.ndarray]:
    """Our greedy tokens through the decode path, and the logits after the prompt and after each token."""
    engine.reset()
    engine.ingest(prompt)
    rows, tokens = [engine.next_token_logits().numpy()], []
    for _ in range(gen):
        tokens += list(engine.generate(1, stop_token_ids=()))
        rows.append(engine.next_token_logits().numpy())
    return tokens, np.stack(rows)


def fp32_reference(engine, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Logits of an fp32 engine on the same (bf16-valued) weights, teacher-forced along ``tokens``: the yardstick that
    says which side's bf16 arithmetic a bf16 disagreement comes from. Eager (no CUDA graphs: the norm scales are
    recomputed after the weights are rounded)."""
    import torch

    from flashrt_ros.runtime.engine import Engine, EngineConfig
    cfg = engine.config
    ref = Engine(EngineConfig(model=cfg.model, device=cfg.device, dtype="float32", seed=cfg.seed, cuda_graphs=False,
                              max_context=len(prompt) + len(tokens) + 8, prefill_chunk=64))
    with torch.no_grad():
        for param in ref.model.parameters():
            param.copy_(param.to(engine.model.output_weight().dtype).float())
    ref.model.bind(ref.arena, ref.kernels)
    ref.ingest(prompt)
    rows = [ref.next_token_logits().numpy()]
    for token in tokens:
        ref.ingest([token])
        rows.append(ref.next_token_logits().numpy())
    del ref
    return np.stack(rows)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def compare(ours: np.ndarray, tokens: list[int], peer: np.ndarray, peer_tokens: list[int]) -> dict:
    """Row i: after the prompt and i of our tokens. Our argmax of row i is our token i (row N has no token)."""
    ours, peer = ours.astype(np.float64), peer.astype(np.float64)
    ours_top, peer_top = ours.argmax(-1), peer.argmax(-1)
    corr = [float(np.corrcoef(a, b)[0, 1]) for a, b in zip(ours, peer)]
    top2 = np.sort(ours, axis=-1)[:, -2:]
    margins = [float(top2[i, 1] - top2[i, 0]) for i in np.flatnonzero(ours_top != peer_top)]
    prefix = next((i for i, (a, b) in enumerate(zip(tokens, peer_tokens)) if a != b), len(tokens))
    return {
        "rows": len(ours), "top1_agreement": float((ours_top == peer_top).mean()),
        "greedy_tokens_equal": int(sum(a == b for a, b in zip(tokens, peer_tokens))), "greedy_tokens": len(tokens),
        "greedy_common_prefix": prefix,
        "logit_corr_min": min(corr), "logit_corr_mean": float(np.mean(corr)),
        "logit_max_abs_diff": float(np.abs(ours - peer).max()), "logit_std": float(ours.std()),
        "rel_l2": float(np.linalg.norm(ours - peer) / np.linalg.norm(ours)),
        "margin_at_disagreement": margins, "median_top1_margin": float(np.median(top2[:, 1] - top2[:, 0])),
        "our_tokens": tokens, "peer_tokens": peer_tokens,
    }


def run(engine, binary: Path, prompt_len: int, gen: int, workdir: Path, ngl: int, kv: str, threads: int,
        gguf_path: Path | None = None, reference: bool = False) -> dict:
    """Write the GGUF (unless given), run both sides, compare. ``engine`` fixes the weights, dtype and device. With
    ``reference`` (a bf16 engine), both sides are also measured against an fp32 engine on the same weights."""
    from flashrt_ros.tools.verify import prompt_tokens

    started = time.perf_counter()
    outtype = "f32" if engine.config.dtype == "float32" else "bf16"
    if gguf_path is None:
        gguf_path = workdir / f"peer_{engine.config.model}_{outtype}.gguf"
        write_gguf(engine.model, gguf_path, outtype)
    written = time.perf_counter()
    prompt = prompt_tokens(engine.vocab_size, prompt_len, PROMPT_STREAM)
    tokens, ours = our_run(engine, prompt, gen)
    ran_ours = time.perf_counter()
    logits, summary = workdir / "peer_logits.f32", workdir / "peer_fidelity.json"
    subprocess.run([str(binary), "fidelity", "--model", str(gguf_path),
                    "--prompt", str(write_tokens(workdir / "prompt.i32", prompt)),
                    "--forced", str(write_tokens(workdir / "forced.i32", tokens)), "--logits", str(logits),
                    "--ngl", str(ngl), "--kv", kv, "--threads", str(threads), "--out", str(summary)], check=True)
    peer_meta = json.loads(summary.read_text())
    peer = np.fromfile(logits, dtype="<f4").reshape(gen + 1, peer_meta["n_vocab"])[:, :engine.vocab_size]
    result = compare(ours, tokens, peer, peer_meta["greedy_tokens"])
    if reference and engine.config.dtype != "float32":
        ref = fp32_reference(engine, prompt, tokens)
        result.update({"fp32_ref_rel_l2_ours": _rel(ours, ref), "fp32_ref_rel_l2_peer": _rel(peer, ref),
                       "fp32_ref_top1_ours": float((ours.argmax(-1) == ref.argmax(-1)).mean()),
                       "fp32_ref_top1_peer": float((peer.argmax(-1) == ref.argmax(-1)).mean())})
    result.update({"model": engine.config.model, "dtype": engine.config.dtype, "device": engine.config.device,
                   "gguf_type": outtype, "peer_kv_cache": kv, "prompt_tokens": prompt_len,
                   "llama_cpp_commit": peer_meta["llama_cpp_commit"], "gguf_write_s": written - started,
                   "ours_s": ran_ours - written, "peer_s": time.perf_counter() - ran_ours})
    return result


def main(argv: list[str] | None = None) -> int:
    from flashrt_ros.runtime.engine import Engine, EngineConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument("--binary", type=Path, default=HERE / "build-cpu" / "bin" / "peer_timing")
    parser.add_argument("--gguf", type=Path, help="reuse this GGUF (written from the same preset, seed and dtype)")
    parser.add_argument("--ngl", type=int, default=0, help="llama.cpp layers on the GPU (99 for all)")
    parser.add_argument("--kv", default=None, help="llama.cpp KV cache type (default: f32 for float32, bf16 else)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--reference", action="store_true", help="bf16: also compare both with an fp32 engine")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    engine = Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                 max_context=args.prompt_len + args.gen + 8, prefill_chunk=64))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        kv = args.kv or ("f32" if args.dtype == "float32" else "bf16")
        result = run(engine, args.binary, args.prompt_len, args.gen, workdir, args.ngl, kv, args.threads, args.gguf,
                     args.reference)
    if args.out:
        provenance.write_result(args.out, result, args.device)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
