"""The recurrent gated delta rule's device time per launch, at the decode step's length (1 row) and the capsule
suffix piece's (24 rows), for a preset's DeltaNet shape:
``python3 bench/time_delta_rule.py [PRESET] [LENGTHS]`` (default qwen3.5-0.8b 1,24), one line per length.
A/B two versions of the kernel in one sitting by running it before and after swapping the module."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flashrt_ros.runtime.config import PRESETS  # noqa: E402
from flashrt_ros.runtime.kernels.delta_rule import gated_delta_rule_triton  # noqa: E402
from flashrt_ros.tools.timing import time_calls_us  # noqa: E402

preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3.5-0.8b"
lengths = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,24").split(",")]
cfg = PRESETS[preset]
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
generator = torch.Generator(device=device).manual_seed(0)
hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                  cfg.linear_value_head_dim)
for length in lengths:
    def rand(*shape):
        return torch.randn(*shape, device=device, generator=generator).to(dtype)
    q, k, v, a, b = rand(length, hk, dk), rand(length, hk, dk), rand(length, hv, dv), rand(length, hv), rand(length, hv)
    a_log, dt_bias = torch.zeros(hv, device=device), torch.ones(hv, device=device)
    state = torch.zeros(hv, dk, dv, device=device)
    us = time_calls_us(device, [lambda: gated_delta_rule_triton(q, k, v, a, b, a_log, dt_bias, state)], repeats=20)
    print(f"{preset} delta rule {length:3d} rows: {us:8.2f} us a launch, {us / length:6.3f} us a row")
