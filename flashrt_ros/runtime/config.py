"""Model configuration: the Qwen3.5 text architecture, read from an HF ``config.json`` or a named preset."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .errors import ErrorCode, FlashRTError
from .vision.config import VisionConfig, vision_from_hf_dict

SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    max_position_embeddings: int = 262_144
    eos_token_ids: tuple[int, ...] = ()
    vision: VisionConfig | None = None          # the vision tower, when the checkpoint or preset has one
    # M-RoPE: how many rotary frequencies follow the temporal, height and width position of a token, interleaved
    # (HF's Qwen3.5 text rotary). Text tokens have three equal components, so it matters only after an image.
    mrope_section: tuple[int, int, int] = (11, 11, 10)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def to_json(self) -> str:
        """Canonical JSON (a text-only config's is what it was before vision existed: fingerprints unchanged)."""
        fields = dataclasses.asdict(self)
        if fields["vision"] is None:      # without images M-RoPE is plain RoPE: the section changes nothing
            del fields["vision"], fields["mrope_section"]
        return json.dumps(fields, sort_keys=True)

    def validate(self) -> "ModelConfig":
        problems = []
        if any(t not in LAYER_TYPES for t in self.layer_types):
            problems.append(f"layer_types must be among {LAYER_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            problems.append("partial_rotary_factor * head_dim must be an even number in (0, head_dim]")
        if len(self.mrope_section) != 3 or any(s < 0 for s in self.mrope_section):
            problems.append(f"mrope_section must be three counts >= 0, got {list(self.mrope_section)}")
        if self.mtp_num_hidden_layers > 1:
            problems.append("at most one MTP layer is supported")
        if problems:
            raise FlashRTError(ErrorCode.LOAD_FAILED, "unsupported model config: " + "; ".join(problems))
        if self.vision is not None:
            self.vision.validate(self.hidden_size, self.vocab_size)
        return self


def from_hf_dict(raw: dict) -> ModelConfig:
    """Build a ModelConfig from an HF ``config.json`` dict (``qwen3_5_text`` or ``qwen3_5`` with ``text_config``)."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise FlashRTError(ErrorCode.LOAD_FAILED,
                           f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    text = raw["text_config"] if model_type == "qwen3_5" else raw
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    rope = dict(text.get("rope_parameters") or {})
    rope.setdefault("rope_theta", text.get("rope_theta", 10_000_000.0))
    rope.setdefault("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    if rope.get("rope_type", "default") != "default":
        raise FlashRTError(ErrorCode.LOAD_FAILED, f"unsupported rope_type {rope['rope_type']!r}")
    num_layers = text["num_hidden_layers"]
    layer_types = text.get("layer_types") or [
        "full_attention" if (i + 1) % text.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(num_layers)]
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    try:
        return ModelConfig(
            vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"], layer_types=tuple(layer_types[:num_layers]),
            num_attention_heads=text["num_attention_heads"], num_key_value_heads=text["num_key_value_heads"],
            head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
            linear_num_key_heads=text["linear_num_key_heads"],
            linear_num_value_heads=text["linear_num_value_heads"],
            linear_key_head_dim=text["linear_key_head_dim"], linear_value_head_dim=text["linear_value_head_dim"],
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4), rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope["rope_theta"]), partial_rotary_factor=float(rope["partial_rotary_factor"]),
            tie_word_embeddings=bool(tie), mtp_num_hidden_layers=text.get("mtp_num_hidden_layers", 0),
            max_position_embeddings=text.get("max_position_embeddings", 262_144), eos_token_ids=eos_ids,
            vision=vision_from_hf_dict(raw), mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
        ).validate()
    except KeyError as missing:
        raise FlashRTError(ErrorCode.LOAD_FAILED, f"config.json lacks required field {missing}") from None


def read_config(folder: Path) -> dict:
    """The folder's ``config.json`` as a dict."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FlashRTError(ErrorCode.LOAD_FAILED, f"no config.json in {folder}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise FlashRTError(ErrorCode.LOAD_FAILED, f"{path} is not valid JSON: {err}") from None


def _hybrid(n: int) -> tuple[str, ...]:
    """Qwen3.5's layout: three Gated DeltaNet layers, then one full-attention layer."""
    return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n))


def _qwen_vision(depth: int, hidden: int, intermediate: int, heads: int, out: int) -> VisionConfig:
    """A released Qwen3.5/3.6 vision tower's shape (16-pixel patches, 2x2 merge, Qwen's multimodal token ids)."""
    return VisionConfig(depth=depth, hidden_size=hidden, intermediate_size=intermediate, num_heads=heads,
                        out_hidden_size=out, image_token_id=248056, vision_start_token_id=248053,
                        vision_end_token_id=248054)


# CPU tests and the demo: byte-level vocabulary (0-255 bytes, 256 end-of-text, the rest free for the discretiser).
_TINY = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, layer_types=_hybrid(4), num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, rope_theta=10_000.0, tie_word_embeddings=True,
    mtp_num_hidden_layers=1, max_position_embeddings=65_536, eos_token_ids=(256,))

PRESETS: dict[str, ModelConfig] = {
    "tiny": _TINY,
    # tiny with a two-block vision tower; ids 512-514 place an image (tiny's own ids and weights are unchanged)
    "tiny-vl": dataclasses.replace(_TINY, vocab_size=516, vision=VisionConfig(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, image_token_id=514,
        vision_start_token_id=512, vision_end_token_id=513, num_position_embeddings=64)),
    "qwen3.5-0.8b": ModelConfig(
        vocab_size=248_320, hidden_size=1024, intermediate_size=3584, layer_types=_hybrid(24),
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        tie_word_embeddings=True, mtp_num_hidden_layers=1, vision=_qwen_vision(12, 768, 3072, 12, 1024)),
    "qwen3.5-2b": ModelConfig(  # its vision shape is assumed (the 4B's tower, out 2048): no public config read
        vocab_size=248_320, hidden_size=2048, intermediate_size=6144, layer_types=_hybrid(24),
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        tie_word_embeddings=True, mtp_num_hidden_layers=1, vision=_qwen_vision(24, 1024, 4096, 16, 2048)),
    "qwen3.6-27b": ModelConfig(
        vocab_size=248_320, hidden_size=5120, intermediate_size=17_408, layer_types=_hybrid(64),
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        tie_word_embeddings=False, mtp_num_hidden_layers=1, vision=_qwen_vision(27, 1152, 4304, 16, 5120)),
}
