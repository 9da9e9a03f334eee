"""What the hardware allows, measured in the same run as the engine: the copy bandwidth, the bytes a decode step
must move, and a graph of nothing but the decode step's GEMVs (cuBLAS, the same weight matrices).

These are the denominators of the benchmark's ratios: "our decode step / the bandwidth floor" and "our decode
step / the GEMV-only graph" only mean something when both sides ran on the same device in the same process.
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from torch import nn

from flashrt_ros.runtime.engine import Engine
from flashrt_ros.runtime.graphs import capture_graph
from flashrt_ros.runtime.vision.config import VISUAL

from .timing import timed


def copy_bandwidth_bytes_per_s(device: torch.device, repeats: int = 10) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written (the convention of the copy floor), over
    1 GiB on a GPU and 128 MiB on the CPU (far beyond its caches either way)."""
    nbytes = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [timed(device, lambda: dst.copy_(src))[1] for _ in range(repeats)]
    return 2 * nbytes / (statistics.median(times) / 1000.0)


def decode_linears(engine: Engine) -> list[torch.Tensor]:
    """The weight matrices one decode step multiplies by (its projections, the MTP head's fc and KV projection,
    and the LM head; not the vision tower's)."""
    model = engine.model
    skipped = set()
    if model.cfg.mtp_num_hidden_layers:   # the MTP layer's output is not computed: only its KV write is state
        layer = model.mtp.layers[0]
        skipped = {id(m) for m in (*layer.mlp.modules(), layer.self_attn.o_proj)}
    weights = [m.weight for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and id(m) not in skipped and not n.startswith(VISUAL)]
    return weights + [model.output_weight()]


def decode_bytes(engine: Engine, position: int) -> dict:
    """Bytes a decode step at ``position`` must move at least: each weight matrix read once, the recurrent and
    conv state read and written once, the KV prefix read once (attention and MTP)."""
    arena = engine.arena
    weights = sum(w.numel() * w.element_size() for w in decode_linears(engine))
    fixed = 2 * (arena.specs["recurrent"].nbytes + arena.specs["conv"].nbytes)
    kv = sum(spec.live_bytes(position) for spec in arena.specs.values() if spec.per_token)
    return {"weight_bytes": weights, "state_bytes": fixed + kv, "total_bytes": weights + fixed + kv}


def gemv_graph_ms(engine: Engine, repeats: int) -> float | None:
    """Median time of one CUDA graph holding only the decode step's GEMVs (one token), back to back."""
    if engine.device.type != "cuda":
        return None
    weights = decode_linears(engine)
    inputs = [torch.randn(1, w.shape[1], device=engine.device, dtype=w.dtype) for w in weights]

    def step():
        for x, w in zip(inputs, weights):
            F.linear(x, w)

    graph, _ = capture_graph(step)
    graph.replay()
    times = [timed(engine.device, graph.replay)[1] for _ in range(repeats)]
    return statistics.median(times)
