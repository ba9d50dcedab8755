"""Parallelism as pure Python: the sharding plan (data, :mod:`.plan`), the layout validator, the
memory / speed planner and its cost model, expert placement tables, rank geometry and device-memory
reservation. Applying the plan to a built model's Cells is :mod:`ms_deepseek.parallel_apply.apply`; the
recipe's ``parallel`` section is :class:`ms_deepseek.config.parallel.ParallelConfig` (re-exported).

Importing this package does not import MindSpore; :mod:`.memory` does so lazily.
"""

from ms_deepseek.config.parallel import ParallelConfig


def memory_metrics():
    """Device memory figures for metrics.jsonl (see :func:`ms_deepseek.parallel_plan.memory.memory_metrics`)."""
    from ms_deepseek.parallel_plan.memory import memory_metrics as _metrics

    return _metrics()


__all__ = ["ParallelConfig", "memory_metrics"]
