"""Loading: HF folders that are broken in each way give FlashRTError(LOAD_FAILED) with a message that says what is
wrong; tokenizers; presets are reproducible per seed; engine settings are validated."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import bench_scripts
import hf_checkpoints as hf
from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError, weights
from flashrt_ros.tools import checkpoint_writer, memory_peak


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


# ---- memory while loading ------------------------------------------------------------------------------------------
SLICE = 1 << 10              # values per slice in these tests: the bound below scales with it, not with the model
BYTES_PER_SLICE_VALUE = 48   # what one sliced value costs in temporaries (int64 index, fp32 values, conversions)


def final_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture
def small_slices(monkeypatch):
    monkeypatch.setattr(weights, "ELEMENTS_PER_SLICE", SLICE)


@pytest.mark.parametrize("preset", ["tiny", "tiny-vl"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["dense", "fp8", "nvfp4"])
def test_a_preset_loads_in_its_final_size_plus_one_slice(fmt, dtype, preset, small_slices):
    """No float32 model, no second copy while fusing or quantizing: every byte allocated while loading beyond the
    final weights (the vision tower's included) is a temporary of one slice. (Materialising the model in float32
    first, then casting and fusing, allocates several times the final size: this fails on that code.)"""
    model, peak, _, _ = memory_peak.measure(
        lambda: weights.load(preset, torch.device("cpu"), dtype, 0, fmt)[0], torch.device("cpu"))
    assert peak - final_bytes(model) <= BYTES_PER_SLICE_VALUE * SLICE, (peak, final_bytes(model))


def test_a_sharded_checkpoint_loads_in_its_final_size_plus_one_slice(tmp_path, small_slices):
    folder = checkpoint_writer.write("tiny", tmp_path / "sharded", "dense", shard_bytes=60_000)
    assert len(list(folder.glob("model-*.safetensors"))) > 3
    for fmt in ("dense", "nvfp4"):
        model, peak, _, _ = memory_peak.measure(
            lambda: weights.load(str(folder), torch.device("cpu"), torch.bfloat16, 0, fmt)[0], torch.device("cpu"))
        assert peak - final_bytes(model) <= BYTES_PER_SLICE_VALUE * SLICE, (fmt, peak, final_bytes(model))


# ---- bad checkpoints: LOAD_FAILED naming the file and the tensor, nothing left allocated ---------------------------
def sharded(tmp_path):
    return checkpoint_writer.write("tiny", tmp_path / "sharded", "dense", shard_bytes=60_000)


def truncate_a_shard(folder):
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    return shard.name, "truncated"


def index_names_a_tensor_its_shard_lacks(folder):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = sorted(folder.glob("model-*.safetensors"))[0].name
    name = next(n for n, f in index["weight_map"].items() if f != first)
    index["weight_map"][name] = first
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return first, name


def tensor_of_an_integer_dtype(folder):
    name = "model.layers.0.input_layernorm.weight"
    shard = folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, shard)
    return shard.name, name


def config_that_disagrees_with_the_tensors(folder):
    edit_config(folder, intermediate_size=96)
    return "model-", "model.layers.0.mlp.", "the config implies"


def index_naming_a_missing_file(folder):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return "model-00099-of-00099.safetensors", "missing"


BREAKAGES = [truncate_a_shard, index_names_a_tensor_its_shard_lacks, tensor_of_an_integer_dtype,
             config_that_disagrees_with_the_tensors, index_naming_a_missing_file]


def attempt(folder, fmt="dense"):
    """The failed load's (code, message), with its traceback (and every frame's tensors) already released."""
    try:
        weights.load(str(folder), torch.device("cpu"), torch.bfloat16, 0, fmt)
    except FlashRTError as err:
        return err.code, err.message
    return None, "loaded"


@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda b: b.__name__)
def test_a_bad_checkpoint_fails_naming_file_and_tensor_and_leaves_nothing_allocated(breakage, tmp_path):
    folder = sharded(tmp_path)
    fragments = breakage(folder)
    (code, message), _, left = memory_peak.retained(lambda: attempt(folder))
    assert code == ErrorCode.LOAD_FAILED and all(f in message for f in fragments), message
    assert left == 0


def failing_after(calls: int, make_error, real):
    """``real``, except that call number ``calls`` raises ``make_error()``."""
    count = []

    def flaky(*args, **kwargs):
        count.append(1)
        if len(count) == calls:
            raise make_error()
        return real(*args, **kwargs)
    return flaky


def kept_error(folder, fmt):
    """The failed load's error, kept (as a caller that logs it later would) with whatever it references."""
    try:
        weights.load(str(folder), torch.device("cpu"), torch.bfloat16, 0, fmt)
    except FlashRTError as err:
        return err
    return None


@pytest.mark.parametrize("where,error,fragment", [
    ("mmap", lambda: OSError(5, "Input/output error"), "Input/output error"),      # a shard unreadable mid-load
    ("quantize", lambda: torch.OutOfMemoryError("CUDA out of memory"), "out of memory on cpu building"),
])
def test_a_failure_mid_load_frees_what_was_built_and_a_retry_loads(tmp_path, monkeypatch, where, error, fragment):
    """Some weights are already built when it fails (a pulled disk, NFS hiccup, the device running out): the error
    names what failed and holds none of them, even kept, and loading again works."""
    from flashrt_ros.runtime import checkpoint, quant
    folder = sharded(tmp_path)
    target, attr = (checkpoint.mmap, "mmap") if where == "mmap" else (quant, "quantize_nvfp4")
    real = getattr(target, attr)
    monkeypatch.setattr(target, attr, failing_after(20, error, real))
    err, peak, left = memory_peak.retained(lambda: kept_error(folder, "nvfp4"))
    assert err.code == ErrorCode.LOAD_FAILED and fragment in err.message, err.message
    assert ("reading tensor" in err.message and ".safetensors" in err.message) if where == "mmap" else \
        "model." in err.message
    assert peak > 0 and left == 0
    monkeypatch.setattr(target, attr, real)
    model, _ = weights.load(str(folder), torch.device("cpu"), torch.bfloat16, 0, "nvfp4")
    preset, _ = weights.load("tiny", torch.device("cpu"), torch.bfloat16, 0, "nvfp4")
    assert weights.weights_digest(model) == weights.weights_digest(preset)


def test_the_load_benchmark_writes_a_folder_then_measures_loading_it(tmp_path):
    """bench/load_memory.py on the CPU: a synthetic fp8 folder of the tiny preset, then a load from it."""
    bench = bench_scripts.load("load_memory")
    folder = tmp_path / "tiny-fp8"
    assert bench.main(["--write-checkpoint", str(folder), "--model", "tiny", "--checkpoint-format", "fp8",
                       "--shard-gb", "0.0001"]) == 0
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    out = tmp_path / "load.json"
    assert bench.main(["--model", str(folder), "--format", "fp8", "--max-context", "256", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    model, _ = weights.load(str(folder), torch.device("cpu"), torch.bfloat16, 0, "fp8")
    assert result["final_weight_bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())
    engine = Engine(EngineConfig(model=str(folder), max_context=256, dtype="bfloat16"))
    assert result["arena_bytes"] == engine.arena_bytes
    assert result["disk_bytes"] == sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert result["checkpoint_scheme"] == "fp8 (block-wise, weight_scale_inv)" and result["source"] == "folder"
    assert result["peak_device_bytes"] >= result["final_weight_bytes"] + result["arena_bytes"]
    assert result["peak_over_final"] == result["peak_device_bytes"] / (result["final_weight_bytes"]
                                                                      + result["arena_bytes"])
    assert result["disk_gb_per_s"] > 0 and result["device"] == "cpu" and result["torch"] == torch.__version__
