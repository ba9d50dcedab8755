"""Collectives of the data-parallel workers, apart from the gradient reduction inside the step.

* :class:`RankMean`: logged values averaged over ranks (one small AllReduce per step);
* :func:`replica_digests`: replicas proven to hold the same weights at each save.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np


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
