"""The vision tower's configuration: the ``vision_config`` of a multimodal ``qwen3_5`` ``config.json`` and the
token ids that place an image in the text stream."""
from __future__ import annotations

import dataclasses

from ..errors import ErrorCode, FlashRTError

VISUAL = "visual."      # the tower's parameter names in the model (``Qwen35.visual``); a checkpoint adds ``model.``


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int                  # the text model's hidden size: merged patches become token embeddings
    image_token_id: int                   # one per merged patch, between the start and end tokens
    vision_start_token_id: int
    vision_end_token_id: int
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    num_position_embeddings: int = 2304   # a square grid of learned position embeddings, interpolated per image
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0          # the 2-D rotary's base (vision_config.rope_parameters)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def validate(self, text_hidden_size: int, vocab_size: int) -> "VisionConfig":
        problems = []
        if self.hidden_size % self.num_heads:
            problems.append("vision hidden_size must be a multiple of num_heads")
        if self.out_hidden_size != text_hidden_size:
            problems.append(f"vision out_hidden_size {self.out_hidden_size} != text hidden_size {text_hidden_size}")
        ids = (self.image_token_id, self.vision_start_token_id, self.vision_end_token_id)
        if any(not 0 <= i < vocab_size for i in ids) or len(set(ids)) != 3:
            problems.append(f"image/vision-start/vision-end token ids {ids} must be distinct and below {vocab_size}")
        if int(self.num_position_embeddings ** 0.5) ** 2 != self.num_position_embeddings:
            problems.append("num_position_embeddings must be a square")
        if problems:
            raise FlashRTError(ErrorCode.LOAD_FAILED, "unsupported vision config: " + "; ".join(problems))
        return self


def vision_from_hf_dict(raw: dict) -> VisionConfig | None:
    """The ``vision_config`` of a multimodal ``config.json`` (None for a text-only one)."""
    vision = raw.get("vision_config")
    if raw.get("model_type") != "qwen3_5" or not vision:
        return None
    try:
        return VisionConfig(
            depth=vision["depth"], hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
            num_heads=vision["num_heads"], out_hidden_size=vision["out_hidden_size"],
            image_token_id=raw.get("image_token_id", 248056),
            vision_start_token_id=raw.get("vision_start_token_id", 248053),
            vision_end_token_id=raw.get("vision_end_token_id", 248054),
            in_channels=vision.get("in_channels", 3), patch_size=vision.get("patch_size", 16),
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            num_position_embeddings=vision.get("num_position_embeddings", 2304),
            hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
            rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10_000.0)))
    except KeyError as missing:
        raise FlashRTError(ErrorCode.LOAD_FAILED, f"config.json's vision_config lacks required field {missing}") from None
