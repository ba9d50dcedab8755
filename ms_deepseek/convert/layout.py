"""The expected tensors of a DeepSeek-V2 checkpoint in either layout, from its config.

The table itself is :mod:`ms_deepseek.model.inventory` (shared with the planner and the
loaders); this module re-exports its layout views for the converter and adds the
sort key that groups tensors by position in the model.

* :func:`expected_hf_shapes`: the released HuggingFace layout (per-expert tensors),
* :func:`expected_ms_shapes`: ours (routed experts stacked per layer, [E, out, in]).

Importable without MindSpore (``from_pretrained`` and the converter both use it).
"""

from __future__ import annotations

from typing import Tuple

from ms_deepseek.convert import names
from ms_deepseek.model.inventory import (Shape, expected_hf_shapes, expected_ms_shapes,  # noqa: F401
                                        ms_buffer_shapes, zero_width_shapes)


def layer_key(name: str) -> Tuple[int, int]:
    """Sort key grouping tensors by position in the model: embeddings, layers 0..L-1, final norm and head."""
    layer = names.layer_of(name)
    if layer is not None:
        return (1, layer)
    return (0, 0) if name.startswith("model.embed_tokens") else (2, 0)
