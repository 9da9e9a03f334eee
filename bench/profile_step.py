"""Where do a decode step, the capsule TTFT's small piece and its first-token logits spend GPU time? A diagnostic
run on the device: ``python3 bench/profile_step.py PRESET CONTEXT [SUFFIX] [WEIGHTS_FORMAT] [SPECULATIVE_TOKENS]``
prints the replay times and, per step, the top kernels by device time (torch.profiler). With SPECULATIVE_TOKENS k > 0
the decode step profiled is the speculative plan's step with k drafts; PROFILE_DENSE_GEMV=triton profiles the Triton
dense GEMVs (``EngineConfig.dense_gemv``) instead of cuBLAS."""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flashrt_ros.runtime import Engine, EngineConfig
from flashrt_ros.runtime.engine import _piece_bucket
from flashrt_ros.tools.timing import timed
from flashrt_ros.tools.verify import prompt_tokens

preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3.5-0.8b"
context = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
suffix = int(sys.argv[3]) if len(sys.argv) > 3 else 24
weights_format = sys.argv[4] if len(sys.argv) > 4 else "dense"
drafts = int(sys.argv[5]) if len(sys.argv) > 5 else 0
draft_vocab = int(sys.argv[6]) if len(sys.argv) > 6 else 0
# a speculative stream's steady state: the step takes the pick of the verify before it (PROFILE_CARRIED=0: it reads
# the LM head for it, as a stream's first step does)
carried = drafts > 0 and os.environ.get("PROFILE_CARRIED", "1") == "1"
engine = Engine(EngineConfig(model=preset, device="cuda", dtype="bfloat16", max_context=context + 128,
                             prefill_chunk=2048, checksum_on_snapshot=False, weights_format=weights_format,
                             capsule_budget_bytes=16 << 30, speculative_tokens=drafts, draft_vocab=draft_vocab,
                             dense_gemv=os.environ.get("PROFILE_DENSE_GEMV", "cublas")))
device = engine.device
engine.ingest(prompt_tokens(engine.vocab_size, context, "profile"))
engine.snapshot("base")
decode_kv = engine._kv_bucket(context + 1 + drafts)
# the plain plan's step is two graphs, the pick and the forward (Engine._plain_step); the speculative plan's one
decode = ([engine.graphs.graphs[("sample", True)], engine.graphs.graphs[("forward", decode_kv)]] if drafts == 0
          else [engine.graphs.graphs[engine._step(drafts, True, decode_kv, carried)[0]]])
piece = [engine.graphs.graphs[("piece", _piece_bucket(suffix), engine._kv_bucket(context + suffix))]]
engine._count.fill_(suffix)


def replayed(graphs):
    """Raw replays change the live state behind the engine's back: say so first, as a step does, or the restore
    after it takes the live fixed state for the capsule's (nothing ran since the restore, as far as it knows),
    skips writing it, and every replay starts further on (at the end, past the rope tables: an index assertion)."""
    def run():
        engine.live.rows.truncate(engine.position)
        for graph in graphs:
            graph.replay()
    return run


steps = {f"decode step ({drafts} drafts{', carried pick' if carried else ''})": replayed(decode),
         f"piece graph ({suffix} tokens)": replayed(piece),
         "first token (the step's pick)": engine.peek_token, "restore (lineage)": lambda: engine.restore("base")}


def median_ms(fn, repeats=20):
    out = []
    for _ in range(repeats):
        out.append(timed(device, fn)[1])
        engine.restore("base")
    return sorted(out)[len(out) // 2]


print(f"{preset} {engine.weights_format} at {context}: {len(engine.graphs.graphs)} graphs, "
      f"kernels {engine.kernel_name}")
for name, fn in steps.items():
    print(f"{name}: {median_ms(fn):.3f} ms")
for name, fn in steps.items():
    engine.restore("base")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print("=====", name)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
