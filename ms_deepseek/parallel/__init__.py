"""Parallelism on Ascend: the recipe's ``parallel`` section, the sharding plan (data), the function
that applies it to a built model, the layout validator, the memory / speed planner, expert
placement tables and device-memory reservation.

Importing this package does not import MindSpore; :mod:`apply` and :mod:`memory` do so lazily.
"""

from ms_deepseek.spec.parallel import ParallelConfig


def memory_metrics():
    """Device memory figures for metrics.jsonl (see :func:`ms_deepseek.parallel.memory.memory_metrics`)."""
    from ms_deepseek.parallel.memory import memory_metrics as _metrics

    return _metrics()


__all__ = ["ParallelConfig", "memory_metrics"]
