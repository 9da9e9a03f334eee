"""Pre-quantized checkpoints of the tiny HF model written by the formats' own library, compressed-tensors (test-only):
FP8 block (``float-quantized``) and NVFP4 (``nvfp4-pack-quantized``), and the reference dequantised weights that
library's ``decompress_model`` gives. The scales are computed the way llm-compressor's observers compute them
(min/max per block or group, a global scale per tensor), with compressed-tensors' own helpers."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.offload import update_offload_parameter
from compressed_tensors.quantization import (QuantizationConfig, QuantizationStrategy, apply_quantization_config,
                                             preset_name_to_scheme)
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from loguru import logger

logger.disable("compressed_tensors")   # its warnings about partial edge blocks: partial blocks are the point here

SCHEMES = {"fp8-block": "FP8_BLOCK", "nvfp4": "NVFP4", "nvfp4-a16": "NVFP4A16"}
# Not multiples of 128: partial 128 x 128 edge blocks in rows and inputs (144 = 128 + 16; 80 < 128).
ODD_SHAPES = dict(hidden_size=80, intermediate_size=144)


def _blocks(w: torch.Tensor, rows: int, cols: int):
    """Per-block (min, max) of ``w``, edge blocks partial (zero padding: the range always holds 0 anyway)."""
    n, k = w.shape
    pad = torch.nn.functional.pad(w, (0, -k % cols, 0, -n % rows))
    blocks = pad.reshape(pad.shape[0] // rows, rows, pad.shape[1] // cols, cols)
    return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))


def _set_scales(module: torch.nn.Module) -> None:
    args = module.quantization_scheme.weights
    w = module.weight.detach().float()
    if args.strategy == QuantizationStrategy.BLOCK:
        low, high = _blocks(w, *args.block_structure)
        scale, _ = calculate_qparams(low, high, args)
    else:                                 # tensor_group: NVFP4
        global_scale = generate_gparam(w.amin(), w.amax())
        groups = w.reshape(w.shape[0], -1, args.group_size)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=global_scale)
        update_offload_parameter(module, "weight_global_scale", global_scale)
    update_offload_parameter(module, "weight_scale", scale.to(module.weight_scale.dtype))


def quantized_model(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """``model`` (an HF Qwen3.5) with every projection but the LM head quantized in ``scheme``, compressed."""
    model = copy.deepcopy(model)
    config = QuantizationConfig(config_groups={"g": preset_name_to_scheme(SCHEMES[scheme], ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _set_scales(module)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.compressor = compressor
    return model


def save(model: torch.nn.Module, folder: Path) -> Path:
    """The compressed model as an HF folder (config.json with its quantization_config)."""
    folder = Path(folder)
    model.save_pretrained(folder)
    model.compressor.update_config(str(folder))
    return folder


def dequantised(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The library's reference: ``decompress_model`` on a copy; every weight, by name."""
    model = copy.deepcopy(model)
    model.compressor.decompress_model(model)
    return {n: p.detach() for n, p in model.named_parameters() if n.endswith(".weight")}


def config(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())
