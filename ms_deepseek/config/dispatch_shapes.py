"""Capacity rule and MoE dispatch/combine buffer shapes, exactly as ``DeepseekV2MoE`` builds them.

Pure Python (no MindSpore import): the MoE layer calls :func:`capacity` itself, and the
planner reads :func:`dispatch_buffers` to size memory and the expert AllToAll volume
"derived from the dispatch as built".

The dispatch (MindFormers MoE v1 / ``MoEV2`` pattern, see ``ms_deepseek/model/moe.py``):

* tokens ``[G, N, H]``: G = the plan's ``dp`` (one group per data-parallel rank, batch
  rows rank-major), N = tokens per group (micro-batch rows per dp rank x sequence);
* routing on the local tokens: ``topk_ids`` / ``combine_index`` / ``weights`` ``[G, N, k]``;
* capacity C per expert **per group** (:func:`capacity`); ``dispatch_index`` ``[G, E, C]``
  (which local token fills each slot, N = the zero padding row), read off a per-group sort of
  float32 keys ``slot_keys`` ``[G, E, k*N]`` (MindFormers ``TopkRouterV2``);
* dispatch buffer ``[G, E, C, H]`` split (dp, 1, 1, 1) (a local Gather with batch dims);
* dp -> ep exchange: viewed ``[dp/ep, ep, E, C, H]`` (ep the inner factor of dp),
  transposed to ``[dp/ep, E, ep, C, H]`` and read as the 4-D expert input
  ``[dp/ep, E, ep*C, H]`` split (dp/ep, ep, 1, 1): one AllToAll inside each group of ``ep``
  adjacent data-parallel ranks (MindSpore inserts it for the layout change under
  ``enable_alltoall``); the expert hidden ``[dp/ep, E, ep*C, I]`` splits I by tp as well;
* expert output ``[dp/ep, E, ep*C, H]`` -> the same exchange back -> ``[G, E, C, H]`` split by dp,
  and a local combine Gather with batch dims -> ``[G, N, k, H]``.

Nothing is replicated over dp: every per-device shape below is the global one divided by
its split. Buffers are replicated over tp (each tp rank holds the same dispatch buffer).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

# The dispatch sorts float32 keys up to 3*k*N - 1 (see DeepseekV2MoE.dispatch_index): exact below 2**24.
SORT_KEY_LIMIT = 2**24


def max_tokens_per_group(k: int) -> int:
    """The most tokens one data-parallel group may route through one MoE layer call (3*k*N < 2**24)."""
    return (SORT_KEY_LIMIT - 1) // (3 * k)


def capacity(tokens_per_group: int, k: int, num_experts: int, factor: Optional[float], multiple: int = 1) -> int:
    """Per-expert buffer rows of one group.

    ``factor`` None (dropless, evaluation): ``tokens_per_group`` (an expert receives a token
    at most once). Otherwise ``ceil(factor * tokens_per_group * k / num_experts)``, at least 1,
    at most ``tokens_per_group`` (more rows could never be filled), rounded up to ``multiple``.
    """
    if factor is None:
        c = tokens_per_group
    else:
        want = factor * tokens_per_group * k / num_experts  # inf for a factor near float max
        c = max(1, tokens_per_group if not math.isfinite(want) else min(tokens_per_group, math.ceil(want)))
    multiple = max(1, int(multiple))
    return -(-c // multiple) * multiple


def training_factor(cfg) -> Optional[float]:
    """The capacity factor of the training buffers: ``cfg.capacity_factor``, or None (C = N) for a dropless
    layer (``moe_dispatch: dropless``), whose sharded form is the worst-case exchange
    (``model/moe.py`` ``DeepseekV2MoE.use_bounded_exchange``). Unsharded, a dropless layer holds its k*N sorted
    rows instead, fewer than the E*N slots counted here: the price is the sharded one, an upper bound."""
    if getattr(cfg, "moe_dispatch", "capacity") == "dropless":
        return None
    return cfg.capacity_factor


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _split(shape: Tuple[int, ...], strategy: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(-(-int(d) // int(s)) for d, s in zip(shape, strategy))


def dispatch_buffers(cfg, dp: int, ep: int, tp: int, tokens_per_group: int, training: bool) -> Dict[str, object]:
    """Named buffer shapes of one MoE layer's forward (global, strategy and per device).

    ``cfg``: a DeepseekV2Config (``n_routed_experts``, ``num_experts_per_tok``, ``hidden_size``,
    ``moe_intermediate_size``, ``capacity_factor``). ``tokens_per_group``: tokens per
    data-parallel rank per micro-batch (micro-batch rows per dp rank x sequence length).
    ``training`` False: the evaluation capacity, ``cfg.eval_capacity_factor`` (None: dropless,
    C = tokens_per_group), as the layer does in eval.

    Returns ``{"capacity": C, "buffers": {name: {"global", "strategy", "per_device",
    "elements_per_device"}}, "alltoall_elements_per_device": n}`` where n is the number of
    activation elements one device sends to the other ranks of its ep group in ONE AllToAll
    (the dispatch exchange; the combine exchange moves the same number back, and the
    backward repeats both): ``E * C * H * (ep - 1) / ep``, 0 when ep == 1.
    """
    E, k, H = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size
    I = cfg.moe_intermediate_size
    N, G = int(tokens_per_group), int(dp)
    outer = dp // ep if ep and dp % ep == 0 else 1  # the exchange view's outer factor: dp = outer * ep
    C = capacity(N, k, E, training_factor(cfg) if training else getattr(cfg, "eval_capacity_factor", None))
    table = {
        "tokens": ((G, N, H), (dp, 1, 1)),
        "topk_ids": ((G, N, k), (dp, 1, 1)),
        "slot_keys": ((G, E, k * N), (dp, 1, 1)),  # float32 sort keys that give dispatch_index
        "dispatch_index": ((G, E, C), (dp, 1, 1)),
        "combine_index": ((G, N, k), (dp, 1, 1)),
        "dispatch_buffer": ((G, E, C, H), (dp, 1, 1, 1)),
        "expert_input": ((outer, E, ep * C, H), (outer, ep, 1, 1)),
        "expert_hidden": ((outer, E, ep * C, I), (outer, ep, 1, tp)),  # gate, up and silu(gate)*up: three
        "expert_output": ((outer, E, ep * C, H), (outer, ep, 1, 1)),
        "combine_buffer": ((G, E, C, H), (dp, 1, 1, 1)),
        "combined": ((G, N, k, H), (dp, 1, 1, 1)),
    }
    buffers = {}
    for name, (shape, strategy) in table.items():
        local = _split(shape, strategy)
        buffers[name] = {
            "global": shape,
            "strategy": strategy,
            "per_device": local,
            "elements_per_device": _numel(local),
        }
    alltoall = (E * C * H * (ep - 1)) // ep if ep > 1 else 0
    return {"capacity": C, "buffers": buffers, "alltoall_elements_per_device": alltoall}
