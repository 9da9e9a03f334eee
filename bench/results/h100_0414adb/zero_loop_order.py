"""What the padding rows' zero stores cost a piece's delta rule by where they sit (an experiment kept with its
results, not a maintained tool). In sm_90 SASS (triton 3.6.0), with the zero-store loop after the serial loop,
ptxas serialises the serial loop's four SHFL reduction trees of a launch with a device count (none of its 40 SHFLs
next to another, a barrier splitting them), where without a count it interleaves them (29 adjacent): the device
count's 6 us a launch. delta_rule.py stores the zeros before the loop; "zeros after" is its text with the loop moved
back. 24 rows of the 0.8B laid out as in a step, the piece's own launch, counts 24 / none / 21.
Run from the repository root on a GPU: python3 bench/results/h100_0414adb/zero_loop_order.py"""
import importlib, sys
from pathlib import Path
ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from flashrt_ros.runtime.kernels import delta_rule
from flashrt_ros.tools.timing import time_calls_us, weight_copies
from time_delta_rule import as_in_a_step

SRC = Path(delta_rule.__file__).read_text().replace("from ._", "from flashrt_ros.runtime.kernels._").replace(
    "from .norms", "from flashrt_ros.runtime.kernels.norms")
ZERO = """    for t in range(real, length):
        tl.store(out_ptrs + t * out_row, tl.zeros([BLOCK_V], out_ptr.dtype.element_ty), mask=col_mask)
"""
FINAL = "    if not STORE_ROWS:\n        tl.store(s_ptrs, s, mask=s_mask)\n"
assert SRC.count(ZERO) == 1 and SRC.count(FINAL) == 1 and SRC.index(ZERO) < SRC.index(FINAL)
after = SRC.replace(ZERO, "").replace(FINAL, ZERO + FINAL)
Path(__file__).with_name("_zl_after.py").write_text(after)
mods = {"zeros first (this tree)": delta_rule, "zeros after (before)": importlib.import_module("_zl_after")}
device = torch.device("cuda")
g = torch.Generator(device=device).manual_seed(0)
hk, hv, dk, dv, L = 16, 16, 128, 128, 24
def rand(*s): return torch.randn(*s, device=device, generator=g).to(torch.bfloat16)
inputs = (rand(L, hk, dk), rand(L, hk, dk), rand(L, hv, dv), rand(L, hv), rand(L, hv), torch.zeros(hv, device=device),
          torch.ones(hv, device=device))
*stepped, count = as_in_a_step(*inputs)
short = torch.tensor(L - 3, device=device)
state = torch.zeros(hv, dk, dv, device=device)
scratch = weight_copies(device, (state.clone(),))
want = {}
for name, mod in mods.items():
    f = mod.gated_delta_rule_triton
    for n in (count, None, short):
        s = state.clone()
        out = f(*stepped, s, n)
        key = None if n is None else int(n)
        same = want.setdefault(key, (out, s))
        same = torch.equal(same[0], out) and torch.equal(same[1], s)
        us = time_calls_us(device, [lambda s=s: f(*stepped, s, n) for s, in scratch], 30)
        print(f"{name:24s} count={'none' if n is None else int(n):>4} {us:7.2f} us  same bytes: {same}", flush=True)
