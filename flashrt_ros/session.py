"""All of the node's behaviour on one Engine, without ROS and without tensor code.

The ROS node (``flashrt_ros.node``) and the bag tools drive a :class:`Session` from exactly one thread
(the engine thread). Every output goes through the ``emit`` callback as a plain dataclass whose field
names mirror ``msg/TokenChunk``, ``msg/ActionChunk`` and ``msg/StateEvent`` (stamps as int ns).

Contract::

    session = Session(engine, discretiser=Discretiser(...), default_sampling=SamplingParams(), emit=print)
    gen = session.observe(ObservationInput(text="hi", max_new_tokens=16))   # Generation | None
    while gen.step():            # one token per call; TokenOutput chunks and the final ActionOutput
        ...                      # are emitted; state operations may run here, between two steps
    session.snapshot() / restore() / fork() / rollback() / drop() / reset() / resume() / capsules()

Rules the node relies on (each is tested in test/test_session.py):

* **Validation first.** Every request is validated (ids, sampling, context room, capsule existence)
  before anything changes; a refused request raises :class:`FlashRTError` and leaves the live state,
  every capsule and any running generation untouched.
* **A refused generation still ends.** An observation with ``max_new_tokens > 0`` that is refused
  emits, right after its failed 'observe' event, one final empty :class:`TokenOutput` with finish
  reason ``error``, a new request id and the observation's stamp, so whoever waits for that
  request's tokens is answered; the event carries the error code and message.
* **One event per operation.** ``observe``, ``snapshot``, ``restore``, ``fork``, ``rollback``,
  ``drop``, ``reset``, ``preempt`` and ``resume`` each emit exactly one :class:`EventOutput`, on
  success and on failure. (An observation with ``snapshot_label`` is two operations: observe, then
  snapshot.)
* **At most one generation** (:attr:`Session.active`). Operations that only read or add capsules
  (snapshot, fork without switch, drop, list) run between two steps and leave the stream
  token-identical. Operations that replace the live state (restore, rollback, reset, fork of a
  capsule with ``switch``, resume) end a running generation with finish reason ``canceled`` once
  they succeeded. A new (valid) observation stops it with ``preempted``.
* **Preemption and resume.** ``Generation.stop('preempted')`` snapshots the live state into the
  capsule ``interrupted-<request_id>`` and remembers the tokens still owed. ``resume(capsule_id)``
  restores that capsule and continues under a new request id with the remaining tokens and the same
  sampling parameters, so preempted + resumed tokens equal an uninterrupted run (the sampler RNG is
  part of the capsule). A resume consumes its record; the capsule stays until dropped. If the
  capsule cannot be taken (budget full), the 'preempt' event says so and the stream is not resumable.
* **Actions.** When a request finishes (for any reason but ``preempted``) and its generated tokens
  (including those generated before a preemption) contain at least ``horizon * dims`` discretiser
  tokens, the first ``horizon * dims`` of them are decoded into one :class:`ActionOutput`, emitted
  after the final :class:`TokenOutput`.
"""
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

from flashrt_ros.discretiser import Discretiser
from flashrt_ros.runtime import CapsuleInfo, ErrorCode, FlashRTError, SamplingParams
from flashrt_ros.runtime.capsules import validate_capsule_id

PRIORITY_NORMAL = 0
PRIORITY_URGENT = 1

LENGTH, STOP, CONTEXT_FULL = "length", "stop", "context_full"
PREEMPTED, CANCELED, ERROR = "preempted", "canceled", "error"
_FINISH_CODES = {PREEMPTED: ErrorCode.PREEMPTED, CANCELED: ErrorCode.CANCELED, ERROR: ErrorCode.INTERNAL}

INTERRUPTED_PREFIX = "interrupted-"


@dataclass
class ObservationInput:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    max_new_tokens: int = 0
    priority: int = PRIORITY_NORMAL
    snapshot_label: str = ""
    stamp_ns: int = 0


@dataclass
class TokenOutput:
    request_id: int
    token_ids: list[int]
    text: str
    position: int
    final: bool
    finish_reason: str
    observation_stamp_ns: int


@dataclass
class ActionOutput:
    request_id: int
    horizon: int
    dims: int
    values: list[float]
    token_ids: list[int]
    observation_stamp_ns: int


@dataclass
class EventOutput:
    seq: int
    op: str
    capsule_id: str = ""
    source_id: str = ""
    steps: int = 0
    switch_to: bool = False
    position_before: int = 0
    position_after: int = 0
    latency_ms: float = 0.0
    success: bool = True
    error_code: int = ErrorCode.OK
    message: str = ""


@dataclass(frozen=True)
class GenerationResult:
    """How a request ended (the Generate action's result)."""
    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str
    position: int
    ttft_ms: float
    error_code: ErrorCode
    message: str


@dataclass(frozen=True)
class _Interrupted:
    """What resume needs to continue a preempted request."""
    request_id: int
    remaining: int
    sampling: SamplingParams
    generated: tuple[int, ...]
    stamp_ns: int


class Generation:
    """One generation request; the engine thread calls :meth:`step` until it returns False.

    ``outcome`` is a Future that resolves to a :class:`GenerationResult` when the request ends.
    """

    def __init__(self, session: "Session", request_id: int, max_new_tokens: int,
                 sampling: SamplingParams, stamp_ns: int, prior_ids=()):
        self.request_id = request_id
        self.sampling = sampling
        self.stamp_ns = stamp_ns
        self.outcome: Future = Future()
        self._session = session
        self._remaining = max_new_tokens
        self._prior = tuple(prior_ids)
        self._ids: list[int] = []
        self._chunk: list[int] = []
        self._started = time.perf_counter()
        self._ttft_ms = 0.0
        self._iter = None
        self._epoch = -1

    @property
    def remaining(self) -> int:
        """Tokens this request may still generate."""
        return self._remaining

    @property
    def generated_ids(self) -> tuple[int, ...]:
        """Every token of this request, including those generated before a preemption."""
        return self._prior + tuple(self._ids)

    @property
    def finished(self) -> bool:
        return self.outcome.done()

    def step(self) -> bool:
        """Decode one token; return True while the request is still running."""
        if self.finished:
            return False
        engine = self._session.engine
        if self._remaining == 0:
            return self._finish(LENGTH)
        try:  # a full context ends the engine's iterator: StopIteration below (no position read per token)
            if self._iter is None or self._epoch != self._session.epoch:
                # Any session operation since the last step may have touched the engine: start a fresh
                # iterator from the committed state (the engine allows stopping one at any boundary).
                self._close_iter()
                self._iter = engine.generate(self._remaining, self.sampling, stop_token_ids=engine.eos_token_ids)
                self._epoch = self._session.epoch
            token = next(self._iter)
        except StopIteration:
            return self._finish(CONTEXT_FULL if engine.position >= engine.max_context else STOP)
        except FlashRTError as e:
            return self._finish(ERROR, e.code, e.message)
        except Exception as e:  # noqa: BLE001 - a runtime bug must end the request, not the thread
            return self._finish(ERROR, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
        if not self._ids:
            self._ttft_ms = (time.perf_counter() - self._started) * 1e3
        self._ids.append(token)
        self._chunk.append(token)
        self._remaining -= 1
        if token in engine.eos_token_ids:
            return self._finish(STOP)
        if self._remaining == 0:
            return self._finish(LENGTH)
        if engine.position >= engine.max_context:
            return self._finish(CONTEXT_FULL)
        if len(self._chunk) >= self._session.stream_chunk_tokens:
            self._emit_chunk(final=False, reason="")
        return True

    def stop(self, reason: str, message: str = "") -> None:
        """End the request at this boundary; ``preempted`` keeps the stream resumable."""
        if self.finished:
            return
        if reason == PREEMPTED:
            self._session._keep_interrupted(self)
        self._finish(reason, _FINISH_CODES.get(reason, ErrorCode.OK), message)

    def _emit_chunk(self, final: bool, reason: str) -> None:
        engine = self._session.engine
        ids, self._chunk = self._chunk, []
        self._session._emit(TokenOutput(self.request_id, ids, engine.tokenizer.decode(ids) if ids else "",
                                        engine.position, final, reason, self.stamp_ns))

    def _finish(self, reason: str, code: ErrorCode = ErrorCode.OK, message: str = "") -> bool:
        """Emit the final chunk (and the action), then resolve ``outcome`` even if emitting failed."""
        self._close_iter()
        session, engine = self._session, self._session.engine
        try:
            self._emit_chunk(final=True, reason=reason)
            action = session.discretiser.action_values(self.generated_ids) if reason != PREEMPTED else None
            if action is not None:
                d = session.discretiser
                session._emit(ActionOutput(self.request_id, d.horizon, d.dims, action[1], action[0],
                                           self.stamp_ns))
        finally:
            if session.active is self:
                session._active = None
            self.outcome.set_result(GenerationResult(
                self.request_id, list(self._ids), engine.tokenizer.decode(self._ids) if self._ids else "",
                reason, engine.position, self._ttft_ms, code, message))
        return False

    def _close_iter(self) -> None:
        if self._iter is not None:
            self._iter.close()
            self._iter = None


class Session:
    """The node's behaviour on one Engine (see the module docstring for the rules)."""

    def __init__(self, engine, *, discretiser: Discretiser, default_sampling: Optional[SamplingParams] = None,
                 emit: Callable[[object], None], stream_chunk_tokens: int = 8):
        if stream_chunk_tokens < 1:
            raise ValueError(f"stream_chunk_tokens must be >= 1, got {stream_chunk_tokens}")
        discretiser.check_vocab(engine.vocab_size)
        self.engine = engine
        self.discretiser = discretiser
        self.default_sampling = (default_sampling or SamplingParams()).validate()
        self.stream_chunk_tokens = stream_chunk_tokens
        self._emit = emit
        self._active: Optional[Generation] = None
        self._interrupted: "OrderedDict[str, _Interrupted]" = OrderedDict()
        self._seq = 0
        self._request_id = 0
        self.epoch = 0  # bumped by every operation; a Generation restarts its engine iterator on change

    @property
    def active(self) -> Optional[Generation]:
        """The running generation, if any."""
        return self._active

    def interrupted(self) -> dict[str, int]:
        """Resumable capsules, oldest first, with the tokens each still owes."""
        return {cid: rec.remaining for cid, rec in self._interrupted.items()}

    # ---- observations -------------------------------------------------------------------------
    def observe(self, obs: ObservationInput, sampling: Optional[SamplingParams] = None,
                seed: Optional[int] = None) -> Optional[Generation]:
        """Ingest an observation; return its Generation when ``max_new_tokens > 0``.

        A running generation is preempted (kept resumable) once the observation is known to be
        valid. ``seed`` reseeds the sampler after ingestion (the Generate action's ``reseed``).
        """
        def run():
            ids = self._tokenise(obs)
            params = (sampling or self.default_sampling).validate()
            if obs.max_new_tokens < 0:
                raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "max_new_tokens must be >= 0")
            if seed is not None and not 0 <= seed < 2**63:
                raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"seed must be in [0, 2**63), got {seed}")
            if not ids and obs.max_new_tokens == 0:
                raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "empty observation: no tokens and nothing to generate")
            if not ids and self.engine.position == 0:
                raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "cannot generate from an empty context")
            if self.engine.position + len(ids) > self.engine.max_context:
                raise FlashRTError(ErrorCode.CONTEXT_OVERFLOW,
                                   f"{len(ids)} tokens at position {self.engine.position} exceed "
                                   f"max_context {self.engine.max_context}")
            if obs.snapshot_label:  # refuse now rather than ingest and then fail to take the capsule(s)
                # a preempted generation is kept as a capsule of the current state first: both must fit
                interrupted = (self.engine.position,) if self._active is not None else ()
                self.engine.check_capsule_room(*interrupted, self.engine.position + len(ids))
            if self._active is not None:
                self._active.stop(PREEMPTED)
            if ids:
                self.engine.ingest(ids)
            if seed is not None:
                self.engine.reseed(seed)
            return params

        try:
            params = self._operation("observe", run, {})
        except FlashRTError:
            if obs.max_new_tokens > 0:
                self._refuse_generation(obs.stamp_ns)
            raise
        if obs.snapshot_label:
            self.snapshot(label=obs.snapshot_label)
        if obs.max_new_tokens == 0:
            return None
        return self._start(obs.max_new_tokens, params, obs.stamp_ns)

    def _tokenise(self, obs: ObservationInput) -> list[int]:
        vocab = self.engine.vocab_size
        bad = [t for t in obs.token_ids if not 0 <= t < vocab]
        if bad:
            raise FlashRTError(ErrorCode.TOKEN_OUT_OF_RANGE,
                               f"token ids {bad[:8]} are outside [0, {vocab})")
        ids = list(obs.token_ids)
        if obs.text:
            ids += self.engine.tokenizer.encode(obs.text)
        return ids + self.discretiser.encode(obs.values)

    def _refuse_generation(self, stamp_ns: int) -> None:
        """End a refused observation's request at once: one final, empty ``error`` chunk under a new
        request id, so a client waiting on ~/tokens for this stamp is answered (the 'observe' event
        just before it carries the error code and message)."""
        self._request_id += 1
        self._emit(TokenOutput(self._request_id, [], "", self.engine.position, True, ERROR, stamp_ns))

    def _start(self, max_new_tokens: int, sampling: SamplingParams, stamp_ns: int, prior_ids=()) -> Generation:
        self._request_id += 1
        self._active = Generation(self, self._request_id, max_new_tokens, sampling, stamp_ns, prior_ids)
        return self._active

    def _keep_interrupted(self, gen: Generation) -> None:
        """Snapshot a preempted stream as ``interrupted-<request_id>`` (one 'preempt' event)."""
        capsule_id = f"{INTERRUPTED_PREFIX}{gen.request_id}"

        def run():
            self.engine.snapshot(capsule_id, label=f"preempted request {gen.request_id}")
            self._interrupted[capsule_id] = _Interrupted(
                gen.request_id, gen.remaining, gen.sampling, gen.generated_ids, gen.stamp_ns)
            fields["message"] = f"request {gen.request_id} preempted with {gen.remaining} tokens left"

        fields = {"capsule_id": capsule_id}
        try:
            self._operation("preempt", run, fields)
        except FlashRTError:
            pass  # the event carries the reason; the stream simply is not resumable

    # ---- state operations ---------------------------------------------------------------------
    def snapshot(self, capsule_id: str = "", label: str = "") -> CapsuleInfo:
        def run():
            if capsule_id:
                self._check_id(capsule_id)
            return self.engine.snapshot(capsule_id or None, label)
        return self._operation("snapshot", run, {"capsule_id": capsule_id})

    def restore(self, capsule_id: str, verify_checksum: bool = False) -> CapsuleInfo:
        return self._operation("restore", lambda: self._replacing(
            lambda: self.engine.restore(self._known(capsule_id), verify_checksum=verify_checksum)),
            {"capsule_id": capsule_id})

    def fork(self, source_id: str = "", capsule_id: str = "", label: str = "", switch: bool = False) -> CapsuleInfo:
        def run():
            if source_id:
                self._known(source_id)
            if capsule_id:
                self._check_id(capsule_id)
            call = lambda: self.engine.fork(source_id or None, capsule_id or None, label, switch)  # noqa: E731
            return self._replacing(call) if switch and source_id else call()
        return self._operation("fork", run, {"capsule_id": capsule_id, "source_id": source_id, "switch_to": switch})

    def rollback(self, capsule_id: str = "", steps: int = 0) -> int:
        def run():
            if bool(capsule_id) == (steps > 0):
                raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "give exactly one of capsule_id and steps > 0")
            if capsule_id:
                return self._replacing(lambda: self.engine.rollback(capsule_id=self._known(capsule_id)))
            return self._replacing(lambda: self.engine.rollback(steps=steps))
        return self._operation("rollback", run, {"source_id": capsule_id, "steps": steps})

    def drop(self, capsule_id: str) -> int:
        def run():
            freed = self.engine.drop(self._known(capsule_id))
            self._interrupted.pop(capsule_id, None)
            return freed
        return self._operation("drop", run, {"capsule_id": capsule_id})

    def reset(self) -> None:
        return self._operation("reset", lambda: self._replacing(self.engine.reset), {})

    def resume(self, capsule_id: str = "") -> Generation:
        """Restore an interrupted stream and continue it; returns the new Generation."""
        def run():
            if capsule_id:
                self._check_id(capsule_id)
            if not self._interrupted:
                raise FlashRTError(ErrorCode.NOTHING_TO_RESUME, "no interrupted generation to resume")
            cid = capsule_id or next(reversed(self._interrupted))
            if cid not in self._interrupted:
                raise FlashRTError(ErrorCode.NOTHING_TO_RESUME, f"{cid!r} is not an interrupted generation")
            self._replacing(lambda: self.engine.restore(cid))
            rec = self._interrupted.pop(cid)
            gen = self._start(rec.remaining, rec.sampling, rec.stamp_ns, rec.generated)
            fields["capsule_id"] = cid
            fields["message"] = (f"request {gen.request_id} resumes request {rec.request_id} "
                                 f"with {rec.remaining} tokens left")
            return gen

        fields = {"capsule_id": capsule_id}
        return self._operation("resume", run, fields)

    def capsules(self) -> list[CapsuleInfo]:
        return self.engine.capsules()

    # ---- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _check_id(capsule_id: str) -> str:
        validate_capsule_id(capsule_id)
        return capsule_id

    def _known(self, capsule_id: str) -> str:
        """Validate the id's form and that the capsule exists (UNKNOWN_CAPSULE otherwise)."""
        self._check_id(capsule_id)
        self.engine.capsule(capsule_id)
        return capsule_id

    def _replacing(self, call):
        """Run an engine call that replaces the live state; a running generation ends as canceled."""
        result = call()
        if self._active is not None:
            self._active.stop(CANCELED, "the live state was replaced")
        return result

    def _operation(self, op: str, run, fields: dict):
        """Run one operation, emit its single EventOutput and re-raise refusals as FlashRTError.

        ``fields`` are the event's extra fields; ``run`` may complete them (e.g. the chosen id).
        A CapsuleInfo result fills in ``capsule_id``.
        """
        before = self.engine.position
        start = time.perf_counter()
        self.epoch += 1
        try:
            result = run()
        except FlashRTError as e:
            self._event(op, fields, before, start, False, e.code, e.message)
            raise
        except Exception as e:  # noqa: BLE001 - report runtime bugs as INTERNAL instead of killing the thread
            err = FlashRTError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
            self._event(op, fields, before, start, False, err.code, err.message)
            raise err from e
        if isinstance(result, CapsuleInfo):
            fields["capsule_id"] = result.id
        self._event(op, fields, before, start, True, ErrorCode.OK, fields.pop("message", ""))
        return result

    def _event(self, op, fields, before, start, success, code, message) -> None:
        fields.pop("message", None)
        self._seq += 1
        self._emit(EventOutput(self._seq, op, position_before=before, position_after=self.engine.position,
                               latency_ms=(time.perf_counter() - start) * 1e3, success=success,
                               error_code=int(code), message=message, **fields))
