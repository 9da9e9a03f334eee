"""A tiny multimodal Qwen3.5 (``Qwen3_5ForConditionalGeneration``) built inside the tests with `transformers`, our
engine on its saved text weights with HF's own vision tower as ``model.visual``, and HF's multimodal references.

The text rotary part is the whole head (16 features, 8 frequencies), so M-RoPE's temporal, height and width
frequencies all occur; patches are 4 pixels so the random images stay small.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

from flashrt_ros.runtime import Engine, EngineConfig
from flashrt_ros.runtime.vision.prepared import PreparedImage
from hf_random import random_model

VOCAB, START, END, PAD, VIDEO = 128, 120, 121, 122, 123
PATCH, TEMPORAL, MERGE = 4, 2, 2
PATCH_WIDTH = 3 * TEMPORAL * PATCH * PATCH


# test/runtime/hf_checkpoints.py's BASE text shape, with the whole head rotary
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, initializer_range=0.1, tie_word_embeddings=True,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 1.0,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def build(seed: int = 0) -> Qwen3_5ForConditionalGeneration:
    """The multimodal model, seeded random (:func:`hf_random.random_model`)."""
    config = Qwen3_5Config(
        text_config=TEXT, tie_word_embeddings=True,
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                           patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE,
                           num_position_embeddings=64, initializer_range=0.1),
        image_token_id=PAD, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return random_model(Qwen3_5ForConditionalGeneration, config, seed)


class HFVisual(nn.Module):
    """HF's tower behind the contract of ``model.visual``: (patches, grid) -> merged embeddings [tokens, hidden]."""

    def __init__(self, tower: nn.Module):
        super().__init__()
        self.tower = tower

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        return self.tower(patches, grid_thw=torch.tensor([grid])).pooler_output


def engine(model: Qwen3_5ForConditionalGeneration, folder: Path, **overrides) -> Engine:
    """Our engine on ``model``'s saved checkpoint, with HF's tower attached."""
    model.save_pretrained(folder)
    config = {"model": str(folder), "max_context": 256, "prefill_chunk": 16, "image_min_pixels": 1, **overrides}
    eng = Engine(EngineConfig(**config))
    eng.model.visual = HFVisual(model.model.visual)
    return eng


def preset_tower(vision, seed: int = 0) -> HFVisual:
    """HF's tower (``Qwen3_5VisionModel``, seeded random) in the shape of one of our ``VisionConfig`` (a preset's)."""
    config = Qwen3_5VisionConfig(depth=vision.depth, hidden_size=vision.hidden_size,
                                 intermediate_size=vision.intermediate_size, num_heads=vision.num_heads,
                                 out_hidden_size=vision.out_hidden_size, patch_size=vision.patch_size,
                                 temporal_patch_size=vision.temporal_patch_size,
                                 spatial_merge_size=vision.spatial_merge_size,
                                 num_position_embeddings=vision.num_position_embeddings, initializer_range=0.1)
    torch.manual_seed(seed)
    return HFVisual(Qwen3_5VisionModel(config).float().eval())


def image(h: int, w: int, seed: int = 0, vision=None) -> PreparedImage:
    """A random prepared image of h x w patches (one frame) for :func:`build`'s tower, or one of shape ``vision``."""
    width, merge = (PATCH_WIDTH, MERGE) if vision is None else (
        vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2, vision.spatial_merge_size)
    patches = torch.randn(h * w, width, generator=torch.Generator().manual_seed(seed))
    return PreparedImage(patches, (1, h, w), merge)


def hf_inputs(items: list) -> dict:
    """HF's ``generate`` inputs for ids and images: the ids with each image as start, pads, end; its patches."""
    ids, images = [], []
    for item in items:
        if isinstance(item, PreparedImage):
            ids += [START] + [PAD] * item.token_count + [END]
            images.append(item)
        else:
            ids.append(item)
    input_ids = torch.tensor([ids])
    out = {"input_ids": input_ids, "mm_token_type_ids": (input_ids == PAD).int(),
           "attention_mask": torch.ones_like(input_ids)}
    if images:
        out["pixel_values"] = torch.cat([i.patches for i in images])
        out["image_grid_thw"] = torch.tensor([i.grid for i in images])
    return out


@torch.no_grad()
def hf_greedy(model: Qwen3_5ForConditionalGeneration, items: list, n: int) -> list[int]:
    inputs = hf_inputs(items)
    out = model.generate(**inputs, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@torch.no_grad()
def hf_last_logits(model: Qwen3_5ForConditionalGeneration, items: list) -> torch.Tensor:
    return model(**hf_inputs(items), use_cache=False).logits[0, -1].float()
