"""What the device count costs a piece's delta rule, by kernel variant (an experiment kept with its results, not a
maintained tool): each variant is delta_rule.py at d70fd49 with its text changed, written beside this script and
imported, then timed on the 0.8B's 24 rows laid out as in a step, with the device count (24 and 21) and without.
This is the second form of the script (count_variants_run2.txt); the first (run1) had v2 and v82 where this has vA
and vC, and counts 24 and none only. Run from the repository root on a GPU: python3 <this file>."""
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
LOOP_START = "    for t in range(0, real):\n"
ZERO_LOOP = """    for t in range(real, length):
        tl.store(out_ptrs + t * out_row, tl.zeros([BLOCK_V], out_ptr.dtype.element_ty), mask=col_mask)
"""
head, rest = SRC.split(LOOP_START)
body, tail = rest.split(ZERO_LOOP)
first, compute = body.split("        if AHEAD:\n            decay, beta", 1)
compute = "        if AHEAD:\n            decay, beta" + compute
first = first.replace("(t + 1) % real", "(t + 1) % length")
store = "        tl.store(out_ptrs + t * out_row"
pre_store, post_store = compute.split(store)
SELECT = (head + "    for t in range(0, length):\n" + first + "        s_before = s\n" + pre_store
          + "        live = t < real\n        s = tl.where(live, s, s_before)\n        out = tl.where(live, out, 0.0)\n"
          + store + post_store + tail)
BRANCH = (head + "    for t in range(0, length):\n" + first + "        if t < real:\n"
          + "".join("    " + line if line.strip() else line for line in compute.splitlines(True)) + ZERO_LOOP + tail)
SOURCES = {"vA_uniform_select": SELECT, "vC_uniform_branch": BRANCH}
VARIANTS = {
    "v0_current": [],
    "v8_prefetch_mod_length": [("(t + 1) % real", "(t + 1) % length")],
    "v11_count_unused_bound": [("real = tl.minimum(tl.load(count_ptr).to(tl.int32), length)", "real = length")],
}
mods = {}
for name, subs in list(VARIANTS.items()) + [(n, []) for n in SOURCES]:
    text = SOURCES.get(name, SRC)
    for old, new in subs:
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    Path(__file__).with_name(f"_dr_{name}.py").write_text(text)
    mods[name] = importlib.import_module(f"_dr_{name}")
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
for cfg in (delta_rule.PIECE_AHEAD, delta_rule.DeltaRuleConfig(4, 1, False)):
    for name, mod in mods.items():
        for n in (count, None, short):
            f = mod.gated_delta_rule_triton
            out = f(*stepped, state.clone(), n, config=cfg)
            key = (tuple(cfg), None if n is None else int(n))
            same = want.setdefault(key, out).equal(out)
            us = time_calls_us(device, [lambda s=s: f(*stepped, s, n, config=cfg) for s, in scratch], 30)
            print(f"{tuple(cfg)} {name:26s} count={'none' if n is None else int(n)} {us:7.2f} us  same bytes: {same}",
                  flush=True)
