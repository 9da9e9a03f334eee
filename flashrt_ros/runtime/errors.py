"""Error codes and the one exception type the runtime raises for bad requests.

The codes mirror ``msg/ErrorCode.msg`` so the ROS node can pass them through unchanged.
Every operation that raises :class:`FlashRTError` leaves the live state and all capsules untouched.
"""
import enum


class ErrorCode(enum.IntEnum):
    OK = 0
    UNKNOWN_CAPSULE = 1
    INVALID_CAPSULE_ID = 2
    DUPLICATE_CAPSULE_ID = 3
    FINGERPRINT_MISMATCH = 4
    CHECKSUM_MISMATCH = 5
    BUDGET_EXCEEDED = 6
    CONTEXT_OVERFLOW = 7
    TOKEN_OUT_OF_RANGE = 8
    INVALID_ARGUMENT = 9
    NO_HISTORY = 10
    NOT_IN_LINEAGE = 11
    NOT_ACTIVE = 12
    TIMEOUT = 13
    CANCELED = 14
    PREEMPTED = 15
    NOTHING_TO_RESUME = 16
    LOAD_FAILED = 17
    INTERNAL = 18
    NO_CAPSULE_DIR = 19
    FILE_ERROR = 20


class FlashRTError(Exception):
    """A refused request: ``code`` says why, ``message`` says it for a human."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = ErrorCode(code)
        self.message = message
