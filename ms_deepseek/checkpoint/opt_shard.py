"""The parallel optimizer's further cut of a parameter, undone for checkpoint files and redone on load.

With ``parallel.optimizer_shard`` (MindSpore's parallel optimizer, ``hsdp`` / ``enable_parallel_optimizer``)
a rank does not hold a parameter's model-parallel slice: MindSpore "saves the parameters as
minimal slices", the slice split evenly along axis 0 over the parameter's optimizer-shard group
(the ranks that hold the same slice), part ``get_rank(group)`` of ``get_group_size(group)``. The
same applies to the optimizer states (``adam_m.*`` / ``adam_v.*``). The group of each parameter is
in the compiled cell's ``parameter_layout_dict`` (entry 5; empty = not cut).

Checkpoint files always hold model-parallel slices (the cut ``layout.json`` describes), so:

* loading takes this rank's part of the slice it read (the rule of MindSpore's own
  ``mindspore.parallel._tensor._load_tensor_by_layout``: ``np.split(slice, size)[rank]``);
* saving gathers the parts back with an AllGather over the group (the pattern of MindSpore's
  ``AllGatherCell`` that ``save_checkpoint(integrated_save=True)`` uses), which concatenates along
  axis 0 in group-rank order. Every rank visits the parameters in the same (sorted) order, so
  ranks that share several groups reach their collectives in the same order.

:class:`OptimizerShards` takes the group functions and the gather as arguments: on Ascend they
are MindSpore's (:meth:`OptimizerShards.from_compiled`); the CPU tests pass emulated groups and
an emulated AllGather over simulated ranks.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable

import numpy as np

from ms_deepseek.core.errors import UserError

LAYOUT_GROUP = 5  # index of the optimizer-shard group in a parameter_layout_dict entry


def own_part(value: np.ndarray, size: int, index: int, name: str = "") -> np.ndarray:
    """Part ``index`` of ``size`` of a model-parallel slice, split along axis 0."""
    if size <= 1:
        return value
    if value.ndim == 0 or value.shape[0] % size:
        raise UserError(
            f"optimizer sharding: {name} slice {list(value.shape)} does not split {size} ways along "
            "axis 0, which MindSpore's parallel optimizer requires"
        )
    rows = value.shape[0] // size
    return value[index * rows : (index + 1) * rows]


def join_parts(parts: Iterable[np.ndarray]) -> np.ndarray:
    """The model-parallel slice from the group's parts in group-rank order (what AllGather returns)."""
    return np.concatenate(list(parts), axis=0)


class OptimizerShards:
    """Per parameter name: its optimizer-shard group (``groups``), that group's size and this rank's
    index in it (``group_size`` / ``group_rank``), and ``gather(group, value) -> joined value``."""

    def __init__(
        self,
        groups: Dict[str, str],
        group_size: Callable[[str], int],
        group_rank: Callable[[str], int],
        gather: Callable[[str, object], object],
    ):
        self.groups = {name: group for name, group in groups.items() if group}
        self.group_size, self.group_rank, self.gather = group_size, group_rank, gather

    def part(self, name: str, value: np.ndarray) -> np.ndarray:
        """What this rank holds of the model-parallel slice ``value`` of ``name`` (restore_into's hook)."""
        group = self.groups.get(name)
        if group is None:
            return value
        return own_part(value, self.group_size(group), self.group_rank(group), name)

    def gathered(self, tensors: Dict[str, object]) -> Dict[str, object]:
        """``tensors`` with every optimizer-sharded one replaced by its model-parallel slice (a collective:
        every rank calls it at the same step)."""
        out = dict(tensors)
        for name in sorted(n for n in tensors if n in self.groups):
            out[name] = self.gather(self.groups[name], tensors[name])
        return out

    @classmethod
    def from_compiled(cls, cell) -> "OptimizerShards":
        """The groups MindSpore chose when it compiled ``cell`` (Ascend; after ``cell.compile``)."""
        from mindspore.communication import get_group_size, get_rank

        layouts = getattr(cell, "parameter_layout_dict", None)
        if not layouts:  # as mindspore.train.serialization does for a cell compiled inside a wrapper
            from mindspore.graph.api import _get_parameter_layout

            layouts = _get_parameter_layout() or {}
        groups = {
            name: str(entry[LAYOUT_GROUP])
            for name, entry in layouts.items()
            if len(entry) > LAYOUT_GROUP and entry[LAYOUT_GROUP]
        }
        cells: Dict[str, object] = {}

        def gather(group: str, param):
            from mindspore import Tensor

            if group not in cells:
                cells[group] = _AllGather(group)
            # a plain Tensor of the parameter, as save_checkpoint passes it; the slice goes to host memory
            # at once, so a save holds at most one gathered slice on the device
            return cells[group](Tensor(param.data)).move_to("CPU")

        return cls(groups, get_group_size, get_rank, gather)


def _AllGather(group: str):
    """MindSpore's AllGatherCell pattern (mindspore/parallel/_cell_wrapper.py): one AllGather over
    ``group`` in a jit cell that the auto-parallel compile leaves alone."""
    from mindspore import jit, nn, ops

    class AllGatherParts(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.allgather = ops.AllGather(group)
            self.add_flags(skip_auto_parallel_compile=True)

        @jit()
        def construct(self, x):
            return self.allgather(x)

    return AllGatherParts()
