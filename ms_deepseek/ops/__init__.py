"""Custom operators with a plain-MindSpore reference and native kernels behind one switch.

>>> from ms_deepseek.ops import ExpertLookup, FP32Softmax, GroupedMatmul, GroupedSwiglu, RepetitionPenalty

See :mod:`ms_deepseek.ops.api` for the contracts and :mod:`ms_deepseek.ops.backend`
for how the implementation is chosen.
"""

from ms_deepseek.ops.api import ExpertLookup, FP32Softmax, GroupedMatmul, GroupedSwiglu, RepetitionPenalty

__all__ = ["ExpertLookup", "FP32Softmax", "GroupedMatmul", "GroupedSwiglu", "RepetitionPenalty"]
