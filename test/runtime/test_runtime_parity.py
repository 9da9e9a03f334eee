"""The engine computes what `transformers`' Qwen3_5ForCausalLM computes, on checkpoints the tests save themselves.

Each config varies one architectural axis the engine must honour: head counts, GQA/MQA, grouped value heads, the
rotary fraction, tied or untied output embeddings, the layer-type mix (including all-linear and all-attention models).
"""
import pytest
import torch

import hf_checkpoints as hf
from flashrt_ros.runtime import Engine, EngineConfig
from flashrt_ros.runtime.model import SMALL_PIECE

CHUNK = 16
PREFIXES = (1, 5, CHUNK, 23, 3 * CHUNK, 77)   # single token, sub-chunk, one chunk, non-multiples, several chunks
PROMPT_LEN = 80
REL_TOL = 1e-4

CONFIGS = {
    "gqa-gva-tied": {},
    "mha-untied-half-rope-attn-first": dict(
        num_attention_heads=2, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=2,
        tie_word_embeddings=False, rope_parameters=hf.rope(1_000_000.0, 0.5),
        layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"]),
    "mqa-gva3-full-rope-kernel3": dict(
        hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=1, head_dim=8,
        linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=3, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=hf.rope(500.0, 1.0),
        layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "all-linear": dict(num_hidden_layers=2, layer_types=["linear_attention"] * 2),
    "all-attention": dict(num_hidden_layers=2, layer_types=["full_attention"] * 2, tie_word_embeddings=False),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def prompt(vocab: int, length: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_engine(folder, **overrides) -> Engine:
    return Engine(EngineConfig(**{"model": str(folder), "max_context": 256, "prefill_chunk": CHUNK, **overrides}))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(HF model, engine loaded from its saved checkpoint, folder) for one tiny config."""
    model = hf.build_model(hf.text_config(**CONFIGS[request.param]))
    folder = hf.save(model, tmp_path_factory.mktemp(request.param))
    return model, make_engine(folder), folder


def test_logits_match_hf_at_every_prefix(checkpoint):
    model, engine, _ = checkpoint
    ids = prompt(engine.vocab_size)
    reference = hf.logits(model, ids)
    for n in PREFIXES:
        engine.reset()
        assert engine.ingest(ids[:n]) == n
        assert rel_err(engine.next_token_logits(), reference[n - 1]) < REL_TOL, f"prefix {n}"


def test_logits_match_hf_when_ingested_in_uneven_pieces(checkpoint):
    """State carried across ingest calls (conv windows, recurrent matrices, KV) continues the sequence exactly."""
    model, engine, _ = checkpoint
    ids = prompt(engine.vocab_size)
    reference = hf.logits(model, ids)
    engine.reset()
    for start, end in zip(PREFIXES, PREFIXES[1:]):
        if start == 1:
            engine.ingest(ids[:1])
        engine.ingest(ids[start:end])
        assert rel_err(engine.next_token_logits(), reference[end - 1]) < REL_TOL, f"prefix {end}"


def test_logits_match_hf_through_long_prefill_pieces(checkpoint):
    """Pieces longer than SMALL_PIECE take the dense path (causal flash attention over exactly the live span), both
    from position 0 and after a prefix."""
    model, _, folder = checkpoint
    engine = make_engine(folder, prefill_chunk=2 * SMALL_PIECE)
    ids = prompt(engine.vocab_size, length=2 * SMALL_PIECE + 72)
    reference = hf.logits(model, ids)
    for pieces in ([ids[:2 * SMALL_PIECE + 22]], [ids[:10], ids[10:]]):
        engine.reset()
        for piece in pieces:
            engine.ingest(piece)
        assert rel_err(engine.next_token_logits(), reference[engine.position - 1]) < REL_TOL, engine.position


def test_greedy_generation_matches_hf_argmax(checkpoint):
    model, engine, _ = checkpoint
    ids = prompt(engine.vocab_size, length=21)
    engine.reset()
    engine.ingest(ids)
    assert list(engine.generate(12, stop_token_ids=[])) == hf.greedy(model, ids, 12)
    assert engine.position == len(ids) + 12


@pytest.mark.parametrize("n", [CHUNK - 1, CHUNK, CHUNK + 1, 40])
def test_prefill_then_decode_equals_longer_prefill(checkpoint, n):
    """ingest(N) + one more token (the decode kernel) == ingest(N+1) (the chunked kernel), then the same greedy."""
    _, engine, _ = checkpoint
    ids = prompt(engine.vocab_size, length=n + 1)
    engine.reset()
    engine.ingest(ids[:n])
    engine.ingest(ids[n:])
    stepwise_logits = engine.next_token_logits()
    stepwise_tokens = list(engine.generate(6, stop_token_ids=[]))
    engine.reset()
    engine.ingest(ids)
    assert rel_err(stepwise_logits, engine.next_token_logits()) < 1e-5
    assert list(engine.generate(6, stop_token_ids=[])) == stepwise_tokens


def test_prefill_then_decode_equals_longer_prefill_on_tiny_preset():
    """The same on the `tiny` preset, whose MTP head keeps its own KV."""
    engine = Engine(EngineConfig(model="tiny", max_context=256, prefill_chunk=CHUNK))
    ids = prompt(256, length=CHUNK + 3)
    engine.ingest(ids)
    first = next(engine.generate(1, stop_token_ids=[]))
    decoded_logits = engine.next_token_logits()
    continuation = list(engine.generate(6, stop_token_ids=[]))
    engine.reset()
    engine.ingest(ids + [first])
    assert rel_err(decoded_logits, engine.next_token_logits()) < 1e-5
    assert list(engine.generate(6, stop_token_ids=[])) == continuation


def test_multimodal_checkpoint_loads_the_same_text_model(tmp_path):
    """`model_type: qwen3_5` (text_config, weights under model.language_model., the vision tower beside them)."""
    model = hf.build_model(hf.text_config(tie_word_embeddings=False), seed=3)
    plain = make_engine(hf.save(model, tmp_path / "text"))
    multimodal = make_engine(hf.save_multimodal(model, tmp_path / "mm"))
    assert plain.model.visual is None and multimodal.model.visual is not None
    text = {n: p for n, p in multimodal.model.named_parameters() if not n.startswith("visual.")}
    assert text.keys() == dict(plain.model.named_parameters()).keys()
    assert all(torch.equal(p, text[n]) for n, p in plain.model.named_parameters())
    ids = prompt(plain.vocab_size, length=30)
    multimodal.ingest(ids)
    assert rel_err(multimodal.next_token_logits(), hf.logits(model, ids)[-1]) < REL_TOL


def test_sharded_checkpoint_loads_identically(tmp_path):
    model = hf.build_model(hf.text_config(), seed=4)
    sharded = hf.save(model, tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    single = make_engine(hf.save(model, tmp_path / "single"))
    from_shards = make_engine(sharded)
    assert from_shards.fingerprint == single.fingerprint
    ids = prompt(single.vocab_size, length=30)
    single.ingest(ids)
    from_shards.ingest(ids)
    assert torch.equal(from_shards.next_token_logits(), single.next_token_logits())
