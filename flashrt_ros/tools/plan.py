"""Will a model fit? Weights (in their loaded layout), arena, rollback history and capsule budget per preset and
format, from shapes alone (a meta-device model: nothing is allocated), against a memory size (Thor: 128 GB that
the GPU, the CPU and the rest of the robot share)."""
from __future__ import annotations

import torch

from flashrt_ros.runtime import quant
from flashrt_ros.runtime.arena import buffer_specs
from flashrt_ros.runtime.config import ModelConfig
from flashrt_ros.runtime.model import Qwen35

THOR_MEMORY_BYTES = 128 * 10**9


def weight_bytes(cfg: ModelConfig, fmt: str, exclude: tuple[str, ...], dtype: torch.dtype) -> int:
    """Bytes of the weights as ``weights.load`` builds them: projections in ``fmt`` (one scale per output channel
    for fp8) except the excluded ones, the LM head quantized in place of a dense untied one, the rest (the vision
    tower's included) in ``dtype``."""
    with torch.device("meta"):
        model = Qwen35(cfg, with_vision=True)     # loaded by default, so counted
    model.fuse_projections()
    targets = set(quant.targets(model, fmt, exclude))
    size = dtype.itemsize
    total = 0
    for name, param in model.named_parameters():
        module = name.rpartition(".")[0]
        if module in targets:
            total += quant.weight_bytes(fmt, *param.shape, size)
        elif not (module == quant.LM_HEAD and quant.LM_HEAD in targets):
            total += param.numel() * size
    if quant.LM_HEAD in targets:
        total += quant.weight_bytes(fmt, cfg.vocab_size, cfg.hidden_size, size)
    return total


def memory_plan(cfg: ModelConfig, fmt: str, dtype: torch.dtype, max_context: int, capsule_budget_bytes: int,
                history_depth: int, memory_bytes: int = THOR_MEMORY_BYTES, exclude: tuple[str, ...] = ()) -> dict:
    specs = buffer_specs(cfg, max_context, dtype)
    arena = max(s.offset + s.nbytes for s in specs)
    history = history_depth * next(s.offset for s in specs if s.name == "kv")   # the fixed state, per rollback step
    weights = weight_bytes(cfg, fmt, exclude, dtype)
    total = weights + arena + history + capsule_budget_bytes
    return {"format": fmt, "weights_bytes": weights, "arena_bytes": arena, "history_bytes": history,
            "capsule_budget_bytes": capsule_budget_bytes, "total_bytes": total, "memory_bytes": memory_bytes,
            "left_bytes": memory_bytes - total, "fits": total <= memory_bytes}
