"""One decode step, with or without self-speculation by the MTP head.

A step runs the main model over a fixed number of rows, :data:`STEP_ROWS`, of which ``k + 1`` are live:

1. the next token is picked (greedy or the seeded draw) from the arena's last hidden state, as plain decoding does,
   unless the verify before already picked it (*carried*: see below);
2. with ``k`` > 0, the MTP head drafts ``k`` more tokens greedily, each from the one before, among the first
   ``draft_vocab`` token ids (BPE ids are ranked by merge frequency, so a prefix of the vocabulary holds most of
   what is generated, and the head's LM-head read shrinks with it; drafts change only how many tokens a step
   commits, never which, so any draft vocabulary keeps the output and the state exact);
3. the main model runs once over the picked token and the drafts (verify), keeping the fixed-size state after each
   row (:class:`RowStates`, laid out as the arena's fixed span);
4. each draft is checked against the token the model itself picks after the row before it: greedy, its argmax; a
   seeded draw, the draw of the counter that plain decoding would use there. The longest matching prefix is
   accepted, so the tokens are exactly plain decoding's, sampled ones included (a draw is kept only where it equals
   the draft; this accepts fewer drafts than the speculative-sampling rule, whose tokens would differ from plain
   decoding's, and keeps a stream's tokens the same with speculation on or off). Under a grammar every pick, the
   checks included, is masked by its row of the engine's mask words (constraint.py), which the matcher fills
   between the draft and the verify part of the step.

Why the state is exact. None of the runtime's GEMMs gives a row the same bytes at another row count (MKL's fp32
GEMV against its GEMM, cuBLAS, the fused quantized GEMV and its rows buckets), so a verify over k + 1 rows cannot
equal k + 1 one-row decode steps. Instead every step, plain decode included, has STEP_ROWS rows: one GEMM shape,
where a row's bytes do not depend on its index or on the other rows; the recurrent parts (conv, gated delta rule)
run the rows kernels, which compute each row as the one-token kernels do and write the state after each row
straight into RowStates (one launch per layer, no copies); attention masks by position over the KV bucket of the
first row, and a step drafts only as far as that bucket reaches. Committing ``c`` tokens then copies row ``c - 1``'s
state into the arena: bit-identical to ``c`` plain steps. KV rows past the committed position are zeroed (the main
and the MTP cache). The MTP head's KV rows written while drafting are rewritten by the verify with the model's hidden
states.

The carried pick. The verify's logits of row ``c - 1`` are the logits of the state that committing ``c`` tokens makes
live, through the same STEP_ROWS-row head, so the verify also picks after its last live row and keeps the pick
after the committed one in ``next_pick`` (a draw under the counter plain decoding would use there). A step that
starts at exactly that state (the engine checks: same commit boundary, same sampling, no grammar) takes it instead
of reading the LM head again: the same token, one LM-head read less per step.
"""
from __future__ import annotations

import dataclasses

import torch

from .arena import LAST_TOKEN, POSITION, RNG_COUNTER, Arena
from .kernels import apply_mask
from .model import Qwen35, StepRows
from .sampler import Sampler

MAX_SPECULATIVE_TOKENS = 4
STEP_ROWS = MAX_SPECULATIVE_TOKENS + 1
MASK_ROWS = STEP_ROWS + 1      # the picked token's, and the pick's after each verify row


class RowStates:
    """The arena's fixed-size state (meta, hidden, conv, recurrent) after each row of a verify step, each row laid
    out byte for byte as the arena's fixed span, so that committing a row is one copy."""

    def __init__(self, arena: Arena, rows: int):
        self.span = arena.specs["kv"].offset
        self.storage = torch.zeros(rows, self.span, dtype=torch.uint8, device=arena.storage.device)
        self._specs = {name: arena.specs[name] for name in arena.fixed_names}

    def view(self, row, name: str) -> torch.Tensor:
        """Buffer ``name`` of row ``row`` (an int), or of every row (``row`` = slice(None): a leading row dim)."""
        spec = self._specs[name]
        raw = self.storage[row, spec.offset:spec.offset + spec.nbytes].view(spec.dtype)
        return raw.unflatten(-1, spec.shape)


@dataclasses.dataclass
class Stats:
    """Counts of speculative steps: drafted and accepted tokens, steps and committed tokens."""
    steps: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, drafted: int, committed: int) -> None:
        self.steps += 1
        self.tokens += committed
        self.drafted += drafted
        self.accepted += committed - 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


class Stepper:
    """The static buffers and the step function of every (k, greedy, kv bucket), over the model's arena and the
    engine's token buffer (``tokens``, at least STEP_ROWS long) and its mask words (``mask_words``, MASK_ROWS rows
    of words, see constraint.py: row 0 masks the picked token, row j + 1 the pick after verify row j)."""

    def __init__(self, model: Qwen35, sampler: Sampler, tokens: torch.Tensor, mask_words: torch.Tensor,
                 mask_lookup: tuple[torch.Tensor, torch.Tensor], draft_vocab: int):
        arena, device = model.arena, tokens.device
        self.model, self.sampler, self.arena, self.tokens = model, sampler, arena, tokens
        self.mask_words, self.mask_lookup = mask_words, mask_lookup
        self.draft_vocab = draft_vocab
        self.rows = RowStates(arena, STEP_ROWS)
        self.count = torch.ones((), dtype=torch.int64, device=device)      # live rows of the step
        self.committed = torch.ones((), dtype=torch.int64, device=device)  # 1 + accepted drafts
        hidden = arena["hidden"]
        self.hidden_rows = torch.zeros(STEP_ROWS, hidden.shape[0], dtype=hidden.dtype, device=device)
        self.pick_rows = torch.zeros_like(self.hidden_rows)               # row 0: the arena's hidden state
        self.offsets = torch.arange(STEP_ROWS, device=device)
        self.next_pick = torch.zeros(1, dtype=torch.int64, device=device)  # the pick after the committed rows

    def _picks(self, logits: torch.Tensor, greedy: bool, first_row: int) -> torch.Tensor:
        """The (masked) picks after logits rows [R, V], by mask rows ``first_row`` on: greedy in one fused pick;
        sampled one row after another (each draw moves the RNG counter)."""
        rows = range(first_row, first_row + logits.shape[0])
        if greedy:
            return self.model.kernels.greedy_pick(logits, self.mask_words[rows.start:rows.stop], self.mask_lookup)
        return torch.cat([self.sampler.sample(apply_mask(row_logits, self.mask_words[row], self.mask_lookup),
                                              self.arena["meta"]) for row_logits, row in zip(logits, rows)])

    def _pick_first(self, greedy: bool, carried: bool) -> None:
        """tokens[0]: the (masked) pick from the arena's last hidden state, through the step's STEP_ROWS-row head;
        ``carried``: the verify before picked it (``next_pick``), and its draw is counted here as a pick's is."""
        if carried:
            self.tokens[:1].copy_(self.next_pick)
            if not greedy:
                self.arena["meta"][RNG_COUNTER] += 1
            return
        self.pick_rows[0].copy_(self.arena["hidden"])
        self.tokens[:1].copy_(self._picks(self.model.logits(self.pick_rows)[:1], greedy, 0))

    def step(self, k: int, greedy: bool, kv_len: int, carried: bool = False):
        """The step with ``k`` drafts (set ``count`` to k + 1 before running it); it leaves the picked token and the
        drafts in ``tokens[:k + 1]`` and, with k > 0, the number to commit in ``committed`` and the pick after
        them in ``next_pick``. ``carried``: its first token is the ``next_pick`` of the step before. With k > 0 it
        is :meth:`draft` then :meth:`verify`, which a constrained step runs apart (the masks of the verify rows
        depend on the drafts)."""
        if k:
            draft, verify = self.draft(k, greedy, kv_len, carried), self.verify(k, greedy, kv_len)

            def run():
                draft()
                verify()
            return run
        model, tokens = self.model, self.tokens

        def run_undrafted():
            self._pick_first(greedy, carried)
            model.forward(tokens[:STEP_ROWS], kv_len, count=self.count, step=StepRows(live=1))
        return run_undrafted

    def draft(self, k: int, greedy: bool, kv_len: int, carried: bool = False):
        """The first part of a step with ``k`` > 0 drafts: the picked token, then the MTP head's drafts, in
        ``tokens[:k + 1]``."""
        meta = self.arena["meta"]

        def run():
            self._pick_first(greedy, carried)
            rows_meta = self.rows.view(slice(None), "meta")                  # after row j: as plain after token j
            rows_meta.copy_(meta.expand(STEP_ROWS, -1))
            rows_meta[:, POSITION] += self.offsets + 1
            if not greedy:                                                    # the first draw is counted in meta
                rows_meta[:, RNG_COUNTER] += self.offsets
            self._draft(k, kv_len)
        return run

    def verify(self, k: int, greedy: bool, kv_len: int):
        """The second part: the main model over the picked token and the drafts, each draft checked against the
        model's own (masked) pick after the row before it; the number to commit in ``committed``, the pick after
        the last committed row in ``next_pick`` (masked by mask row k + 1 after the last draft: all allowed unless
        a grammar is live, and then the engine does not carry it)."""
        model, tokens = self.model, self.tokens

        def run():
            rows_meta = self.rows.view(slice(None), "meta")
            rows_meta[:, LAST_TOKEN] = tokens[:STEP_ROWS]
            model.forward(tokens[:STEP_ROWS], kv_len, count=self.count,
                          step=StepRows(live=k + 1, states=self.rows, hidden=self.hidden_rows))
            self.rows.view(slice(None), "hidden").copy_(self.hidden_rows)
            logits = model.logits(self.hidden_rows)
            picks = self._picks(logits[:k + 1], greedy, 1)
            self.committed.copy_(1 + (picks[:k] == tokens[1:k + 1]).long().cumprod(0).sum())
            self.next_pick.copy_(picks.index_select(0, (self.committed - 1).view(1)))
        return run

    def _draft(self, k: int, kv_len: int) -> None:
        """k greedy MTP drafts after tokens[0] into tokens[1:k + 1]; the head's KV at position p + i."""
        model, tokens = self.model, self.tokens
        previous, position = self.arena["hidden"][None], self.arena["meta"][POSITION:POSITION + 1]
        for i in range(k):
            previous = model.mtp_draft(tokens[i:i + 1], previous, position + i, kv_len)
            tokens[i + 1:i + 2].copy_(model.logits(previous, vocab=self.draft_vocab).argmax(-1))

    def commit(self, row: int) -> None:
        """Make the state after verify row ``row`` live (its KV rows are in place already)."""
        self.arena.storage[:self.rows.span].copy_(self.rows.storage[row])

    def invalidate(self, start: int, end: int) -> None:
        """Zero the KV rows [start, end) of the main and the MTP cache (written by a verify, not committed)."""
        if end > start:
            for name in ("kv", "mtp_kv"):
                if name in self.arena.specs:
                    self.arena[name][start:end].zero_()
