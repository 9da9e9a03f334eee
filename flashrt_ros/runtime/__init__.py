"""flashrt_ros.runtime: a graph-bound Qwen3.5 engine whose whole state is one arena, with capsules of it.

Pure PyTorch; no ROS imports anywhere below this package. Names are imported on first use (PEP 562), so that
``flashrt_ros.runtime.errors`` and the ROS-level modules that need only it load without torch (the Jazzy CI step).
"""
import importlib

_EXPORTS = {
    "capsule.capsule": ("INTERRUPTED_PREFIX", "MAX_LABEL_BYTES", "CapsuleInfo", "validate_capsule_id",
                 "validate_client_capsule_id"),
    "config": ("PRESETS", "ModelConfig"),
    "engine": ("Engine", "EngineConfig"),
    "errors": ("ErrorCode", "FlashRTError"),
    "sampler": ("SamplingParams",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
