"""Building a model with weights: from a local HF folder (safetensors, single or sharded) or a seeded preset."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from . import quant, rng
from .checksum import checksum
from .config import PRESETS, ModelConfig, load_config
from .errors import ErrorCode, FlashRTError
from .model import Qwen35

# Checkpoints of the multimodal `qwen3_5` model keep the text weights under this prefix.
_PREFIX_ALIASES = (("model.language_model.", "model."),)
_IGNORED_PREFIXES = ("model.visual.", "visual.")


def _empty_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Qwen35:
    with torch.device("meta"):
        model = Qwen35(cfg)
    return model.to_empty(device=device).to(dtype)


def _fill_random(name: str, tensor: torch.Tensor, seed: int) -> None:
    """Deterministic values from (seed, parameter name), identical on every device, generated in slices."""
    flat = tensor.view(-1)
    stream = rng.stream_key(name)
    step = 1 << 24
    for start in range(0, flat.numel(), step):
        index = torch.arange(start, min(start + step, flat.numel()), device=tensor.device)
        u = rng.uniform(seed, stream, index) * 2.0 - 1.0
        if name.endswith("A_log"):
            values = torch.log(0.02 + 0.24 * (u + 1.0))                  # A in [0.02, 0.5]: state kept for tens of tokens
        elif name.endswith("dt_bias"):
            values = 1.0 + 0.1 * u
        elif tensor.dim() == 1:                                          # norm weights, near their neutral value
            values = 0.1 * u + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
        elif name.endswith("embed_tokens.weight"):
            values = u * (0.02 * math.sqrt(3.0))                       # std 0.02, as HF initialises
        else:
            values = u / math.sqrt(math.prod(tensor.shape[1:]))          # bound 1/sqrt(fan_in)
        flat[start:start + index.numel()] = values.to(tensor.dtype)


def random_model(preset: str, device: torch.device, dtype: torch.dtype, seed: int) -> Qwen35:
    if preset not in PRESETS:
        raise FlashRTError(ErrorCode.LOAD_FAILED, f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    model = _empty_model(PRESETS[preset], device, dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            _fill_random(name, param.data, seed)
    model.fuse_projections()
    return model


def _checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FlashRTError(ErrorCode.LOAD_FAILED, f"{folder}: shard(s) listed in the index are missing: {missing}")
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise FlashRTError(ErrorCode.LOAD_FAILED, f"{folder}: no model.safetensors or model.safetensors.index.json")


def _canonical_name(name: str) -> str | None:
    if name.startswith(_IGNORED_PREFIXES):
        return None
    for old, new in _PREFIX_ALIASES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def load_model(folder: Path, device: torch.device, dtype: torch.dtype) -> Qwen35:
    """Load a local HF checkpoint; clear errors for missing files, unknown or mis-shaped tensors.

    Projections stored quantized (compressed-tensors ``nvfp4-pack-quantized`` or FP8 ``float-quantized``) load
    dequantised into the dense model, and their stored form is kept for :func:`quant.quantize_model`."""
    from safetensors import safe_open

    folder = Path(folder)
    if not folder.is_dir():
        raise FlashRTError(ErrorCode.LOAD_FAILED, f"model folder {folder} does not exist")
    cfg = load_config(folder)
    model = _empty_model(cfg, device, dtype)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    quantized: dict[str, dict[str, torch.Tensor]] = {}       # compressed-tensors parts, by module name
    checkpoint: dict[str, quant.QuantizedWeight] = {}
    with torch.no_grad():
        for path in _checkpoint_files(folder):
            with safe_open(str(path), framework="pt") as f:
                for raw_name in f.keys():
                    name = _canonical_name(raw_name)
                    if name is None or (name.startswith("mtp.") and not cfg.mtp_num_hidden_layers):
                        continue
                    tensor = f.get_tensor(raw_name)
                    if quant.is_quantized_checkpoint_tensor(name, tensor):
                        module, _, suffix = name.rpartition(".")
                        quantized.setdefault(module, {})[suffix] = tensor.to(device)
                        continue
                    _copy_checked(params, name, tensor, path.name, raw_name)
                    loaded.add(name)
        for module, parts in quantized.items():
            weight = quant.from_checkpoint(module, parts)
            _copy_checked(params, f"{module}.weight", weight.dequantize(), folder.name, f"{module} (quantized)")
            loaded.add(f"{module}.weight")
            checkpoint[module] = weight
    missing = sorted(set(params) - loaded)
    if missing:
        raise FlashRTError(ErrorCode.LOAD_FAILED, f"{folder}: checkpoint lacks {len(missing)} tensor(s), e.g. "
                                                  f"{missing[:3]}")
    model.fuse_projections()
    # Handed to quant.quantize_model, which keeps these bytes when the engine runs in their format.
    model.quantized_checkpoint = checkpoint
    return model


def _copy_checked(params: dict, name: str, tensor: torch.Tensor, where: str, label: str) -> None:
    if name not in params:
        raise FlashRTError(ErrorCode.LOAD_FAILED, f"{where}: unexpected tensor {label!r}")
    if tuple(tensor.shape) != tuple(params[name].shape):
        raise FlashRTError(ErrorCode.LOAD_FAILED, f"{where}: tensor {label!r} has shape {tuple(tensor.shape)}, "
                                                  f"the config implies {tuple(params[name].shape)}")
    params[name].copy_(tensor)


def weights_digest(model: Qwen35) -> str:
    """A digest of every parameter's name, shape, dtype and bytes (checksummed on the device)."""
    h = hashlib.sha256()
    for name, param in model.named_parameters():
        h.update(f"{name}:{tuple(param.shape)}:{param.dtype}:".encode())
        h.update(checksum(param.data.contiguous().view(-1).view(torch.uint8)).encode())
    return h.hexdigest()
