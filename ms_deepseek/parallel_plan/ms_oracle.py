"""MindSpore's own Python functions, used as the oracle for what the project assumes about MindSpore.

The simulation (``plan --simulate``) and the tests compare the project's rules with these,
never with the project's own helpers: a rule about MindSpore is only as good as its source.

* :func:`batch_row_of_rank`: where MindSpore puts a rank's dataset batch in the global batch
  (``mindspore/parallel/_utils.py`` ``_to_full_tensor``: stage rank ``r`` is placed at
  ``(r % dataset_strategy[i][0]) * rows``, i.e. the repeat of ``VirtualDatasetInfo`` on the
  left of the device matrix, ``ops_info/virtual_dataset_info.cc``).
"""

from __future__ import annotations

from typing import Tuple

import numpy as np


def batch_row_of_rank(rank: int, world: int, pipeline_stages: int, strategy, rows: int) -> int:
    """First row of the global batch that MindSpore takes ``rank``'s ``rows`` rows for.

    Runs ``mindspore.parallel._utils._to_full_tensor`` under ``dataset_strategy=strategy`` and
    ``pipeline_stages`` (the auto-parallel context is restored afterwards)."""
    from mindspore import context
    from mindspore.parallel._utils import _to_full_tensor

    saved = {k: context.get_auto_parallel_context(k) for k in ("dataset_strategy", "pipeline_stages")}
    try:
        per_input = not isinstance(strategy, str)
        value = tuple(tuple(int(k) for k in s) for s in strategy) if per_input else strategy
        context.set_auto_parallel_context(dataset_strategy=value, pipeline_stages=int(pipeline_stages))
        width = len(strategy[0]) if per_input else 2
        marker = np.ones((rows,) + (1,) * (width - 1), np.int32)  # [rows, 1, ...] of ones
        inputs = tuple(marker for _ in strategy) if per_input else (marker, marker)
        full = _to_full_tensor(inputs, world, rank)[0].asnumpy()
    finally:
        restore = {"pipeline_stages": saved["pipeline_stages"]}
        ds = saved["dataset_strategy"]
        restore["dataset_strategy"] = (
            ds if ds in ("data_parallel", "full_batch") else (tuple(tuple(s) for s in ds) if ds else "data_parallel")
        )
        context.set_auto_parallel_context(**restore)
    hit = np.flatnonzero(full.reshape(full.shape[0], -1)[:, 0])
    return int(hit[0])


def slice_of_rank(rank: int, world: int, pipeline_stages: int, strategy, rows: int) -> Tuple[int, int]:
    """(slice index, slices) of the global batch axis MindSpore gives ``rank`` (``"full_batch"``: (0, 1):
    ``_utils._need_to_full`` is False, every rank feeds the whole batch)."""
    if strategy == "full_batch":
        return 0, 1
    slices = world // pipeline_stages if strategy == "data_parallel" else int(strategy[0][0])
    return batch_row_of_rank(rank, world, pipeline_stages, strategy, rows) // rows, slices
