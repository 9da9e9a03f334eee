"""Constrained decoding through llguidance: a grammar's matcher, its token mask, and the state a capsule keeps.

A :class:`Constraint` is the live matcher of one constrained generation. Its whole state is
:class:`ConstraintState` (the compiled grammar text + the tokens accepted since the constraint began): the native
matcher cannot be serialised, so snapshots keep that state and restores rebuild the matcher by replaying the tokens
(``Constraint(llg_tok, state)``), which reaches the same matcher state because the matcher is deterministic.

The mask is llguidance's bitmask (one bit per token id, little-endian 32-bit words), computed on the CPU and copied
into a static device buffer of words that the decode step applies to the logits (``kernels.pick``: the masked fill
of a sampled pick, the fused masked argmax of a greedy one), so a captured decode graph reads it without being
re-captured.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Sequence

import torch

from .errors import ErrorCode, FlashRTError
from .tokenizer import ByteTokenizer, HFTokenizer

# What a Generate goal may name as its constraint, and the llguidance format each one is compiled from.
GRAMMAR_FORMATS = ("json_schema", "lark", "gbnf", "regex")
# llguidance's JSON options unless a schema's own "x-guidance" says otherwise
JSON_OPTIONS = {"whitespace_flexible": False}


def _llguidance():
    import llguidance           # a runtime dependency, imported on first use: unconstrained engines never load it
    return llguidance


@dataclasses.dataclass(frozen=True)
class ConstraintState:
    """Everything needed to rebuild a matcher: the compiled llguidance grammar and the tokens it has accepted."""
    grammar: str
    tokens: tuple[int, ...] = ()


def compile_grammar(kind: str, text: str) -> str:
    """A JSON schema, Lark, GBNF or regex text to llguidance's grammar; INVALID_ARGUMENT with the library's
    message when it does not compile."""
    llg = _llguidance()
    if kind not in GRAMMAR_FORMATS:
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"grammar kind must be one of {GRAMMAR_FORMATS}, got {kind!r}")
    try:
        if kind == "json_schema":           # compact JSON (no free whitespace): every token carries content
            grammar = llg.LLMatcher.grammar_from_json_schema(json.loads(text), defaults=JSON_OPTIONS)
        else:
            grammar = llg.grammar_from(kind, text)
    except (ValueError, TypeError) as exc:             # json.JSONDecodeError is a ValueError
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"bad {kind}: {exc}") from None
    message = llg.LLMatcher.validate_grammar(grammar)
    if message and not message.startswith("WARNING"):
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"bad {kind}: {message}")
    return grammar


class _ByteVocabulary:
    """The byte-level tokenizer seen by llguidance: ids 0-255 are bytes; ids from 256 are special tokens."""

    def __init__(self, vocab_size: int, eos_token_id: int):
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [b"<|special_%d|>" % i for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


def llg_tokenizer(tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
    """The runtime's tokenizer given to llguidance (``ByteTokenizer`` or ``HFTokenizer``, see tokenizer.py)."""
    llg = _llguidance()
    if isinstance(tokenizer, HFTokenizer):      # llguidance reads tokenizer.json itself (no transformers needed)
        if not eos_token_ids:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "constrained decoding needs the model's end-of-sequence "
                                                           "token (eos_token_id in config.json or generation_config"
                                                           ".json), which ends a completed output; this model has none")
        return llg.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
    if not isinstance(tokenizer, ByteTokenizer):
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "constrained decoding needs a tokenizer (this model has none)")
    eos = eos_token_ids[0] if eos_token_ids else 256       # a preset without one: the first non-byte id ends it
    return llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocabulary(vocab_size, eos)), slices=[])


class Constraint:
    """The live matcher of one constrained generation, and the tokens it accepted."""

    def __init__(self, llg_tok, state: ConstraintState):
        self._llg_tok = llg_tok
        self.grammar = state.grammar
        self._matcher = _llguidance().LLMatcher(llg_tok, state.grammar)
        self.tokens: list[int] = []
        self._check()
        if state.tokens and not self._matcher.consume_tokens(list(state.tokens)):
            self._check()
        self.tokens = list(state.tokens)

    def _check(self) -> None:
        if self._matcher.is_error():
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"grammar: {self._matcher.get_error()}")

    def state(self) -> ConstraintState:
        return ConstraintState(self.grammar, tuple(self.tokens))

    def fill_mask(self, words: torch.Tensor, staging: torch.Tensor | None = None) -> None:
        """Compute the allowed next tokens on the CPU and copy the bitmask into the device buffer ``words``, through
        ``staging`` (pinned host words: a copy the device stream orders, which the host does not wait for) if
        given."""
        bits = self._bitmask(words.numel())
        if staging is not None:
            bits = staging.copy_(bits)
        words.copy_(bits, non_blocking=True)

    def fill_verify_masks(self, tokens: Sequence[int], words: torch.Tensor) -> None:
        """The masks of a speculative step's verify rows, into ``words[1:]``: ``tokens[0]`` is the step's picked
        token (masked by ``words[0]``), ``tokens[1:]`` the MTP drafts; ``words[j]`` is the mask after
        ``tokens[:j]``, so the model's check of draft j is picked under the grammar. The walk ends at the first draft
        the grammar forbids (its row's mask refuses it, so the verify ends the accepted run there) or after a token
        that completes the grammar; later rows allow every token (no draft past that point is accepted). The
        matcher ends as it began: the step's committed tokens are accepted one by one afterwards."""
        host = torch.full((words.shape[0], words.shape[1]), -1, dtype=torch.int32)
        walked = 0
        for row, token in enumerate(tokens):
            if row:
                if self._matcher.is_stopped():
                    break
                host[row] = self._bitmask(words.shape[1])
                if not (int(host[row, token // 32]) >> (token % 32)) & 1:
                    break
            self._consume(token)
            walked += 1
        if not self._matcher.rollback(walked):
            self.__init__(self._llg_tok, self.state())
        words[1:].copy_(host[1:], non_blocking=True)

    def _bitmask(self, words: int) -> torch.Tensor:
        bits = self._matcher.compute_bitmask()
        self._check()
        return torch.frombuffer(bytearray(bits), dtype=torch.int32)[:words]   # llguidance may pad its vocabulary

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):      # the mask allowed it: a defect, not the request's fault
            raise FlashRTError(ErrorCode.INTERNAL, f"token {token} was sampled against the grammar: "
                                                   f"{self._matcher.get_error()}")

    def accept(self, token: int) -> None:
        self._consume(token)
        self.tokens.append(token)

    def rollback(self, count: int) -> None:
        """Forget the last ``count`` accepted tokens (the matcher's own rollback; a rebuild if it refuses)."""
        kept = self.tokens[:len(self.tokens) - count]
        if not self._matcher.rollback(count):
            self.__init__(self._llg_tok, ConstraintState(self.grammar, tuple(kept)))
        self.tokens = kept

    @property
    def accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar."""
        return self._matcher.is_accepting()

    @property
    def stopped(self) -> bool:
        """The grammar admits no further token (it completed and its end was accepted)."""
        return self._matcher.is_stopped()


def mask_lookup(vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The static word index and bit of every token id, for ``kernels.pick.apply_mask``."""
    ids = torch.arange(vocab_size, device=device, dtype=torch.int32)
    return (ids // 32).long(), ids % 32


def mask_words(vocab_size: int, device: torch.device, rows: int) -> torch.Tensor:
    """The device buffer of mask words, ``rows`` masks (one per row a step picks from), every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)

