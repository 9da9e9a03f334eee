"""The runtime's kernels against independent references: the chunked delta rule against the recurrent one (and both
against `transformers`' reference loop), causal conv in pieces, GQA attention against a naive masked softmax, RoPE,
the counter-based RNG and the state checksum."""
import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen

from flashrt_ros.runtime import Engine, EngineConfig, rng
from flashrt_ros.runtime.checksum import checksum
from flashrt_ros.runtime.kernels import (apply_rope, attention_causal, attention_masked, causal_conv,
                                         delta_rule_chunked, delta_rule_recurrent)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def delta_inputs(length: int, k_heads: int, v_heads: int, dk: int = 8, dv: int = 12, seed: int = 0):
    """Random q, k, v, log-decay g <= 0, beta in (0, 1), and a nonzero initial state."""
    g_ = gen(seed)
    q = torch.randn(length, k_heads, dk, generator=g_)
    k = torch.randn(length, k_heads, dk, generator=g_)
    v = torch.randn(length, v_heads, dv, generator=g_)
    g = -F.softplus(torch.randn(length, v_heads, generator=g_))
    beta = torch.rand(length, v_heads, generator=g_)
    state = 0.5 * torch.randn(v_heads, dk, dv, generator=g_)
    return q, k, v, g, beta, state


HEAD_RATIOS = [(2, 2), (2, 4), (1, 3)]


@pytest.mark.parametrize("k_heads,v_heads", HEAD_RATIOS)
@pytest.mark.parametrize("length", [1, 7, 16, 37, 64])
def test_chunked_delta_rule_matches_recurrent(length, k_heads, v_heads):
    q, k, v, g, beta, state = delta_inputs(length, k_heads, v_heads)
    chunked_state, recurrent_state = state.clone(), state.clone()
    chunked = delta_rule_chunked(q, k, v, g, beta, chunked_state, chunk=16)
    recurrent = delta_rule_recurrent(q, k, v, g, beta, recurrent_state)
    assert chunked.shape == recurrent.shape == v.shape
    torch.testing.assert_close(chunked, recurrent, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(chunked_state, recurrent_state, rtol=1e-4, atol=1e-5)
    assert not torch.equal(recurrent_state, state), "the state is updated in place"


@pytest.mark.parametrize("k_heads,v_heads", HEAD_RATIOS)
def test_recurrent_delta_rule_matches_transformers_reference(k_heads, v_heads):
    q, k, v, g, beta, state = delta_inputs(11, k_heads, v_heads, seed=1)
    ours = state.clone()
    out = delta_rule_recurrent(q, k, v, g, beta, ours)
    ref_out, ref_state = hf_qwen.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref_out[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours, ref_state[0], rtol=1e-5, atol=1e-6)


def test_chunked_delta_rule_in_pieces_equals_one_pass():
    q, k, v, g, beta, state = delta_inputs(45, 2, 4, seed=2)
    whole_state, pieces_state = state.clone(), state.clone()
    whole = delta_rule_chunked(q, k, v, g, beta, whole_state, chunk=16)
    pieces = [delta_rule_chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], pieces_state, chunk=16)
              for a, b in ((0, 16), (16, 19), (19, 45))]
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pieces_state, whole_state, rtol=1e-4, atol=1e-5)


def test_causal_conv_in_pieces_equals_one_pass_and_zero_padded_reference():
    kernel, channels, length = 4, 6, 20
    x = torch.randn(length, channels, generator=gen(3))
    weight = torch.randn(channels, kernel, generator=gen(4))
    reference = F.silu(F.conv1d(F.pad(x.t(), (kernel - 1, 0))[None], weight[:, None], groups=channels)[0].t())
    whole_state = torch.zeros(kernel - 1, channels)
    whole = causal_conv(x, whole_state, weight)
    torch.testing.assert_close(whole, reference)
    assert torch.equal(whole_state, x[-(kernel - 1):])
    pieces_state = torch.zeros(kernel - 1, channels)
    pieces = [causal_conv(x[a:b], pieces_state, weight) for a, b in ((0, 1), (1, 3), (3, 12), (12, 20))]
    torch.testing.assert_close(torch.cat(pieces), whole)
    assert torch.equal(pieces_state, whole_state)


def naive_attention(q, keys, values, positions):
    """Per query and head: softmax(q.k / sqrt(D)) over keys at positions <= the query's, with GQA head sharing."""
    length, heads, dim = q.shape
    groups = heads // keys.shape[1]
    out = torch.zeros_like(q)
    for i in range(length):
        span = int(positions[i]) + 1
        for h in range(heads):
            scores = keys[:span, h // groups] @ q[i, h] / dim ** 0.5
            out[i, h] = scores.softmax(-1) @ values[:span, h // groups]
    return out


GQA_SHAPES = [(4, 4), (4, 2), (6, 1)]


def qkv(length: int, span: int, heads: int, kv_heads: int, dim: int = 8, seed: int = 5):
    g_ = gen(seed)
    return (torch.randn(length, heads, dim, generator=g_), torch.randn(span, kv_heads, dim, generator=g_),
            torch.randn(span, kv_heads, dim, generator=g_))


@pytest.mark.parametrize("heads,kv_heads", GQA_SHAPES)
def test_masked_attention_matches_naive_softmax_and_ignores_stale_entries(heads, kv_heads):
    """Decode and small pieces: queries at ``positions`` over a KV bucket longer than the live prefix."""
    start, length, bucket = 5, 7, 32
    q, keys, values = qkv(length, bucket, heads, kv_heads)
    positions = torch.arange(start, start + length)
    out = attention_masked(q, keys, values, positions)
    torch.testing.assert_close(out, naive_attention(q, keys, values, positions), rtol=1e-5, atol=1e-6)
    end = start + length
    keys[end:] = 1e3 * torch.randn(bucket - end, kv_heads, keys.shape[-1], generator=gen(6))
    values[end:] = 1e3 * torch.randn(bucket - end, kv_heads, keys.shape[-1], generator=gen(7))
    torch.testing.assert_close(attention_masked(q, keys, values, positions), out)


@pytest.mark.parametrize("heads,kv_heads", GQA_SHAPES)
@pytest.mark.parametrize("length,span", [(9, 9), (9, 30)], ids=["from-start", "after-a-prefix"])
def test_causal_attention_matches_naive_softmax(heads, kv_heads, length, span):
    """Prefill chunks: the L queries are the last L of exactly ``span`` positions (lower-right causal)."""
    q, keys, values = qkv(length, span, heads, kv_heads)
    expected = naive_attention(q, keys, values, torch.arange(span - length, span))
    torch.testing.assert_close(attention_causal(q, keys, values), expected, rtol=1e-5, atol=1e-6)


def test_engine_rope_tables_and_rotation_match_transformers():
    """The engine's RoPE tables (partial rotary, tiny preset) and rotation equal HF's rotary embedding + apply."""
    engine = Engine(EngineConfig(model="tiny", max_context=64))
    cfg = engine.model_config
    hf_config = Qwen3_5TextConfig(head_dim=cfg.head_dim, hidden_size=cfg.hidden_size,
                                  num_attention_heads=cfg.num_attention_heads,
                                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                                   "partial_rotary_factor": cfg.partial_rotary_factor})
    positions = torch.arange(3, 40)
    x = torch.randn(len(positions), cfg.num_attention_heads, cfg.head_dim, generator=gen(6))
    hf_cos, hf_sin = hf_qwen.Qwen3_5TextRotaryEmbedding(hf_config)(x, positions[None])
    cos, sin = engine.model.rope_cos[positions], engine.model.rope_sin[positions]
    torch.testing.assert_close(cos, hf_cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, hf_sin[0], rtol=1e-5, atol=1e-5)
    expected, _ = hf_qwen.apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected)


def test_rope_scores_depend_only_on_relative_position():
    dim, rot = 16, 8
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.arange(64).float()[:, None] * inv_freq
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    q, k = torch.randn(2, 1, 1, dim, generator=gen(7))

    def score(m, n):
        qm = apply_rope(q, cos[m:m + 1], sin[m:m + 1])
        kn = apply_rope(k, cos[n:n + 1], sin[n:n + 1])
        return float((qm * kn).sum())

    assert score(9, 4) == pytest.approx(score(30, 25), rel=1e-5)
    assert score(9, 4) != pytest.approx(score(9, 5), rel=1e-3)
    rotated = apply_rope(q, cos[9:10], sin[9:10])
    assert torch.equal(rotated[..., rot:], q[..., rot:]), "features past rotary_dim pass through"
    torch.testing.assert_close(rotated.norm(), q.norm())


# ---- RNG ----------------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _unshift_xor(x: int, shift: int) -> int:
    result = x
    for _ in range(32 // shift + 1):
        result = x ^ (result >> shift)
    return result


def _inverse_hash32(x: int) -> int:
    """The inverse of rng.hash32 (lowbias32 is a bijection on 32-bit words)."""
    x = _unshift_xor(x, 16)
    x = (x * pow(0x846CA68B, -1, 1 << 32)) & _M32
    x = _unshift_xor(x, 15)
    x = (x * pow(0x7FEB352D, -1, 1 << 32)) & _M32
    return _unshift_xor(x, 16)


def _hash32(x: int) -> int:
    return int(rng.hash32(torch.tensor([x]))[0])


def _index_with_bits(seed: int, stream: int, bits: int) -> int:
    """The index whose 32 random bits in ``rng.uniform(seed, stream, index)`` are ``bits``."""
    key = _hash32((seed & _M32) ^ _hash32(stream & _M32))
    return (_inverse_hash32(_inverse_hash32(bits) ^ key) - key) & _M32


def test_uniform_is_reproducible_per_seed_stream_index():
    index = torch.arange(10_000)
    u = rng.uniform(7, 3, index)
    assert torch.equal(u, rng.uniform(torch.tensor(7), torch.tensor(3), index.clone()))
    permutation = torch.randperm(index.numel(), generator=gen(8))
    assert torch.equal(rng.uniform(7, 3, index[permutation]), u[permutation]), "no hidden generator state"
    assert not torch.equal(u, rng.uniform(8, 3, index))
    assert not torch.equal(u, rng.uniform(7, 4, index))
    assert abs(float(u.mean()) - 0.5) < 0.01
    histogram = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert (histogram - 1000).abs().max() < 150


@pytest.mark.parametrize("seed,stream", [(0, 0), (7, 3), (2 ** 40 + 5, 123_456)])
def test_uniform_is_strictly_inside_unit_interval(seed, stream):
    """Including the draws whose random bits are the largest and smallest possible (found by inverting the hash):
    a 1.0 would make the sampler's Gumbel noise infinite."""
    assert _inverse_hash32(_hash32(0xDEADBEEF)) == 0xDEADBEEF
    top, bottom = _index_with_bits(seed, stream, _M32), _index_with_bits(seed, stream, 0)
    index = torch.cat([torch.arange(100_000), torch.tensor([top, bottom])])
    u = rng.uniform(seed, stream, index)
    assert (float(u[-2]), float(u[-1])) == (float(u.max()), float(u.min())), "the extreme draws were found"
    assert bool((u > 0).all()), f"min {float(u.min())}"
    assert bool((u < 1).all()), f"max {float(u.max())} at index {int(index[u.argmax()])}"


# ---- checksum -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [64, 67])
def test_checksum_detects_every_single_byte_change(size):
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen(9))
    original = checksum(data)
    assert checksum(data.clone()) == original
    for position in range(size):
        for flip in (0x01, 0x80, 0xFF):
            damaged = data.clone()
            damaged[position] ^= flip
            assert checksum(damaged) != original, f"byte {position} ^ {flip:#x} went unnoticed"


def test_checksum_is_order_sensitive():
    data = torch.arange(1, 65, dtype=torch.uint8)
    original = checksum(data)
    swapped_bytes = data.clone()
    swapped_bytes[[10, 11]] = swapped_bytes[[11, 10]]
    swapped_words = data.view(torch.int32).clone()
    swapped_words[[2, 3]] = swapped_words[[3, 2]]
    assert checksum(swapped_bytes) != original
    assert checksum(swapped_words.view(torch.uint8)) != original
    assert checksum(data.flip(0)) != original
    assert checksum(data.roll(4)) != original


@pytest.mark.parametrize("rows", [2, 5, 8])
def test_a_few_row_projection_on_the_cpu_rounds_each_row_as_if_it_sat_first(rows):
    """model.linear: a speculative verify's rows (up to GEMV_ROWS) each get the bytes of the same row placed first
    (MKL's GEMM rounds a row by its place: row 4 of 5 on an AVX2 EPYC); one row and longer pieces are F.linear."""
    from flashrt_ros.runtime.model import GEMV_ROWS, linear
    x, weight = torch.randn(rows, 64, generator=gen(rows)), torch.randn(320, 64, generator=gen(100 + rows))
    full = linear(x, weight)
    for row in range(rows):
        order = [row] + [r for r in range(rows) if r != row]
        assert torch.equal(linear(x[order], weight)[0], full[row]), row
    assert torch.allclose(full, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    long = torch.randn(GEMV_ROWS + 1, 64, generator=gen(7))
    assert torch.equal(linear(long, weight), F.linear(long, weight)) and torch.equal(linear(x[:1], weight),
                                                                                      F.linear(x[:1], weight))
