"""Loading: HF folders that are broken in each way give FlashRTError(LOAD_FAILED) with a message that says what is
wrong; tokenizers; presets are reproducible per seed; engine settings are validated."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_checkpoints as hf
from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError


def load(folder, **overrides) -> Engine:
    return Engine(EngineConfig(model=str(folder), max_context=128, prefill_chunk=16, **overrides))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return hf.save(hf.build_model(hf.text_config(tie_word_embeddings=False)), tmp_path_factory.mktemp("good"))


@pytest.fixture
def checkpoint(saved, tmp_path):
    """A private copy of a good checkpoint, to break."""
    return shutil.copytree(saved, tmp_path / "ckpt")


def edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_tensors(folder, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def load_fails(folder, *fragments) -> FlashRTError:
    with pytest.raises(FlashRTError) as error:
        load(folder)
    assert error.value.code == ErrorCode.LOAD_FAILED
    for fragment in fragments:
        assert fragment in error.value.message, error.value.message
    return error.value


def test_missing_folder(tmp_path):
    load_fails(tmp_path / "nowhere", "nowhere", "does not exist")


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    load_fails(checkpoint, "config.json")


def test_config_that_is_not_json(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    load_fails(checkpoint, "not valid JSON")


def test_unsupported_model_type(checkpoint):
    edit_config(checkpoint, model_type="llama")
    load_fails(checkpoint, "'llama'", "qwen3_5")


def test_config_lacking_a_required_field(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    del config["linear_num_value_heads"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    load_fails(checkpoint, "linear_num_value_heads")


def test_inconsistent_head_counts(checkpoint):
    edit_config(checkpoint, num_key_value_heads=3)
    load_fails(checkpoint, "num_key_value_heads")


def test_unsupported_rope_type(checkpoint):
    edit_config(checkpoint, rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0})
    load_fails(checkpoint, "yarn")


def test_missing_safetensors(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    load_fails(checkpoint, "model.safetensors")


def test_missing_shard(tmp_path):
    folder = hf.save(hf.build_model(hf.text_config()), tmp_path / "sharded", max_shard_size="20KB")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    load_fails(folder, shard.name)


def test_tensor_of_the_wrong_shape(checkpoint):
    name = "model.layers.0.linear_attn.in_proj_z.weight"
    edit_tensors(checkpoint, lambda t: t.update({name: t[name][:-1]}))
    load_fails(checkpoint, name, "shape")


def test_missing_tensors(checkpoint):
    name = "model.layers.3.self_attn.k_norm.weight"
    edit_tensors(checkpoint, lambda t: t.pop(name))
    load_fails(checkpoint, name, "1 tensor")


def test_missing_output_head_of_an_untied_model(checkpoint):
    edit_tensors(checkpoint, lambda t: t.pop("lm_head.weight"))
    load_fails(checkpoint, "lm_head.weight")


def test_unexpected_tensor(checkpoint):
    edit_tensors(checkpoint, lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}))
    load_fails(checkpoint, "model.layers.9.mlp.up_proj.weight")


def test_mtp_weights_are_ignored_when_the_config_has_no_mtp_layer(checkpoint, saved):
    edit_tensors(checkpoint, lambda t: t.update({"mtp.fc.weight": torch.zeros(32, 64)}))
    assert load(checkpoint).fingerprint == load(saved).fingerprint


def test_folder_without_tokenizer_runs_from_token_ids(saved):
    engine = load(saved)
    assert not (saved / "tokenizer.json").exists()
    with pytest.raises(FlashRTError) as error:
        engine.tokenizer.encode("hello")
    assert error.value.code == ErrorCode.INVALID_ARGUMENT
    assert engine.ingest([1, 2, 3]) == 3
    assert len(list(engine.generate(2, stop_token_ids=[]))) == 2


def test_folder_with_tokenizer_json_uses_it(checkpoint):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5, "robot": 9}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    engine = load(checkpoint)
    assert engine.tokenizer.encode("hello robot walrus") == [5, 9, 0]
    assert engine.tokenizer.decode([5, 9]) == "hello robot"


def test_presets_are_reproducible_per_seed():
    def preset(seed):
        return Engine(EngineConfig(model="tiny", max_context=64, seed=seed))

    a, b, c = preset(0), preset(0), preset(1)
    assert a.fingerprint == b.fingerprint != c.fingerprint
    weights = {name: p for name, p in a.model.named_parameters()}
    for name, param in b.model.named_parameters():
        assert torch.equal(param, weights[name]), name
    assert all(not torch.equal(p, weights[name]) for name, p in c.model.named_parameters()
               if p.numel() > 1)
    for engine in (a, b):
        engine.ingest(list(b"same seed"))
    assert list(a.generate(5)) == list(b.generate(5))


def test_byte_tokenizer_of_the_tiny_preset():
    engine = Engine(EngineConfig(model="tiny", max_context=64))
    ids = engine.tokenizer.encode("grüß")
    assert ids == list("grüß".encode())
    assert engine.tokenizer.decode(ids + [256, 300]) == "grüß"
    assert engine.eos_token_ids == (256,)


@pytest.mark.parametrize("overrides,code", [
    (dict(dtype="float64"), ErrorCode.INVALID_ARGUMENT),
    (dict(max_context=0), ErrorCode.INVALID_ARGUMENT),
    (dict(prefill_chunk=24), ErrorCode.INVALID_ARGUMENT),
    (dict(history_depth=0), ErrorCode.INVALID_ARGUMENT),
    (dict(capsule_budget_bytes=-1), ErrorCode.INVALID_ARGUMENT),
    (dict(max_context=1 << 20), ErrorCode.INVALID_ARGUMENT),
    (dict(model="no-such-preset"), ErrorCode.LOAD_FAILED),
])
def test_engine_config_is_validated(overrides, code):
    with pytest.raises(FlashRTError) as error:
        Engine(EngineConfig(**{"model": "tiny", "max_context": 64, **overrides}))
    assert error.value.code == code


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of CUDA on a machine without it")
def test_cuda_without_a_gpu_is_a_load_failure():
    with pytest.raises(FlashRTError) as error:
        Engine(EngineConfig(model="tiny", device="cuda", max_context=64))
    assert error.value.code == ErrorCode.LOAD_FAILED
