"""What one training step processes and the bytes per element it is held in: the planner's inputs beside the
model, the layout and the hardware (:mod:`ms_deepseek.parallel_plan.costs`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ms_deepseek.config.lora import LoraSpec
from ms_deepseek.config.quant import QuantSpec


@dataclass
class Precision:
    """Bytes per element. ``grad_bytes`` None: gradients in each parameter's own dtype (MindSpore)."""

    compute_bytes: int = 2  # activations (bfloat16 on Ascend)
    grad_bytes: Optional[int] = None
    optimizer_bytes: int = 8  # AdamW m and v in float32 (train.optim.AdamW)
    master_bytes: int = 0  # extra float32 master copy (0: parameters are updated in place)
    optimizer_level: str = "level1"  # MindSpore parallel optimizer: level1 shards weights + states,
    # level2/level3 also gradients


@dataclass
class Workload:
    seq_len: int
    global_batch_size: int
    micro_batch_size: int = 1
    flash_attention: bool = False  # True: fused attention (FlashAttentionScore) keeps no [T, T] scores
    lora: Optional[LoraSpec] = None  # None: full fine-tuning / pretraining
    quant: Optional[QuantSpec] = None  # a quantized frozen base under LoRA (None: the base in param_dtype)
    validation: bool = False  # data.validation: the eval graph's peak counts too (eval_peak)
