"""The Qwen3.5 hybrid text model (Gated DeltaNet + gated full attention + optional MTP head) over an arena.

Module and parameter names mirror the HF checkpoint (``model.layers.N.linear_attn.in_proj_qkv.weight``, ...), so a
``model.safetensors`` loads with ``load_state_dict``. The forward pass reads and writes the stream's state only
through the arena views it is bound to, and keeps the position on the device, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .arena import LAST_TOKEN, POSITION, Arena
from .config import ModelConfig


# Prefill pieces up to this length are graph-captured on CUDA and always use the reference delta-rule kernel, so
# graph-captured and eager runs compute the same bytes; longer pieces may use fla-core.
SMALL_PIECE = 64


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Default RoPE inverse frequencies over the rotary part of the head (fp32, CPU)."""
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float) / cfg.rotary_dim))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.scale: torch.Tensor | None = None   # (1 + weight) in fp32, computed once by Qwen35.bind

    def forward(self, x):
        return kernels.rms_norm(x, self.scale, self.eps)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, cfg.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, cfg.linear_value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, cfg.linear_num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, cfg.linear_num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.linear_conv_kernel_dim, groups=cfg.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(cfg.linear_num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.linear_num_value_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(cfg.linear_value_head_dim))
        self.out_proj = nn.Linear(cfg.linear_value_dim, cfg.hidden_size, bias=False)

    def forward(self, x, conv_state, recurrent_state, use_fla: bool):
        cfg, length = self.cfg, x.shape[0]
        mixed = kernels.causal_conv(self.in_proj_qkv(x), conv_state, self.conv1d.weight[:, 0, :])
        q, k, v = mixed.split([cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim], dim=-1)
        q = q.reshape(length, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
        k = k.reshape(length, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
        v = v.reshape(length, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        if length == 1:
            core = kernels.delta_rule_recurrent(q, k, v, g, beta, recurrent_state)
        elif use_fla and length > SMALL_PIECE:
            core = kernels.delta_rule_fla(q, k, v, g, beta, recurrent_state)
        else:
            core = kernels.delta_rule_chunked(q, k, v, g, beta, recurrent_state)
        z = self.in_proj_z(x).reshape(length, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
        core = kernels.gated_rms_norm(core, z, self.norm.weight, cfg.rms_norm_eps)
        return self.out_proj(core.reshape(length, cfg.linear_value_dim))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, heads * dim * 2, bias=False)   # query and output gate, per head
        self.k_proj = nn.Linear(cfg.hidden_size, kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, positions, kv_cache, kv_len: int, dense: bool):
        """kv_cache: this layer's [max_context, 2, Hkv, D] slice of the arena's position-major KV buffer.

        ``dense``: the queries are exactly the last L of ``kv_len`` positions (an eager prefill chunk), so attention
        uses a flash kernel with an implicit causal bias; otherwise ``kv_len`` is a bucket and attention is masked.
        """
        cfg, length = self.cfg, x.shape[0]
        q, gate = self.q_proj(x).view(length, cfg.num_attention_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
        q = kernels.apply_rope(self.q_norm(q), cos, sin)
        k = kernels.apply_rope(self.k_norm(self.k_proj(x).view(length, cfg.num_key_value_heads, cfg.head_dim)),
                               cos, sin)
        v = self.v_proj(x).view(length, cfg.num_key_value_heads, cfg.head_dim)
        kv_cache[:, 0].index_copy_(0, positions, k)
        kv_cache[:, 1].index_copy_(0, positions, v)
        attend = kernels.attention_causal if dense else kernels.attention_masked
        out = attend(q, kv_cache[:kv_len, 0], kv_cache[:kv_len, 1], *(() if dense else (positions,)))
        out = out.reshape(length, -1) * torch.sigmoid(gate.reshape(length, -1))
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str):
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, mixer_out):
        x = x + mixer_out
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPHead(nn.Module):
    """Multi-token-prediction head: one full-attention layer fed by fc(cat(norm(embed(t+1)), norm(h_t)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention")])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = TextModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.mtp_num_hidden_layers:
            self.mtp = MTPHead(cfg)
        self.arena: Arena | None = None
        self.use_fla = False

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def bind(self, arena: Arena, use_fla: bool = False) -> None:
        """Attach the arena; build the static RoPE tables (one row per position) and the fp32 norm scales."""
        cfg = self.cfg
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.scale = 1.0 + module.weight.float()
        self.arena, self.use_fla = arena, use_fla
        max_context = arena["kv"].shape[0]
        device, dtype = arena["hidden"].device, arena["hidden"].dtype
        freqs = torch.arange(max_context, dtype=torch.float)[:, None] * rope_inv_freq(cfg)[None, :]
        freqs = torch.cat([freqs, freqs], dim=-1)
        self.rope_cos = freqs.cos().to(device=device, dtype=dtype)
        self.rope_sin = freqs.sin().to(device=device, dtype=dtype)
        self.offsets = torch.arange(max_context, device=device)

    def logits(self) -> torch.Tensor:
        """Next-token logits (fp32) from the last hidden state in the arena."""
        return F.linear(self.arena["hidden"], self.output_weight()).float()

    def forward(self, tokens: torch.Tensor, kv_len: int, dense: bool = False) -> None:
        """Append ``tokens`` [L] to the stream: update every state buffer, the last hidden state and the position.

        ``kv_len`` bounds the attention span: a bucket >= position + L (it selects a graph, not a result), or with
        ``dense`` exactly position + L (eager prefill chunks).
        """
        arena, cfg = self.arena, self.cfg
        meta = arena["meta"]
        length = tokens.shape[0]
        positions = meta[POSITION] + self.offsets[:length]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        embeds = self.model.embed_tokens(tokens)
        x = embeds
        linear_idx = attn_idx = 0
        for layer in self.model.layers:
            h = layer.input_layernorm(x)
            if layer.is_linear:
                mixed = layer.linear_attn(h, arena["conv"][linear_idx], arena["recurrent"][linear_idx], self.use_fla)
                linear_idx += 1
            else:
                mixed = layer.self_attn(h, cos, sin, positions, arena["kv"][:, attn_idx], kv_len, dense)
                attn_idx += 1
            x = layer(x, mixed)
        hidden = self.model.norm(x)
        if cfg.mtp_num_hidden_layers:
            self._mtp_forward(embeds, hidden, cos, sin, positions, kv_len, dense)
        arena["hidden"].copy_(hidden[-1])
        meta[LAST_TOKEN] = tokens[-1]
        meta[POSITION] += length

    def _mtp_forward(self, embeds, hidden, cos, sin, positions, kv_len: int, dense: bool) -> None:
        """Advance the MTP head's KV: the pair at position p is (hidden state before token p, embedding of token p)."""
        mtp = self.mtp
        previous = torch.cat([self.arena["hidden"][None], hidden[:-1]], dim=0)
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(embeds), mtp.pre_fc_norm_hidden(previous)], dim=-1))
        layer = mtp.layers[0]  # only its KV write is state; its output feeds speculative decoding (a later issue)
        layer.self_attn(layer.input_layernorm(x), cos, sin, positions, self.arena["mtp_kv"][:, 0], kv_len, dense)
