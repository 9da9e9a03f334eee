"""Reading a local HF checkpoint folder tensor by tensor: ``model.safetensors`` or shards named by
``model.safetensors.index.json``, memory-mapped and read in row slices (straight from the safetensors layout: a
header, then each tensor's bytes), so host memory holds one slice at a time. Every shard's header is checked (and
every tensor located) before anything is read, so a truncated shard or an index naming a missing file fails before
a byte of the model is allocated.

Pre-quantized projections are read as :class:`~.quant.QuantizedWeight` in the engine's layout, exactly (the stored
codes as they are, scales repeated over the rows and inputs they cover). Schemes, from ``config.json``'s
``quantization_config`` or ModelOpt's ``hf_quant_config.json``:

* ``fp8`` (Qwen's official ``-FP8`` releases): ``<m>.weight`` float8_e4m3fn and ``<m>.weight_scale_inv`` per block
  of ``weight_block_size`` (edge blocks partial); ``w = weight * weight_scale_inv``.
* compressed-tensors ``float-quantized``: ``<m>.weight`` float8_e4m3fn and ``<m>.weight_scale`` per tensor, channel
  or block (``block_structure``); ``w = weight * weight_scale``.
* compressed-tensors ``nvfp4-pack-quantized``: ``<m>.weight_packed``, ``<m>.weight_scale`` (E4M3 per 16 inputs),
  ``<m>.weight_global_scale``; ``w = e2m1 * weight_scale / weight_global_scale``.
* ModelOpt ``NVFP4``: ``<m>.weight`` (packed uint8), ``<m>.weight_scale`` (E4M3 per 16), ``<m>.weight_scale_2``;
  ``w = e2m1 * weight_scale * weight_scale_2``.

Activation quantization (``input_scale``, ``input_global_scale``, dynamic activation schemes) and KV-cache
quantization are not run: the engine is weight-only, activations and the KV cache stay in the engine's dtype (more
precise than what the checkpoint was calibrated for). They are ignored by name, with a warning. What changes how the
weights themselves read (integer types, zero points, activation ordering, other group sizes) is refused.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import mmap
from pathlib import Path

import torch

from . import quant
from .errors import ErrorCode, FlashRTError
from .kernels import quant_gemv as kq
from .vision.config import VISUAL

_log = logging.getLogger(__name__)

# Checkpoints of the multimodal `qwen3_5` model keep the text weights under `model.language_model.` and the vision
# tower under `model.visual.` (older layouts: top-level `visual.`); ours are `model.` and `visual.`.
_PREFIX_ALIASES = (("model.language_model.", "model."), ("model." + VISUAL, VISUAL))
_ACTIVATION_TENSORS = ("input_scale", "input_global_scale", "input_zero_point", "k_scale", "v_scale")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROWS_PER_READ = 4096                       # rows per slice read (and quantized) at a time


def failed(message: str) -> FlashRTError:
    return FlashRTError(ErrorCode.LOAD_FAILED, message)


def canonical_name(name: str) -> str:
    """Our name of a checkpoint tensor."""
    for old, new in _PREFIX_ALIASES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


# ---- quantization schemes ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Scheme:
    """How one checkpoint stores quantized projections: the format, the tensor suffixes and the block shape."""
    label: str                             # for messages, e.g. "compressed-tensors float-quantized"
    fmt: str                               # fp8 | nvfp4
    codes: str                             # suffix of the codes tensor
    scale: str                             # suffix of the per-block / per-group scale
    second_scale: str | None = None        # nvfp4: suffix of the tensor-wide scale
    second_is_divisor: bool = False        # compressed-tensors divides by its global scale, ModelOpt multiplies
    block: tuple[int, int] | None = None   # fp8 block scales: (rows, inputs) per scale; None: shape says it

    def suffixes(self) -> tuple[str, ...]:
        return tuple(s for s in (self.codes, self.scale, self.second_scale) if s)


def _ignored(where: str, what: str) -> None:
    _log.warning("%s: %s is ignored: the engine runs weight-only, activations and the KV cache stay in its dtype",
                 where, what)


def _compressed_tensors_scheme(q: dict, where: str) -> Scheme:
    fmt = q.get("format")
    groups = list((q.get("config_groups") or {}).values())
    weights = [g.get("weights") for g in groups if g.get("weights")]
    if not weights or any(w != weights[0] for w in weights):
        raise failed(f"{where}: compressed-tensors config_groups must share one weights scheme, got {weights}")
    w = weights[0]
    refuse = [f"{k}={w.get(k)!r}" for k, ok in (("symmetric", True), ("dynamic", False), ("actorder", None))
              if k in w and w[k] != ok]
    if refuse:
        raise failed(f"{where}: compressed-tensors weights with {', '.join(refuse)} are not supported")
    if any(g.get("input_activations") for g in groups):
        _ignored(where, "input_activations (activation quantization)")
    if q.get("kv_cache_scheme"):
        _ignored(where, "kv_cache_scheme")
    if fmt == "float-quantized" and w.get("type") == "float" and w.get("num_bits") == 8:
        block = tuple(w["block_structure"]) if w.get("strategy") == "block" else None
        return Scheme(f"compressed-tensors {fmt}", "fp8", "weight", "weight_scale", block=block)
    if fmt == "nvfp4-pack-quantized" and w.get("num_bits") == 4 and w.get("group_size") == kq.NVFP4_GROUP:
        return Scheme(f"compressed-tensors {fmt}", "nvfp4", "weight_packed", "weight_scale", "weight_global_scale",
                      second_is_divisor=True)
    raise failed(f"{where}: compressed-tensors format {fmt!r} with weights {w} is not supported (supported: "
                 f"float-quantized 8-bit float, nvfp4-pack-quantized with group_size {kq.NVFP4_GROUP})")


def _fp8_scheme(q: dict, where: str) -> Scheme:
    if q.get("fmt", "e4m3") != "e4m3":
        raise failed(f"{where}: fp8 fmt {q.get('fmt')!r} is not supported (only e4m3)")
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise failed(f"{where}: fp8 without a two-dimensional weight_block_size is not supported, got {block}")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        _ignored(where, f"activation_scheme {q['activation_scheme']!r}")
    return Scheme("fp8 (block-wise, weight_scale_inv)", "fp8", "weight", "weight_scale_inv", block=tuple(block))


def _modelopt_scheme(q: dict, where: str) -> Scheme:
    algo = q.get("quant_algo")
    if algo != "NVFP4" or q.get("group_size", kq.NVFP4_GROUP) != kq.NVFP4_GROUP:
        raise failed(f"{where}: ModelOpt quant_algo {algo!r} with group_size {q.get('group_size')} is not supported "
                     f"(supported: NVFP4, group_size {kq.NVFP4_GROUP})")
    if q.get("kv_cache_quant_algo"):
        _ignored(where, f"kv_cache_quant_algo {q['kv_cache_quant_algo']!r}")
    return Scheme("ModelOpt NVFP4", "nvfp4", "weight", "weight_scale", "weight_scale_2")


def read_scheme(folder: Path, config: dict) -> Scheme | None:
    """The folder's quantization scheme (None: dense); unsupported ones are refused naming what is unsupported."""
    modelopt = folder / "hf_quant_config.json"
    if modelopt.is_file():
        return _modelopt_scheme(json.loads(modelopt.read_text()).get("quantization", {}), str(modelopt))
    q = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    if not q:
        return None
    where, method = f"{folder / 'config.json'} quantization_config", q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(q, where)
    if method == "fp8":
        return _fp8_scheme(q, where)
    if method == "modelopt":
        return _modelopt_scheme(q, where)
    raise failed(f"{where}: quant_method {method!r} is not supported (supported: fp8, compressed-tensors, modelopt)")


# ---- the folder ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorInfo:
    path: Path
    raw_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int                            # of its first byte in the file


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8,
                       "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                       "BOOL": torch.bool}


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header and where its data starts, with every tensor's byte range checked against the
    file's size (a truncated or corrupt shard fails here, naming the file and the first tensor it cuts)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or 8 + length > size:
            raise failed(f"{path}: not a safetensors file (truncated header)")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise failed(f"{path}: not a safetensors file (header: {err})") from None
    header.pop("__metadata__", None)
    for raw, entry in header.items():
        begin, end = entry["data_offsets"]
        if 8 + length + end > size:
            raise failed(f"{path.name}: truncated: tensor {raw!r} ends at byte {8 + length + end}, the file has {size}")
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise failed(f"{path.name}: tensor {raw!r} has unsupported dtype {entry['dtype']}")
        expected = math.prod(entry["shape"]) * _SAFETENSORS_DTYPES[entry["dtype"]].itemsize
        if end - begin != expected:
            raise failed(f"{path.name}: tensor {raw!r} holds {end - begin} bytes, its shape and dtype need {expected}")
    return header, 8 + length


def shard_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The checkpoint's files, and the index's tensor -> file map when it is sharded."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise failed(f"{index}: not a safetensors index ({err!r})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise failed(f"{folder}: shard(s) listed in the index are missing: {missing}")
        return [folder / s for s in shards], weight_map
    single = folder / "model.safetensors"
    if single.is_file():
        return [single], None
    raise failed(f"{folder}: no model.safetensors or model.safetensors.index.json")


class Checkpoint:
    """A checkpoint folder's tensors, by our names; headers only until rows are read."""

    def __init__(self, folder: Path, config: dict, mtp: bool, vision: bool):
        """``mtp``, ``vision``: whether the model reads the MTP head's and the vision tower's tensors (when it does
        not, they are left unread)."""
        self.folder = folder
        self.scheme = read_scheme(folder, config)
        self.tensors: dict[str, TensorInfo] = {}
        files, weight_map = shard_files(folder)
        activation_scales = []
        for path in files:
            header, data_start = _header(path)
            claimed = {raw for raw, file in (weight_map or {}).items() if file == path.name}
            absent = sorted(claimed - set(header))
            if absent:
                raise failed(f"{folder / 'model.safetensors.index.json'}: names tensor {absent[0]!r} in {path.name}, "
                             f"which does not hold it")
            for raw, entry in header.items():
                name = canonical_name(raw)
                if (name.startswith("mtp.") and not mtp) or (name.startswith(VISUAL) and not vision):
                    continue
                if name.rsplit(".", 1)[-1] in _ACTIVATION_TENSORS:
                    activation_scales.append(raw)      # weight-only: see the module docstring
                    continue
                self.tensors[name] = TensorInfo(path, raw, tuple(entry["shape"]), _SAFETENSORS_DTYPES[entry["dtype"]],
                                                data_start + entry["data_offsets"][0])
        if activation_scales:
            _ignored(str(folder), f"{len(activation_scales)} activation / KV scale tensor(s), e.g. "
                                  f"{activation_scales[0]!r},")
        self.quantized = self._quantized_modules()

    def _quantized_modules(self) -> set[str]:
        """Modules stored quantized: those with the scheme's scale tensor."""
        if self.scheme is None:
            stray = [n for n, t in self.tensors.items() if t.dtype not in _FLOAT_DTYPES]
            if stray:
                info = self.tensors[stray[0]]
                raise failed(f"{info.path.name}: tensor {info.raw_name!r} is {info.dtype}, but config.json declares "
                             f"no quantization_config")
            return set()
        suffix = f".{self.scheme.scale}"
        return {n[:-len(suffix)] for n in self.tensors if n.endswith(suffix)}

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise failed(f"{self.folder}: checkpoint lacks tensor {name!r}")
        return self.tensors[name]

    def dense_shape(self, name: str) -> tuple[int, ...]:
        info = self.info(name)
        if info.dtype not in _FLOAT_DTYPES:
            raise failed(f"{info.path.name}: tensor {info.raw_name!r} is {info.dtype} without the scales of the "
                         f"checkpoint's quantization ({self.scheme.label if self.scheme else 'none declared'})")
        return info.shape

    def used_names(self, module: str) -> list[str]:
        """The checkpoint tensors a module stored quantized is read from."""
        return [f"{module}.{s}" for s in self.scheme.suffixes()]

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of a tensor as stored, copied out of the memory-mapped file (mapped only meanwhile)."""
        info = self.info(name)
        stop = info.shape[0] if stop is None and info.shape else (stop or 0)
        row = math.prod(info.shape[1:]) if info.shape else 1
        count = (stop - start) * row if info.shape else 1
        try:
            with open(info.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
                view = torch.frombuffer(mapped, dtype=info.dtype, count=count,
                                        offset=info.offset + start * row * info.dtype.itemsize)
                out = view.clone().view(stop - start, *info.shape[1:]) if info.shape else view.clone().view(())
                del view
        except (OSError, ValueError) as err:        # the file changed or vanished since its header was checked
            raise failed(f"{info.path.name}: reading tensor {info.raw_name!r} failed: {err}") from None
        return out

    # ---- quantized modules ---------------------------------------------------------------------------------------
    def stored_weight(self, module: str, n: int, k: int, check_only: bool = False,
                      keep_fp8: bool = False) -> quant.QuantizedWeight | None:
        """Module ``module``'s [N, K] weight as stored, in the engine's layout, exactly. Shapes and dtypes are checked
        from the headers first; ``check_only``: only that. ``keep_fp8``: the fp8 kernels will run it, so its scales
        must cover whole runs of :data:`~.kernels.quant_gemv.RUN` inputs (dequantising takes any block)."""
        s = self.scheme
        infos = {suffix: self.info(f"{module}.{suffix}") for suffix in s.suffixes()}

        def bad(why: str) -> FlashRTError:
            files = sorted({i.path.name for i in infos.values()})
            return failed(f"{', '.join(files)}: quantized tensor {module!r} ({s.label}): {why}")

        def expect(suffix: str, shapes: tuple, dtypes: tuple) -> None:
            i = infos[suffix]
            if i.shape not in shapes or i.dtype not in dtypes:
                raise bad(f"{suffix} is {i.dtype} {i.shape}, expected {' or '.join(map(str, shapes))} "
                          f"of {' or '.join(map(str, dtypes))}")
        if s.fmt == "nvfp4":
            if k % kq.NVFP4_GROUP:
                raise bad(f"nvfp4 needs K divisible by {kq.NVFP4_GROUP}, got {k}")
            expect(s.codes, ((n, k // 2),), (torch.uint8,))
            expect(s.scale, ((n, k // kq.NVFP4_GROUP),), (torch.float8_e4m3fn,))
            expect(s.second_scale, ((), (1,)), (torch.float32,))
            if check_only:
                return None
            second = self.read(f"{module}.{s.second_scale}").float().reshape(1)
            row_scale = (1.0 / second if s.second_is_divisor else second).expand(n).contiguous()
            return quant.QuantizedWeight("nvfp4", self.read(f"{module}.{s.codes}"),
                                         self.read(f"{module}.{s.scale}"), row_scale)
        expect(s.codes, ((n, k),), (torch.float8_e4m3fn,))
        scale_dtypes = (torch.float32, torch.bfloat16, torch.float16)
        if s.block is None:       # per tensor or per output channel
            expect(s.scale, ((), (1,), (n,), (n, 1)), scale_dtypes)
            if check_only:
                return None
            scale = self.read(f"{module}.{s.scale}").float().reshape(-1, 1).expand(n, 1).contiguous()
            return quant.QuantizedWeight("fp8", self.read(f"{module}.{s.codes}"), scale)
        rows, cols = s.block
        expect(s.scale, ((-(-n // rows), -(-k // cols)),), scale_dtypes)
        group = quant.fp8_block_group(cols, k)
        if group % kq.RUN and keep_fp8:
            raise bad(f"K = {k} is not a multiple of the {cols}-wide blocks and the partial last block is not a "
                      f"multiple of {kq.RUN} inputs wide; the fp8 kernels cannot hold it exactly (load with "
                      f"weights_format dense or nvfp4 instead)")
        if check_only:
            return None
        return quant.fp8_from_blocks(self.read(f"{module}.{s.codes}"), self.read(f"{module}.{s.scale}"), rows, cols)
