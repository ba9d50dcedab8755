"""Collectives of the data-parallel workers, apart from the gradient reduction inside the step.

* :class:`RankMean`: logged values averaged over ranks (one small AllReduce per step);
* :func:`replica_digests`: replicas proven to hold the same weights at each save;
* :func:`init_distributed`: joining the collective group (msrun workers, or a rank of MindSpore's dry run).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from ms_deepseek.core.errors import UserError


def replica_digests(tensors: Dict[str, object], world: int) -> List[str]:
    """SHA-1 of this rank's weights, all-gathered: one hex digest per rank. Raises if they differ."""
    import hashlib

    import mindspore as ms
    from mindspore import ops

    h = hashlib.sha1()
    for name in sorted(tensors):
        h.update(name.encode() + tensors[name].asnumpy().tobytes())
    mine = np.frombuffer(h.digest(), dtype=np.int32)  # 20 bytes -> [5]
    gathered = ops.AllGather()(ms.Tensor(mine)).asnumpy().reshape(world, -1)  # [world, 5]
    digests = [row.astype(np.int32).tobytes().hex() for row in gathered]
    if len(set(digests)) != 1:
        raise RuntimeError(
            f"data-parallel replicas hold different weights (sha1 per rank: {digests}); gradient averaging is broken"
        )
    return digests


class RankMean:
    """Mean of the logged values over data-parallel workers (one small AllReduce per step)."""

    def __init__(self, world: int):
        from mindspore import ops

        self.world = world
        self.all_reduce = ops.AllReduce()

    def __call__(self, loss: float, aux: float, stats: np.ndarray, stop: float = 0.0):
        """(loss, aux, stats) averaged, and whether any rank asked to stop (``stop`` > 0 on some rank)."""
        import mindspore as ms

        vec = np.concatenate([[loss, aux, stop], stats.reshape(-1)]).astype(np.float32)
        out = self.all_reduce(ms.Tensor(vec)).asnumpy() / self.world
        return float(out[0]), float(out[1]), out[3:].reshape(stats.shape), bool(out[2] > 0)


def gather_ints(values: List[int]) -> np.ndarray:
    """Every rank's ``values`` (same length on all ranks), all-gathered: [world, len(values)] int32."""
    import mindspore as ms
    from mindspore import ops

    mine = np.asarray(values, dtype=np.int32).reshape(1, -1)
    return ops.AllGather()(ms.Tensor(mine)).asnumpy().reshape(-1, mine.shape[1])


def any_rank(flag: float) -> bool:
    """True when ``flag`` > 0 on any rank (one AllReduce of one number)."""
    import mindspore as ms
    from mindspore import ops

    return bool(ops.AllReduce()(ms.Tensor([flag], ms.float32)).asnumpy()[0] > 0)


def checked_on_every_rank(check, rank: int, world: int, any_rank_fn=None):
    """Run ``check()`` (raises UserError on a problem) on every rank, then agree: when it failed on any rank,
    every rank raises (the failing one its own message, the others naming their rank), so no rank goes on
    into the step's first collective to wait for one that stopped."""
    from ms_deepseek.core.errors import UserError

    problem = None
    try:
        check()
    except UserError as exc:
        problem = str(exc)
    if world > 1 and (any_rank_fn or any_rank)(1.0 if problem else 0.0) and problem is None:
        raise UserError(
            f"rank {rank}: another rank's check before step 1 failed (its log names the parameter or "
            "primitive); every rank stops"
        )
    if problem is not None:
        raise UserError(problem)


def dry_run_level() -> Optional[str]:
    """``MS_SIMULATION_LEVEL`` when MindSpore's dry run is on, else None.

    Under the dry run a compiled step returns placeholders, not its outputs (an int where the step
    returns a tuple; ``verification/compile/worker.py`` never runs a step at level 0 for that reason),
    so training cannot go on past the compile."""
    level = os.environ.get("MS_SIMULATION_LEVEL", "").strip()
    return level or None


def is_distributed() -> bool:
    # msrun workers, or one rank of MindSpore's dry run (MS_SIMULATION_LEVEL with RANK_SIZE /
    # RANK_ID, tools/ascend_dryrun.sh), where init() is simulated
    dryrun = bool(os.environ.get("MS_SIMULATION_LEVEL")) and int(os.environ.get("RANK_SIZE", "1") or 1) > 1
    return int(os.environ.get("MS_WORKER_NUM", "1") or 1) > 1 or os.environ.get("MS_ROLE") == "MS_WORKER" or dryrun


def init_distributed(par) -> Tuple[int, int]:
    """Join the collective group when this process is one of several workers; returns (rank, world size)."""
    if not is_distributed():
        return 0, 1
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    init()
    rank, world = get_rank(), get_group_size()
    if world != par.world_size:
        raise UserError(
            f"parallel: {par.describe()} needs {par.world_size} workers (dp x tp x pp) but msrun started {world}"
        )
    if not par.uses_semi_auto:  # sharded layouts get their context from the AutoParallel wrapper
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=world)
    return rank, world
