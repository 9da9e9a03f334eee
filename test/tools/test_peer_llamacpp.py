"""The llama.cpp peer benchmark's pieces that can be checked on the CPU (bench/peer_llamacpp).

- The GGUF the sdist's converter writes from our weights holds exactly our tensors: read back with gguf-py and
  compared with an independent statement of llama.cpp's qwen35 layout (names, ``1 + w`` norms, ``-exp(A_log)``,
  grouped-to-tiled V heads), bit for bit in bf16.
- ggml's interleaved MRoPE (``ggml_mrope_cache_init`` in ggml-cpu/ops.cpp), fed the 4-D positions llama.cpp builds
  for text tokens (t = h = w = p, e = 0), rotates every pair by p * our inverse frequency: it is our 1-D partial RoPE.
- With a CPU build of llama.cpp present (bench/peer_llamacpp/build-cpu), greedy tokens and logits of both agree
  on the tiny preset in float32.

Skipped without the trimmed source (``python3 bench/peer_llamacpp/prepare_source.py``); CI does not build llama.cpp.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flashrt_ros.runtime.config import PRESETS
from flashrt_ros.runtime.model import rope_inv_freq
from flashrt_ros.runtime import weights

PEER = Path(__file__).resolve().parents[2] / "bench" / "peer_llamacpp"
SRC = PEER / "llama.cpp"
BINARY = PEER / "build-cpu" / "bin" / "peer_timing"

needs_source = pytest.mark.skipif(not (SRC / "convert_hf_to_gguf.py").is_file(),
                                  reason="no trimmed llama.cpp source: run bench/peer_llamacpp/prepare_source.py")
sys.path.insert(0, str(PEER))

from fidelity import run as fidelity_run  # noqa: E402
from gguf_writer import import_converter, imrope_sections, read_metadata, write_gguf  # noqa: E402
import results  # noqa: E402


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    model, _ = weights.load("tiny", torch.device("cpu"), torch.bfloat16, seed=3)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(model, path, "bf16")
    return model, path


def _reader(path):
    gguf, _ = import_converter(SRC)
    return gguf, gguf.GGUFReader(str(path))


def _tiled(t: torch.Tensor, dim: int, k_heads: int, head_dim: int) -> torch.Tensor:
    """V heads grouped by K head ([g0v0, g0v1, g1v0, ...]) to tiled order ([g0v0, g1v0, g0v1, ...]) along dim."""
    n = t.shape[dim]
    index = torch.arange(n).reshape(k_heads, n // (k_heads * head_dim), head_dim).transpose(0, 1).reshape(n)
    return t.index_select(dim, index)


def _expected(model) -> dict[str, torch.Tensor]:
    """llama.cpp's qwen35 tensors from our HF-named weights, written out independently of the converter."""
    cfg, hf = model.cfg, model.hf_state_dict()
    k, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    f32 = lambda t: t.float()                                       # noqa: E731
    out = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": 1 + f32(hf["model.norm.weight"])}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = hf["lm_head.weight"]
    for i, kind in enumerate(cfg.layer_types):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out |= {b + "attn_norm.weight": 1 + f32(hf[p + "input_layernorm.weight"]),
                b + "post_attention_norm.weight": 1 + f32(hf[p + "post_attention_layernorm.weight"]),
                b + "ffn_gate.weight": hf[p + "mlp.gate_proj.weight"], b + "ffn_up.weight": hf[p + "mlp.up_proj.weight"],
                b + "ffn_down.weight": hf[p + "mlp.down_proj.weight"]}
        if kind == "full_attention":
            a = p + "self_attn."
            out |= {b + "attn_q.weight": hf[a + "q_proj.weight"], b + "attn_k.weight": hf[a + "k_proj.weight"],
                    b + "attn_v.weight": hf[a + "v_proj.weight"], b + "attn_output.weight": hf[a + "o_proj.weight"],
                    b + "attn_q_norm.weight": 1 + f32(hf[a + "q_norm.weight"]),
                    b + "attn_k_norm.weight": 1 + f32(hf[a + "k_norm.weight"])}
            continue
        a = p + "linear_attn."
        qkv, qk = hf[a + "in_proj_qkv.weight"], 2 * k * dk
        conv = hf[a + "conv1d.weight"][:, 0, :]
        out |= {b + "attn_qkv.weight": torch.cat([qkv[:qk], _tiled(qkv[qk:], 0, k, dv)]),
                b + "attn_gate.weight": _tiled(hf[a + "in_proj_z.weight"], 0, k, dv),
                b + "ssm_beta.weight": _tiled(hf[a + "in_proj_b.weight"], 0, k, 1),
                b + "ssm_alpha.weight": _tiled(hf[a + "in_proj_a.weight"], 0, k, 1),
                b + "ssm_a": _tiled(-torch.exp(f32(hf[a + "A_log"])), 0, k, 1),
                b + "ssm_dt.bias": _tiled(f32(hf[a + "dt_bias"]), 0, k, 1),
                b + "ssm_conv1d.weight": f32(torch.cat([conv[:qk], _tiled(conv[qk:], 0, k, dv)])),
                b + "ssm_norm.weight": f32(hf[a + "norm.weight"]),
                b + "ssm_out.weight": _tiled(hf[a + "out_proj.weight"], 1, k, dv)}
    return out


@needs_source
def test_gguf_holds_our_weights_bit_for_bit(tiny_bf16):
    model, path = tiny_bf16
    assert model.cfg.linear_num_key_heads < model.cfg.linear_num_value_heads   # the V-head reorder is exercised
    gguf, reader = _reader(path)
    expected = _expected(model)
    found = {t.name: t for t in reader.tensors}
    assert set(found) == set(expected)
    for name, want in expected.items():
        t = found[name]
        if want.dtype == torch.bfloat16:
            assert t.tensor_type == gguf.GGMLQuantizationType.BF16, name
            got = np.frombuffer(t.data.tobytes(), dtype=np.uint16).reshape(want.shape)
            np.testing.assert_array_equal(got, want.contiguous().view(torch.int16).numpy().view(np.uint16), err_msg=name)
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
            np.testing.assert_array_equal(np.asarray(t.data).reshape(want.shape), want.numpy(), err_msg=name)


@needs_source
def test_gguf_metadata_describes_the_preset(tiny_bf16):
    model, path = tiny_bf16
    cfg = model.cfg
    _, reader = _reader(path)
    field = lambda key: reader.fields[f"qwen35.{key}"].contents()   # noqa: E731
    assert reader.fields["general.architecture"].contents() == "qwen35"
    assert field("block_count") == cfg.num_layers                    # the MTP head is left out
    assert field("attention.recurrent_layers") == [t == "linear_attention" for t in cfg.layer_types]
    assert field("rope.dimension_count") == cfg.rotary_dim
    assert field("rope.freq_base") == pytest.approx(cfg.rope_theta)
    assert (field("ssm.group_count"), field("ssm.time_step_rank"), field("ssm.state_size")) == \
        (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == cfg.vocab_size
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == cfg.eos_token_ids[0]


@needs_source
def test_fast_metadata_reader_matches_gguf_py(tiny_bf16, tmp_path):
    _, path = tiny_bf16
    _, reader = _reader(path)
    fields = read_metadata(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields.keys() == expected.keys()
    for key, value in expected.items():
        assert fields[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_metadata(tmp_path / "not.gguf")


def _ggml_imrope_theta(sections: list[int], n_dims: int, head_dim: int, base: float, pos: int) -> np.ndarray:
    """ggml_mrope_cache_init's angle per rotary pair (is_imrope, no YaRN, freq_scale 1), for llama.cpp's text
    positions: t = h = w = pos, e = 0 (llm_graph_input_pos::set_input)."""
    sect_dims = sum(sections)
    assert sect_dims <= head_dim, "GGML_ASSERT(sect_dims <= ne0)"
    theta_scale = base ** (-2.0 / n_dims)
    theta_t = theta_h = theta_w = float(pos)
    theta_e = 0.0
    out = []
    for i0 in range(0, n_dims, 2):
        sector = (i0 // 2) % sect_dims
        if sector % 3 == 1 and sector < 3 * sections[1]:
            theta = theta_h
        elif sector % 3 == 2 and sector < 3 * sections[2]:
            theta = theta_w
        elif sector % 3 == 0 and sector < 3 * sections[0]:
            theta = theta_t
        else:
            theta = theta_e
        out.append(theta)
        theta_t, theta_h, theta_w, theta_e = (x * theta_scale for x in (theta_t, theta_h, theta_w, theta_e))
    return np.array(out)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("pos", [0, 1, 7, 2047, 16383, 65535])
def test_interleaved_mrope_reduces_to_our_partial_rope_for_text(preset, pos):
    cfg = PRESETS[preset]
    sections = imrope_sections(cfg.rotary_dim)
    theta = _ggml_imrope_theta(sections, cfg.rotary_dim, cfg.head_dim, cfg.rope_theta, pos)
    ours = pos * rope_inv_freq(cfg).double().numpy()
    np.testing.assert_allclose(theta, ours, rtol=1e-6, atol=0)   # ours is fp32, as is ggml


def test_imrope_sections_that_leave_a_pair_on_the_extra_axis_do_not_reduce():
    cfg = PRESETS["qwen3.5-0.8b"]
    theta = _ggml_imrope_theta([11, 11, 9, 0], cfg.rotary_dim, cfg.head_dim, cfg.rope_theta, 100)
    assert theta[29] == 0.0 and not np.allclose(theta, 100 * rope_inv_freq(cfg).double().numpy())
    assert imrope_sections(64) == [11, 11, 10, 0]          # the converter's default for Qwen3.5's 64 rotary dims


@needs_source
@pytest.mark.skipif(not BINARY.is_file(), reason="no CPU build of llama.cpp (see bench/peer_llamacpp/README.md)")
def test_llama_cpp_agrees_with_our_engine_on_tiny_float32(tmp_path):
    from flashrt_ros.runtime.engine import Engine, EngineConfig
    engine = Engine(EngineConfig(model="tiny", dtype="float32", max_context=128, prefill_chunk=64, seed=5))
    result = fidelity_run(engine, BINARY, prompt_len=40, gen=12, workdir=tmp_path, ngl=0, kv="f32", threads=2)
    assert result["rows"] == 13
    assert result["top1_agreement"] == 1.0
    assert result["greedy_tokens_equal"] == 12
    assert result["logit_corr_min"] > 0.99999
    assert result["rel_l2"] < 1e-3


def test_results_compare_like_for_like_and_judge_the_targets():
    """Figures as bench and peer_timing write them; llama.cpp's set_data (3.0 ms) over our full restore (0.2 ms)."""
    ours = {"rows": [{"context": 2048, "cold_ttft_ms": 40.0, "decode_ms_per_token": 1.5, "capsule_bytes": 2**20,
                      "snapshot_p50_ms": 0.2, "restore_p50_ms": 0.2, "lineage_restore_p50_ms": 0.05,
                      "capsule_ttft_ms": 2.2}],
            "model": "m", "kernels": "k", "dtype": "bfloat16"}
    peer = {"llama_cpp_commit": "0c1e57098bba", "n_ubatch": 2048, "kv_cache": "f16", "rows": [
        {"context": 2048, "cold_ttft_ms": 60.0, "decode_ms_per_token": 1.2, "state_host_bytes": 2**21,
         "state_get_host_ms": 20.0, "state_set_host_ms": 30.0, "state_get_device_ms": 1.0, "state_set_device_ms": 3.0,
         "restore_suffix_ttft_host_ms": 50.0, "restore_suffix_ttft_device_ms": 21.0, "first_token_cold": 1,
         "first_token_host_restore": 1, "first_token_device_restore": 1}, {"context": 8192}]}
    rows = results.paired(ours, peer)
    assert [o["context"] for o, _, _ in rows] == [2048]              # contexts only llama.cpp ran are left out
    ratio = rows[0][2]
    assert ratio["restore_speedup_device"] == pytest.approx(15.0)     # against our full restore, not the lineage one
    assert ratio["lineage_restore_speedup_device"] == pytest.approx(60.0)
    met = {t["target"]: t["met"] for t in results.targets(rows)}
    assert met == {results.TARGETS[0][0]: False, results.TARGETS[1][0]: False, results.TARGETS[2][0]: True,
                   results.TARGETS[3][0]: False}
    text = results.section(ours, peer, None, {"device": "d", "command": "c", "commit": "x", "date": "2026-12-03"})
    assert "| 2048 | 40.00 / 60.00 (1.50x) | 1.50 / 1.20 (0.80x) |" in text
    assert "equals its cold prefill's" in text and "our decode <= llama.cpp's at 2048 (0.80x)" in text
