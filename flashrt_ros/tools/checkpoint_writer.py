"""Writing a synthetic HF checkpoint folder of a preset's shape (its seeded weights), tensor by tensor into shards,
so the from-disk load path can be measured on a machine without the real weights or the formats' libraries:

* ``dense``: bf16 ``.weight`` tensors;
* ``fp8``: Qwen's official ``-FP8`` layout (``quant_method: fp8``, e4m3 codes, ``weight_scale_inv`` per 128 x 128
  block, edge blocks partial);
* ``nvfp4``: compressed-tensors ``nvfp4-pack-quantized`` (``weight_packed``, ``weight_scale``,
  ``weight_global_scale``, group 16).

The LM head and the embedding stay bf16 in every format (as in the released checkpoints). Host memory holds one
shard being written."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from flashrt_ros.runtime import quant
from flashrt_ros.runtime.config import PRESETS, ModelConfig
from flashrt_ros.runtime.kernels import quant_gemv as kq
from flashrt_ros.runtime.model import Qwen35
from flashrt_ros.runtime.weights import random_rows

FP8_BLOCK = 128
DTYPE = torch.bfloat16


def hf_config(cfg: ModelConfig) -> dict:
    """The ``qwen3_5_text`` ``config.json`` that :func:`.config.from_hf_dict` reads back as ``cfg``."""
    return {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "torch_dtype": "bfloat16",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "layer_types": list(cfg.layer_types),
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "linear_num_key_heads": cfg.linear_num_key_heads,
            "linear_num_value_heads": cfg.linear_num_value_heads, "linear_key_head_dim": cfg.linear_key_head_dim,
            "linear_value_head_dim": cfg.linear_value_head_dim, "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
            "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                "partial_rotary_factor": cfg.partial_rotary_factor},
            "mtp_num_hidden_layers": cfg.mtp_num_hidden_layers,
            "max_position_embeddings": cfg.max_position_embeddings, "eos_token_id": list(cfg.eos_token_ids)}


def quantization_config(fmt: str) -> dict | None:
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "modules_to_not_convert": ["lm_head", "embed_tokens"]}
    if fmt == "nvfp4":
        weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": kq.NVFP4_GROUP,
                   "symmetric": True, "dynamic": False}
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "format": "nvfp4-pack-quantized"}}}
    return None


def fp8_blocks(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """E4M3 codes and fp32 ``weight_scale_inv`` per 128 x 128 block (amax / 448; edge blocks partial)."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -k % FP8_BLOCK, 0, -n % FP8_BLOCK))
    blocks = padded.reshape(padded.shape[0] // FP8_BLOCK, FP8_BLOCK, -1, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / quant.FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    full = scale.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return {"weight": (w.float() / full).to(torch.float8_e4m3fn), "weight_scale_inv": scale}


def nvfp4_packed(w: torch.Tensor) -> dict[str, torch.Tensor]:
    global_scale = quant.nvfp4_global_scale(w)
    weight = quant.quantize_nvfp4(w, global_scale)
    return {"weight_packed": weight.q, "weight_scale": weight.scale, "weight_global_scale": global_scale}


ENCODERS = {"fp8": fp8_blocks, "nvfp4": nvfp4_packed}
FORMATS = ("dense", *ENCODERS)


def _tensors(cfg: ModelConfig, fmt: str, seed: int, device: torch.device):
    """(HF name, shape) of every tensor, then a function producing its stored tensors {name: tensor}."""
    with torch.device("meta"):
        model = Qwen35(cfg, with_vision=False)      # the config it writes is text-only (hf_config)
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    for name, param in model.named_parameters():
        shape = tuple(param.shape)

        def produce(name=name, shape=shape):
            w = random_rows(name, shape, 0, shape[0], seed, DTYPE, device)
            if fmt == "dense" or name not in linears:
                return {name: w.cpu()}
            module = name[:-len(".weight")]
            return {f"{module}.{suffix}": t.cpu() for suffix, t in ENCODERS[fmt](w).items()}
        stored_bytes = math.prod(shape) * (2 if fmt == "dense" or name not in linears else 1)
        yield name, stored_bytes, produce


def write(preset: str, folder: Path, fmt: str = "dense", seed: int = 0, shard_bytes: int = 2 << 30,
          device: torch.device = torch.device("cpu")) -> Path:
    """Write the preset's checkpoint in ``fmt`` to ``folder`` (shards of about ``shard_bytes``, an index); the
    weights are generated and encoded on ``device``."""
    from safetensors.torch import save_file

    cfg = PRESETS[preset]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    plan, shard, size = [], [], 0          # shards of tensor producers, by estimated bytes
    for name, nbytes, produce in _tensors(cfg, fmt, seed, device):
        if shard and size + nbytes > shard_bytes:
            plan.append(shard)
            shard, size = [], 0
        shard.append(produce)
        size += nbytes
    plan.append(shard)
    weight_map = {}
    for index, producers in enumerate(plan, 1):
        file = f"model-{index:05d}-of-{len(plan):05d}.safetensors"
        tensors = {}
        for produce in producers:
            tensors.update(produce())
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = hf_config(cfg)
    if quantization_config(fmt):
        config["quantization_config"] = quantization_config(fmt)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
