"""Pre-quantized checkpoints load into the engine's quantized layouts without a dequantise / requantise round trip:
the stored codes are kept byte for byte, the weights equal what the format's own library (compressed-tensors)
dequantises, and the logits match HF running those weights. Formats: compressed-tensors FP8 block and NVFP4 (written
by the library), Qwen's official FP8 (``weight_scale_inv``) and ModelOpt NVFP4 (renamed from the library's files,
same numbers), and the synthetic folders of checkpoint_writer. Shapes that are not multiples of 128 throughout; a
model trained here checks the predictions."""
import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM

import bench_scripts
import ct_checkpoints as ct
import hf_checkpoints as hf
from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError, quant, weights
from flashrt_ros.tools import checkpoint_writer

PROMPT = list(range(3, 40))
FORMAT_OF = {"fp8-block": "fp8", "nvfp4": "nvfp4", "nvfp4-a16": "nvfp4"}


def load(folder, fmt, **overrides) -> Engine:
    """The engine on ``folder`` in ``fmt``; the LM head, which the checkpoints keep dense, stays dense."""
    return Engine(EngineConfig(model=str(folder), max_context=128, weights_format=fmt, weights_exclude=("lm_head",),
                               **overrides))


def loaded_weights(engine: Engine) -> dict[str, quant.QuantizedWeight]:
    """Every quantized weight of the engine under its HF name (fused projections split back into their rows)."""
    parts, out = engine.model.fused_parts(), {}
    for name, module in engine.model.named_modules():
        if isinstance(module, quant.QuantLinear):
            key = "lm_head.weight" if name == "quantized_head" else f"{name}.weight"
            offset = 0
            for part, rows in parts.get(key, [(key, module.out_features)]):
                out[part] = module.weight().rows(offset, offset + rows)
                offset += rows
    return out


def codes(tensors: dict, module: str, suffix: str) -> torch.Tensor:
    return tensors[f"{module}.{suffix}"]


@pytest.fixture(scope="module")
def hf_model():
    """fp32 tiny HF model of shapes that are not multiples of 128 (hidden 80, intermediate 144 = 128 + 16)."""
    return hf.build_model(hf.text_config(tie_word_embeddings=False, **ct.ODD_SHAPES), seed=5)


@pytest.fixture(scope="module", params=sorted(ct.SCHEMES))
def ct_checkpoint(request, hf_model, tmp_path_factory):
    """(scheme, the library's compressed model, its saved folder)."""
    model = ct.quantized_model(hf_model, request.param)
    return request.param, model, ct.save(model, tmp_path_factory.mktemp(request.param))


def assert_equals_library(engine: Engine, reference: dict[str, torch.Tensor]) -> None:
    """Our weights (fp32, exact) equal the library's dequantised ones: exactly in fp32, or rounded to the library's
    dtype where it dequantises in bf16 (NVFP4: it divides by the global scale in that dtype)."""
    ours = loaded_weights(engine)
    assert ours, "nothing was loaded quantized"
    for name, weight in ours.items():
        expected = reference[name]
        assert torch.equal(weight.dequantize().to(expected.dtype), expected), name


def test_library_checkpoint_loads_to_its_dequantised_weights_with_codes_kept(ct_checkpoint, hf_model):
    scheme, model, folder = ct_checkpoint
    fmt = FORMAT_OF[scheme]
    engine = load(folder, fmt)
    reference = ct.dequantised(model)
    assert_equals_library(engine, reference)
    stored = load_file(folder / "model.safetensors")
    suffix = "weight_packed" if fmt == "nvfp4" else "weight"
    for name, weight in loaded_weights(engine).items():
        assert torch.equal(weight.q, codes(stored, name[:-len(".weight")], suffix)), name
    # the logits of HF running the library's dequantised weights
    oracle = hf.build_model(hf_model.config, seed=5)
    oracle.load_state_dict({k: v.float() for k, v in reference.items()}, strict=False)
    engine.ingest(PROMPT)
    logits, expected = engine.next_token_logits(), hf.logits(oracle, PROMPT)[-1]
    # fp8: fp32 weights, identical: summation order only. nvfp4: the library's weights are rounded to bf16, ours exact.
    tolerance = 1e-5 if fmt == "fp8" else 3e-2
    assert float((logits - expected).norm() / expected.norm()) < tolerance


def test_activation_quantization_is_ignored_by_name_with_a_warning(ct_checkpoint, caplog):
    scheme, _, folder = ct_checkpoint
    with caplog.at_level(logging.WARNING, logger="flashrt_ros.runtime.checkpoint"):
        load(folder, FORMAT_OF[scheme])
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert ("input_activations" in warned) == (scheme != "nvfp4-a16"), warned
    assert ("input_global_scale" in warned) == (scheme == "nvfp4"), warned      # the tensors it stores for them


def qwen_fp8(ct_folder, out):
    """The compressed-tensors FP8 block checkpoint as Qwen's official -FP8 repos store it: the same codes and block
    scales, named weight_scale_inv, under quant_method fp8."""
    tensors = {k.replace(".weight_scale", ".weight_scale_inv"): v
               for k, v in load_file(ct_folder / "model.safetensors").items()}
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    config = ct.config(ct_folder)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def modelopt_nvfp4(ct_folder, out):
    """The compressed-tensors NVFP4 checkpoint as ModelOpt stores it: packed codes in .weight, the E4M3 scales, and
    weight_scale_2 = 1 / the global scale (ModelOpt multiplies where compressed-tensors divides)."""
    tensors = {}
    for name, t in load_file(ct_folder / "model.safetensors").items():
        if name.endswith(".weight_global_scale"):
            tensors[name.replace("weight_global_scale", "weight_scale_2")] = 1.0 / t
        elif name.endswith(".input_global_scale"):
            tensors[name.replace("input_global_scale", "input_scale")] = t
        else:
            tensors[name.replace(".weight_packed", ".weight")] = t
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    config = ct.config(ct_folder)
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    (out / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": ["lm_head"]}}))
    return out


def test_qwen_official_fp8_loads_the_same_weights_as_the_library_checkpoint(hf_model, tmp_path):
    model = ct.quantized_model(hf_model, "fp8-block")
    library = ct.save(model, tmp_path / "ct")
    engine = load(qwen_fp8(library, tmp_path / "qwen"), "fp8")
    assert_equals_library(engine, ct.dequantised(model))
    assert engine.fingerprint == load(library, "fp8").fingerprint


def test_modelopt_nvfp4_loads_its_codes_and_scales(hf_model, tmp_path):
    model = ct.quantized_model(hf_model, "nvfp4")
    folder = modelopt_nvfp4(ct.save(model, tmp_path / "ct"), tmp_path / "modelopt")
    engine = load(folder, "nvfp4")
    stored = load_file(folder / "model.safetensors")
    for name, weight in loaded_weights(engine).items():
        module = name[:-len(".weight")]
        assert torch.equal(weight.q, stored[name]) and torch.equal(weight.scale, stored[f"{module}.weight_scale"])
        # ModelOpt's dequantisation: e2m1 * weight_scale * weight_scale_2, in fp32
        e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
        packed = stored[name].long()
        values = e2m1[torch.stack([packed & 15, packed >> 4], -1).flatten(1)]
        expected = values * stored[f"{module}.weight_scale"].float().repeat_interleave(16, 1) \
            * stored[f"{module}.weight_scale_2"]
        assert torch.equal(weight.dequantize(), expected), name


def test_block_scales_that_cannot_be_held_exactly_are_refused_naming_the_tensor(tmp_path):
    """hidden 40: K = 40 is one partial 128-block 40 wide, not a multiple of the kernels' 16-input runs."""
    model = ct.quantized_model(hf.build_model(hf.text_config(tie_word_embeddings=False, hidden_size=40)), "fp8-block")
    folder = ct.save(model, tmp_path / "ct")
    with pytest.raises(FlashRTError) as err:
        load(folder, "fp8")
    assert err.value.code == ErrorCode.LOAD_FAILED
    assert "model.safetensors" in err.value.message and "K = 40" in err.value.message
    assert "model.layers.0." in err.value.message and "weights_format dense or nvfp4" in err.value.message
    load(folder, "dense")                                   # what the message offers works


@pytest.mark.parametrize("change,fragment", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "symmetric=False"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder='group'"),
    (lambda q: q.update(format="pack-quantized"), "'pack-quantized'"),
    (lambda q: q.update(quant_method="gptq"), "'gptq'"),
])
def test_what_changes_how_weights_read_is_refused_by_name(ct_checkpoint, tmp_path, change, fragment):
    scheme, _, folder = ct_checkpoint
    copy = shutil.copytree(folder, tmp_path / "copy")
    config = ct.config(copy)
    change(config["quantization_config"])
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(FlashRTError, match=fragment) as err:
        load(copy, FORMAT_OF[scheme])
    assert err.value.code == ErrorCode.LOAD_FAILED


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_synthetic_folders_keep_their_codes_and_load_in_another_format_through_dense(fmt, tmp_path):
    """checkpoint_writer's folders (what bench/load_memory.py measures on the GPU): stored codes are kept (a fused
    projection's pieces keep their own scales); loading them in another format quantizes the dequantised weights,
    which equals quantizing a dense checkpoint of those weights."""
    folder = checkpoint_writer.write("tiny", tmp_path / fmt, fmt, shard_bytes=60_000)
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    engine = load(folder, fmt)
    stored = {}
    for shard in folder.glob("model-*.safetensors"):
        stored.update(load_file(shard))
    suffix = "weight_packed" if fmt == "nvfp4" else "weight"
    kept = loaded_weights(engine)
    assert kept and all(torch.equal(w.q, stored[f"{n[:-len('.weight')]}.{suffix}"]) for n, w in kept.items())
    dense = {n: w.dequantize() for n, w in kept.items()}
    other = "nvfp4" if fmt == "fp8" else "fp8"
    converted = load(folder, other)
    parts = converted.model.fused_parts()
    layers = {n: m for n, m in converted.model.named_modules() if isinstance(m, quant.QuantLinear)}
    assert set(layers) == {n for n, m in engine.model.named_modules() if isinstance(m, quant.QuantLinear)}
    for name, layer in layers.items():
        pieces = [dense[p] for p, _ in parts.get(f"{name}.weight", [(f"{name}.weight", 0)])]
        expected = quant.QUANTIZERS[other](torch.cat(pieces).to(torch.float32))
        assert torch.equal(layer.weight().dequantize(), expected.dequantize()), name


def test_a_stored_format_loaded_dense_is_its_dequantised_weights_with_a_warning(ct_checkpoint, caplog):
    scheme, model, folder = ct_checkpoint
    with caplog.at_level(logging.WARNING, logger="flashrt_ros.runtime.weights"):
        engine = load(folder, "dense", dtype="bfloat16")
    assert f"in {FORMAT_OF[scheme]}" in caplog.text and "weights_format is dense: they are dequantised" in caplog.text
    reference = ct.dequantised(model)
    for fused, parts in engine.model.fused_parts().items():
        rows = engine.model.get_parameter(fused).split([r for _, r in parts])
        for (name, _), piece in zip(parts, rows):
            assert torch.equal(piece, reference[name].to(torch.bfloat16)), name


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Qwen3.5 trained here for a few seconds (bench/train_tiny_lm.py): confident predictions, unlike random
    weights, so a wrongly read scale or code changes them. Without an MTP head: transformers' model class, which
    compressed-tensors quantizes and saves, has none, so its folder would lack the mtp.* tensors the config names."""
    folder = tmp_path_factory.mktemp("trained") / "lm"
    train = bench_scripts.load("train_tiny_lm")
    train.build(folder, steps=80, hidden=64, layers=4, heads=4, head_dim=16, vocab=320, batch=16, seq_len=64,
                lr=3e-3, corpus_chars=200_000, heldout=0.05, seed=0, mtp=False)
    return folder, (folder / train.HELDOUT_FILE).read_text()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheme", ["fp8-block", "nvfp4-a16"])
def test_a_trained_model_quantized_by_the_library_predicts_what_hf_predicts_on_its_weights(scheme, trained,
                                                                                          tmp_path):
    """Quantized by compressed-tensors and loaded by us, the trained model gives HF's logits on the library's
    dequantised weights, token by token (decode), and the same predictions."""
    folder, heldout = trained
    model = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    quantized = ct.quantized_model(model, scheme)
    shutil.copy(folder / "tokenizer.json", ct.save(quantized, tmp_path / "q") / "tokenizer.json")
    model.load_state_dict({k: v.float() for k, v in ct.dequantised(quantized).items()}, strict=False)
    engine = load(tmp_path / "q", FORMAT_OF[scheme])
    ids = engine.tokenizer.encode(heldout)[:48]
    expected = hf.logits(model, ids)
    ours = []
    for token in ids:
        engine.ingest([token])
        ours.append(engine.next_token_logits())
    ours = torch.stack(ours)
    assert float((ours - expected).norm() / expected.norm()) < (1e-5 if scheme == "fp8-block" else 1e-2)
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.97


@pytest.mark.parametrize("edit,fragment", [
    (lambda t, m: t.update({f"{m}.weight_scale": t[f"{m}.weight_scale"].float()}), "weight_scale is torch.float32"),
    (lambda t, m: t.update({f"{m}.weight_packed": t[f"{m}.weight_packed"][:, :-1].contiguous()}), "weight_packed is"),
    (lambda t, m: t.pop(f"{m}.weight_global_scale"), "lacks tensor"),
])
def test_a_malformed_quantized_tensor_fails_naming_file_and_module(hf_model, tmp_path, edit, fragment):
    folder = ct.save(ct.quantized_model(hf_model, "nvfp4-a16"), tmp_path / "ct")
    module = "model.layers.1.mlp.down_proj"
    tensors = load_file(folder / "model.safetensors")
    edit(tensors, module)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(FlashRTError) as err:
        load(folder, "nvfp4")
    assert err.value.code == ErrorCode.LOAD_FAILED and fragment in err.value.message, err.value.message
    assert module in err.value.message
