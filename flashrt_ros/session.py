"""All of the node's behaviour on one Engine, without ROS and without tensor code.

The ROS node (``flashrt_ros.node``) and the bag tools drive a :class:`Session` from exactly one thread
(the engine thread). Every output goes through the ``emit`` callback as a plain dataclass whose field
names mirror ``msg/TokenChunk``, ``msg/ActionChunk`` and ``msg/StateEvent`` (stamps as int ns).

Contract::

    session = Session(engine, discretiser=Discretiser(...), default_sampling=SamplingParams(), emit=print)
    gen = session.observe(ObservationInput(text="hi", max_new_tokens=16))   # Generation | None
    while gen.step():            # one token per call; TokenOutput chunks and the final ActionOutput
        ...                      # are emitted; state operations may run here, between two steps
    session.generate(obs, override_sampling=..., ...)   # the ~/generate action's goal
    session.snapshot() / restore() / fork() / rollback() / drop() / reset() / resume() / cancel()
    session.export_capsule() / import_capsule()   # <capsule_dir>/<capsule_id>.capsule
    session.list_capsules() / activate() / deactivate() / observation_lost(count)

Each method is one row of :data:`flashrt_ros.operations.OPERATIONS`: its keyword arguments are the
request's field names, it returns the row's typed result, and its event carries those fields.

Rules the node relies on (each is tested in test/test_session.py):

* **Validation first.** Every request is validated (ids, sampling, context room, capsule existence)
  before anything changes; a refused request raises :class:`FlashRTError` and leaves the live state,
  every capsule and any running generation untouched.
* **A refused generation still ends.** An observation with ``max_new_tokens > 0`` that is refused
  emits, right after its failed 'observe' event, one final empty :class:`TokenOutput` with finish
  reason ``error``, a new request id and the observation's stamp, so whoever waits for that
  request's tokens is answered; the event carries the error code and message.
* **One event per operation.** Every operation of the table but ``list`` emits exactly one
  :class:`EventOutput`, on success and on failure, carrying its request fields, the request it opened
  (``request_id``) and the generation running when it ran (``running_request_id``, at
  ``position_before``): what a replay needs to re-issue it at the same token boundary. (An observation
  with ``snapshot_label`` is two operations: observe, then snapshot.) The first activation of a fresh
  session leaves no event: every recording starts at a fresh, active node.
* **Inactive refuses.** After :meth:`deactivate` (which ends a running generation as ``canceled``)
  every operation is refused with ``NOT_ACTIVE`` (an event, and for a generating observation its
  ``error`` chunk) until :meth:`activate`.
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

from flashrt_ros import ros_schema
from flashrt_ros.discretiser import Discretiser
from flashrt_ros.operations import (CONSTRAINT_FIELDS, CapsuleResult, Done, DropResult, ListResult, PositionResult,
                                    ResumeResult, as_float32)
from flashrt_ros.runtime import (INTERRUPTED_PREFIX, ErrorCode, FlashRTError, SamplingParams,
                                 validate_client_capsule_id)
from flashrt_ros.runtime.vision import ingest_length

PRIORITY_NORMAL = 0
PRIORITY_URGENT = 1

LENGTH, STOP, CONTEXT_FULL = "length", "stop", "context_full"
INCOMPLETE = "incomplete"        # max_new_tokens ended a constrained output before its grammar was complete
PREEMPTED, CANCELED, ERROR = "preempted", "canceled", "error"
_FINISH_CODES = {PREEMPTED: ErrorCode.PREEMPTED, CANCELED: ErrorCode.CANCELED, ERROR: ErrorCode.INTERNAL}


@dataclass
class ObservationInput:
    """What an observation carries, ingested in this order: token_ids, images, text, values. An image (a runtime
    ``vision.image.Image``, or a ``PreparedImage``) takes its image tokens plus two positions."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    images: list = field(default_factory=list)
    max_new_tokens: int = 0
    priority: int = PRIORITY_NORMAL
    snapshot_label: str = ""
    stamp_ns: int = 0
    json_schema: str = ""       # the output's constraint (max_new_tokens > 0), as a Generate goal's fields
    grammar: str = ""
    output_type: str = ""

    def constraint_fields(self) -> dict:
        return {name: getattr(self, name) for name in CONSTRAINT_FIELDS}


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
    """Mirrors ``msg/StateEvent``: the request's fields as made, then what the operation did."""
    seq: int
    op: str
    capsule_id: str = ""
    source_id: str = ""
    label: str = ""
    pinned: bool = False
    tier: str = ""
    wait: bool = False
    steps: int = 0
    switch_to: bool = False
    verify_checksum: bool = False
    observation: Optional[ObservationInput] = None
    override_sampling: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    reseed: bool = False
    seed: int = 0
    json_schema: str = ""
    grammar: str = ""
    output_type: str = ""
    count: int = 0
    result_id: str = ""
    request_id: int = 0
    running_request_id: int = 0
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
    acceptance_rate: float = 0.0     # speculative decoding: accepted / drafted MTP tokens (0 when off)
    tokens_per_step: float = 0.0     # tokens per decode step (1 without speculation)


@dataclass
class TypedOutput:
    """The parsed message of a generation with an ``output_type`` (published typed by the node)."""
    request_id: int
    type_name: str
    text: str
    message: object


@dataclass(frozen=True)
class _Interrupted:
    """What resume needs to continue a preempted request."""
    request_id: int
    remaining: int
    sampling: SamplingParams
    generated: tuple[int, ...]
    stamp_ns: int
    output_type: str = ""


class Generation:
    """One generation request; the engine thread calls :meth:`step` until it returns False.

    ``outcome`` is a Future that resolves to a :class:`GenerationResult` when the request ends.
    """

    def __init__(self, session: "Session", request_id: int, max_new_tokens: int,
                 sampling: SamplingParams, stamp_ns: int, prior_ids=(), output_type: str = ""):
        self.request_id = request_id
        self.output_type = output_type
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
    def position(self) -> int:
        """The live stream position (a device read on CUDA: not for every step)."""
        return self._session.engine.position

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
        reason, code, message, typed = self._check_constraint(reason, code, message)
        try:
            self._emit_chunk(final=True, reason=reason)
            action = session.discretiser.action_values(self.generated_ids) if reason != PREEMPTED else None
            if action is not None:
                d = session.discretiser
                session._emit(ActionOutput(self.request_id, d.horizon, d.dims, action[1], action[0],
                                           self.stamp_ns))
            if typed is not None:
                session._emit(typed)
        finally:
            if session.active is self:
                session._active = None
            self.outcome.set_result(GenerationResult(
                self.request_id, list(self._ids), engine.tokenizer.decode(self._ids) if self._ids else "",
                reason, engine.position, self._ttft_ms, code, message, engine.generation_stats.acceptance_rate,
                engine.generation_stats.tokens_per_step))
        return False

    def _check_constraint(self, reason: str, code: ErrorCode, message: str):
        """A constrained output cut short is ``incomplete``; a complete ``output_type`` one is parsed into its
        message (a TypedOutput to emit)."""
        constraint = self._session.engine.constraint
        if constraint is None or reason not in (LENGTH, STOP):
            return reason, code, message, None
        if not constraint.accepting:
            return INCOMPLETE, code, ("max_new_tokens reached before the constraint was complete: the output is not "
                                      "valid JSON / not in the grammar"), None
        if not self.output_type:
            return reason, code, message, None
        text = self._session.engine.tokenizer.decode(list(self.generated_ids))
        try:
            return reason, code, message, TypedOutput(self.request_id, self.output_type, text,
                                                      ros_schema.parse_message(self.output_type, text))
        except (ValueError, TypeError, AssertionError) as e:   # what a message's field setters raise
            return ERROR, ErrorCode.INTERNAL, f"{self.output_type}: the output does not make a message: {e}", None

    def _close_iter(self) -> None:
        if self._iter is not None:
            self._iter.close()
            self._iter = None


class Session:
    """The node's behaviour on one Engine (see the module docstring for the rules)."""

    def __init__(self, engine, *, discretiser: Discretiser, default_sampling: Optional[SamplingParams] = None,
                 emit: Callable[[object], None], stream_chunk_tokens: int = 8, active: bool = True):
        if stream_chunk_tokens < 1:
            raise ValueError(f"stream_chunk_tokens must be >= 1, got {stream_chunk_tokens}")
        discretiser.check_vocab(engine.vocab_size)
        self.engine = engine
        self.discretiser = discretiser
        self.default_sampling = default_sampling or SamplingParams()
        self.stream_chunk_tokens = stream_chunk_tokens
        self._emit = emit
        self._accepting = active
        self._active: Optional[Generation] = None
        self._interrupted: "OrderedDict[str, _Interrupted]" = OrderedDict()
        self._seq = 0
        self._request_id = 0
        self.epoch = 0  # bumped by every operation; a Generation restarts its engine iterator on change

    @property
    def active(self) -> Optional[Generation]:
        """The running generation, if any."""
        return self._active

    @property
    def accepting(self) -> bool:
        """Whether operations are accepted (the lifecycle node is active)."""
        return self._accepting

    @property
    def last_request_id(self) -> int:
        """The most recent request id handed out (0 = none yet)."""
        return self._request_id

    @property
    def position(self) -> int:
        return self.engine.position

    def interrupted(self) -> dict[str, int]:
        """Resumable capsules, oldest first, with the tokens each still owes."""
        return {cid: rec.remaining for cid, rec in self._interrupted.items()}

    def diagnostics(self) -> dict:
        """The engine's figures (:meth:`Engine.stats`) and its fingerprint, for ``/diagnostics``."""
        return {**self.engine.stats(), "fingerprint": self.engine.fingerprint}

    # ---- observations -------------------------------------------------------------------------
    def observe(self, observation: ObservationInput) -> Optional[Generation]:
        """Ingest a ``~/observation``; return its Generation when ``max_new_tokens > 0``.

        A running generation is preempted (kept resumable) once the observation is known to be valid.
        """
        return self._observe("observe", observation, {})

    def generate(self, observation: ObservationInput, override_sampling: bool = False, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, reseed: bool = False, seed: int = 0,
                 json_schema: str = "", grammar: str = "", output_type: str = "") -> Generation:
        """A ``~/generate`` goal: :meth:`observe` with the goal's sampling (the node's unless
        ``override_sampling``) and, with ``reseed``, the sampler reseeded to ``seed`` after ingestion; the output
        constrained by at most one of ``json_schema``, ``grammar`` (Lark/GBNF) or ``output_type`` (a ROS message
        type, whose parsed message is emitted as a TypedOutput)."""
        fields = {"override_sampling": override_sampling, "temperature": temperature, "top_p": top_p,
                  "top_k": top_k, "reseed": reseed, "seed": seed,
                  "json_schema": json_schema, "grammar": grammar, "output_type": output_type}
        if observation.max_new_tokens <= 0:
            return self._operation("generate", _raise(ErrorCode.INVALID_ARGUMENT,
                                                      "observation.max_new_tokens must be > 0"),
                                   {**fields, "observation": observation})
        return self._observe("generate", observation, fields)

    def _observe(self, op: str, obs: ObservationInput, fields: dict) -> Optional[Generation]:
        """An observation, with a Generate goal's sampling and seed ``fields`` (none for a plain observation)."""
        seed = fields["seed"] if fields.get("reseed") else None

        def run():  # every check before the running generation is preempted
            ids, params = self._check_observation(obs, fields, seed)
            constraint = self._constraint(fields, obs)
            if self._active is not None:
                self._active.stop(PREEMPTED)
            if ids:
                self.engine.ingest(ids)
            if seed is not None:
                self.engine.reseed(seed)
            if generating:
                self.engine.constrain(constraint)
            return params

        generating = obs.max_new_tokens > 0
        fields = {**fields, "observation": obs, "request_id": self._request_id + 1 if generating else 0}
        try:
            params = self._operation(op, run, fields)
        except FlashRTError:
            if generating:
                self._refuse_generation(obs.stamp_ns)
            raise
        if obs.snapshot_label:
            self.snapshot(label=obs.snapshot_label)
        if not generating:
            return None
        return self._start(obs.max_new_tokens, params, obs.stamp_ns,
                           output_type=fields.get("output_type", "") or obs.output_type)

    def _constraint(self, fields: dict, obs: ObservationInput):
        """The constraint of a goal (``fields``) or of its observation, compiled (INVALID_ARGUMENT with the
        library's or the type mapping's message), or None; changes nothing."""
        goal = {name: fields[name] for name in CONSTRAINT_FIELDS if fields.get(name, "")}
        own = {name: value for name, value in obs.constraint_fields().items() if value}
        if goal and own:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "a goal's constraint goes in the goal or in its "
                                                           "observation, not both")
        given = goal or own
        if len(given) > 1:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"at most one of {', '.join(CONSTRAINT_FIELDS)}; "
                                                           f"got {', '.join(given)}")
        if "output_type" in given:
            return self.engine.compile_constraint("json_schema", ros_schema.schema_for(given["output_type"]))
        if "json_schema" in given:
            return self.engine.compile_constraint("json_schema", given["json_schema"])
        if "grammar" in given:
            return self.engine.compile_constraint("gbnf", given["grammar"])   # llguidance reads Lark or GBNF
        return None

    def _sampling(self, fields: dict) -> SamplingParams:
        """The request's sampling, made (and so checked) once here: a Generate goal's own with
        ``override_sampling``, else the node's defaults."""
        if not fields.get("override_sampling"):
            return self.default_sampling
        return SamplingParams(temperature=float(fields["temperature"]), top_k=int(fields["top_k"]),
                              top_p=float(fields["top_p"]))

    def _check_observation(self, obs: ObservationInput, fields: dict, seed: Optional[int],
                           after_tokens: int = 0) -> tuple[list[int], SamplingParams]:
        """Every check of an observation, before the running generation is preempted: its tokens and its
        sampling parameters (a Generate goal's ``fields``), or FlashRTError. ``after_tokens``: tokens ahead of it,
        still to be ingested."""
        ids = self.engine.check_ingest(self._tokenise(obs), after_tokens)
        length = ingest_length(ids)
        params = self._sampling(fields)
        if obs.max_new_tokens < 0:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "max_new_tokens must be >= 0")
        if obs.max_new_tokens == 0 and any(obs.constraint_fields().values()):
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "a constraint (json_schema, grammar, output_type) needs "
                                                           "max_new_tokens > 0: it constrains what is generated")
        if seed is not None:
            self.engine.check_seed(seed)
        if not ids and obs.max_new_tokens == 0:
            raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "empty observation: no tokens and nothing to generate")
        if obs.max_new_tokens:
            self.engine.check_generate(after_tokens + length)
        if obs.snapshot_label:  # refuse now rather than ingest and then fail to take the capsule(s)
            # a preempted generation is kept as a capsule of the current state first: both must fit
            interrupted = (self.engine.position,) if self._active is not None else ()
            self.engine.check_capsule_room(*interrupted, self.engine.position + after_tokens + length,
                                           label=obs.snapshot_label)
        return ids, params

    def observe_group(self, observations: list[ObservationInput]) -> Optional[Generation]:
        """Ingest observations that queued up together (in arrival order) as ONE prefill; return the
        Generation the last one asks for, if any.

        Each observation still gets its own 'observe' event, with its own span of positions
        (``position_before`` .. ``position_after``) and ``count`` = how many observations after it share the
        prefill (0 for the last), so a replay re-issues the same group as one prefill: a prefill of A+B is
        not byte-identical to a prefill of A, then of B (the chunked delta rule folds differently), though
        the tokens in context are the same. The group is one commit boundary. A refused observation is
        left out of the prefill (its event says why), exactly as it would be refused alone; the running
        generation (only an urgent group runs while one does) is preempted once, if any is accepted.
        Only the last observation may generate or carry a ``snapshot_label`` (they end a group).
        """
        if len(observations) == 1:
            return self.observe(observations[0])
        if any(o.max_new_tokens or o.snapshot_label for o in observations[:-1]):
            raise ValueError("only the last observation of a group may generate or take a snapshot")
        before = self.engine.position
        running = self._active.request_id if self._active is not None else 0
        start = time.perf_counter()
        self.epoch += 1
        checked, pending, constraint = [], 0, None
        for obs in observations:
            try:
                self._check_accepting()
                ids, params = self._check_observation(obs, {}, None, pending)
                if obs is observations[-1]:
                    constraint = self._constraint({}, obs)
            except FlashRTError as e:
                checked.append((None, None, e))
                continue
            checked.append((ids, params, None))
            pending += ingest_length(ids)
        tokens = [t for ids, _, error in checked if error is None for t in ids]
        if any(error is None for _, _, error in checked) and self._active is not None:
            self._active.stop(PREEMPTED)  # as one accepted observation alone would
        if tokens:
            try:
                self.engine.ingest(tokens)
            except Exception as e:  # noqa: BLE001 - nothing was committed: every accepted one fails with the reason
                failed = e if isinstance(e, FlashRTError) else FlashRTError(ErrorCode.INTERNAL,
                                                                            f"{type(e).__name__}: {e}")
                checked = [(None, None, err or failed) for _, _, err in checked]
        position, last = before, observations[-1]
        for index, (obs, (ids, params, error)) in enumerate(zip(observations, checked)):
            generating = obs.max_new_tokens > 0
            fields = {"observation": obs, "count": len(observations) - 1 - index,
                      "request_id": self._request_id + 1 if generating else 0}
            at = running if index == 0 else 0
            if error is not None:
                self._event("observe", fields, at, position, start, False, error.code, error.message, after=position)
                if generating:
                    self._refuse_generation(obs.stamp_ns)
                continue
            after = position + ingest_length(ids)
            self._event("observe", fields, at, position, start, True, ErrorCode.OK, "", after=after)
            position = after
        ids, params, error = checked[-1]
        if error is not None:
            return None
        if last.snapshot_label:
            self.snapshot(label=last.snapshot_label)
        if last.max_new_tokens > 0:
            self.engine.constrain(constraint)
            return self._start(last.max_new_tokens, params, last.stamp_ns, output_type=last.output_type)
        return None

    def observation_dropped(self, observation: ObservationInput, message: str) -> Done:
        """Record that ``observation`` was never ingested: the node's observation queue dropped or refused it
        (an 'observation_dropped' event carrying it, so its stamp, and why in ``message``)."""
        return self._operation("observation_dropped", Done, {"observation": observation, "message": message},
                               needs_active=False)

    def refuse_observation(self, observation: ObservationInput, message: str) -> Done:
        """Refuse an observation the node could not convert (an image it cannot read, see ``image_convert``):
        always raises FlashRTError (INVALID_ARGUMENT with ``message``) after one failed 'observation_refused' event
        carrying what of it converted, and for a generating one its final ``error`` chunk, as a refusal here does.
        Nothing else changes."""
        generating = observation.max_new_tokens > 0
        fields = {"observation": observation, "message": message,
                  "request_id": self._request_id + 1 if generating else 0}
        try:
            return self._operation("observation_refused", _raise(ErrorCode.INVALID_ARGUMENT, message), fields)
        finally:
            if generating:
                self._refuse_generation(observation.stamp_ns)

    def observation_lost(self, count: int) -> Done:
        """Record that ``count`` observations never reached the engine (an 'observation_lost' event)."""
        def run():
            fields["message"] = f"{count} observation(s) lost before reaching the engine"
            return Done()
        fields = {"count": count}
        return self._operation("observation_lost", run, fields, needs_active=False)

    def _tokenise(self, obs: ObservationInput) -> list:
        """The observation's ingest items: token ids, images, the text's ids, the values' ids."""
        ids = list(obs.token_ids) + list(obs.images)
        if obs.text:
            ids += self.engine.tokenizer.encode(obs.text)
        return ids + self.discretiser.encode(obs.values)

    def _refuse_generation(self, stamp_ns: int) -> None:
        """End a refused observation's request at once: one final, empty ``error`` chunk under a new
        request id, so a client waiting on ~/tokens for this stamp is answered (the 'observe' event
        just before it carries the error code and message)."""
        self._request_id += 1
        self._emit(TokenOutput(self._request_id, [], "", self.engine.position, True, ERROR, stamp_ns))

    def _start(self, max_new_tokens: int, sampling: SamplingParams, stamp_ns: int, prior_ids=(),
               output_type: str = "") -> Generation:
        self._request_id += 1
        self._active = Generation(self, self._request_id, max_new_tokens, sampling, stamp_ns, prior_ids, output_type)
        return self._active

    def _keep_interrupted(self, gen: Generation) -> None:
        """Snapshot a preempted stream as ``interrupted-<request_id>`` (one 'preempt' event)."""
        capsule_id = f"{INTERRUPTED_PREFIX}{gen.request_id}"

        def run():
            self.engine.snapshot(capsule_id, label=f"preempted request {gen.request_id}")
            self._interrupted[capsule_id] = _Interrupted(
                gen.request_id, gen.remaining, gen.sampling, gen.generated_ids, gen.stamp_ns, gen.output_type)
            fields["message"] = f"request {gen.request_id} preempted with {gen.remaining} tokens left"

        fields = {"result_id": capsule_id}
        try:
            self._operation("preempt", run, fields)
        except FlashRTError:
            pass  # the event carries the reason; the stream simply is not resumable

    # ---- state operations ---------------------------------------------------------------------
    def snapshot(self, capsule_id: str = "", label: str = "", pinned: bool = False) -> CapsuleResult:
        return self._operation("snapshot", lambda: self._capsule(self.engine.snapshot(
            self._client_id(capsule_id), label, pinned)), {"capsule_id": capsule_id, "label": label, "pinned": pinned})

    def restore(self, capsule_id: str, verify_checksum: bool = False) -> CapsuleResult:
        return self._operation("restore", lambda: self._replacing(lambda: self._capsule(
            self.engine.restore(self._known(capsule_id), verify_checksum=verify_checksum))),
            {"capsule_id": capsule_id, "verify_checksum": verify_checksum})

    def fork(self, source_id: str = "", capsule_id: str = "", label: str = "", switch_to: bool = False
             ) -> CapsuleResult:
        def run():
            if source_id:
                self._known(source_id)
            call = lambda: self._capsule(  # noqa: E731
                self.engine.fork(source_id or None, self._client_id(capsule_id), label, switch_to))
            return self._replacing(call) if switch_to and source_id else call()
        return self._operation("fork", run, {"capsule_id": capsule_id, "source_id": source_id, "label": label,
                                             "switch_to": switch_to})

    def rollback(self, capsule_id: str = "", steps: int = 0) -> PositionResult:
        # the engine validates everything before it changes anything (a refusal leaves the stream running)
        return self._operation("rollback", lambda: self._replacing(lambda: PositionResult(
            self.engine.rollback(capsule_id=capsule_id or None, steps=steps or None))),
            {"capsule_id": capsule_id, "steps": steps})

    def drop(self, capsule_id: str) -> DropResult:
        def run():
            freed = self.engine.drop(self._known(capsule_id))
            self._interrupted.pop(capsule_id, None)
            fields["result_id"] = capsule_id
            return DropResult(freed)
        fields = {"capsule_id": capsule_id}
        return self._operation("drop", run, fields)

    def export_capsule(self, capsule_id: str) -> CapsuleResult:
        """Write a stored capsule to ``<capsule_dir>/<capsule_id>.capsule``."""
        return self._operation("export", lambda: self._capsule(self.engine.export_capsule(capsule_id)),
                               {"capsule_id": capsule_id})

    def import_capsule(self, capsule_id: str) -> CapsuleResult:
        """Read ``<capsule_dir>/<capsule_id>.capsule`` into the store (a client id: reserved prefixes refused)."""
        return self._operation("import", lambda: self._capsule(self.engine.import_capsule(
            validate_client_capsule_id(capsule_id))), {"capsule_id": capsule_id})

    def spill_capsule(self, capsule_id: str, tier: str = "", wait: bool = True) -> CapsuleResult:
        """Move a capsule off the device (host | disk | "" = the next tier down); see Engine.spill."""
        return self._operation("spill", lambda: self._capsule(self.engine.spill(self._known(capsule_id), tier, wait)),
                               {"capsule_id": capsule_id, "tier": tier, "wait": wait})

    def fetch_capsule(self, capsule_id: str, wait: bool = True) -> CapsuleResult:
        """Bring a spilled capsule back onto the device; ``wait`` false prefetches a disk-tier one."""
        return self._operation("fetch", lambda: self._capsule(self.engine.fetch(self._known(capsule_id), wait)),
                               {"capsule_id": capsule_id, "wait": wait})

    def pin_capsule(self, capsule_id: str, pinned: bool = True) -> CapsuleResult:
        """Pin a capsule to the device (fetched first) or unpin it; interrupted-* capsules stay pinned."""
        def run():
            self._known(capsule_id)
            if not pinned and capsule_id.startswith(INTERRUPTED_PREFIX):
                raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"capsule {capsule_id!r} holds an interrupted "
                                                               f"stream: it stays pinned until resumed or dropped")
            return self._capsule(self.engine.pin(capsule_id, pinned))
        return self._operation("pin", run, {"capsule_id": capsule_id, "pinned": pinned})

    def reset(self) -> Done:
        return self._operation("reset", lambda: self._replacing(lambda: self.engine.reset() or Done()), {})

    def resume(self, capsule_id: str = "") -> ResumeResult:
        """Restore an interrupted stream and continue it (the new Generation is :attr:`active`)."""
        def run():
            if capsule_id:
                self._known(capsule_id)
            if not self._interrupted:
                raise FlashRTError(ErrorCode.NOTHING_TO_RESUME, "no interrupted generation to resume")
            cid = capsule_id or next(reversed(self._interrupted))
            if cid not in self._interrupted:
                raise FlashRTError(ErrorCode.NOTHING_TO_RESUME, f"{cid!r} is not an interrupted generation")
            self._replacing(lambda: self.engine.restore(cid))
            rec = self._interrupted.pop(cid)
            gen = self._start(rec.remaining, rec.sampling, rec.stamp_ns, rec.generated, rec.output_type)
            fields.update(result_id=cid, request_id=gen.request_id,
                          message=f"request {gen.request_id} resumes request {rec.request_id} "
                                  f"with {rec.remaining} tokens left")
            return ResumeResult(gen.request_id, self.engine.position, gen.remaining)

        fields = {"capsule_id": capsule_id}
        return self._operation("resume", run, fields)

    def cancel(self, request_id: int) -> Done:
        """Stop generation ``request_id`` at this boundary (finish reason ``canceled``)."""
        def run():
            if self._active is None or self._active.request_id != request_id:
                raise FlashRTError(ErrorCode.INVALID_ARGUMENT, f"request {request_id} is not running")
            self._active.stop(CANCELED)
            return Done()
        return self._operation("cancel", run, {"request_id": request_id})

    def list_capsules(self) -> ListResult:
        """The capsules and the budget (read-only: no event)."""
        self._check_accepting()
        e = self.engine
        return ListResult(e.capsules(), e.capsule_bytes_used, e.capsule_budget_bytes, e.position, e.live_parent)

    def capsules(self) -> list:
        return self.engine.capsules()

    def set_sampling(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> Done:
        """New default sampling (the node's live ``sampling.*`` parameters) for requests started after it.

        The values are rounded to float32, as a Generate goal's are, so that the event (float32 fields) holds
        exactly what is used and a replay samples with the same temperature."""
        temperature, top_p = as_float32(temperature), as_float32(top_p)

        def run():
            self.default_sampling = SamplingParams(temperature=temperature, top_k=int(top_k), top_p=top_p)
            return Done()
        return self._operation("set_sampling", run, {"temperature": temperature, "top_p": top_p, "top_k": top_k},
                               needs_active=False)

    # ---- lifecycle -----------------------------------------------------------------------------
    def activate(self) -> Done:
        """Accept operations again. The first activation of a fresh session (no event yet) leaves no
        event: a recording starts at a fresh, active node."""
        if self._seq == 0 and not self._accepting:
            self._accepting = True
            return Done()

        def run():
            self._accepting = True
            return Done()
        return self._operation("activate", run, {}, needs_active=False)

    def deactivate(self) -> Done:
        """Refuse operations (``NOT_ACTIVE``) until :meth:`activate`; a running generation ends ``canceled``."""
        def run():
            self._accepting = False
            if self._active is not None:
                self._active.stop(CANCELED, "node deactivated")
            return Done()
        return self._operation("deactivate", run, {}, needs_active=False)

    # ---- helpers -----------------------------------------------------------------------------
    def _check_accepting(self) -> None:
        if not self._accepting:
            raise FlashRTError(ErrorCode.NOT_ACTIVE, "node is not active")

    def _capsule(self, info) -> CapsuleResult:
        return CapsuleResult(info, self.engine.position)

    @staticmethod
    def _client_id(capsule_id: str) -> str | None:
        """A client's requested capsule id (None: the engine picks one), refused if invalid or reserved."""
        return validate_client_capsule_id(capsule_id) if capsule_id else None

    def _known(self, capsule_id: str) -> str:
        """Validate the id's form and that the capsule exists (UNKNOWN_CAPSULE otherwise)."""
        self.engine.capsule(capsule_id)
        return capsule_id

    def _replacing(self, call):
        """Run an engine call that replaces the live state; a running generation ends as canceled."""
        result = call()
        if self._active is not None:
            self._active.stop(CANCELED, "the live state was replaced")
        return result

    def _operation(self, op: str, run, fields: dict, needs_active: bool = True):
        """Run one operation, emit its single EventOutput and re-raise refusals as FlashRTError.

        ``fields`` are the event's request fields; ``run`` may complete them (e.g. the chosen id).
        A CapsuleResult fills in ``result_id``. A refusal carries the live position it left
        unchanged (``FlashRTError.position``), for responses that report one.
        """
        before = self.engine.position
        running = self._active.request_id if self._active is not None else 0
        start = time.perf_counter()
        self.epoch += 1
        try:
            if needs_active:
                self._check_accepting()
            result = run()
        except FlashRTError as e:
            self._event(op, fields, running, before, start, False, e.code, e.message)
            e.position = before
            raise
        except Exception as e:  # noqa: BLE001 - report runtime bugs as INTERNAL instead of killing the thread
            err = FlashRTError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
            self._event(op, fields, running, before, start, False, err.code, err.message)
            err.position = before
            raise err from e
        if isinstance(result, CapsuleResult):
            fields["result_id"] = result.capsule.id
        self._event(op, fields, running, before, start, True, ErrorCode.OK, fields.get("message", ""))
        return result

    def _event(self, op, fields, running, before, start, success, code, message, after=None) -> None:
        fields = {k: v for k, v in fields.items() if k != "message"}
        self._seq += 1
        self._emit(EventOutput(self._seq, op, running_request_id=running, position_before=before,
                               position_after=self.engine.position if after is None else after,
                               latency_ms=(time.perf_counter() - start) * 1e3, success=success,
                               error_code=int(code), message=message, **fields))


def _raise(code: ErrorCode, message: str):
    def run():
        raise FlashRTError(code, message)
    return run
