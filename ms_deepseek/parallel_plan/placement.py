"""Expert placement: which EP rank holds each routed expert, and in which local slot.

The MoE dispatch reads this [E, 2] int32 table (column 0: EP rank, column 1: local
slot on that rank) through the ``ExpertLookup`` op, and each (token, choice) goes to
buffer row ``rank * (E / ep) + slot``. A different placement (e.g. re-balanced from
measured expert load) is therefore data, not code: build the table here and
:func:`ms_deepseek.parallel_apply.apply.apply_plan` writes it into every MoE layer's
non-trainable ``mlp.expert_placement`` Parameter.

Placement and stored weights: the stacked expert weights [E, out, in] stay in expert
order (index e = expert e, as in the HF checkpoint). The rows of the capacity buffer
are ordered by (rank, slot), so with a non-contiguous placement the buffer row of
expert e is ``rank(e) * E_local + slot(e)``; :func:`buffer_order` gives the expert
held at each buffer row, which is how the stacked weights must be permuted to line up
with the buffer when a custom placement is used.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import numpy as np

from ms_deepseek.core.errors import UserError


def contiguous_assignment(num_experts: int, ep: int) -> list:
    """Expert e -> EP rank e // (E / ep): blocks of consecutive experts per rank."""
    check_divisible(num_experts, ep)
    per_rank = num_experts // ep
    return [e // per_rank for e in range(num_experts)]


def check_divisible(num_experts: int, ep: int, where: str = "parallel.ep") -> None:
    if ep < 1:
        raise UserError(f"{where}: must be >= 1, got {ep}")
    if num_experts % ep:
        raise UserError(f"{where}: n_routed_experts={num_experts} is not divisible by ep={ep}")


def placement_table(
    num_experts: int, ep: int, assignment: Optional[Sequence[int]] = None, where: str = "parallel.expert_placement"
) -> np.ndarray:
    """The [E, 2] int32 table for ``ep`` ranks.

    ``assignment[e]`` is the EP rank of expert e (None: contiguous blocks). Every rank must
    hold exactly E / ep experts; local slots are given in increasing expert order per rank.
    """
    check_divisible(num_experts, ep)
    per_rank = num_experts // ep
    if assignment is None:
        assignment = contiguous_assignment(num_experts, ep)
    assignment = list(assignment)
    if len(assignment) != num_experts:
        raise UserError(f"{where}: has {len(assignment)} entries, expected n_routed_experts={num_experts}")
    for e, rank in enumerate(assignment):
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < ep:
            raise UserError(f"{where}[{e}]: EP rank must be an integer in [0, ep={ep}), got {rank!r}")
    counts = Counter(int(r) for r in assignment)
    for rank in range(ep):
        if counts.get(rank, 0) != per_rank:
            raise UserError(
                f"{where}: EP rank {rank} holds {counts.get(rank, 0)} experts, "
                f"expected n_routed_experts / ep = {per_rank}"
            )
    table = np.zeros((num_experts, 2), dtype=np.int32)
    next_slot = [0] * ep
    for e, rank in enumerate(assignment):
        table[e, 0] = rank
        table[e, 1] = next_slot[rank]
        next_slot[rank] += 1
    return table


def buffer_order(table: np.ndarray) -> np.ndarray:
    """[E] expert id held at each buffer row ``rank * E_local + slot`` (inverse of the table)."""
    num_experts = table.shape[0]
    ranks = int(table[:, 0].max()) + 1
    per_rank = num_experts // ranks
    order = np.full(num_experts, -1, dtype=np.int64)
    rows = table[:, 0].astype(np.int64) * per_rank + table[:, 1]
    order[rows] = np.arange(num_experts)
    if (order < 0).any():
        raise UserError("expert placement: table does not cover every (rank, slot) exactly once")
    return order


def balanced_assignment(expert_load: Sequence[float], ep: int) -> list:
    """A placement that evens out measured per-expert load across EP ranks.

    Greedy longest-processing-time: experts sorted by load, each given to the least
    loaded rank that still has a free slot. ``expert_load`` is e.g. a layer's
    ``expert_load`` list from metrics.jsonl.
    """
    num_experts = len(expert_load)
    check_divisible(num_experts, ep)
    per_rank = num_experts // ep
    totals = [0.0] * ep
    used = [0] * ep
    assignment = [0] * num_experts
    for e in sorted(range(num_experts), key=lambda i: (-float(expert_load[i]), i)):
        rank = min((r for r in range(ep) if used[r] < per_rank), key=lambda r: (totals[r], r))
        assignment[e] = rank
        totals[rank] += float(expert_load[e])
        used[rank] += 1
    return assignment
