"""Parameter names: HuggingFace checkpoint <-> ms_deepseek, the one adapter for both directions.

Our names are the HuggingFace names, except routed experts, which are stacked per
layer so the MoE runs them as one batched matmul:

    HF:  model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight   [out, in]
    ms:  model.layers.{i}.mlp.experts.{gate,up,down}_proj.weight       [E, out, in]

Expert e sits at index e of the stack, so conversion is renaming plus stacking:
bytes are never changed.
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

# an expert's weight, or a quantized one's scale / offset (checkpoint/convert/quant_format.py)
_EXPERT_TENSOR = r"((?:gate|up|down)_proj\.weight(?:_scale|_offset)?)$"
_HF_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\." + _EXPERT_TENSOR)
_MS_EXPERT = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\." + _EXPERT_TENSOR)


def hf_to_ms(name: str) -> Tuple[str, Optional[int]]:
    """HF tensor name -> (our name, expert index or None when the tensor is not a routed expert)."""
    match = _HF_EXPERT.match(name)
    if match:
        return f"{match.group(1)}.{match.group(3)}", int(match.group(2))
    return name, None


def is_stacked_expert(name: str) -> bool:
    return _MS_EXPERT.match(name) is not None


def ms_to_hf(name: str, num_experts: int) -> List[str]:
    """Our name -> the HF names it holds (one, or one per expert for a stacked tensor, in stack order)."""
    match = _MS_EXPERT.match(name)
    if match:
        return [f"{match.group(1)}.{e}.{match.group(3)}" for e in range(num_experts)]
    return [name]


def layer_of(name: str) -> Optional[int]:
    """Decoder layer index of a tensor name (either layout), None for embeddings / final norm / head."""
    match = re.match(r"^model\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def unstack(name: str, array, num_experts: int) -> List[Tuple[str, object]]:
    """(HF name, value) pairs of one of our tensors: a stacked expert tensor splits along axis 0."""
    hf_names = ms_to_hf(name, num_experts)
    return list(zip(hf_names, [array] if len(hf_names) == 1 else list(array)))


def layer_key(name: str) -> Tuple[int, int]:
    """Sort key grouping tensors by position in the model: embeddings, layers 0..L-1, final norm and head."""
    layer = layer_of(name)
    if layer is not None:
        return (1, layer)
    return (0, 0) if name.startswith("model.embed_tokens") else (2, 0)
