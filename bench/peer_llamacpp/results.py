"""The peer table: our engine and llama.cpp side by side from one run's JSON files, in BENCHMARKS.md's format.

    python3 bench/peer_llamacpp/results.py --peer peer_llamacpp.json --ours ours.json [--fidelity fidelity.json]
        [--device "one NVIDIA H200"] [--command "..."] [--commit abc1234] [--append BENCHMARKS.md]

Prints the markdown section (and appends it to --append); --summary writes the ratios and the issue's targets as JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

# The targets, each as (what, ratio key, bound): a ratio >= bound meets it. Restores are compared like for like:
# bench's restore and capsule TTFT are full copies into a reset arena, every byte, as set_data writes.
TARGETS = (("our decode <= llama.cpp's", "decode_peer_over_ours", 1.0),
           ("our restore >= 20x faster than its state set (full restore; llama.cpp on device)", "restore_speedup_device",
            20.0),
           ("our restore >= 20x faster than its state set (full restore; llama.cpp host buffer)", "restore_speedup_host",
            20.0),
           ("our capsule TTFT >= 10x better than its restore + suffix (on device)", "capsule_ttft_speedup_device", 10.0))


def ratios(ours: dict, peer: dict) -> dict:
    """Peer time over ours, per figure (> 1: we are faster)."""
    return {
        "cold_ttft_peer_over_ours": peer["cold_ttft_ms"] / ours["cold_ttft_ms"],
        "decode_peer_over_ours": peer["decode_ms_per_token"] / ours["decode_ms_per_token"],
        "restore_speedup_host": peer["state_set_host_ms"] / ours["restore_p50_ms"],
        "restore_speedup_device": peer["state_set_device_ms"] / ours["restore_p50_ms"],
        "lineage_restore_speedup_device": peer["state_set_device_ms"] / ours["lineage_restore_p50_ms"],
        "snapshot_speedup_device": peer["state_get_device_ms"] / ours["snapshot_p50_ms"],
        "capsule_ttft_speedup_host": peer["restore_suffix_ttft_host_ms"] / ours["capsule_ttft_ms"],
        "capsule_ttft_speedup_device": peer["restore_suffix_ttft_device_ms"] / ours["capsule_ttft_ms"],
    }


def paired(ours: dict, peer: dict) -> list[tuple[dict, dict, dict]]:
    by_context = {r["context"]: r for r in peer["rows"]}
    return [(o, by_context[o["context"]], ratios(o, by_context[o["context"]]))
            for o in ours["rows"] if o["context"] in by_context]


def targets(rows: list[tuple[dict, dict, dict]]) -> list[dict]:
    return [{"target": what, "context": o["context"], "ratio": r[key], "met": r[key] >= bound}
            for what, key, bound in TARGETS for o, _, r in rows]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def table(rows: list[tuple[dict, dict, dict]]) -> str:
    head = ("| context | cold TTFT ms, ours / llama.cpp | decode ms/token, ours / llama.cpp | state bytes, our capsule / "
            "llama.cpp seq state | snapshot ms, ours / llama.cpp get (device; host) | restore ms, ours (lineage delta) / "
            "llama.cpp set (device; host) | restore + 24-token suffix + first token ms, ours / llama.cpp "
            "(device; host) |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for o, p, r in rows:
        lines.append(
            f"| {o['context']} | {o['cold_ttft_ms']:.2f} / {p['cold_ttft_ms']:.2f} ({r['cold_ttft_peer_over_ours']:.2f}x) "
            f"| {o['decode_ms_per_token']:.2f} / {p['decode_ms_per_token']:.2f} ({r['decode_peer_over_ours']:.2f}x) "
            f"| {_mib(o['capsule_bytes'])} / {_mib(p['state_host_bytes'])} "
            f"| {o['snapshot_p50_ms']:.3f} / {p['state_get_device_ms']:.3f}; {p['state_get_host_ms']:.3f} "
            f"| {o['restore_p50_ms']:.3f} ({o['lineage_restore_p50_ms']:.3f}) / {p['state_set_device_ms']:.3f}; "
            f"{p['state_set_host_ms']:.3f} ({r['restore_speedup_device']:.1f}x; {r['restore_speedup_host']:.1f}x) "
            f"| {o['capsule_ttft_ms']:.2f} / {p['restore_suffix_ttft_device_ms']:.2f}; "
            f"{p['restore_suffix_ttft_host_ms']:.2f} ({r['capsule_ttft_speedup_device']:.1f}x; "
            f"{r['capsule_ttft_speedup_host']:.1f}x) |")
    return "\n".join(lines)


def fidelity_line(f: dict) -> str:
    line = (f"- **Fidelity** ({f['model']}, {f['dtype']} on {f['device']}, GGUF {f['gguf_type']}, llama.cpp KV "
            f"{f['peer_kv_cache']}, prompt {f['prompt_tokens']} tokens, {f['greedy_tokens']} greedy tokens): top-1 "
            f"agreement {f['top1_agreement']:.3f} over {f['rows']} teacher-forced rows; llama.cpp's own greedy "
            f"continuation equals ours for {f['greedy_tokens_equal']}/{f['greedy_tokens']} tokens (common prefix "
            f"{f['greedy_common_prefix']}); logit correlation min {f['logit_corr_min']:.6f} (mean "
            f"{f['logit_corr_mean']:.6f}), relative L2 {f['rel_l2']:.2e}, max |diff| {f['logit_max_abs_diff']:.3g} "
            f"(logit std {f['logit_std']:.3g}).")
    if "fp32_ref_rel_l2_ours" in f:
        line += (f" Against an fp32 engine on the same bf16 weights: ours {f['fp32_ref_rel_l2_ours']:.2e} (top-1 "
                 f"{f['fp32_ref_top1_ours']:.3f}), llama.cpp {f['fp32_ref_rel_l2_peer']:.2e} (top-1 "
                 f"{f['fp32_ref_top1_peer']:.3f}).")
    return line


def readme_row(rows: list[tuple[dict, dict, dict]], peer: dict) -> str:
    """The README's measured-numbers row for the longest context (the 27B column is left as not measured)."""
    o, p, r = rows[-1]
    return (f"| llama.cpp `{peer['llama_cpp_commit'][:7]}` on the same weights, same run (@{o['context'] // 1024}k): "
            f"decode; cold TTFT; seq-state set on device; its restore + suffix + first token "
            f"| {p['decode_ms_per_token']:.2f} ms ({r['decode_peer_over_ours']:.2f}x ours); "
            f"{p['cold_ttft_ms']:.1f} ms ({r['cold_ttft_peer_over_ours']:.2f}x); "
            f"{p['state_set_device_ms']:.3f} ms ({r['restore_speedup_device']:.1f}x our restore); "
            f"{p['restore_suffix_ttft_device_ms']:.2f} ms ({r['capsule_ttft_speedup_device']:.1f}x our capsule TTFT) "
            f"| not measured |")


def section(ours: dict, peer: dict, fidelity: dict | None, meta: dict) -> str:
    rows = paired(ours, peer)
    unmet = [t for t in targets(rows) if not t["met"]]
    same_first = all(p["first_token_cold"] == p["first_token_device_restore"] == p["first_token_host_restore"]
                     for _, p, _ in rows)
    parts = [
        f"## Peer: llama.cpp on the same weights and shapes ({ours['model']}, {meta['device']})", "",
        f"- **Command**: `{meta['command']}`.",
        f"- **Commit**: `{meta['commit']}`. **Device**: {meta['device']}. **Date**: {meta['date']}.",
        f"- **llama.cpp**: `{peer['llama_cpp_commit']}` (vendored in llama-cpp-python 0.3.36), built by "
        f"`bench/peer_llamacpp`; GGUF from our seeded weights by the sdist's own converter class; n_ubatch "
        f"{peer['n_ubatch']}, KV cache {peer.get('kv_cache', 'f16')}, flash attention auto, greedy, one token per `llama_decode`. Ours: "
        f"kernels `{ours['kernels']}`, {ours['dtype']}.",
        "- llama.cpp's state is `llama_state_seq_get_data`/`set_data` of sequence 0, into a host buffer and with "
        "`LLAMA_STATE_SEQ_FLAGS_ON_DEVICE` (a device-resident copy; one per sequence); its TTFT after restore is "
        "set_data + the 24-token suffix + argmax. The first token after every restore "
        + ("equals its cold prefill's." if same_first else "**differs** from its cold prefill's in some row."),
        "", table(rows), "",
        "Ratios in brackets: llama.cpp's time over ours (> 1: ours is faster). Our restore and capsule TTFT are full "
        "copies into a reset arena, every byte, as set_data writes; in parentheses the lineage-aware restore (the live "
        "KV rows already held by the capsule: only the fixed state is copied), which llama.cpp has no counterpart of.",
    ]
    if fidelity:
        parts.append(fidelity_line(fidelity))
    parts.append("- **Targets**: " + ("all met." if not unmet else "not met: " + "; ".join(
        f"{t['target']} at {t['context']} ({t['ratio']:.2f}x)" for t in unmet) + "."))
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", type=Path, required=True)
    parser.add_argument("--ours", type=Path, required=True)
    parser.add_argument("--fidelity", type=Path)
    parser.add_argument("--device", default="one NVIDIA H200")
    parser.add_argument("--command", default="bash bench/peer_llamacpp/run_h200.sh")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--append", type=Path, help="append the section to this markdown file")
    parser.add_argument("--summary", type=Path, help="write ratios and targets as JSON here")
    parser.add_argument("--readme-row", action="store_true", help="also print the README's measured-numbers row")
    args = parser.parse_args(argv)
    ours, peer = json.loads(args.ours.read_text()), json.loads(args.peer.read_text())
    fidelity = json.loads(args.fidelity.read_text()) if args.fidelity and args.fidelity.is_file() else None
    meta = {"device": args.device, "command": args.command, "commit": args.commit, "date": args.date}
    text = section(ours, peer, fidelity, meta)
    print(text)
    if args.readme_row:
        print("README row:\n" + readme_row(paired(ours, peer), peer))
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)
    if args.summary:
        rows = paired(ours, peer)
        args.summary.write_text(json.dumps({"rows": [{"context": o["context"], **r} for o, _, r in rows],
                                            "targets": targets(rows), **meta}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
