"""Tiny Qwen3.5 checkpoints built inside the tests with `transformers` (no downloads), and HF reference outputs.

The models are random but not degenerate: ``initializer_range`` 0.1 and every 1-D weight (RMSNorm scales, ``A_log``,
``dt_bias``) perturbed, so a wrong norm convention or decay formula shows up in the logits.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

from hf_random import random_model

# Shared by every tiny config unless overridden: GQA (4 query heads on 2 KV heads), grouped value heads (4 value
# heads on 2 key heads), the default hybrid layout (3 Gated DeltaNet layers, then full attention), tied embeddings.
BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, initializer_range=0.1, tie_word_embeddings=True,
            max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                           "partial_rotary_factor": 0.25})


def text_config(**overrides) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(**{**BASE, **overrides})


def rope(theta: float, partial_rotary_factor: float) -> dict:
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial_rotary_factor}


def build_model(config: Qwen3_5TextConfig, seed: int = 0) -> Qwen3_5ForCausalLM:
    """A seeded random HF model in fp32, eval mode, with every 1-D weight moved off its neutral value."""
    return random_model(Qwen3_5ForCausalLM, config, seed)


def save(model: Qwen3_5ForCausalLM, folder: Path, **save_kwargs) -> Path:
    model.save_pretrained(folder, **save_kwargs)
    return Path(folder)


# A small vision tower that is not the released shape: 2 heads of 12, 4-pixel patches, a 4 x 4 learned position grid,
# a rotary base that is not the default (so the loader must read it); weights ten times HF's initial scale, so that
# attention is far from uniform and the rotary embedding shows in the features.
VISION = dict(depth=2, hidden_size=24, intermediate_size=40, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, num_position_embeddings=16, initializer_range=0.2,
              rope_parameters={"rope_type": "axial", "rope_theta": 5000.0})


def multimodal_model(model: Qwen3_5ForCausalLM, seed: int = 0) -> Qwen3_5ForConditionalGeneration:
    """``model``'s text weights in HF's multimodal ``qwen3_5`` model, with a seeded :data:`VISION` tower (its 1-D
    weights moved off their neutral values) and the image token ids at the top of the vocabulary."""
    text = model.config
    top = text.vocab_size - 1
    config = Qwen3_5Config(text_config=text.to_dict(), vision_config={**VISION, "out_hidden_size": text.hidden_size},
                           image_token_id=top - 2, video_token_id=top - 3, vision_start_token_id=top - 1,
                           vision_end_token_id=top, tie_word_embeddings=text.tie_word_embeddings)
    torch.manual_seed(seed)
    multimodal = Qwen3_5ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        multimodal.model.language_model.load_state_dict(model.model.state_dict())
        multimodal.lm_head.load_state_dict(model.lm_head.state_dict())
        for param in multimodal.model.visual.parameters():
            if param.dim() == 1:
                param.add_(0.3 * torch.randn_like(param))
    return multimodal


def save_multimodal(model: Qwen3_5ForCausalLM, folder: Path) -> Path:
    """The same text weights as the multimodal ``qwen3_5`` checkpoint stores them (saved by transformers): the config
    nests the text and vision configs, the text weights live under ``model.language_model.``, the tower's under
    ``model.visual.``."""
    return save(multimodal_model(model), Path(folder))


@torch.no_grad()
def logits(model: Qwen3_5ForCausalLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] fp32 logits of one full-sequence forward pass (no cache)."""
    return model(torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def greedy(model: Qwen3_5ForCausalLM, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens, each the argmax of a full-sequence forward pass (HF's cached ``generate`` cannot run
    a model without attention layers)."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(logits(model, ids)[-1].argmax()))
    return ids[-n:]
