"""Device memory: reserve the pool from the planner's estimate, and report what is in use.

On Ascend the pool is reserved before the first compile:
``mindspore.runtime.set_memory(init_size=estimate, max_size=estimate + headroom)``, so the
planned working memory is taken in one piece at start-up (an impossible layout fails
then, not after an hour) and the pool can grow only into the headroom. The reservation is capped at the HBM size minus
what the CANN runtime and HCCL keep outside MindSpore's pool.

On CPU ``set_memory`` and the ``memory_*`` counters are no-ops (design.md): the
sizes are still computed and returned, and :func:`memory_metrics` reports zeros.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, Optional

LOG = logging.getLogger("ms_deepseek.parallel.memory")
GB = 1024 ** 3


def _gb_string(value: float) -> str:
    """MindSpore's size format ("12.5GB"), rounded up to 0.1 GB, never "0GB"."""
    return f"{max(0.1, math.ceil(value * 10) / 10):.1f}GB"


def reservation_sizes(plan_result, headroom_gb: float = 2.0, stage: Optional[int] = None,
                      hbm_gb: Optional[float] = None, runtime_reserved_gb: float = 3.0) -> Dict[str, object]:
    """The pool sizes for one rank (its pipeline ``stage``; None = the fullest stage)."""
    if headroom_gb < 0:
        from ms_deepseek.errors import UserError

        raise UserError(f"parallel.memory_headroom_gb: must be >= 0, got {headroom_gb}")
    stages = plan_result.stages
    if not stages:
        raise ValueError("reservation_sizes: the plan result has no memory estimate (invalid layout)")
    chosen = plan_result.worst if stage is None else stages[stage]
    hbm = hbm_gb if hbm_gb is not None else plan_result.layout.hbm_gb
    cap = hbm - runtime_reserved_gb
    # HCCL allocates its communication buffers itself, outside MindSpore's pool.
    estimate = chosen.pool / GB
    hccl = chosen.hccl_buffers / GB
    pool_need = estimate + headroom_gb
    cap -= hccl
    size = min(pool_need, cap)
    # The estimate is reserved up front; the headroom is the pool's limit for growth, so
    # 1 - allocated/reserved stays a measure of fragmentation rather than of unused headroom.
    initial = min(estimate, size)
    return {
        "stage": chosen.stage,
        "estimate_gb": round(estimate, 3),
        "headroom_gb": headroom_gb,
        "hccl_gb": round(hccl, 3),
        "cap_gb": round(cap, 3),
        "capped": pool_need > cap,
        "init_size": _gb_string(initial),
        "max_size": _gb_string(size),
        "increase_size": "2.0GB",
    }


def reserve_device_memory(plan_result, headroom_gb: float = 2.0, stage: Optional[int] = None,
                          hbm_gb: Optional[float] = None, runtime_reserved_gb: float = 3.0) -> Dict[str, object]:
    """Reserve the device pool (Ascend, before compile); return the computed sizes.

    ``applied`` in the result says whether ``set_memory`` was called (False on CPU/GPU).
    """
    sizes = reservation_sizes(plan_result, headroom_gb, stage, hbm_gb, runtime_reserved_gb)
    import mindspore as ms

    target = ms.get_context("device_target")
    sizes["applied"] = False
    if target == "Ascend":
        ms.runtime.set_memory(init_size=sizes["init_size"], increase_size=sizes["increase_size"],
                              max_size=sizes["max_size"])
        sizes["applied"] = True
        LOG.info("device memory pool reserved: %s (estimate %.1f GB + headroom %.1f GB, cap %.1f GB)",
                 sizes["max_size"], sizes["estimate_gb"], headroom_gb, sizes["cap_gb"])
        if sizes["capped"]:
            LOG.warning("device memory: estimate + headroom exceeds %.1f GB; the pool is capped there",
                        sizes["cap_gb"])
    return sizes


def memory_metrics() -> Dict[str, float]:
    """``memory_allocated_gb``, ``memory_reserved_gb``, ``memory_fragmentation`` (1 - allocated/reserved)
    and ``memory_peak_allocated_gb`` of this process's device pool, for metrics.jsonl."""
    import mindspore as ms

    allocated = float(ms.runtime.memory_allocated())
    reserved = float(ms.runtime.memory_reserved())
    peak = float(ms.runtime.max_memory_allocated())
    return metrics_from_counts(allocated, reserved, peak)


def metrics_from_counts(allocated: float, reserved: float, peak: float = 0.0) -> Dict[str, float]:
    fragmentation = 1.0 - allocated / reserved if reserved > 0 else 0.0
    return {
        "memory_allocated_gb": round(allocated / GB, 4),
        "memory_reserved_gb": round(reserved / GB, 4),
        "memory_fragmentation": round(max(0.0, fragmentation), 4),
        "memory_peak_allocated_gb": round(peak / GB, 4),
    }
