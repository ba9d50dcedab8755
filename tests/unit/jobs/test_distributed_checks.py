"""A check before step 1 that fails on one rank stops every rank (jobs.distributed.checked_on_every_rank)."""

import pytest

from ms_deepseek.core.errors import UserError
from ms_deepseek.jobs.distributed import checked_on_every_rank


def _world(failing_rank, world=4):
    """Run the agreement for every rank of a world, the AllReduce emulated by the flags' sum."""
    flags = [1.0 if r == failing_rank else 0.0 for r in range(world)]

    def check_of(rank):
        def check():
            if rank == failing_rank:
                raise UserError("compiled layout: parameter w: MindSpore ..., plan ...")

        return check

    outcome = {}
    for rank in range(world):
        try:
            checked_on_every_rank(check_of(rank), rank, world, any_rank_fn=lambda flag: sum(flags) > 0)
            outcome[rank] = "went on"
        except UserError as exc:
            outcome[rank] = str(exc)
    return outcome


def test_one_failing_rank_stops_every_rank():
    outcome = _world(failing_rank=2)
    assert outcome[2].startswith("compiled layout: parameter w")
    for rank in (0, 1, 3):
        assert outcome[rank].startswith(f"rank {rank}: another rank's check before step 1 failed"), outcome


def test_no_failure_goes_on_everywhere():
    assert set(_world(failing_rank=None).values()) == {"went on"}


def test_single_process_raises_its_own_problem():
    with pytest.raises(UserError, match="compiled layout"):
        checked_on_every_rank(lambda: (_ for _ in ()).throw(UserError("compiled layout: x")), 0, 1)
