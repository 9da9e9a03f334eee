"""The engine: one model, one live stream in one arena, and capsules of it.

Public calls validate everything first and raise :class:`FlashRTError` before touching any state, so a refused
request leaves the live state and every capsule byte-identical. Every call ends at a commit boundary.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import itertools
import operator
import time
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from .arena import RNG_COUNTER, RNG_SEED, ROPE_DELTA, Arena, buffer_specs
from .capsule import file as capsule_io
from .capsule import tiers as capsule_tiers
from .capsule.capsule import FIXED, Block, CapsuleInfo, Layout, StoredCapsule, row_parts
from .capsule.manager import CapsuleManager
from .capsule.live import LiveCopier
from .capsule.store import CapsuleStore
from .checksum import checksum
from .config import PRESETS
from . import constraint as constraints
from .constraint import Constraint, ConstraintState
from .errors import ErrorCode, FlashRTError
from .graphs import GraphRunner
from .kernels import apply_mask, quant_gemv
from . import kernels as kernel_sets
from . import platform, quant
from .model import PIECE_BUCKET, SMALL_PIECE
from .sampler import Sampler, SamplingParams
from .speculative import MASK_ROWS, MAX_SPECULATIVE_TOKENS, STEP_ROWS, Stats, Stepper
from .tokenizer import load_tokenizer
from .vision.captured import CapturedTower
from .vision.layout import Item, ingest_length, lay_out
from .vision.prepared import PreparedImage
from .vision.preprocess import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, Image, preprocess
from .weights import load, weights_digest

COMPILED_GRAMMARS = 32      # grammars kept compiled (compile_constraint)
PLAN_VERSION = "flashrt-plan-2"   # 2: fused projections, padded piece buckets, fixed 64-row delta-rule chunks
# speculative_tokens > 0: every decode step is a STEP_ROWS-row step (speculative.py), whose bytes differ from the
# one-row step's, so capsules of the two plans are told apart by their fingerprints
SPECULATIVE_PLAN_VERSION = "flashrt-plan-3-spec"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MIN_KV_BUCKET = 256
# the released Qwen3-VL / Qwen3.5 processor's pixel budget per image (its preprocessor_config "size")
_log = logging.getLogger("flashrt.runtime")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"                 # preset name or local HF folder
    device: str = "cpu"
    dtype: str = "float32"
    max_context: int = 2048
    prefill_chunk: int = 64             # tokens per prefill piece (a power of two)
    cuda_graphs: bool = True
    use_fla: bool = True                # fla-core chunked kernel for long prefill pieces on CUDA when installed
    kernels: str = "auto"               # auto | triton | reference (see kernels.select)
    dense_gemv: str = "cublas"          # cublas | triton: the dense projections of decode and verify (kernels.select)
    weights_format: str = "dense"       # dense | fp8 | nvfp4 (see quant.py)
    weights_exclude: tuple[str, ...] = ()   # fnmatch patterns of projections kept dense (``lm_head``: the LM head)
    capsule_budget_bytes: int = 256 << 20
    capsule_budget_fraction: float = 0.0    # > 0: cap the budget at this share of MemAvailable (host-memory devices)
    history_depth: int = 32
    checksum_on_snapshot: bool = True
    seed: int = 0
    capsule_dir: str = ""               # export/import folder, <capsule_dir>/<id>.capsule ("" = none)
    capsule_key_file: str = ""          # HMAC key that signs and checks capsule files ("" = unsigned files)
    capsule_evict_policy: str = "refuse"    # refuse | lru: spill least-recently-used unpinned capsules down a tier
    capsule_host_budget_bytes: int = 1 << 30   # pinned host tier (discrete GPUs only; 0 = none)
    max_capsules: int = 1024            # capsules stored at once, on every tier (each costs time in every listing)
    speculative_tokens: int = 0         # MTP drafts verified per decode step (0 = off; see speculative.py)
    draft_vocab: int = 0                # drafts pick among the first draft_vocab token ids (0 = all; speed only)
    vision_tower: bool = True           # build the model's vision tower when it has one (False: images are refused)
    image_min_pixels: int = DEFAULT_MIN_PIXELS   # an image is resized into [min, max] pixels before the tower
    image_max_pixels: int = DEFAULT_MAX_PIXELS

    def validate(self) -> "EngineConfig":
        def bad(why):
            return FlashRTError(ErrorCode.INVALID_ARGUMENT, f"engine config: {why}")
        if self.dtype not in _DTYPES:
            raise bad(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_context < 1:
            raise bad("max_context must be >= 1")
        if self.prefill_chunk < 1 or self.prefill_chunk & (self.prefill_chunk - 1):
            raise bad(f"prefill_chunk must be a power of two, got {self.prefill_chunk}")
        if self.kernels not in kernel_sets.CHOICES:
            raise bad(f"kernels must be one of {list(kernel_sets.CHOICES)}, got {self.kernels!r}")
        if self.dense_gemv not in kernel_sets.DENSE_GEMV_CHOICES:
            raise bad(f"dense_gemv must be one of {list(kernel_sets.DENSE_GEMV_CHOICES)}, got {self.dense_gemv!r}")
        if self.history_depth < 1 or self.capsule_budget_bytes < 0:
            raise bad("history_depth must be >= 1 and capsule_budget_bytes >= 0")
        if self.weights_format not in quant.FORMATS:
            raise bad(f"weights_format must be one of {list(quant.FORMATS)}, got {self.weights_format!r}")
        if self.capsule_evict_policy not in capsule_tiers.POLICIES:
            raise bad(f"capsule_evict_policy must be one of {list(capsule_tiers.POLICIES)}, "
                      f"got {self.capsule_evict_policy!r}")
        if self.capsule_host_budget_bytes < 0:
            raise bad("capsule_host_budget_bytes must be >= 0")
        if self.max_capsules < 1:
            raise bad(f"max_capsules must be >= 1, got {self.max_capsules}")
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise bad(f"speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {self.speculative_tokens}")
        if self.draft_vocab < 0:
            raise bad(f"draft_vocab must be >= 0 (0 = the whole vocabulary), got {self.draft_vocab}")
        if not 0.0 <= self.capsule_budget_fraction <= 1.0:
            raise bad(f"capsule_budget_fraction must be in [0, 1], got {self.capsule_budget_fraction}")
        if not 0 < self.image_min_pixels <= self.image_max_pixels:
            raise bad(f"image pixel budget needs 0 < image_min_pixels <= image_max_pixels, got "
                      f"{self.image_min_pixels} and {self.image_max_pixels}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise FlashRTError(ErrorCode.LOAD_FAILED, f"device {self.device!r} requested but CUDA is not available")
        return self


@dataclasses.dataclass(frozen=True)
class _Boundary:
    """A commit boundary kept for rollback: its position and where its fixed-size state is, either a history slot
    (arena layout) or the fixed block of the capsule it was restored from (no copy needed)."""
    position: int
    slot: int | None = None
    fixed: Block | None = None


def _pieces(count: int, chunk: int) -> list[int]:
    """Split a prefill into full chunks, then the rest: its multiple of SMALL_PIECE as one eager piece, and what
    remains (< SMALL_PIECE) as one small piece. The split depends on the length alone, so a capsule at a
    chunk-aligned position plus a suffix runs exactly the pieces that a cold prefill of the whole runs."""
    pieces = [chunk] * (count // chunk)
    rest = count % chunk
    if rest > SMALL_PIECE:
        pieces.append(rest - rest % SMALL_PIECE)
        rest %= SMALL_PIECE
    return pieces + ([rest] if rest else [])


def _piece_bucket(length: int) -> int:
    """The padded length a small piece runs at (one captured graph per bucket)."""
    return -(-length // PIECE_BUCKET) * PIECE_BUCKET


class Engine:
    @torch.no_grad()
    def __init__(self, config: EngineConfig = EngineConfig()):
        self.config = cfg = config.validate()
        self.capsule_dir = capsule_io.prepare_capsule_dir(cfg.capsule_dir) if cfg.capsule_dir else None
        self._capsule_key = capsule_io.load_key(cfg.capsule_key_file) if cfg.capsule_key_file else None
        self.device = torch.device(cfg.device)
        dtype = _DTYPES[cfg.dtype]
        folder = None if cfg.model in PRESETS else Path(cfg.model)
        self.platform = platform.probe(self.device, dtype)     # raises LOAD_FAILED if the device cannot compute
        self.model, self.weights_format = load(cfg.model, self.device, dtype, cfg.seed, cfg.weights_format,
                                               cfg.weights_exclude, use_triton=self.platform.quant_triton,
                                               with_vision=cfg.vision_tower)
        self.model.eval().requires_grad_(False)
        self.model_config = self.model.cfg
        if cfg.max_context > self.model_config.max_position_embeddings:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"max_context {cfg.max_context} exceeds the model's "
                                                           f"{self.model_config.max_position_embeddings} positions")
        self.tokenizer = load_tokenizer(folder)
        self.arena = Arena(buffer_specs(self.model_config, cfg.max_context, dtype), self.device)
        self._position: int | None = None                     # see the position property
        self.kernels, self.kernel_reason = kernel_sets.select(cfg.kernels, self.device, cfg.use_fla,
                                                                 cfg.dense_gemv)
        _log.info("kernels: %s (%s)", self.kernels.name, self.kernel_reason)
        self.kernel_name = self.kernels.name
        self.model.bind(self.arena, self.kernels)
        if cfg.speculative_tokens and not self.model_config.mtp_num_hidden_layers:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"speculative_tokens {cfg.speculative_tokens} needs the "
                                                           f"model's MTP head, and {cfg.model!r} has none")
        self.sampler = Sampler(self.model_config.vocab_size, self.device)
        self._sampling: SamplingParams | None = None
        # constrained decoding: the static mask the decode step reads, the live matcher (a capsule's: its info)
        self._mask_words = constraints.mask_words(self.model_config.vocab_size, self.device,
                                                  MASK_ROWS if cfg.speculative_tokens else 1)
        self._mask_lookup = constraints.mask_lookup(self.model_config.vocab_size, self.device)
        self.constraint: Constraint | None = None
        self._masks_written = False          # mask words may hold a matcher's masks (see _set_constraint)
        self._compiled_grammars: dict[tuple[str, str], ConstraintState] = {}   # see compile_constraint
        self._mask_of: tuple[Constraint, int] | None = None     # the matcher state the mask words hold the mask of
        self._token_host = torch.zeros(1, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._mask_host = torch.zeros(self._mask_words.shape[1], dtype=torch.int32,    # staging of the next mask
                                      pin_memory=self.device.type == "cuda")
        self._llg_tokenizer = None
        self._tokens = torch.zeros(max(cfg.prefill_chunk, PIECE_BUCKET, STEP_ROWS), dtype=torch.int64,
                                   device=self.device)
        # the speculative plan's steps (None: main's one-row decode step, see _plain_step)
        self.stepper = (Stepper(self.model, self.sampler, self._tokens, self._mask_words, self._mask_lookup,
                                self._draft_vocab(cfg.draft_vocab)) if cfg.speculative_tokens else None)
        self.speculative_stats = Stats()          # since start
        self.generation_stats = Stats()           # of the last generate call
        self._count = torch.ones((), dtype=torch.int64, device=self.device)  # real tokens of a small piece
        self.plan = SPECULATIVE_PLAN_VERSION if cfg.speculative_tokens else PLAN_VERSION
        self._fingerprints = self._compute_fingerprints(dtype)      # of either plan, to name a mismatch
        self.fingerprint = self._fingerprints[self.plan]
        self.layout = Layout.of(self.arena)
        self.store = CapsuleStore(platform.capsule_budget_bytes(cfg.capsule_budget_bytes, cfg.capsule_budget_fraction,
                                                              self.platform, platform.mem_available_bytes()),
                                self.layout, cfg.max_capsules)
        self.live = LiveCopier(self.arena, self.layout, self.store)   # snapshots take, restores write
        self.last_restore_bytes = 0
        self.tiers = capsule_tiers.Tiers(self.store, self.device, self.capsule_dir, self._capsule_key,
                                         self.platform.pinned_host_tier, cfg.capsule_host_budget_bytes,
                                         cfg.capsule_evict_policy)
        self.capsule_manager = CapsuleManager(self.store, self.tiers, self._check_fingerprint, cfg.max_context,
                                              self.arena.live_nbytes, on_settle=self._release_freed_boundary,
                                              check_constraint=self._rebuilt_constraint)
        # capsule files of this engine in capsule_dir are disk-tier capsules; why the others were refused
        self.capsule_dir_refused = self.tiers.index(self._check_fingerprint, self.arena.live_nbytes)
        self._fixed_span = self.arena.specs["kv"].offset
        self._history = torch.zeros(cfg.history_depth, self._fixed_span, dtype=torch.uint8, device=self.device)
        self._boundaries: deque[_Boundary] = deque()          # oldest first
        self._carry: tuple[_Boundary, SamplingParams] | None = None     # see _take_carried_pick
        self._next_slot = 0
        self.live_parent = ""
        self.kv_buckets = self._kv_bucket_sizes()
        self.graphs = GraphRunner(cfg.cuda_graphs and self.device.type == "cuda")
        self._tower_graphs = CapturedTower(self.device, self.graphs.enabled)
        self._warm_up()
        if self.graphs.enabled:
            self._capture_graphs()
        self.stats_ttft_ms = 0.0
        self.stats_tokens_per_s = 0.0
        self._last_ingest_s = 0.0
        self.reset()

    # ---- properties --------------------------------------------------------------------------------------
    def _draft_vocab(self, requested: int) -> int:
        if requested > self.model_config.vocab_size:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"draft_vocab {requested} exceeds the model's vocabulary "
                                                           f"of {self.model_config.vocab_size} tokens")
        return requested or self.model_config.vocab_size

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def max_context(self) -> int:
        return self.config.max_context

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.model_config.eos_token_ids

    @property
    def position(self) -> int:
        """The live position. Every operation that moves it records where it ends (``_moved_to``), so reading it
        costs no device sync; after an operation that failed part-way it is read from the arena once."""
        if self._position is None:
            self._position = self.arena.position()
        return self._position

    def _moved_to(self, position: int | None) -> None:
        """Record the live position an operation ends at (None: unknown, read from the arena when next needed)."""
        self._position = position

    @property
    def arena_bytes(self) -> int:
        return self.arena.nbytes

    @property
    def capsule_bytes_used(self) -> int:
        return self.store.used_bytes

    @property
    def capsule_budget_bytes(self) -> int:
        return self.store.budget_bytes

    def stats(self) -> dict:
        return {"position": self.position, "ttft_ms": self.stats_ttft_ms,
                "decode_tokens_per_s": self.stats_tokens_per_s, "arena_bytes": self.arena_bytes,
                "capsule_bytes": self.capsule_bytes_used, "capsule_budget_bytes": self.capsule_budget_bytes,
                "capsule_count": len(self.store.infos()), "capsule_host_bytes": self.store.host_bytes,
                "capsule_tiers": ",".join(self.tiers.names), "capsule_tier_error": self.tiers.disk_failure,
                "kernel": self.kernel_name,
                "kernel_reason": self.kernel_reason, "weights_format": self.weights_format,
                "cuda_graphs": len(self.graphs.graphs), "speculative_tokens": self.config.speculative_tokens,
                "acceptance_rate": self.speculative_stats.acceptance_rate,
                "tokens_per_step": self.speculative_stats.tokens_per_step, **self.platform.diagnostics()}

    # ---- execution ---------------------------------------------------------------------------------------
    def _kv_bucket_sizes(self) -> list[int]:
        sizes, size = [], _MIN_KV_BUCKET
        while size < self.config.max_context:
            sizes.append(size)
            size *= 2
        return sizes + [self.config.max_context]

    def _kv_bucket(self, end: int) -> int:
        return next(b for b in self.kv_buckets if b >= end)

    def _piece_step(self, bucket: int, kv_len: int):
        """A small piece: ``bucket`` tokens of which ``self._count`` are real."""
        return lambda: self.model.forward(self._tokens[:bucket], kv_len, count=self._count)

    def _piece_buckets(self) -> list[int]:
        return list(range(PIECE_BUCKET, _piece_bucket(min(SMALL_PIECE, self.config.prefill_chunk)) + 1,
                          PIECE_BUCKET))

    def _sample_step(self, greedy: bool):
        """The first part of the plain plan's decode step (one row, speculative_tokens 0): the next token, masked,
        into ``_tokens[0]``."""
        def sample():
            logits, words = self.model.logits(), self._mask_words[:1]
            if greedy:
                token = self.model.kernels.greedy_pick(logits[None], words, self._mask_lookup)
            else:
                token = self.sampler.sample(apply_mask(logits, words[0], self._mask_lookup), self.arena["meta"])
            self._tokens[:1].copy_(token)
        return sample

    def _forward_step(self, kv_len: int):
        """The second part: the model over ``_tokens[0]``."""
        return lambda: self.model.forward(self._tokens[:1], kv_len)

    def _plain_step(self, greedy: bool, kv_len: int) -> int:
        """A plain decode step, its token released once picked: the pick runs (its own graph), the token is copied
        to the host, the forward is launched (its own graph), and the host waits for the pick only. While the device
        runs the forward the caller has the token (a stream's tokens come one forward sooner: the first after an
        ingest as soon as it is picked), and under a constraint the matcher accepts it and computes the next token's
        mask, whose copy into the mask words the stream orders after the forward. Every later operation is ordered
        after the forward on the same stream, so what it sees is the state after the token. Returns the token
        (accepted by the constraint, if one is live)."""
        self.graphs.run(("sample", greedy), self._sample_step(greedy))
        self._token_host.copy_(self._tokens[:1], non_blocking=True)
        picked = torch.cuda.Event() if self.device.type == "cuda" else None
        if picked is not None:
            picked.record()
        self.graphs.run(("forward", kv_len), self._forward_step(kv_len))
        if picked is not None:
            picked.synchronize()              # the pick only: the forward goes on
        token = int(self._token_host[0])
        if self.constraint is not None:
            self.constraint.accept(token)
            if not self.constraint.stopped:
                self._fill_mask()
        return token

    def _refresh_mask(self) -> None:
        """The live matcher's mask into the mask words, unless they hold it already (the step before computed it
        while its forward ran: :meth:`_plain_step`)."""
        if self.constraint is not None and self._mask_of != (self.constraint, len(self.constraint.tokens)):
            self._fill_mask()

    def _fill_mask(self) -> None:
        """The live matcher's mask of the next token into the mask words (row 0), noting which state it is of."""
        self.constraint.fill_mask(self._mask_words[0], self._mask_host)
        self._mask_of = (self.constraint, len(self.constraint.tokens))

    def _step(self, drafts: int, greedy: bool, kv_len: int, carried: bool = False):
        """The graph key and the function of the speculative plan's STEP_ROWS-row step with ``drafts`` drafts (this
        sets its live row count, drafts + 1; ``carried``: it takes the pick the verify before made, see
        :meth:`_take_carried_pick`). The plain plan's step is :meth:`_plain_step`."""
        self.stepper.count.fill_(drafts + 1)
        return ("step", drafts, greedy, kv_len, carried), self.stepper.step(drafts, greedy, kv_len, carried)

    def _take_carried_pick(self, params: SamplingParams) -> bool:
        """Whether the next step may start from the pick the last verify made after its committed rows
        (``Stepper.next_pick``): only while the live state is still the one that verify made live (the same commit
        boundary object: any restore, rollback, fork into the live state or ingest replaces it), under the same
        sampling and no grammar. Taken once: the step that uses it makes the next."""
        carry, self._carry = self._carry, None
        return (carry is not None and carry[0] is self._boundaries[-1] and carry[1] == params
                and self.constraint is None)

    def _constrained_step(self, drafts: int, greedy: bool, kv_len: int) -> None:
        """A speculative step with drafts under the live constraint: its two parts run apart, and between them the
        matcher walks the picked token and the drafts to mask each verify row (``Constraint.fill_verify_masks``), so
        every check is the grammar's pick and no draft the grammar forbids is accepted."""
        self.stepper.count.fill_(drafts + 1)
        self.graphs.run(("draft", drafts, greedy, kv_len), self.stepper.draft(drafts, greedy, kv_len))
        self.constraint.fill_verify_masks(self._tokens[:drafts + 1].tolist(), self._mask_words)
        self.graphs.run(("verify", drafts, greedy, kv_len), self.stepper.verify(drafts, greedy, kv_len))

    def _warm_up(self) -> None:
        """Run one eager long piece, so its kernels compile (Triton JIT, autotuning) before any request. Mutates
        the arena (reset afterwards)."""
        length = min(self.config.prefill_chunk, self.config.max_context) // SMALL_PIECE * SMALL_PIECE
        if length > SMALL_PIECE:
            self._tokens[:length].zero_()
            self.model.forward(self._tokens[:length], length, dense=True)

    def _capture_graphs(self) -> None:
        """Capture the decode steps (greedy and sampled, with 0 .. speculative_tokens drafts) and every small-piece
        bucket for every KV bucket, after the eager warm-up has compiled their kernels. Mutates the arena.

        Larger pieces run eagerly: they are compute-bound, so a graph would save nothing measurable."""
        def prepare():
            self.arena.storage.zero_()
            self._tokens.zero_()
            self._count.fill_(1)
        for kv_len in self.kv_buckets:
            if self.stepper is None:          # the plain step's second part (_plain_step)
                self.graphs.capture(("forward", kv_len), self._forward_step(kv_len), prepare)
            else:
                for greedy, k, carried in itertools.product((True, False), range(self.config.speculative_tokens + 1),
                                                            (False, True)):
                    self.graphs.capture(*self._step(k, greedy, kv_len, carried), prepare)
                    if k and not carried:     # a constrained step's two parts (_constrained_step)
                        self.graphs.capture(("draft", k, greedy, kv_len), self.stepper.draft(k, greedy, kv_len),
                                            prepare)
                        self.graphs.capture(("verify", k, greedy, kv_len), self.stepper.verify(k, greedy, kv_len),
                                            prepare)
            for bucket in self._piece_buckets():
                self.graphs.capture(("piece", bucket, kv_len), self._piece_step(bucket, kv_len), prepare)
        if self.stepper is None:
            for greedy in (True, False):
                self.graphs.capture(("sample", greedy), self._sample_step(greedy), prepare)
        torch.cuda.synchronize(self.device)

    def _feed(self, start: int, token_ids: Sequence[int], embeds: torch.Tensor | None = None,
              rope_positions: torch.Tensor | None = None) -> None:
        """Run the model over ``token_ids`` appended at ``start``, in :func:`_pieces`. With images: ``embeds``
        [N, H] (the image rows replaced) and ``rope_positions`` [N, 3]; their pieces run eagerly, each small one
        padded to its bucket exactly as its graph would be (padding rows repeat the last real row's inputs)."""
        offset = 0
        for length in _pieces(len(token_ids), self.config.prefill_chunk):
            end = start + offset + length
            rows = length if length > SMALL_PIECE else _piece_bucket(length)
            if embeds is None:
                inputs = {}
            else:
                real = offset + torch.arange(rows, device=self.device).clamp_max(length - 1)
                inputs = {"embeds": embeds[real], "rope_positions": rope_positions[real]}
            if length <= SMALL_PIECE:
                kv_len = self._kv_bucket(end)
                padded = token_ids[offset:offset + length] + [0] * (rows - length)
                self._tokens[:rows].copy_(torch.tensor(padded, dtype=torch.int64), non_blocking=True)
                self._count.fill_(length)
                if inputs:
                    self.model.forward(self._tokens[:rows], kv_len, count=self._count, **inputs)
                else:
                    self.graphs.run(("piece", rows, kv_len), self._piece_step(rows, kv_len))
            else:
                self._tokens[:length].copy_(torch.tensor(token_ids[offset:offset + length], dtype=torch.int64))
                self.model.forward(self._tokens[:length], end, dense=True, **inputs)
            offset += length

    # ---- history for rollback(steps=k) --------------------------------------------------------------------
    def _push_boundary(self, position: int) -> None:
        """Record the fixed-size state at this commit boundary; KV is append-only, so it needs no copy."""
        slot = self._next_slot
        self._next_slot = (slot + 1) % self.config.history_depth
        if len(self._boundaries) == self.config.history_depth:
            self._boundaries.popleft()
        self._history[slot].copy_(self.arena.storage[:self._fixed_span], non_blocking=True)
        self._boundaries.append(_Boundary(position, slot=slot))

    def _restart_history(self, fixed: Block | None = None) -> None:
        """After the live state was replaced: the only boundary is now, backed by the capsule block ``fixed`` if it
        holds the live fixed-size state."""
        self._boundaries.clear()
        if fixed is None:
            self._push_boundary(self.position)
        else:
            self._boundaries.append(_Boundary(self.position, fixed=fixed))

    # ---- stream ------------------------------------------------------------------------------------------
    def _check_tokens(self, items: Iterable, position: int) -> list[Item]:
        """Token ids checked and images prepared and checked (:meth:`_prepare_image`), all before anything
        changes; the ids and images as a list."""
        checked: list[Item] = []
        for item in items:
            try:
                checked.append(operator.index(item))
            except TypeError:
                image = self._prepare_image(item)
                if image is None:
                    raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "token ids must be integers (or images)") from None
                checked.append(image)
        bad = [t for t in checked if isinstance(t, int) and not 0 <= t < self.vocab_size]
        if bad:
            raise FlashRTError(ErrorCode.TOKEN_OUT_OF_RANGE,
                               f"token id(s) {bad[:5]} outside [0, {self.vocab_size})")
        length = ingest_length(checked)
        if position + length > self.max_context:
            raise FlashRTError(ErrorCode.CONTEXT_OVERFLOW, f"{length} tokens at position {position} exceed "
                                                           f"max_context {self.max_context}")
        return checked

    @property
    def visual(self):
        """The vision tower (``model.visual``), or None: the model has none, or ``vision_tower`` is off."""
        return getattr(self.model, "visual", None)

    def _prepare_image(self, item) -> PreparedImage | None:
        """``item`` as a checked PreparedImage (an ``Image`` preprocessed under the engine's pixel budget), or None
        when it is not an image. INVALID_ARGUMENT: no vision tower, or a grid, patch shape or size the tower
        cannot take."""
        if not isinstance(item, (PreparedImage, Image)):
            return None
        vision = self.model_config.vision
        if vision is None or self.visual is None:
            why = "has no vision tower" if vision is None else "was started with vision_tower off"
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"an image was sent, but model {self.config.model!r} {why}")
        if isinstance(item, Image):
            item = preprocess(item, vision, self.config.image_min_pixels, self.config.image_max_pixels)
        return self._check_image(item, vision)

    def _check_image(self, image: PreparedImage, vision) -> PreparedImage:
        def bad(why):
            return FlashRTError(ErrorCode.INVALID_ARGUMENT, f"image: {why}")
        merge = vision.spatial_merge_size
        try:
            t, h, w = (operator.index(n) for n in image.grid)
        except (TypeError, ValueError):
            raise bad(f"grid must be three integers (t, h, w), got {image.grid!r}") from None
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise bad(f"grid {image.grid} must be positive, its h and w multiples of {merge} (zero-size image?)")
        if image.spatial_merge_size != merge:
            raise bad(f"prepared for spatial_merge_size {image.spatial_merge_size}, the tower merges {merge}")
        pixels = h * w * vision.patch_size ** 2
        if pixels > self.config.image_max_pixels:
            raise bad(f"{pixels} pixels ({h} x {w} patches of {vision.patch_size}) exceed image_max_pixels "
                      f"{self.config.image_max_pixels}")
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        patches = image.patches
        if (not isinstance(patches, torch.Tensor) or not patches.is_floating_point()
                or tuple(patches.shape) != (t * h * w, width)):
            raise bad(f"patches must be a float tensor [{t * h * w}, {width}] for grid {image.grid}, got "
                      f"{getattr(patches, 'dtype', type(patches).__name__)} {tuple(getattr(patches, 'shape', ()))}")
        if not bool(torch.isfinite(patches).all()):
            raise bad("patches hold NaN or infinite values")
        return image

    def _encode(self, image: PreparedImage) -> torch.Tensor:
        """The tower's embeddings of one image [token_count, hidden] in the model dtype."""
        out = self._tower_graphs(self.visual, image.patches, image.grid)
        if tuple(out.shape) != (image.token_count, self.model_config.hidden_size):
            raise FlashRTError(ErrorCode.INTERNAL, f"the vision tower gave {tuple(out.shape)} for grid {image.grid}, "
                                                   f"not [{image.token_count}, {self.model_config.hidden_size}]")
        return out.to(self.arena["hidden"].dtype)

    @property
    def rope_delta(self) -> int:
        """The live ROPE_DELTA (the next text token's rotary position minus its row; 0 without images)."""
        return int(self.arena["meta"][ROPE_DELTA])

    # ---- checks a caller runs before it changes anything (the engine's own calls run them too) ------------
    def check_ingest(self, items: Iterable, after_tokens: int = 0) -> list[Item]:
        """TOKEN_OUT_OF_RANGE / CONTEXT_OVERFLOW / INVALID_ARGUMENT unless ``items`` (token ids and images:
        ``PreparedImage`` or ``Image``) can be appended now (after ``after_tokens`` more positions, still to be
        ingested); returns them checked, every image prepared (``vision.ingest_length`` gives their length)."""
        return self._check_tokens(items, self.position + after_tokens)

    def check_generate(self, after_tokens: int = 0) -> None:
        """INVALID_ARGUMENT if generating would start from an empty context (after ``after_tokens`` more)."""
        if self.position + after_tokens == 0:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "empty context: ingest at least one token first")

    @staticmethod
    def check_seed(seed: int) -> None:
        if not 0 <= seed < 2 ** 63:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"seed must be in [0, 2**63), got {seed}")

    @torch.inference_mode()
    def ingest(self, items: Sequence) -> int:
        """Append token ids and images to the context (chunked prefill) as one commit boundary; returns the new
        position. An image is ``<vision_start> <image_pad> * token_count <vision_end>`` with the pads' embeddings
        the vision tower's, run before anything changes."""
        started = time.perf_counter()
        start = self.position
        items = self._check_tokens(items, start)
        if not items:
            return start
        images = [item for item in items if isinstance(item, PreparedImage)]
        features = [self._encode(image) for image in images]
        layout = lay_out(items, self.model_config.vision, start, self.rope_delta) if images else None
        ids = items if layout is None else layout.token_ids
        self.constrain(None)              # the stream left the constrained generation
        self.live.rows.truncate(start)
        self._moved_to(None)
        if layout is None:
            self._feed(start, ids)
        else:
            embeds = self.model.model.embed_tokens(torch.tensor(ids, device=self.device))
            for (row, image), feature in zip(layout.images, features):
                embeds[row:row + image.token_count] = feature
            self._feed(start, ids, embeds, layout.rope_positions.to(self.device))
            self.arena["meta"][ROPE_DELTA] = layout.rope_delta
        self._moved_to(start + len(ids))
        self._push_boundary(start + len(ids))
        self._last_ingest_s = time.perf_counter() - started
        return start + len(ids)

    def generate(self, max_new_tokens: int, sampling: SamplingParams | None = None,
                 stop_token_ids: Iterable[int] | None = None) -> Iterator[int]:
        """Validate now; then yield one token per commit boundary. Stop iterating at any time: the state stays
        consistent at the last yielded token. Ends early at a stop token or when the context is full."""
        params = sampling or SamplingParams()
        if max_new_tokens < 0:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self.check_generate()
        stops = set(self.eos_token_ids if stop_token_ids is None else stop_token_ids)
        return self._generate(max_new_tokens, params, stops)

    def _drafts(self, position: int, remaining: int) -> int:
        """How many drafts the step at ``position`` verifies: the configured number, fewer where the context, the
        tokens still wanted or the first row's KV bucket (which every row attends over) end sooner; none on the plain
        plan, without a bucket lookup per token."""
        if self.stepper is None:
            return 0
        bucket = self._kv_bucket(position + 1)
        return max(0, min(self.config.speculative_tokens, remaining - 1, self.max_context - position - 1,
                          bucket - position - 1))

    @torch.inference_mode()
    def _generate(self, max_new_tokens: int, params: SamplingParams, stops: set[int]) -> Iterator[int]:
        """Steps of 1 + accepted drafts tokens; each token is its own commit boundary: before it is yielded the
        state after it is made live, so any operation between two yields sees the state of plain decoding there.
        When one replaces the live state (a restore, rollback, ingest...), the step's remaining tokens are dropped
        and the next step starts from the new live state."""
        self.generation_stats = Stats()
        produced = 0
        while produced < max_new_tokens:
            position = self.position
            if position >= self.max_context:
                return
            started = time.perf_counter()
            if params != self._sampling:
                self.sampler.configure(params)
                self._sampling = params
            drafts = self._drafts(position, max_new_tokens - produced)
            kv_len = self._kv_bucket(position + 1)
            self.live.rows.truncate(position)
            self._moved_to(None)
            constrained = self.constraint is not None
            self._refresh_mask()
            accepted = constrained and self.stepper is None
            if self.stepper is None:
                tokens = [self._plain_step(params.greedy, kv_len)]
            else:
                carried = self._take_carried_pick(params)
                if drafts and constrained:
                    self._constrained_step(drafts, params.greedy, kv_len)
                else:
                    self.graphs.run(*self._step(drafts, params.greedy, kv_len, carried))
                tokens = self._tokens[:drafts + 1].tolist()
            committed = int(self.stepper.committed) if drafts else 1
            if drafts:
                self.stepper.invalidate(position + committed, position + drafts + 1)
            released = time.perf_counter()
            for stats in (self.speculative_stats, self.generation_stats):
                stats.add(drafts, committed)
            steps = self.generation_stats.steps
            if steps == 1:
                self.stats_ttft_ms = 1000.0 * (self._last_ingest_s + released - started)
            else:   # the stream's rate, release to release (a plain step's forward runs while the caller has its token)
                rate = committed / max(released - last_released, 1e-9)
                self.stats_tokens_per_s = rate if steps == 2 else 0.9 * self.stats_tokens_per_s + 0.1 * rate
            last_released = released
            for row, token in enumerate(tokens[:committed]):
                if drafts:
                    self.stepper.commit(row)
                if constrained:
                    if not accepted:
                        self.constraint.accept(token)
                    if self.constraint.stopped:
                        stops = stops | {token}
                self._moved_to(position + row + 1)
                self._push_boundary(position + row + 1)
                boundary = self._boundaries[-1]
                produced += 1
                yield token
                if token in stops:
                    if drafts:
                        self.stepper.invalidate(position + row + 1, position + committed)
                    return
                if self._boundaries[-1] is not boundary:     # the live state was replaced meanwhile
                    break
            else:
                if drafts and not constrained:
                    self._carry = (self._boundaries[-1], params)

    # ---- constrained decoding -----------------------------------------------------------------------------
    def compile_constraint(self, kind: str, text: str) -> ConstraintState:
        """Check a grammar against this engine's tokenizer (INVALID_ARGUMENT with the library's message); changes
        nothing live. The last :data:`COMPILED_GRAMMARS` grammars that compiled are kept, so a planner that sends
        the same schema with every observation compiles it once (a refused one is checked again each time)."""
        key = (kind, text)
        state = self._compiled_grammars.pop(key, None)
        if state is None:
            state = ConstraintState(constraints.compile_grammar(kind, text))
            Constraint(self._llg(), state)
        self._compiled_grammars[key] = state                  # the most recent last
        if len(self._compiled_grammars) > COMPILED_GRAMMARS:
            del self._compiled_grammars[next(iter(self._compiled_grammars))]
        return state

    def constrain(self, state: ConstraintState | None) -> None:
        """Constrain the next generated tokens (None: unconstrained). The matcher is live state: snapshots keep it,
        restores, forks and rollbacks bring it back."""
        self._set_constraint(None if state is None else Constraint(self._llg(), state))

    def _set_constraint(self, constraint: Constraint | None) -> None:
        """The live matcher. Mask words are written only while one is live, so they need clearing (every token
        allowed) only after one was: a restore of an unconstrained capsule into an unconstrained stream launches
        nothing for it."""
        self.constraint = constraint
        if constraint is not None:
            self._masks_written = True
        elif self._masks_written:
            self._mask_words.fill_(-1)
            self._masks_written = False

    def _llg(self):
        if self._llg_tokenizer is None:       # built once (for an HF vocabulary it takes about a second)
            self._llg_tokenizer = constraints.llg_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._llg_tokenizer

    def _rebuilt_constraint(self, info: CapsuleInfo) -> Constraint | None:
        """The matcher of a capsule's constraint, rebuilt from its state; CHECKSUM_MISMATCH if that fails (a file's
        state that this engine's tokenizer and grammar library do not replay: edited, or another tokenizer)."""
        state = info.constraint
        if state is None:
            return None
        try:
            if any(token >= self.vocab_size for token in state.tokens):
                raise FlashRTError(ErrorCode.TOKEN_OUT_OF_RANGE, f"token ids outside [0, {self.vocab_size})")
            return Constraint(self._llg(), state)
        except FlashRTError as err:
            raise FlashRTError(ErrorCode.CHECKSUM_MISMATCH, f"capsule {info.id!r}: its grammar state does not "
                                                            f"rebuild here ({err.message})") from None

    @torch.inference_mode()
    def peek_token(self) -> int:
        """The greedy next token (under the live constraint's mask), without committing it: the plain step's pick
        (:meth:`_plain_step`), run as a stream runs it (its graph, on CUDA), so the time it takes is what a stream's
        first token takes (scoring, TTFT measurement)."""
        self._refresh_mask()
        self.graphs.run(("sample", True), self._sample_step(True))
        return int(self._tokens[0])

    @torch.inference_mode()
    def next_token_logits(self) -> torch.Tensor:
        """fp32 logits for the token after the live context (for tests and verification)."""
        return self.model.logits().cpu()

    @torch.inference_mode()
    def reset(self) -> None:
        """Empty context, sampler reseeded to the configured seed; capsules are kept."""
        self.arena.storage.zero_()
        self.arena["meta"][RNG_SEED] = self.config.seed
        self._moved_to(0)
        self.constrain(None)
        self.live_parent = ""
        self.live.rows.clear()
        self._restart_history()

    @torch.inference_mode()
    def reseed(self, seed: int) -> None:
        self.check_seed(seed)
        self.arena["meta"][RNG_SEED] = seed
        self.arena["meta"][RNG_COUNTER] = 0
        self.live.rows.truncate(self.position)    # the fixed state changed: no stored block equals it now
        self._restart_history()

    # ---- capsules ----------------------------------------------------------------------------------------
    def _copy_live(self, position: int) -> torch.Tensor:
        data = torch.empty(self.arena.live_nbytes(position), dtype=torch.uint8, device=self.device)
        self.arena.read_live(position, data)
        return data

    def _new_capsule(self, capsule_id: str | None, label: str, parent: str) -> CapsuleInfo:
        new_id = self.store.new_id(capsule_id, label)
        position = self.position
        plan = self.live.plan(position)
        shared = {block.id for segments, _ in plan.values() for block, _, _ in segments}
        self.capsule_manager.make_room(self.live.plan_bytes(plan, position), label, protect=shared)
        rows = self.live.take(plan, position)
        info = CapsuleInfo(id=new_id, parent=parent, label=label, position=position,
                           nbytes=self.layout.nbytes(position), tier="device" if self.device.type == "cuda" else "host",
                           checksum=checksum(row_parts(rows)) if self.config.checksum_on_snapshot else "",
                           created=time.time(), constraint=None if self.constraint is None else self.constraint.state())
        self.store.add_rows(info, self.fingerprint, rows, lineage_parent=parent)
        self.live.taken(rows, position)
        return self.store.info(new_id)

    @torch.inference_mode()
    def snapshot(self, capsule_id: str | None = None, label: str = "", pinned: bool = False) -> CapsuleInfo:
        """A capsule of the live state. ``pinned``: it never leaves the device (the planner's root)."""
        self._settle()
        info = self._new_capsule(capsule_id, label, parent=self.live_parent)
        self.live_parent = info.id
        if pinned:
            self.store.get(info.id).pinned = True
            info = self.store.info(info.id)
        return info

    # ---- tiers and eviction (capsule.manager) ----------------------------------------------------------------
    def _settle(self) -> None:
        self.capsule_manager.settle()

    def _release_freed_boundary(self) -> None:
        """Release a rollback boundary whose bytes left the device (run after every settle)."""
        oldest = self._boundaries[0] if self._boundaries else None
        if oldest is not None and oldest.fixed is not None and oldest.fixed.id not in self.store.blocks:
            # the oldest rollback boundary still points at a capsule's freed fixed state: release it too
            if len(self._boundaries) == 1:
                self._restart_history()       # the live state is that boundary: keep it as a copy
            else:
                self._boundaries.popleft()

    @torch.inference_mode()
    def spill(self, capsule_id: str, tier: str = "", wait: bool = True) -> CapsuleInfo:
        """Move a capsule off the device: to ``tier`` (host | disk; "" = the next one down). Its device blocks are
        released at once. A disk spill with ``wait=False`` writes the file in the background: until it is complete
        the capsule is on the host tier (its staging copy, restorable); a failed write leaves it there. A disk
        spill of a capsule whose file is being written joins that write, whether or not it ends meanwhile."""
        return self.capsule_manager.spill(capsule_id, tier, wait)

    @torch.inference_mode()
    def fetch(self, capsule_id: str, wait: bool = True) -> CapsuleInfo:
        """Bring a host or disk tier capsule back onto the device (making room as the policy allows). A disk-tier
        capsule with ``wait=False`` (a prefetch) is read in the background and attached at the next capsule call;
        a restore of it waits for the read. Refused now if it could not fit."""
        return self.capsule_manager.fetch(capsule_id, wait)

    def pin(self, capsule_id: str, pinned: bool = True) -> CapsuleInfo:
        """Pin a capsule to the device (fetched first) or unpin it."""
        return self.capsule_manager.pin(capsule_id, pinned)

    def _load(self, capsule: StoredCapsule, constraint: Constraint | None, kv_only: bool = False) -> None:
        """Make the capsule live: its fixed state, only the KV rows the live arena does not already hold, and its
        matcher (``constraint``, rebuilt by the caller before it changed anything: _rebuilt_constraint)."""
        position = capsule.info.position
        self._moved_to(None)
        # what this restore wrote (a sibling: the fixed state + divergence)
        self.last_restore_bytes = self.live.load(capsule.rows, position, kv_only)
        self._moved_to(position)
        self.live_parent = capsule.info.id
        self.store.touch(capsule.info.id)
        self._set_constraint(constraint)
        self._restart_history(None if kv_only else capsule.rows[FIXED][0][0])

    @torch.inference_mode()
    def restore(self, capsule_id: str, verify_checksum: bool = False, kv_only: bool = False) -> CapsuleInfo:
        """Make the capsule the live state. ``kv_only`` restores only KV and metadata (an ablation: it diverges)."""
        constraint = self._rebuilt_constraint(self.store.get(capsule_id).info)     # before a fetch moves it
        capsule = self.capsule_manager.restorable(capsule_id, verify_checksum)
        self._load(capsule, constraint, kv_only)
        return self.store.info(capsule_id)

    @torch.inference_mode()
    def fork(self, source_id: str | None = None, capsule_id: str | None = None, label: str = "",
             switch: bool = False) -> CapsuleInfo:
        """A new, independent capsule of a capsule (or of the live state, when source_id is None)."""
        if source_id is None:
            info = self._new_capsule(capsule_id, label, parent=self.live_parent)
            if switch:
                self.live_parent = info.id
            return info
        new_id = self.store.new_id(capsule_id, label)
        constraint = self._rebuilt_constraint(self.store.get(source_id).info) if switch else None
        source = self.capsule_manager.restorable(source_id, verify_checksum=False)
        self.capsule_manager.make_room(0, label, keep_ids=(source_id,))
        info = dataclasses.replace(source.info, id=new_id, parent=source_id, label=label, created=time.time())
        self.store.add_rows(info, source.fingerprint, dict(source.rows), lineage_parent=source_id)  # all shared
        self.store.touch(source_id)
        if switch:
            self._load(self.store.get(new_id), constraint)
        return self.store.info(new_id)

    @torch.inference_mode()
    def rollback(self, capsule_id: str | None = None, steps: int | None = None) -> int:
        """Back to an ancestor capsule of the live state, or ``steps`` commit boundaries back."""
        if (capsule_id is None) == (steps is None):
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "rollback needs exactly one of capsule_id or steps")
        if capsule_id is not None:
            capsule = self.capsule_manager.restorable(capsule_id, verify_checksum=False, fetch=False)
            if capsule_id not in self.store.ancestors(self.live_parent):
                raise FlashRTError(ErrorCode.NOT_IN_LINEAGE, f"capsule {capsule_id!r} is not an ancestor of the live "
                                                             f"state (live descends from {self.live_parent!r})")
            constraint = self._rebuilt_constraint(capsule.info)
            self.capsule_manager.on_device(capsule)
            self._load(capsule, constraint)
            return self.position
        if steps < 1:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"steps must be >= 1, got {steps}")
        if steps >= len(self._boundaries):
            raise FlashRTError(ErrorCode.NO_HISTORY, f"only {len(self._boundaries) - 1} commit boundaries of history "
                                                     f"are kept; cannot go back {steps}")
        for _ in range(steps):
            self._boundaries.pop()
        if self.constraint is not None:       # generated tokens are one boundary each; before them, no constraint
            if steps <= len(self.constraint.tokens):
                self.constraint.rollback(steps)
            else:
                self.constrain(None)
        target = self._boundaries[-1]
        position = target.position
        self._moved_to(None)
        if target.fixed is not None:
            self.arena.write_live(0, target.fixed.data)
        else:
            self.arena.storage[:self._fixed_span].copy_(self._history[target.slot])
            self._next_slot = (target.slot + 1) % self.config.history_depth
        self._moved_to(position)
        self.live.rows.truncate(position)
        self.live_parent = next((a for a in self.store.ancestors(self.live_parent)
                                 if self.store.get(a).info.position <= position), "")
        return position

    def check_capsule_room(self, *positions: int, label: str = "") -> None:
        """Raise BUDGET_EXCEEDED unless capsules of the live state at all these positions (default: now) fit,
        the last one labelled ``label``. Each capsule after the first shares the rows of the one before it."""
        first, *later = sorted(positions or (self.position,))
        need = self.live.plan_bytes(self.live.plan(first), first)
        for before, position in zip([first, *later], later):
            need += self.live.plan_bytes({name: ((), before) for name in self.layout.row_bytes}, position)
        self.tiers.victims(need, label)

    def drop(self, capsule_id: str) -> int:
        """Free a capsule. The live state and other capsules then descend from its nearest stored ancestor."""
        freed, parent = self.capsule_manager.drop(capsule_id)
        if self.live_parent == capsule_id:
            self.live_parent = parent
        return freed

    def capsule(self, capsule_id: str) -> CapsuleInfo:
        return self.store.info(capsule_id)

    def close(self) -> None:
        """Finish the tiers' background work (pending spill files complete, dropped capsules' files gone) and stop
        their threads. Idempotent; the owner calls it when it lets the engine go (the node: cleanup, shutdown)."""
        self.capsule_manager.close()

    def capsules(self) -> list[CapsuleInfo]:
        return self.capsule_manager.infos()

    @torch.inference_mode()
    def live_checksum(self) -> str:
        """The checksum of the live state's bytes, computed in place (equal to its capsule's)."""
        return checksum([self.arena.storage[offset:offset + length]
                         for offset, _, length in self.arena.segments(self.position)])

    @torch.inference_mode()
    def live_bytes(self) -> torch.Tensor:
        """A copy of the live state's bytes in capsule layout (for byte-exact checks)."""
        return self._copy_live(self.position)

    def capsule_bytes(self, capsule_id: str) -> torch.Tensor:
        """A capsule's full bytes in capsule layout (a copy: its shared rows included), wherever it is."""
        return self.capsule_manager.capsule_bytes(capsule_id)

    # ---- files -------------------------------------------------------------------------------------------
    def capsule_file(self, capsule_id: str) -> Path:
        """``<capsule_dir>/<capsule_id>.capsule``; NO_CAPSULE_DIR when no capsule directory is configured."""
        return self.capsule_manager.capsule_file(capsule_id)

    def export_capsule(self, capsule_id: str) -> CapsuleInfo:
        """Write a stored capsule to :meth:`capsule_file` (atomic; signed when a key is configured). A capsule on
        the disk tier is in that file already (nothing to write). Any other file of that id is kept
        (DUPLICATE_CAPSULE_ID): remove it first to export again. An exported file stays when the capsule is
        dropped or fetched."""
        return self.capsule_manager.export_capsule(capsule_id)

    @torch.inference_mode()
    def import_capsule(self, capsule_id: str) -> CapsuleInfo:
        """Read :meth:`capsule_file` into the store: same fingerprint, free id, within the budget; its recorded
        parent belongs to another session, so it starts a lineage of its own. A file listed at configure is a
        disk-tier capsule already: importing it fetches it onto the device."""
        return self.capsule_manager.import_capsule(capsule_id)

    # ---- identity ----------------------------------------------------------------------------------------
    def _compute_fingerprints(self, dtype: torch.dtype) -> dict[str, str]:
        """The fingerprint of this model and config under each decode plan (the plain one is main's, unchanged)."""
        identity = {"weights": weights_digest(self.model, with_tower=False), "config": self.model_config.to_json(),
                    "manifest": self.arena.manifest_json(), "dtype": str(dtype),
                    "kernels": self.kernel_name, "device_type": self.device.type,
                    "prefill_chunk": self.config.prefill_chunk, "weights_format": self.weights_format}
        if self.config.weights_format != "dense" or self.kernels.dense_linear is not None:
            identity["gemv_table"] = quant_gemv.table_digest(self.device)
        return {plan: hashlib.sha256(json.dumps({**identity, "plan": plan}, sort_keys=True).encode()).hexdigest()
                for plan in (PLAN_VERSION, SPECULATIVE_PLAN_VERSION)}

    def _check_fingerprint(self, what: str, fingerprint: str) -> None:
        """Refuse a capsule of another model or config. The two decode plans (speculative_tokens 0 and > 0) share
        the state's layout and meaning, so a capsule of either restores here byte for byte; the tokens after it
        are then this engine's plan's decoding from that state (each plan is exact and repeatable on its own)."""
        if fingerprint not in self._fingerprints.values():
            raise FlashRTError(ErrorCode.FINGERPRINT_MISMATCH,
                               f"{what} was taken from another model or config (fingerprint {fingerprint[:12]}..., "
                               f"this engine {self.fingerprint[:12]}...)")
