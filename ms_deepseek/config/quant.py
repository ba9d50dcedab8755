"""A quantized frozen base under LoRA (QLoRA): the recipe's ``quant:`` section.

``bits: 8``: symmetric int8, one scale per output channel; ``bits: 4``: symmetric int4, two values
per byte, one scale per ``group_size`` input columns (``group_size: null`` = per output channel).
Only the frozen base is quantized, so the section is valid only beside a ``lora:`` section
(checked by :func:`ms_deepseek.config.recipe.validate`). The checkpoint format and the layers are
documented in ``docs/lora.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ms_deepseek.core.errors import UserError
from ms_deepseek.core.schema import check_at_most

QUANT_BITS = (4, 8)


@dataclass
class QuantSpec:
    bits: int = 4  # 8: int8 per output channel; 4: int4, packed two per byte
    group_size: Optional[int] = None  # input columns per scale; null: one scale per output channel

    def __post_init__(self):
        if self.bits not in QUANT_BITS:
            raise UserError(f"quant.bits: must be 4 or 8, got {self.bits}")
        if self.group_size is not None and self.group_size < 1:
            raise UserError(f"quant.group_size: must be a whole number >= 1 (or null), got {self.group_size}")
        check_at_most("quant.group_size", self.group_size, 2**20, "input columns per scale")
        if self.group_size is not None and self.bits == 4 and self.group_size % 2:
            raise UserError(
                f"quant.group_size: int4 packs two values per byte, so the group size must be even, "
                f"got {self.group_size}"
            )


# The frozen base weights the converter quantizes: the Linear weights of attention, the dense MLP
# and the shared experts, and the stacked routed experts. Embeddings, norms (also q_a_layernorm /
# kv_a_layernorm, kind "attention" but one-dimensional), biases, the router (mlp.gate) and lm_head
# keep their dtype.
QUANTIZED_KINDS = ("attention", "dense_mlp", "shared_experts", "routed_experts")


def is_quantized(info) -> bool:
    """Whether a :class:`ms_deepseek.config.inventory.ParamInfo` of the base is stored quantized."""
    return (
        info.kind in QUANTIZED_KINDS
        and info.name.endswith(".weight")
        and len(info.shape) >= 2
        and ".lora_" not in info.name
    )


def group_size_problem(spec: QuantSpec, inventory) -> Optional[str]:
    """One line naming the first quantized weight whose input width the group size does not divide."""
    if spec.group_size is None:
        return None
    for info in inventory:
        if is_quantized(info) and info.shape[-1] % spec.group_size:
            return (
                f"quant.group_size: {spec.group_size} does not divide the input width {info.shape[-1]} of {info.name}"
            )
    return None
