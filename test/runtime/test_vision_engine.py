"""Images in the engine (issue 32): M-RoPE positions against transformers' ``get_rope_index`` and text rotary, and
greedy tokens and logits of prompts with images against ``Qwen3_5ForConditionalGeneration`` (HF's tower drives our
engine as ``model.visual``); the image path's refusals change nothing."""
import dataclasses
import json

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen

import hf_vision as hv
from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError
from flashrt_ros.runtime.arena import ROPE_DELTA
from flashrt_ros.runtime.config import PRESETS, from_hf_dict
from flashrt_ros.runtime.kernels import _triton
from flashrt_ros.runtime.kernels.rope import mrope_components, mrope_rows
from flashrt_ros.runtime.vision import ingest_length
from flashrt_ros.runtime.vision.layout import lay_out
from flashrt_ros.runtime.vision.prepared import PreparedImage

REL_TOL = 1e-4
# text before, between and after; images of different sizes (wide, tall, square), one long enough for a dense piece
PROMPTS = {
    "one-image": [5, 6, 7, hv.image(4, 6, seed=1), 8, 9, 10, 11],
    "two-images": [3, 4, 5, hv.image(6, 4, seed=2), 9, 10, 11, hv.image(4, 4, seed=3), 12, 13],
    "image-first-then-text": [hv.image(2, 8, seed=4), 40, 41],
    "long-image": [1, 2, hv.image(16, 18, seed=5), 3, 4, 5],
}


@pytest.fixture(scope="module")
def hf_model():
    return hv.build()


@pytest.fixture(scope="module")
def folder(hf_model, tmp_path_factory):
    return tmp_path_factory.mktemp("vl") / "checkpoint"


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def test_mrope_positions_and_delta_match_hf_get_rope_index(hf_model):
    for name, items in PROMPTS.items():
        inputs = hv.hf_inputs(items)
        want, delta = hf_model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                    image_grid_thw=inputs["image_grid_thw"])
        layout = lay_out(items, vision_of(hf_model), 0, 0)
        assert layout.token_ids == inputs["input_ids"][0].tolist(), name
        assert torch.equal(layout.rope_positions, want[:, 0].T), name
        assert layout.rope_delta == int(delta), name
        assert ingest_length(items) == len(layout.token_ids), name


def test_mrope_positions_continue_across_ingests(hf_model):
    """Items laid out in two ingests (the second from the first's row and delta) get the positions of one ingest."""
    items = PROMPTS["two-images"]
    whole = lay_out(items, vision_of(hf_model), 0, 0)
    first = lay_out(items[:5], vision_of(hf_model), 0, 0)
    second = lay_out(items[5:], vision_of(hf_model), len(first.token_ids), first.rope_delta)
    assert torch.equal(torch.cat([first.rope_positions, second.rope_positions]), whole.rope_positions)
    assert second.rope_delta == whole.rope_delta


@pytest.mark.parametrize("head_dim,factor,section", [(16, 1.0, (11, 11, 10)), (256, 0.25, (11, 11, 10)),
                                                     (16, 0.25, (11, 11, 10)), (32, 1.0, (6, 4, 6))])
def test_mrope_rows_match_hf_text_rotary(head_dim, factor, section):
    """cos/sin rows of 3-component positions equal HF's interleaved M-RoPE (sections 11/11/10: all three axes occur
    at rotary dim 16 and 64; at 4 only time and height do; 6/4/6 cuts the height axis short), with the section read
    from the config as our loader reads it."""
    import hf_checkpoints as hf
    config = hf.text_config(head_dim=head_dim, rope_parameters={**hf.rope(10_000.0, factor),
                                                                "mrope_section": list(section)})
    assert from_hf_dict(config.to_dict()).mrope_section == section
    rotary = hf_qwen.Qwen3_5TextRotaryEmbedding(config)
    positions = torch.randint(0, 200, (3, 1, 40), generator=torch.Generator().manual_seed(0))
    want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    dim = int(head_dim * factor)
    inv_freq = 1.0 / (10_000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.arange(256, dtype=torch.float)[:, None] * inv_freq[None, :]
    table_cos, table_sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    components = mrope_components(dim, section)
    assert torch.equal(mrope_rows(table_cos, positions[:, 0].T, components), want_cos[0])
    assert torch.equal(mrope_rows(table_sin, positions[:, 0].T, components), want_sin[0])


@pytest.mark.parametrize("chunk", [16, 128])
@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_logits_and_greedy_tokens_match_hf_generate(hf_model, folder, name, chunk):
    """Prefill logits and 8 greedy tokens (the decode step reads ROPE_DELTA from the arena) equal HF's; chunk 16
    splits images across pieces, chunk 128 runs the long prompt as one dense piece."""
    items = PROMPTS[name]
    engine = hv.engine(hf_model, folder, prefill_chunk=chunk)
    engine.ingest(items)
    assert engine.position == ingest_length(items)
    assert rel_err(engine.next_token_logits(), hv.hf_last_logits(hf_model, items)) < REL_TOL
    assert list(engine.generate(8, stop_token_ids=())) == hv.hf_greedy(hf_model, items, 8)


@torch.no_grad()
def test_merged_input_embeddings_equal_hf(hf_model, folder):
    """The embeddings the engine feeds (over all its pieces) are HF's ``inputs_embeds`` after its masked_scatter of
    ``get_image_features`` (every image's merged patches at its own pads, text rows their token embeddings)."""
    items = PROMPTS["two-images"]
    engine = hv.engine(hf_model, folder)
    fed, forward = [], engine.model.forward

    def recording(tokens, kv_len, count=None, **kwargs):
        rows = tokens.shape[0] if count is None else int(count)
        fed.append(kwargs["embeds"][:rows].clone())
        return forward(tokens, kv_len, count=count, **kwargs)

    engine.model.forward = recording
    engine.ingest(items)
    inputs = hv.hf_inputs(items)
    features = hf_model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    embeds = hf_model.get_input_embeddings()(inputs["input_ids"])[0]
    want = embeds.masked_scatter((inputs["input_ids"][0] == hv.PAD)[:, None], torch.cat(features))
    got = torch.cat(fed)
    assert got.shape == want.shape and len(fed) > 1
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_items_split_over_ingests_continue_like_one(hf_model, folder):
    """An image ingested after text (a second call: positions from the arena's delta) and text after it continue as
    HF's single prompt does."""
    items = PROMPTS["two-images"]
    engine = hv.engine(hf_model, folder)
    for part in (items[:3], items[3:5], items[5:8], items[8:]):
        engine.ingest(part)
    assert rel_err(engine.next_token_logits(), hv.hf_last_logits(hf_model, items)) < REL_TOL
    assert list(engine.generate(6, stop_token_ids=())) == hv.hf_greedy(hf_model, items, 6)


def test_plain_rotary_positions_would_not_match(hf_model, folder):
    """The parity above depends on M-RoPE: with the delta forced to 0 (plain positions after the image) the next
    tokens' logits leave HF's."""
    items = PROMPTS["one-image"]
    engine = hv.engine(hf_model, folder)
    engine.ingest(items[:4])
    engine.arena["meta"][ROPE_DELTA] = 0
    engine.ingest(items[4:])
    assert rel_err(engine.next_token_logits(), hv.hf_last_logits(hf_model, items)) > 1e-3


def test_a_text_only_config_keeps_its_json():
    """The fingerprint hashes the config's JSON: a text-only model's has no M-RoPE section (it changes nothing
    without images), so its fingerprint and capsules are those of before; a vision model's has it."""
    assert "mrope_section" not in json.loads(PRESETS["tiny"].to_json())
    assert json.loads(PRESETS["tiny-vl"].to_json())["mrope_section"] == [11, 11, 10]


def test_text_through_the_image_path_is_byte_identical():
    """Text rows fed with explicit three-equal-component positions and their own embeddings (as an ingest with images
    feeds them) leave the arena exactly as the text path does: M-RoPE of equal components is plain RoPE."""
    engine = Engine(EngineConfig(model="tiny", max_context=256, prefill_chunk=16))
    ids = list(range(30, 100))
    engine.ingest(ids)
    want = engine.arena.storage.clone()
    engine.reset()
    rows = torch.arange(len(ids))[:, None].expand(-1, 3)
    engine._feed(0, ids, engine.model.model.embed_tokens(torch.tensor(ids)), rows)
    assert torch.equal(engine.arena.storage, want)


@pytest.mark.skipif(_triton.triton is None, reason="needs Triton (its interpreter on the CPU)")
def test_triton_attention_input_stage_agrees_with_the_reference(hf_model, folder):
    """The Triton kernels (TRITON_INTERPRET=1 on the CPU) on an image ingest: rotary rows of 3-component positions
    and KV rows apart from them, then decode with the delta; they agree with the reference kernels."""
    items = [5, hv.image(4, 4, seed=1), 8]
    reference, fast = hv.engine(hf_model, folder), hv.engine(hf_model, folder, kernels="triton")
    assert fast.kernel_name.startswith("triton")
    for engine in (reference, fast):
        engine.ingest(items)
    assert rel_err(fast.next_token_logits(), reference.next_token_logits()) < REL_TOL
    assert list(fast.generate(2, stop_token_ids=())) == list(reference.generate(2, stop_token_ids=()))
    assert fast.rope_delta == reference.rope_delta == 2 - 4


def test_raw_images_are_preprocessed_under_the_engine_budget(hf_model, folder):
    """An ``Image`` (V1's preprocessing, merged later) is prepared in check_ingest with the engine's pixel budget and
    ingested as that PreparedImage; the logits equal HF's on the same patches."""
    images = pytest.importorskip("flashrt_ros.runtime.vision.preprocess",
                                 reason="the preprocessing (issue 32, V1) is not in this branch yet")
    import numpy
    rgb = numpy.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=numpy.uint8)
    engine = hv.engine(hf_model, folder, image_min_pixels=16 * hv.PATCH ** 2, image_max_pixels=120 * hv.PATCH ** 2)
    want = images.preprocess(images.Image(rgb), engine.model_config.vision, 16 * hv.PATCH ** 2, 120 * hv.PATCH ** 2)
    checked = engine.check_ingest([1, images.Image(rgb), 2])
    assert checked[1].grid == want.grid and torch.equal(checked[1].patches, want.patches)
    assert engine.ingest([1, images.Image(rgb), 2]) == ingest_length([1, want, 2])
    assert rel_err(engine.next_token_logits(), hv.hf_last_logits(hf_model, [1, want, 2])) < REL_TOL


def vision_of(model):
    return from_hf_dict(model.config.to_dict()).vision


# ---- refusals -------------------------------------------------------------------------------------------------

def assert_refused(engine, items, code, match):
    before, capsules = engine.live_checksum(), [(c.id, c.position) for c in engine.capsules()]
    position, delta = engine.position, engine.rope_delta
    with pytest.raises(FlashRTError, match=match) as err:
        engine.check_ingest(items)
    assert err.value.code == code
    with pytest.raises(FlashRTError, match=match):
        engine.ingest(items)
    assert engine.live_checksum() == before and engine.position == position and engine.rope_delta == delta
    assert [(c.id, c.position) for c in engine.capsules()] == capsules


def test_images_refused_without_a_vision_tower():
    """A text-only model, and a vision model started with vision_tower off: INVALID_ARGUMENT, nothing changes."""
    image = PreparedImage(torch.zeros(16, 1536), (1, 4, 4))
    for config in (EngineConfig(model="tiny", max_context=128), EngineConfig(model="tiny-vl", max_context=128,
                                                                              vision_tower=False)):
        engine = Engine(config)
        engine.ingest([1, 2, 3])
        engine.snapshot("kept")
        assert engine.visual is None
        why = "has no vision tower" if config.model == "tiny" else "vision_tower off"
        assert_refused(engine, [4, image, 5], ErrorCode.INVALID_ARGUMENT, why)


def test_bad_images_are_refused_and_change_nothing(hf_model, folder):
    engine = hv.engine(hf_model, folder, image_max_pixels=64 * hv.PATCH ** 2)
    engine.ingest([1, hv.image(4, 4), 2])
    engine.snapshot("after-image")
    good = hv.image(4, 6)
    nan = good.patches.clone()
    nan[3, 5] = float("nan")
    cases = [
        (PreparedImage(torch.zeros(0, hv.PATCH_WIDTH), (1, 0, 4)), "zero-size"),
        (PreparedImage(torch.zeros(12, hv.PATCH_WIDTH), (1, 3, 4)), "multiples of 2"),
        (PreparedImage(good.patches[:, :10], good.grid), "patches must be a float tensor"),
        (PreparedImage(good.patches.long(), good.grid), "patches must be a float tensor"),
        (PreparedImage(nan, good.grid), "NaN"),
        (hv.image(10, 8), "exceed image_max_pixels"),
        (dataclasses.replace(good, spatial_merge_size=1), "spatial_merge_size"),
        ("not an image", "integers"),
    ]
    for image, match in cases:
        code = ErrorCode.INVALID_ARGUMENT
        assert_refused(engine, [7, image, 8], code, match)
    assert_refused(engine, [7, good, 10_000], ErrorCode.TOKEN_OUT_OF_RANGE, "outside")
    room = engine.max_context - engine.position
    assert_refused(engine, [7] * (room - good.token_count - 2) + [good, 8], ErrorCode.CONTEXT_OVERFLOW,
                   "exceed max_context")
    assert engine.ingest([7] * (room - good.token_count - 2) + [good]) == engine.max_context   # exactly fits


def test_image_pixel_budget_is_validated():
    for low, high in ((0, 100), (200, 100)):
        with pytest.raises(FlashRTError, match="image pixel budget") as err:
            EngineConfig(image_min_pixels=low, image_max_pixels=high).validate()
        assert err.value.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel_set", ["reference", "triton"])
def test_image_stream_on_cuda_graphs_equals_eager(kernel_set):
    """On CUDA the captured decode steps read ROPE_DELTA from the arena and the tower runs as a graph per grid: after
    two frames of one grid (the preset's own tower; the second replays the first's graph), graph replay equals eager
    decoding (tokens and bytes), and a capsule after the images continues token-identically on both."""
    vision = PRESETS["tiny-vl"].vision
    items = [5, 6, hv.image(8, 6, seed=1, vision=vision), 7, hv.image(8, 6, seed=2, vision=vision), 8]
    results = []
    for graphs in (True, False):
        engine = Engine(EngineConfig(model="tiny-vl", device="cuda", max_context=512, cuda_graphs=graphs,
                                     kernels=kernel_set, image_min_pixels=1))
        assert bool(engine.graphs.graphs) == graphs
        engine.ingest(items[:3])           # the tower's graph of this grid is captured here ...
        engine.ingest(items[3:])           # ... and replayed for the second frame
        assert bool(engine._tower_graphs.graphs) == graphs
        engine.snapshot("frame")
        tokens = list(engine.generate(20, stop_token_ids=()))
        engine.restore("frame")
        assert list(engine.generate(20, stop_token_ids=())) == tokens
        results.append((tokens, engine.live_bytes().cpu(), engine.rope_delta))
    assert results[0][0] == results[1][0] and results[0][2] == results[1][2] == 2 * (4 - 12)
    assert torch.equal(results[0][1], results[1][1])
