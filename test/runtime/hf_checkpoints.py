"""Tiny Qwen3.5 checkpoints built inside the tests with `transformers` (no downloads), and HF reference outputs.

The models are random but not degenerate: ``initializer_range`` 0.1 and every 1-D weight (RMSNorm scales, ``A_log``,
``dt_bias``) perturbed, so a wrong norm convention or decay formula shows up in the logits.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5TextConfig

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


def save_multimodal(model: Qwen3_5ForCausalLM, folder: Path) -> Path:
    """The same weights as the multimodal ``qwen3_5`` checkpoint stores them: the config nests the text config and
    the text weights live under ``model.language_model.``, next to vision weights (one stand-in tensor here)."""
    folder = Path(folder)
    plain = save(model, folder / "plain")
    tensors = load_file(plain / "model.safetensors")
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    out = folder / "multimodal"
    out.mkdir()
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    text = model.config.to_dict()
    wrapper = Qwen3_5Config(text_config=text, tie_word_embeddings=model.config.tie_word_embeddings).to_dict()
    assert wrapper["model_type"] == "qwen3_5"
    (out / "config.json").write_text(json.dumps(wrapper))
    return out


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
