"""Building a model with weights, from a local HF folder (:mod:`.checkpoint`) or a seeded preset, straight into its
final dtype, device and layout: fused projections and quantized formats are written in place, slice by slice, so
peak memory is the final weights plus one slice (no float32 model, no second copy while fusing or quantizing)."""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from pathlib import Path

import torch
from torch import nn

from . import quant, rng
from .checkpoint import Checkpoint
from .checksum import checksum
from .config import PRESETS, ModelConfig, from_hf_dict, read_config
from .errors import ErrorCode, FlashRTError
from .model import Qwen35
from .vision.config import VISUAL

_log = logging.getLogger(__name__)
ELEMENTS_PER_SLICE = 1 << 20      # values generated, read, converted or quantized at a time: ~45 B of temporaries each


def _neutral(name: str) -> float:
    """A 1-D weight's neutral value: 1 for a plain-scale norm (the Gated DeltaNet output norm, the vision tower's
    LayerNorms), 0 for Qwen's (1 + w) RMSNorms and for biases."""
    module, _, leaf = name.rpartition(".")
    plain_norm = name.endswith("linear_attn.norm.weight") or (
        name.startswith(VISUAL) and leaf == "weight" and module.rpartition(".")[2].startswith("norm"))
    return 1.0 if plain_norm else 0.0


def random_rows(name: str, shape: tuple[int, ...], start: int, stop: int, seed: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """Rows ``start:stop`` of a preset parameter: deterministic values from (seed, parameter name, flat index),
    identical on every device whatever the slicing."""
    row = math.prod(shape[1:])
    index = torch.arange(start * row, stop * row, device=device)
    u = rng.uniform(seed, rng.stream_key(name), index) * 2.0 - 1.0
    if name.endswith("A_log"):
        values = torch.log(0.02 + 0.24 * (u + 1.0))                  # A in [0.02, 0.5]: state kept for tens of tokens
    elif name.endswith("dt_bias"):
        values = 1.0 + 0.1 * u
    elif len(shape) == 1:                                            # norms and biases, near their neutral value
        values = 0.1 * u + _neutral(name)
    elif name.endswith("embed_tokens.weight"):
        values = u * (0.02 * math.sqrt(3.0))                       # std 0.02, as HF initialises
    else:
        values = u / math.sqrt(row)                                  # bound 1/sqrt(fan_in)
    return values.to(dtype).view(stop - start, *shape[1:])


class _Preset:
    """The source of a preset's weights: generated, slice by slice, where they are needed."""
    quantized: frozenset = frozenset()
    scheme = None

    def __init__(self, preset: str, seed: int, dtype: torch.dtype, device: torch.device, with_vision: bool):
        with torch.device("meta"):
            model = Qwen35(PRESETS[preset], with_vision)
            self.tensors = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.folder, self.seed, self.dtype, self.device = preset, seed, dtype, device

    def dense_shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name]

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        return random_rows(name, self.tensors[name], start, stop, self.seed, self.dtype, self.device)


def _row_slices(shape: tuple[int, ...]):
    step = max(1, ELEMENTS_PER_SLICE // max(1, math.prod(shape[1:])))
    for start in range(0, shape[0], step):
        yield start, min(start + step, shape[0])


@dataclasses.dataclass
class _Part:
    """One HF tensor of a (possibly fused) weight: its name, rows and shape, and whether it is stored quantized."""
    name: str
    shape: tuple[int, ...]
    stored: bool

    @property
    def module(self) -> str:
        return self.name[:-len(".weight")]


class _Builder:
    """Builds each weight straight into its final dtype, device and (fused, quantized) layout: the only temporaries
    are one slice of one source tensor, and a stored quantized tensor as read."""

    def __init__(self, source, device: torch.device, dtype: torch.dtype):
        self.source, self.device, self.dtype = source, device, dtype

    def stored(self, part: _Part) -> quant.QuantizedWeight:
        return self.source.stored_weight(part.module, *part.shape)

    def slices(self, part: _Part):
        """(start, stop, rows in the engine's dtype on its device); a stored part is read once, then dequantised."""
        weight = self.stored(part) if part.stored else None
        for start, stop in _row_slices(part.shape):
            rows = (weight.rows(start, stop).dequantize() if part.stored
                    else self.source.read(part.name, start, stop))
            yield start, stop, rows.to(device=self.device, dtype=self.dtype)

    def dense(self, shape: tuple[int, ...], parts: list[_Part]) -> torch.Tensor:
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        offset = 0
        for part in parts:
            for start, stop, rows in self.slices(part):
                out[offset + start:offset + stop].copy_(rows)
            offset += part.shape[0]
        return out

    def quantized(self, fmt: str, n: int, k: int, parts: list[_Part]) -> quant.QuantizedWeight:
        """The [N, K] weight in ``fmt``: parts stored in ``fmt`` keep their bytes; the others are quantized here,
        row slice by row slice (nvfp4: with one global scale over all of them, as quantizing their concatenation)."""
        kept = {p.name: self.stored(p) for p in parts if p.stored and self.source.scheme.fmt == fmt}
        group = math.gcd(*[kept[p.name].group if p.name in kept else k for p in parts]) if fmt == "fp8" else 0
        out = quant.QuantizedWeight.empty(fmt, n, k, group, self.device)
        fresh = [p for p in parts if p.name not in kept]
        global_scale = None
        if fmt == "nvfp4" and fresh:
            amax = max(rows.abs().amax().float() for p in fresh for _, _, rows in self.slices(p))
            global_scale = quant.nvfp4_global_scale(amax)
        offset = 0
        for part in parts:
            if part.name in kept:
                out.rows(offset, offset + part.shape[0]).copy_(kept.pop(part.name))
            else:
                for start, stop, rows in self.slices(part):
                    encoded = quant.quantize_fp8(rows) if fmt == "fp8" else quant.quantize_nvfp4(rows, global_scale)
                    out.rows(offset + start, offset + stop).copy_(encoded)
            offset += part.shape[0]
        return out


def _parts(source, shape: tuple[int, ...], sources: list[tuple[str, int]], missing: list[str],
           fmt: str) -> list[_Part]:
    """The parts of one weight (``fmt``: its format), each checked against the checkpoint's header (shape, dtype)
    before any is read."""
    parts = []
    for name, rows in sources:
        part = _Part(name, (rows, *shape[1:]), False)
        if part.module in source.quantized and name.endswith(".weight") and len(shape) == 2:
            source.stored_weight(part.module, *part.shape, check_only=True,
                                 keep_fp8=fmt == "fp8" == source.scheme.fmt)
            part.stored = True
        elif name not in source.tensors:
            missing.append(name)
            continue
        elif tuple(source.dense_shape(name)) != part.shape:
            info = source.info(name)
            raise FlashRTError(ErrorCode.LOAD_FAILED, f"{info.path.name}: tensor {info.raw_name!r} has shape "
                                                      f"{tuple(info.shape)}, the config implies {part.shape}")
        parts.append(part)
    return parts


def _lacks(folder, missing: list[str]) -> FlashRTError:
    text = [n for n in missing if not n.startswith(VISUAL)]
    if text:
        return FlashRTError(ErrorCode.LOAD_FAILED, f"{folder}: checkpoint lacks {len(text)} tensor(s), e.g. {text[:3]}")
    return FlashRTError(ErrorCode.LOAD_FAILED, f"{folder}: config.json has a vision_config, but the checkpoint lacks "
                                               f"{len(missing)} vision tower tensor(s), e.g. "
                                               f"{['model.' + n for n in missing[:3]]} (without the vision tower, "
                                               f"the text model loads alone)")


def _plan(model: Qwen35, source, fmt: str, targets: set[str]) -> list[tuple[str, tuple[int, ...], list[_Part], bool]]:
    """(weight, shape, parts, quantized?) for every weight of the (fused, meta) model; every tensor of the source is
    located and checked, and every tensor of the checkpoint used, before anything is allocated."""
    fused, plan, missing = model.fused_parts(), [], []
    for name, param in model.named_parameters():
        if name == f"{quant.LM_HEAD}.weight" and quant.LM_HEAD in targets:
            continue                                   # built as the quantized head below
        shape, quantize = tuple(param.shape), name.rpartition(".")[0] in targets
        parts = _parts(source, shape, fused.get(name, [(name, shape[0])]), missing, fmt if quantize else "dense")
        plan.append((name, shape, parts, quantize))
    if quant.LM_HEAD in targets:
        shape = tuple(model.output_weight().shape)
        head = "model.embed_tokens.weight" if model.cfg.tie_word_embeddings else f"{quant.LM_HEAD}.weight"
        plan.append((quant.LM_HEAD, shape, _parts(source, shape, [(head, shape[0])], missing, fmt), True))
    if missing:
        raise _lacks(source.folder, missing)
    used = {n for _, _, parts, _ in plan for p in parts
            for n in (source.used_names(p.module) if p.stored else [p.name])}
    unexpected = sorted(set(source.tensors) - used)
    if unexpected:
        info = source.info(unexpected[0])
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise FlashRTError(ErrorCode.LOAD_FAILED, f"{info.path.name}: unexpected tensor {info.raw_name!r}{more}")
    return plan


def _build(cfg: ModelConfig, source, device: torch.device, dtype: torch.dtype, fmt: str,
           exclude: tuple[str, ...], use_triton: bool, with_vision: bool) -> Qwen35:
    with torch.device("meta"):
        model = Qwen35(cfg, with_vision)
    model.fuse_projections()
    plan = _plan(model, source, fmt, set(quant.targets(model, fmt, exclude)))
    builder = _Builder(source, device, dtype)
    with torch.no_grad():
        for name, shape, parts, quantize in plan:
            try:
                _build_one(model, builder, name, shape, parts, quantize, fmt, use_triton)
            except torch.OutOfMemoryError:
                raise FlashRTError(ErrorCode.LOAD_FAILED, f"out of memory on {device} building {name!r} in {fmt} "
                                                          f"(`flashrt-runtime plan` shows what the model needs)"
                                   ) from None
    return model


def _build_one(model: Qwen35, builder: _Builder, name: str, shape: tuple[int, ...], parts: list[_Part],
               quantize: bool, fmt: str, use_triton: bool) -> None:
    if not quantize:
        module, _, leaf = name.rpartition(".")
        model.get_submodule(module)._parameters[leaf] = nn.Parameter(builder.dense(shape, parts), requires_grad=False)
        return
    layer = quant.QuantLinear(builder.quantized(fmt, *shape, parts), use_triton)
    if name == quant.LM_HEAD:
        model.quantized_head = layer           # read by Qwen35.logits(); an untied dense head is not built
        if hasattr(model, quant.LM_HEAD):
            del model.lm_head
    else:
        parent, _, attr = name.rpartition(".")[0].rpartition(".")
        setattr(model.get_submodule(parent), attr, layer)


def load(model: str, device: torch.device, dtype: torch.dtype, seed: int = 0, fmt: str = "dense",
         exclude: tuple[str, ...] = (), use_triton: bool = False, with_vision: bool = True) -> tuple[Qwen35, str]:
    """A preset (seeded random weights) or a local HF folder, built in ``fmt`` (``quant.targets`` names what is
    quantized; the vision tower is never quantized: it is built in ``dtype``, as Qwen's FP8 releases keep it);
    returns the model and the format's identity for the fingerprint. ``with_vision``: build the vision tower
    (``model.visual``) when the config has one (False: ``model.visual`` is None and its tensors are not read)."""
    if model in PRESETS:
        cfg, source = PRESETS[model], _Preset(model, seed, dtype, device, with_vision)
    else:
        folder = Path(model)
        if not folder.is_dir():
            raise FlashRTError(ErrorCode.LOAD_FAILED, f"model folder {folder} does not exist (and {model!r} is not a "
                                                      f"preset: {', '.join(PRESETS)})")
        raw = read_config(folder)
        cfg = from_hf_dict(raw)
        source = Checkpoint(folder, raw, mtp=bool(cfg.mtp_num_hidden_layers),
                            vision=with_vision and cfg.vision is not None)
        if source.scheme is not None and source.scheme.fmt != fmt:
            _log.warning("%s stores its projections in %s (%s) but weights_format is %s: they are dequantised%s",
                         folder, source.scheme.fmt, source.scheme.label, fmt,
                         "" if fmt == "dense" else f" and quantized again in {fmt}")
    try:
        return (_build(cfg, source, device, dtype, fmt, exclude, use_triton, with_vision),
                quant.identity(fmt, use_triton))
    except FlashRTError as err:
        error = err.with_traceback(None)      # drops the frames, and with them the weights built so far
        error.__context__ = error.__cause__ = None
    if device.type == "cuda":                 # hand the freed blocks back (on Thor, to the rest of the robot)
        torch.cuda.empty_cache()
    raise error


def weights_digest(model: Qwen35, with_tower: bool = True) -> str:
    """A digest of every parameter's name, shape, dtype and bytes (checksummed on the device); without
    ``with_tower``, of the text model's alone (what a capsule's continuation depends on: the tower only turns the
    next image into embeddings, so capsules move between engines with the tower loaded or not)."""
    h = hashlib.sha256()
    for name, param in model.named_parameters():
        if not with_tower and name.startswith(VISUAL):
            continue
        h.update(f"{name}:{tuple(param.shape)}:{param.dtype}:".encode())
        h.update(checksum(param.data.contiguous().view(-1).view(torch.uint8)).encode())
    return h.hexdigest()
