"""Device memory: reserve the pool from what the device has, check it against the planner's
estimate, and report what is in use.

On Ascend the pool is reserved before the first compile with
``mindspore.runtime.set_memory(init_size=estimate, max_size=cap)`` where ``cap`` is the HBM
minus what the CANN runtime and HCCL keep outside MindSpore's pool. The pool is NOT capped at
the planner's estimate: an underestimate must not turn into an out-of-memory error while HBM
is free. ``init_size`` takes the estimate in one piece at start-up (so a layout the device
cannot hold fails then, not an hour later) and the pool may grow up to the cap.
``parallel.memory_headroom_gb`` is the margin the estimate should leave below the cap: less
than that is reported (``tight``) and logged as a warning, not enforced.

On CPU ``set_memory`` and the ``memory_*`` counters are no-ops (MindSpore 2.9.0): the
sizes are still computed and returned, and :func:`memory_metrics` reports zeros.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, Optional

LOG = logging.getLogger("ms_deepseek.parallel_plan.memory")
GB = 1024**3


def _gb_string(value: float, up: bool = True) -> str:
    """MindSpore's size format ("12.5GB"), rounded to a tenth (up, or down for a cap), never "0GB"."""
    tenths = math.ceil(value * 10 - 1e-9) if up else math.floor(value * 10 + 1e-9)
    return f"{max(0.1, tenths / 10):.1f}GB"


def reservation_sizes(
    plan_result,
    headroom_gb: float = 2.0,
    stage: Optional[int] = None,
    hbm_gb: Optional[float] = None,
    runtime_reserved_gb: float = 3.0,
) -> Dict[str, object]:
    """The pool sizes for one rank (its pipeline ``stage``; None = the fullest stage)."""
    if headroom_gb < 0:
        from ms_deepseek.core.errors import UserError

        raise UserError(f"parallel.memory_headroom_gb: must be >= 0, got {headroom_gb}")
    stages = plan_result.stages
    if not stages:
        raise ValueError("reservation_sizes: the plan result has no memory estimate (invalid layout)")
    chosen = plan_result.worst if stage is None else stages[stage]
    hbm = hbm_gb if hbm_gb is not None else plan_result.layout.hbm_gb
    hccl = chosen.hccl_buffers / GB  # HCCL allocates its buffers itself, outside the pool
    cap = hbm - runtime_reserved_gb - hccl  # what the device has for MindSpore's pool
    estimate = chosen.pool / GB
    free = cap - estimate
    return {
        "stage": chosen.stage,
        "estimate_gb": round(estimate, 3),
        "cap_gb": round(cap, 3),
        "free_gb": round(free, 3),  # what the estimate leaves of the pool
        "headroom_gb": headroom_gb,  # the margin asked for (parallel.memory_headroom_gb)
        "hccl_gb": round(hccl, 3),
        "tight": free < headroom_gb,
        "over": free < 0,
        "init_size": _gb_string(min(estimate, cap), up=estimate < cap),
        "max_size": _gb_string(cap, up=False),
        "increase_size": "2.0GB",
    }


def reserve_device_memory(
    plan_result,
    headroom_gb: float = 2.0,
    stage: Optional[int] = None,
    hbm_gb: Optional[float] = None,
    runtime_reserved_gb: float = 3.0,
) -> Dict[str, object]:
    """Reserve the device pool (Ascend, before compile); return the computed sizes.

    ``applied`` in the result says whether ``set_memory`` was called (False on CPU/GPU).
    """
    sizes = reservation_sizes(plan_result, headroom_gb, stage, hbm_gb, runtime_reserved_gb)
    import mindspore as ms

    target = ms.get_context("device_target")
    sizes["applied"] = False
    if target == "Ascend":
        ms.runtime.set_memory(
            init_size=sizes["init_size"], increase_size=sizes["increase_size"], max_size=sizes["max_size"]
        )
        sizes["applied"] = True
        LOG.info(
            "device memory pool: %s reserved up front (the planner's estimate), up to %s (HBM minus runtime and HCCL)",
            sizes["init_size"],
            sizes["max_size"],
        )
        if sizes["tight"]:
            LOG.warning(
                "device memory: the planner's estimate %.1f GB leaves %.1f GB of the %.1f GB pool "
                "(parallel.memory_headroom_gb asks for %.1f GB)",
                sizes["estimate_gb"],
                sizes["free_gb"],
                sizes["cap_gb"],
                headroom_gb,
            )
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
