"""The Qwen3.5 hybrid text model (Gated DeltaNet + gated full attention + optional MTP head) over an arena.

Module and parameter names mirror the HF checkpoint (``model.layers.N.linear_attn.in_proj_qkv.weight``, ...), so a
``model.safetensors`` loads with ``load_state_dict``. The forward pass reads and writes the stream's state only
through the arena views it is bound to, and keeps the position on the device, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .arena import LAST_TOKEN, POSITION, ROPE_DELTA, Arena
from .config import ModelConfig
from .kernels import KernelSet, output_gate
from .vision.encoder import VisionEncoder
from .kernels.rope import mrope_components, mrope_rows
from .kernels.dense_gemv import MAX_ROWS as GEMV_ROWS
from .quant import QuantLinear


# Prefill pieces up to this length run as one graph replay on CUDA, padded to a multiple of PIECE_BUCKET; the
# padding rows are masked out of every state write, so whatever they hold the arena ends byte-identical. (Against
# the same tokens run unpadded it agrees within rounding only: GEMM libraries round a row differently for another
# row count.) Longer pieces run eagerly over exactly the live span (and may use fla-core's chunked delta rule).
SMALL_PIECE = 64
PIECE_BUCKET = 8


@dataclasses.dataclass(frozen=True)
class StepRows:
    """A decode or speculative-verify step: a fixed number of rows (the same for every step, so each GEMM has one
    shape and a row's bytes do not depend on which row it is or on the others), of which the first ``live`` are
    tokens. ``states`` (verify only) receives the fixed-size state after each live row, ``hidden`` [rows, H] the
    final hidden state of every row."""
    live: int
    states: object | None = None        # speculative.RowStates
    hidden: torch.Tensor | None = None


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Default RoPE inverse frequencies over the rotary part of the head (fp32, CPU)."""
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float) / cfg.rotary_dim))


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of ``parts``' outputs (one GEMM instead of several)."""
    weight = torch.cat([p.weight.data for p in parts], dim=0)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


@dataclasses.dataclass(frozen=True)
class Normed:
    """``rms_norm(x, scale, eps)``, left for the projection that reads it to compute in its prologue."""
    x: torch.Tensor
    scale: torch.Tensor
    eps: float


@dataclasses.dataclass(frozen=True)
class Gated:
    """``silu_mul(gate_up)``, left for the projection that reads it to compute in its prologue."""
    gate_up: torch.Tensor


def _gemv(kernels: KernelSet, rows: int):
    """The kernel set's dense GEMV when it takes ``rows`` rows, else None (cuBLAS through ``F.linear``)."""
    return kernels.dense_linear if kernels.dense_linear is not None and rows <= GEMV_ROWS else None


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)``, except that on the CPU each of a few rows (2..GEMV_ROWS) is its own one-row product
    (a batched GEMM of M = 1 each). A row's bytes must not depend on its place among the rows: a speculative verify
    commits any of its rows as the state a plain step would have written. MKL computes the rows left over from its
    row panels with other instructions (on an AVX2 EPYC, row 4 of a 5-row product rounds unlike rows 0-3; 4 or 8
    rows round alike). cuBLAS computes every row of a few-row GEMM alike (the GPU speculation tests)."""
    rows = x.reshape(-1, x.shape[-1])
    if x.device.type != "cpu" or not 1 < rows.shape[0] <= GEMV_ROWS:
        return F.linear(x, weight)
    per_row = torch.bmm(rows[:, None, :], weight.t().expand(rows.shape[0], -1, -1))
    return per_row.reshape(*x.shape[:-1], weight.shape[0])


def project(module: nn.Module, x, kernels: KernelSet, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``[residual +] module(x)`` for ``x`` a tensor, a :class:`Normed` or a :class:`Gated` input [L, ...]. A dense
    projection of few rows runs as the kernel set's dense GEMV with the input's norm or gate and the residual add
    fused in; otherwise the kernel set computes the input and the module (cuBLAS, or a quantized GEMV) multiplies."""
    tensor = x.x if isinstance(x, Normed) else x.gate_up if isinstance(x, Gated) else x
    gemv = _gemv(kernels, tensor.shape[0]) if isinstance(module, nn.Linear) else None
    if gemv is not None:
        norm, eps = (x.scale, x.eps) if isinstance(x, Normed) else (None, 0.0)
        return gemv(tensor, module.weight, norm, eps, isinstance(x, Gated), residual)
    if isinstance(x, Normed):
        tensor = kernels.rms_norm(x.x, x.scale, x.eps)
    elif isinstance(x, Gated):
        tensor = kernels.silu_mul(x.gate_up)
    y = linear(tensor, module.weight) if isinstance(module, nn.Linear) and module.bias is None else module(tensor)
    return y if residual is None else residual + y


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.scale: torch.Tensor | None = None   # (1 + weight) in fp32, computed once by Qwen35.bind


class MLP(nn.Module):
    """SwiGLU. HF's gate_proj and up_proj become one ``gate_up_proj`` (:func:`fusions`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, kernels, residual=None):
        return project(self.down_proj, Gated(project(self.gate_up_proj, x, kernels)), kernels, residual)


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

    def forward(self, x, conv_state, recurrent_state, count, dense: bool, kernels, step: "StepRows | None" = None,
                index: int = 0, residual=None):
        """``step``: a decode or verify step (see :class:`StepRows`); ``index``: this layer's among the DeltaNet
        layers (its slot in the step's per-row states); ``residual``: added to the output (see :func:`project`)."""
        cfg = self.cfg
        heads, head_dim = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        projected = project(self.in_proj, x, kernels)
        length = projected.shape[0]
        mixed, z, b, a = projected.split([cfg.conv_dim, cfg.linear_value_dim, heads, heads], dim=-1)
        if step is None:
            q, k, v = self._qkv(kernels.causal_conv(mixed, conv_state, self.conv1d.weight[:, 0, :], count))
            delta_rule = kernels.delta_rule_long if dense else kernels.gated_delta_rule
            core = delta_rule(q, k, v, a, b, self.A_log, self.dt_bias, recurrent_state, count)
        else:
            core = self._step_rows(mixed, a, b, conv_state, recurrent_state, step, index, kernels)
        core = kernels.gated_rms_norm(core, z.unflatten(-1, (heads, head_dim)), self.norm.weight, cfg.rms_norm_eps)
        return project(self.out_proj, core.reshape(length, cfg.linear_value_dim), kernels, residual)

    def _qkv(self, mixed):
        cfg = self.cfg
        q, k, v = mixed.split([cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim], dim=-1)
        return (q.unflatten(-1, (cfg.linear_num_key_heads, cfg.linear_key_head_dim)),
                k.unflatten(-1, (cfg.linear_num_key_heads, cfg.linear_key_head_dim)),
                v.unflatten(-1, (cfg.linear_num_value_heads, cfg.linear_value_head_dim)))

    def _step_rows(self, mixed, a, b, conv_state, recurrent_state, step: "StepRows", index: int, kernels):
        """The conv and the delta rule of a step's live rows. A decode step (one live row, no ``step.states``) runs
        the one-token kernels on the state; a verify runs the rows kernels, which compute every row's bytes as a
        one-token step would and keep the state after each row in ``step.states`` (the arena's state is left for
        the commit to replace). Rows past ``step.live`` are padding: their output is zero."""
        cfg = self.cfg
        live, weight = step.live, self.conv1d.weight[:, 0, :]
        core = torch.zeros(mixed.shape[0], cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                           dtype=mixed.dtype, device=mixed.device)
        if step.states is None:
            q, k, v = self._qkv(kernels.causal_conv(mixed[:live], conv_state, weight))
            core[:live] = kernels.gated_delta_rule(q, k, v, a[:live], b[:live], self.A_log, self.dt_bias,
                                                   recurrent_state)
            return core
        conv_rows, recurrent_rows = (step.states.view(slice(None), name)[:live, index]
                                     for name in ("conv", "recurrent"))
        q, k, v = self._qkv(kernels.causal_conv_rows(mixed[:live], conv_state, weight, conv_rows))
        core[:live] = kernels.gated_delta_rule_rows(q, k, v, a[:live], b[:live], self.A_log, self.dt_bias,
                                                    recurrent_state, recurrent_rows)
        return core


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

    def write_kv(self, x, cos, sin, positions, kv_cache, count, kernels):
        """Project x, write its normalised, rotated keys and its values into ``kv_cache`` at ``positions`` (rows
        below ``count``); return the rotated queries [L, H, D] and the output gate [L, H, D]."""
        cfg = self.cfg
        heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        projected = project(self.qkv_proj, x, kernels)
        length = projected.shape[0]
        query_gate, k, v = projected.split([heads * dim * 2, kv_heads * dim, kv_heads * dim], dim=-1)
        q, gate = query_gate.view(length, heads, 2 * dim).chunk(2, dim=-1)
        q = kernels.qk_norm_rope_kv_write(q, k.view(length, kv_heads, dim), v.view(length, kv_heads, dim),
                                          self.q_norm.scale, self.k_norm.scale, cfg.rms_norm_eps, cos, sin,
                                          kv_cache, positions, count)
        return q, gate

    def forward(self, x, cos, sin, positions, kv_cache, kv_len: int, count, dense: bool, kernels, residual=None):
        """kv_cache: this layer's [max_context, 2, Hkv, D] slice of the arena's position-major KV buffer.

        ``dense``: the queries are exactly the last L of ``kv_len`` positions (an eager prefill piece), so attention
        uses a flash kernel with an implicit causal bias; otherwise ``kv_len`` is a bucket and attention is masked.
        ``residual``: added to the output (see :func:`project`).
        """
        q, gate = self.write_kv(x, cos, sin, positions, kv_cache, count, kernels)
        length = q.shape[0]
        keys, values = kv_cache[:kv_len, 0], kv_cache[:kv_len, 1]
        if dense:
            out = output_gate(kernels.attention_prefill(q, keys, values), gate)
        else:
            out = kernels.attention_decode(q, keys, values, positions, gate)
        return project(self.o_proj, out.reshape(length, -1), kernels, residual)


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


def fusions(cfg: ModelConfig) -> dict[type, tuple[str, list[str], list[int]]]:
    """Per module class: the fused projection, the HF projections it concatenates (rows in this order) and their
    row counts. in_proj = [qkv | z | b | a], gate_up_proj = [gate | up], qkv_proj = [query+gate | key | value]:
    the projections of one input as one GEMM."""
    kv = cfg.num_key_value_heads * cfg.head_dim
    return {GatedDeltaNet: ("in_proj", ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"],
                            [cfg.conv_dim, cfg.linear_value_dim, cfg.linear_num_value_heads,
                             cfg.linear_num_value_heads]),
            MLP: ("gate_up_proj", ["gate_proj", "up_proj"], [cfg.intermediate_size] * 2),
            Attention: ("qkv_proj", ["q_proj", "k_proj", "v_proj"],
                        [2 * cfg.num_attention_heads * cfg.head_dim, kv, kv])}


class Qwen35(nn.Module):
    def __init__(self, cfg: ModelConfig, with_vision: bool = False):
        """``with_vision``: build the vision tower (``visual``) when the config has one (``weights.load`` does by
        default); ``visual`` is None otherwise, and what only decodes (shapes, floors) builds the text model alone."""
        super().__init__()
        self.cfg = cfg
        self.model = TextModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.mtp_num_hidden_layers:
            self.mtp = MTPHead(cfg)
        self.visual = VisionEncoder(cfg.vision) if cfg.vision is not None and with_vision else None
        self.arena: Arena | None = None
        self.kernels: KernelSet | None = None

    def fuse_projections(self) -> None:
        """Concatenate the weights of projections that read the same input (:func:`fusions`)."""
        table = fusions(self.cfg)
        for module in list(self.modules()):
            if type(module) in table:
                fused, parts, _ = table[type(module)]
                setattr(module, fused, _fused_linear([getattr(module, p) for p in parts]))
                for part in parts:
                    delattr(module, part)

    def fused_parts(self) -> dict[str, list[tuple[str, int]]]:
        """Each fused weight's HF source weights in row order: ``{"...mlp.gate_up_proj.weight":
        [("...mlp.gate_proj.weight", rows), ("...mlp.up_proj.weight", rows)], ...}`` (the model fused or not)."""
        table, out = fusions(self.cfg), {}
        for name, module in self.named_modules():
            if type(module) in table:
                fused, parts, rows = table[type(module)]
                out[f"{name}.{fused}.weight"] = [(f"{name}.{p}.weight", r) for p, r in zip(parts, rows)]
        return out

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under HF checkpoint names (fused projections split back into views; nothing copied)."""
        parts, out = self.fused_parts(), {}
        for name, tensor in self.state_dict().items():
            if name not in parts:
                out[name] = tensor
                continue
            for (part, _), piece in zip(parts[name], tensor.split([rows for _, rows in parts[name]], dim=0)):
                out[part] = piece
        return out

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def bind(self, arena: Arena, kernels: KernelSet) -> None:
        """Attach the arena and the kernel set; build the static RoPE tables (one row per position), which rotary
        feature follows which M-RoPE component, and the fp32 norm scales."""
        cfg = self.cfg
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.scale = 1.0 + module.weight.float()
        self.arena, self.kernels = arena, kernels
        self.dense_layers = not any(isinstance(m, QuantLinear) for m in self.model.layers.modules())
        max_context = arena["kv"].shape[0]
        device, dtype = arena["hidden"].device, arena["hidden"].dtype
        freqs = torch.arange(max_context, dtype=torch.float)[:, None] * rope_inv_freq(cfg)[None, :]
        freqs = torch.cat([freqs, freqs], dim=-1)
        self.rope_cos = freqs.cos().to(device=device, dtype=dtype)
        self.rope_sin = freqs.sin().to(device=device, dtype=dtype)
        self.rope_components = mrope_components(cfg.rotary_dim, cfg.mrope_section).to(device)
        self.offsets = torch.arange(max_context, device=device)

    def logits(self, hidden: torch.Tensor | None = None, vocab: int | None = None) -> torch.Tensor:
        """Next-token logits (fp32) from ``hidden`` (default: the last hidden state in the arena), through the
        quantized LM head that ``weights.load`` builds, if any; with ``vocab``, of the first ``vocab`` token ids
        only (the head's leading rows: a contiguous view, read alone)."""
        hidden = self.arena["hidden"] if hidden is None else hidden
        head = getattr(self, "quantized_head", None)
        if head is not None:
            return head(hidden, out_features=vocab).float()
        weight = self.output_weight()[:vocab]
        flat = hidden.reshape(-1, weight.shape[1])
        gemv = _gemv(self.kernels, flat.shape[0])
        if gemv is not None:
            return gemv(flat, weight).reshape(*hidden.shape[:-1], -1).float()
        return linear(hidden, weight).float()

    def rope_rows(self, positions: torch.Tensor, rope_positions: torch.Tensor | None = None):
        """cos, sin [L, R] of tokens at KV rows ``positions`` [L]: text tokens rotate at their row plus the arena's
        ROPE_DELTA; ``rope_positions`` [L, 3] (an ingest with images) gives every token's M-RoPE position instead."""
        if rope_positions is None:
            rotary = positions + self.arena["meta"][ROPE_DELTA]
            return self.rope_cos[rotary], self.rope_sin[rotary]
        return (mrope_rows(self.rope_cos, rope_positions, self.rope_components),
                mrope_rows(self.rope_sin, rope_positions, self.rope_components))

    def forward(self, tokens: torch.Tensor, kv_len: int, count: torch.Tensor | None = None,
                dense: bool = False, step: StepRows | None = None, embeds: torch.Tensor | None = None,
                rope_positions: torch.Tensor | None = None) -> None:
        """Append tokens to the stream: update every state buffer, the last hidden state and the position.

        ``tokens`` [L]; ``count`` (a 0-d int64 device tensor) says how many of them are real: the rest pad a
        fixed-size bucket and touch no state. None means all L. ``kv_len`` bounds the attention span: a bucket
        >= position + L (it selects a graph, not a result), or with ``dense`` exactly position + L (eager pieces).
        ``step``: a decode or verify step of ``count`` (= ``step.live``) tokens (see :class:`StepRows`).
        ``embeds`` [L, H]: the input embeddings when they are not the tokens' own (an image's rows); ``rope_positions``
        [L, 3]: every token's M-RoPE position (see :meth:`rope_rows`).
        """
        arena, cfg = self.arena, self.cfg
        kernels = self.kernels
        meta = arena["meta"]
        length = tokens.shape[0]
        eps = cfg.rms_norm_eps
        positions = (meta[POSITION] + self.offsets[:length]).clamp_max(self.offsets.shape[0] - 1)
        cos, sin = self.rope_rows(positions, rope_positions)
        embeds = self.model.embed_tokens(tokens) if embeds is None else embeds
        layers = self.model.layers
        # fused: every projection is the dense GEMV, which norms its input and adds the residual (see _add_norm)
        fused = self.dense_layers and _gemv(kernels, length) is not None
        x = embeds
        h = (Normed(x, layers[0].input_layernorm.scale, eps) if fused
             else kernels.rms_norm(x, layers[0].input_layernorm.scale, eps))
        linear_idx = attn_idx = 0
        for index, layer in enumerate(layers):
            residual = x if fused else None
            if layer.is_linear:
                mixed = layer.linear_attn(h, arena["conv"][linear_idx], arena["recurrent"][linear_idx], count, dense,
                                          kernels, step, linear_idx, residual)
                linear_idx += 1
            else:
                mixed = layer.self_attn(h, cos, sin, positions, arena["kv"][:, attn_idx], kv_len, count, dense,
                                        kernels, residual)
                attn_idx += 1
            h, x = self._add_norm(mixed, x, layer.post_attention_layernorm, fused)
            following = layers[index + 1].input_layernorm if index + 1 < len(layers) else self.model.norm
            h, x = self._add_norm(layer.mlp(h, kernels, x if fused else None), x, following, fused)
        hidden = kernels.rms_norm(h.x, h.scale, eps) if fused else h      # the final norm's output
        if step is not None and step.hidden is not None:
            step.hidden.copy_(hidden)
        if cfg.mtp_num_hidden_layers:
            self._mtp_forward(embeds, hidden, cos, sin, positions, count, kernels)
        if count is None:
            arena["hidden"].copy_(hidden[-1])
            meta[LAST_TOKEN] = tokens[-1]
            meta[POSITION] += length
        else:   # index_select: indexing with a device scalar would read it on the host (not capturable)
            last = (count - 1).view(1)
            arena["hidden"].copy_(hidden.index_select(0, last)[0])
            meta[LAST_TOKEN:LAST_TOKEN + 1].copy_(tokens.index_select(0, last))
            meta[POSITION] += count

    def _add_norm(self, mixed, x, norm: RMSNorm, fused: bool):
        """(the next sublayer's input, the residual stream) after a sublayer whose output is ``mixed``. Fused: the
        sublayer's output projection has added the residual (``mixed`` is the stream) and the next projections norm
        it in their prologue; else one add + norm kernel."""
        if fused:
            return Normed(mixed, norm.scale, self.cfg.rms_norm_eps), mixed
        return self.kernels.add_rms_norm(mixed, x, norm.scale, self.cfg.rms_norm_eps)

    def _mtp_forward(self, embeds, hidden, cos, sin, positions, count, kernels) -> None:
        """Advance the MTP head's KV: the pair at position p is (hidden state before token p, embedding of token p).

        Only the KV write is state; the head's output is computed by :meth:`mtp_draft` when it drafts."""
        eps = self.cfg.rms_norm_eps
        previous = torch.cat([self.arena["hidden"][None], hidden[:-1]], dim=0)
        x = self._mtp_input(embeds, previous)
        layer = self.mtp.layers[0]
        layer.self_attn.write_kv(kernels.rms_norm(x, layer.input_layernorm.scale, eps), cos, sin, positions,
                                 self.arena["mtp_kv"][:, 0], count, kernels)

    def _mtp_input(self, embeds, previous):
        """The MTP layer's input: fc(cat(norm(embedding of token p), norm(hidden state before p)))."""
        mtp, eps, kernels = self.mtp, self.cfg.rms_norm_eps, self.kernels
        return project(mtp.fc, torch.cat([kernels.rms_norm(embeds, mtp.pre_fc_norm_embedding.scale, eps),
                                          kernels.rms_norm(previous, mtp.pre_fc_norm_hidden.scale, eps)], dim=-1),
                       kernels)

    def mtp_draft(self, token: torch.Tensor, previous: torch.Tensor, position: torch.Tensor,
                  kv_len: int) -> torch.Tensor:
        """One step of the MTP head: the pair (``previous`` hidden state [1, H], embedding of ``token`` [1]) at
        ``position`` [1] writes the head's KV there and returns the head's final hidden state [1, H], whose logits
        predict the token after ``token`` (a draft; a chain of drafts feeds this output back as ``previous``)."""
        layer, eps, kernels = self.mtp.layers[0], self.cfg.rms_norm_eps, self.kernels
        x = self._mtp_input(self.model.embed_tokens(token), previous)
        h = kernels.rms_norm(x, layer.input_layernorm.scale, eps)
        cos, sin = self.rope_rows(position)
        mixed = layer.self_attn(h, cos, sin, position,
                                self.arena["mtp_kv"][:, 0], kv_len, None, False, kernels)
        h, x = kernels.add_rms_norm(mixed, x, layer.post_attention_layernorm.scale, eps)
        return kernels.add_rms_norm(layer.mlp(h, kernels), x, self.mtp.norm.scale, eps)[0]
