"""Micro-benchmark: the Triton gated delta rule at the 0.8B shape (16 heads, dk = dv = 128) for 1 and 24 rows,
per num_warps and value block (CUDA graphs of 18 launches, as in a step)."""
import torch
from flashrt_ros.runtime.kernels import delta_rule as dr
torch.manual_seed(0)
H, dk, dv = 16, 128, 128
for L in (1, 5, 24, 64):
    q, k = (torch.randn(L, H, dk, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(L, H, dv, device="cuda", dtype=torch.bfloat16)
    a, b = (torch.randn(L, H, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    A_log, dt_bias = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
    want_state = torch.randn(H, dk, dv, device="cuda") * 0.1
    ref_state = want_state.clone()
    want = dr.gated_delta_rule_reference(q, k, v, a, b, A_log, dt_bias, ref_state)
    for bv in (16, 32, 64):
        for warps in (1, 2, 4, 8):
            orig = dr._value_block
            dr._value_block = lambda h, d, bv=bv: bv
            try:
                states = [want_state.clone() for _ in range(18)]
                out = dr.gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, states[0].clone(), num_warps=warps)
                err = (out.float() - want.float()).abs().max().item()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for s in states:
                        dr.gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, s, num_warps=warps)
                g.replay(); torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(50):
                    g.replay()
                end.record(); torch.cuda.synchronize()
                print(f"L={L:3d} BV={bv:3d} warps={warps}: {start.elapsed_time(end) / 50 / 18 * 1000:7.2f} us/launch  max|err|={err:.2e}", flush=True)
            except Exception as e:
                print(f"L={L} BV={bv} warps={warps}: {type(e).__name__}: {str(e)[:100]}")
            finally:
                dr._value_block = orig
