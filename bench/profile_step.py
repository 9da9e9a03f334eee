"""Where does a decode step / small prefill / cold prefill spend GPU time? (diagnostic, run on the device)"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flashrt_ros.runtime import Engine, EngineConfig
from flashrt_ros.runtime.verify import prompt_tokens

preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3.5-0.8b"
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
t0 = time.time()
eng = Engine(EngineConfig(model=preset, device="cuda", dtype="bfloat16", max_context=ctx + 128, prefill_chunk=2048,
                          checksum_on_snapshot=False))
print("init s", time.time() - t0, "graphs", len(eng.graphs.graphs), flush=True)
prompt = prompt_tokens(eng.vocab_size, ctx, "p")


def timed(fn, n=5):
    out = []
    for _ in range(n):
        torch.cuda.synchronize(); s = time.perf_counter(); fn(); torch.cuda.synchronize()
        out.append(1000 * (time.perf_counter() - s))
    return sorted(out)[len(out) // 2]


eng.reset(); eng.ingest(prompt[:2048]); eng.snapshot("base")
key = ("decode", True, eng._kv_bucket(2049))
g = eng.graphs.graphs[key]
print("decode graph replay ms", timed(lambda: (g.replay(), eng.restore("base"))))
print("restore alone ms", timed(lambda: eng.restore("base")))
print("eager decode step ms", timed(lambda: (eng._decode_step(True, key[2])(), eng.restore("base"))))
gen = lambda: (eng.restore("base"), list(eng.generate(8, stop_token_ids=())))
print("generate 8 ms", timed(gen))
print("cold prefill", ctx, "ms", timed(lambda: (eng.reset(), eng.ingest(prompt)), 3))
for name, fn in [("decode_graph", lambda: g.replay()), ("generate8", gen),
                 ("cold_prefill", lambda: (eng.reset(), eng.ingest(prompt)))]:
    eng.restore("base")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn(); torch.cuda.synchronize()
    print("=====", name)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
