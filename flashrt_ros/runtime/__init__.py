"""flashrt_ros.runtime: a graph-bound Qwen3.5 engine whose whole state is one arena, with capsules of it.

Pure PyTorch; no ROS imports anywhere below this package.
"""
from .capsules import (INTERRUPTED_PREFIX, MAX_LABEL_BYTES, CapsuleInfo, validate_capsule_id,
                       validate_client_capsule_id)
from .config import PRESETS, ModelConfig
from .engine import Engine, EngineConfig
from .errors import ErrorCode, FlashRTError
from .sampler import SamplingParams

__all__ = ["CapsuleInfo", "Engine", "EngineConfig", "ErrorCode", "FlashRTError", "INTERRUPTED_PREFIX",
           "MAX_LABEL_BYTES", "ModelConfig", "PRESETS", "SamplingParams", "validate_capsule_id",
           "validate_client_capsule_id"]
