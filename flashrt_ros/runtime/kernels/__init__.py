"""The runtime's kernels: per operation one reference function (plain PyTorch, the CPU path and the oracle) and,
beside it in the same module, one fast kernel with the same contract.

Every function writes its recurrent outputs into caller-owned buffers (``copy_`` or in-place stores), never
rebinding them, so the same code runs eagerly on the CPU and inside captured CUDA graphs over the arena.
"""
from .attention import attention_causal, attention_masked
from .conv import causal_conv
from .delta_rule import delta_rule_chunked, delta_rule_fla, delta_rule_recurrent, fla_available
from .norms import gated_rms_norm, l2norm, rms_norm
from .rope import apply_rope

__all__ = ["apply_rope", "attention_causal", "attention_masked", "causal_conv", "delta_rule_chunked",
           "delta_rule_fla", "delta_rule_recurrent", "fla_available", "gated_rms_norm", "l2norm", "rms_norm"]
