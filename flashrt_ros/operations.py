"""The one table of the node's operations: every way a client changes or reads the stream, written once.

Each :class:`Operation` says where it is offered (``~/<name>`` service, the ``~/generate`` action, the
``~/observation`` topic, a lifecycle transition), which :class:`flashrt_ros.session.Session` method runs it,
which request fields its ``StateEvent`` carries (under the same names: the event holds the request as it was
made, so a replay re-issues exactly that), whether a success replaces the live state, and its typed result,
whose fields fill the service response of the same names.

The node builds its services from this table, the client its service helpers, and the bag tools read it to
re-issue recorded events (offline: ``getattr(session, op.method)(**ros_convert.session_kwargs(op, event))``;
live: the same fields as a service request). No ROS import here: types are named, and resolved where ROS is loaded.

To add an operation: add its result type (if new) and one ``Operation`` row, and a Session method whose
keyword arguments are the request's field names. Node, client and bag tools pick it up.
"""
import struct
from dataclasses import dataclass
from typing import Optional


# ---- typed results (field names = the response fields they fill) ----------------------------------------
@dataclass(frozen=True)
class CapsuleResult:
    """A capsule created or made live, and the live position afterwards."""
    capsule: object          # flashrt_ros.runtime.CapsuleInfo
    position: int


@dataclass(frozen=True)
class PositionResult:
    position: int


@dataclass(frozen=True)
class DropResult:
    freed_bytes: int


@dataclass(frozen=True)
class ResumeResult:
    request_id: int          # the resumed generation streams on ~/tokens under this id
    position: int
    remaining_tokens: int


@dataclass(frozen=True)
class ListResult:
    capsules: list           # CapsuleInfo, oldest first
    used_bytes: int
    budget_bytes: int
    live_position: int
    live_parent: str


@dataclass(frozen=True)
class Done:
    """No result beyond success (reset, cancel, lifecycle)."""


@dataclass(frozen=True)
class Operation:
    op: str                    # the StateEvent ``op``, and this table's key
    kind: str                  # service | action | topic | lifecycle | parameter | consequence
    interface: str             # ROS name relative to the node ("" when none)
    ros_type: str              # interface type ("" when none)
    method: str                # Session method ("" for consequences, which another operation emits)
    fields: tuple = ()         # request fields the event carries (same names in request, event, method)
    replaces_state: object = False  # True, False, or the name of the request field that decides (fork)
    result: type = Done

    def replaces(self, request) -> bool:
        """Whether a successful call with ``request`` (a request or event) replaces the live state."""
        if isinstance(self.replaces_state, str):
            return bool(getattr(request, self.replaces_state)) and bool(getattr(request, "source_id", ""))
        return bool(self.replaces_state)


# Sampling fields of a Generate goal, carried by its 'generate' event under the same names.
SAMPLING_FIELDS = ("override_sampling", "temperature", "top_p", "top_k", "reseed", "seed")
# Constraint fields of a Generate goal (at most one set), carried by its 'generate' event under the same names.
CONSTRAINT_FIELDS = ("json_schema", "grammar", "output_type")


def as_float32(value: float) -> float:
    """``value`` as a float32 field of a request or event holds it (temperature and top_p are float32 in the Generate
    goal and in StateEvent): sampling defaults are rounded so, so that an event holds exactly what is used."""
    return struct.unpack("f", struct.pack("f", float(value)))[0]

OPERATIONS: dict = {o.op: o for o in (
    Operation("observe", "topic", "observation", "flashrt_ros/msg/Observation", "observe", ("observation",)),
    Operation("generate", "action", "generate", "flashrt_ros/action/Generate", "generate",
              ("observation", *SAMPLING_FIELDS, *CONSTRAINT_FIELDS)),
    Operation("cancel", "action", "generate", "flashrt_ros/action/Generate", "cancel", ("request_id",)),
    Operation("snapshot", "service", "snapshot", "flashrt_ros/srv/Snapshot", "snapshot",
              ("capsule_id", "label", "pinned"), result=CapsuleResult),
    Operation("restore", "service", "restore", "flashrt_ros/srv/Restore", "restore",
              ("capsule_id", "verify_checksum"), True, CapsuleResult),
    Operation("fork", "service", "fork", "flashrt_ros/srv/Fork", "fork",
              ("source_id", "capsule_id", "label", "switch_to"), "switch_to", CapsuleResult),
    Operation("rollback", "service", "rollback", "flashrt_ros/srv/Rollback", "rollback",
              ("capsule_id", "steps"), True, PositionResult),
    Operation("drop", "service", "drop_capsule", "flashrt_ros/srv/DropCapsule", "drop", ("capsule_id",),
              result=DropResult),
    Operation("export", "service", "export_capsule", "flashrt_ros/srv/ExportCapsule", "export_capsule",
              ("capsule_id",), result=CapsuleResult),
    Operation("import", "service", "import_capsule", "flashrt_ros/srv/ImportCapsule", "import_capsule",
              ("capsule_id",), result=CapsuleResult),
    Operation("spill", "service", "spill_capsule", "flashrt_ros/srv/SpillCapsule", "spill_capsule",
              ("capsule_id", "tier", "wait"), result=CapsuleResult),
    Operation("fetch", "service", "fetch_capsule", "flashrt_ros/srv/FetchCapsule", "fetch_capsule",
              ("capsule_id", "wait"), result=CapsuleResult),
    Operation("pin", "service", "pin_capsule", "flashrt_ros/srv/PinCapsule", "pin_capsule",
              ("capsule_id", "pinned"), result=CapsuleResult),
    Operation("reset", "service", "reset", "std_srvs/srv/Trigger", "reset", (), True),
    Operation("resume", "service", "resume", "flashrt_ros/srv/Resume", "resume", ("capsule_id",), True,
              ResumeResult),
    Operation("list", "service", "list_capsules", "flashrt_ros/srv/ListCapsules", "list_capsules",
              result=ListResult),
    Operation("activate", "lifecycle", "", "", "activate"),
    Operation("deactivate", "lifecycle", "", "", "deactivate"),
    Operation("set_sampling", "parameter", "sampling.*", "", "set_sampling", ("temperature", "top_p", "top_k")),
    Operation("observation_lost", "topic", "observation", "", "observation_lost", ("count",)),
    # the node's observation queue dropped or refused this observation (overload policy; the event carries it)
    Operation("observation_dropped", "topic", "observation", "", "observation_dropped",
              ("observation", "message")),
    # the node could not convert this observation (an image it cannot read); the event carries the rest of it
    Operation("observation_refused", "topic", "observation", "", "refuse_observation", ("observation", "message")),
    # emitted inside another operation (never re-issued): the interrupted stream's capsule, and the capsule
    # an observation's ``snapshot_label`` asks for (a 'snapshot' event right after its 'observe')
    Operation("preempt", "consequence", "", "", ""),
)}

# Operations that read only: they leave no event (nothing to replay).
READ_ONLY = frozenset({"list"})


def services() -> list:
    """The table's services, in table order."""
    return [o for o in OPERATIONS.values() if o.kind == "service"]


def operation(op: str) -> Optional[Operation]:
    return OPERATIONS.get(op)


def resolve_type(name: str):
    """The ROS interface class named ``pkg/kind/Name`` (imports ROS: only call where ROS is loaded)."""
    import importlib

    package, kind, cls = name.split("/")
    return getattr(importlib.import_module(f"{package}.{kind}"), cls)
