"""Loading the vision tower: ``weights.load(..., with_vision=)`` builds ``model.visual`` from a preset's seeded
weights or a checkpoint folder's ``model.visual.*`` (as transformers saves a ``Qwen3_5ForConditionalGeneration``);
a folder whose config has a vision_config but lacks the tensors is refused naming them; quantized formats leave the
tower dense. The text model's preset weights are what they were before the tower existed."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import hf_checkpoints as hf
from flashrt_ros.runtime import ErrorCode, FlashRTError, quant, weights
from flashrt_ros.runtime.vision.encoder import VisionEncoder
from flashrt_ros.runtime.vision.preprocess import Image, preprocess
from flashrt_ros.tools import checkpoint_writer, memory_peak

CPU = torch.device("cpu")
# weights_digest of the presets' text models on main before the tower existed (d817b90), bf16 on the CPU: the seeded
# text weights must not move (capsule fingerprints and the digests recorded in BENCHMARKS.md depend on them).
TEXT_DIGESTS = {"tiny": "7df5d3e6fee2e7bf4d35415b358891e11a4f8123174a9d210827e079f986dbdb",
                "tiny-vl": "ccad44db39a1fc9ba67f6a92ab44ae1aadd0d4d165fb9156b96b1e42d07eb823"}
TOL = 1e-5


def text_parameters(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if not n.startswith("visual.")}


@pytest.mark.parametrize("preset", sorted(TEXT_DIGESTS))
def test_preset_text_weights_are_unchanged(preset):
    text_only, _ = weights.load(preset, CPU, torch.bfloat16, with_vision=False)
    assert text_only.visual is None
    assert weights.weights_digest(text_only) == TEXT_DIGESTS[preset]
    full, _ = weights.load(preset, CPU, torch.bfloat16)
    assert (full.visual is not None) == (preset == "tiny-vl")
    ours = text_parameters(full)
    assert ours.keys() == dict(text_only.named_parameters()).keys()
    assert all(torch.equal(p, ours[n]) for n, p in text_only.named_parameters())


def test_preset_tower_is_seeded_and_runs():
    model, _ = weights.load("tiny-vl", CPU, torch.float32, seed=0)
    again, _ = weights.load("tiny-vl", CPU, torch.float32, seed=0)
    other, _ = weights.load("tiny-vl", CPU, torch.float32, seed=1)
    assert weights.weights_digest(model) == weights.weights_digest(again) != weights.weights_digest(other)
    tower = model.visual
    assert isinstance(tower, VisionEncoder) and all(p.dtype == torch.float32 for p in tower.parameters())
    norms = torch.cat([tower.blocks[0].norm1.weight, tower.merger.norm.weight])
    assert (norms - 1).abs().max() <= 0.1 and tower.blocks[0].attn.qkv.bias.abs().max() <= 0.1   # LayerNorm ~ 1
    image = preprocess(Image(np.full((40, 72, 3), 200, np.uint8)), model.cfg.vision, 32 * 32, 64 * 64 * 4)
    features = tower(image.patches, image.grid)
    assert features.shape == (image.token_count, model.cfg.hidden_size) and torch.isfinite(features).all()


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """(HF's multimodal model, its folder as save_pretrained wrote it)."""
    text = hf.build_model(hf.text_config(tie_word_embeddings=False), seed=7)
    model = hf.multimodal_model(text, seed=8)
    return model, hf.save(model, tmp_path_factory.mktemp("multimodal"))


def images(vision) -> list:
    rng = np.random.default_rng(0)
    return [preprocess(Image(rng.integers(0, 256, shape, dtype=np.uint8)), vision, 16 * 16, 64 * 64)
            for shape in ((24, 40, 3), (50, 20, 3))]


@torch.no_grad()
def test_checkpoint_tower_equals_transformers(multimodal):
    hf_model, folder = multimodal
    model, _ = weights.load(str(folder), CPU, torch.float32)
    prepared = images(model.cfg.vision)
    assert prepared[0].grid != prepared[1].grid
    for image in prepared:
        expected = hf_model.model.visual(image.patches, grid_thw=torch.tensor([image.grid])).pooler_output
        got = model.visual(image.patches, image.grid)
        assert got.shape == expected.shape == (image.token_count, hf_model.config.text_config.hidden_size)
        torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)


def test_checkpoint_loads_in_its_final_size_plus_one_slice(multimodal, monkeypatch):
    """The tower's fp32 tensors become bf16 weights slice by slice, like the text model's (no fp32 copy)."""
    _, folder = multimodal
    monkeypatch.setattr(weights, "ELEMENTS_PER_SLICE", 1 << 10)
    model, peak, _, _ = memory_peak.measure(lambda: weights.load(str(folder), CPU, torch.bfloat16)[0], CPU)
    final = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model.visual is not None and peak - final <= 48 * (1 << 10), (peak, final)


def test_checkpoint_without_the_tower_asked_loads_the_text_model(multimodal):
    _, folder = multimodal
    model, _ = weights.load(str(folder), CPU, torch.float32, with_vision=False)
    full, _ = weights.load(str(folder), CPU, torch.float32)
    assert model.visual is None and model.cfg.vision is not None
    assert all(torch.equal(p, text_parameters(full)[n]) for n, p in model.named_parameters())


def rewritten(folder, out, keep) -> str:
    """``folder`` with only the tensors ``keep(name)`` accepts (config.json as it was)."""
    out.mkdir()
    tensors = load_file(folder / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if keep(n)}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text((folder / "config.json").read_text())
    return str(out)


@pytest.mark.parametrize("dropped, count", [("model.visual.", 33), ("model.visual.merger.", 6)])
def test_a_vision_config_without_its_tensors_is_refused_naming_them(multimodal, tmp_path, dropped, count):
    _, folder = multimodal
    lacking = rewritten(folder, tmp_path / "lacking", lambda n: not n.startswith(dropped))
    with pytest.raises(FlashRTError) as refused:
        weights.load(lacking, CPU, torch.float32)
    assert refused.value.code == ErrorCode.LOAD_FAILED
    assert f"lacks {count} vision tower tensor(s)" in refused.value.message and dropped in refused.value.message
    assert weights.load(lacking, CPU, torch.float32, with_vision=False)[0].visual is None


def qwen_fp8(folder, out) -> str:
    """``folder`` in the layout of Qwen's official -FP8 releases: the text projections as e4m3 codes with
    128 x 128 block scales, the vision tower (and embeddings, norms, conv) in bf16, listed in modules_to_not_convert."""
    out.mkdir()
    tensors = load_file(folder / "model.safetensors")
    stored = {}
    for name, tensor in tensors.items():
        projection = name.startswith("model.language_model.layers.") and name.endswith("proj.weight")
        if projection:
            stored.update({f"{name[:-len('weight')]}{k}": v for k, v in checkpoint_writer.fp8_blocks(tensor).items()})
        else:
            stored[name] = tensor.to(torch.bfloat16)
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128],
                                     "modules_to_not_convert": ["lm_head", "embed_tokens", "model.visual.blocks"]}
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_formats_keep_the_tower_dense(multimodal, tmp_path, fmt):
    """Qwen's FP8 layout loaded as fp8 (codes kept), and the dense folder quantized to nvfp4 at load: the text
    projections quantized, the tower's weights exactly the stored ones in the engine's dtype."""
    hf_model, folder = multimodal
    source = qwen_fp8(folder, tmp_path / "fp8") if fmt == "fp8" else str(folder)
    model, _ = weights.load(source, CPU, torch.bfloat16, fmt=fmt)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, quant.QuantLinear)
    tower = dict(model.visual.named_parameters())
    expected = hf_model.model.visual.state_dict()
    assert tower.keys() == expected.keys()
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, expected[n].to(torch.bfloat16)) for n, p in tower.items())
    assert all(type(m) is nn.Linear for m in model.visual.modules() if isinstance(m, nn.Linear))
