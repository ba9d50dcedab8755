"""The guards around a run's steps, apart from the step itself.

* the run folder's lease (rank 0, :mod:`.lease`): taken before anything in the folder is read or written
  (:func:`take_lease`); another job that takes the folder over stops this one before its next step or save;
* launch's heartbeat (:class:`~.preempt.Heartbeat`): the steps started and finished, for launch's watchdog,
  and the step that raised, so that launch dumps the stacks of the ranks behind first;
* the stop request (:class:`~.preempt.StopRequest`): a SIGTERM is recorded, and every rank saves and stops
  after the step in which any rank got one (the flag rides on the step's reduction of the logged values).

The trainer asks :class:`RunGuards` at a step's edges (:meth:`~RunGuards.step_started`,
:meth:`~RunGuards.step_finished`, :meth:`~RunGuards.before_save`) and nothing else of them.
"""

from __future__ import annotations

from typing import Optional

from ms_deepseek.checkpoint import training as ckpt_mod
from ms_deepseek.jobs.distributed import dry_run_level
from ms_deepseek.jobs.lease import RunLease
from ms_deepseek.jobs.preempt import Heartbeat, StopRequest
from ms_deepseek.train.context import RunContext, TrainOptions


def take_lease(ctx: RunContext, options: TrainOptions) -> Optional[RunLease]:
    """Rank 0's lease of the run folder, taken before anything there is read or written; None on the other
    ranks and under MindSpore's dry run (which writes nothing there). ``--resume latest`` of a run folder that
    does not exist is refused first, in its own words."""
    if ctx.rank != 0 or dry_run_level() is not None:
        return None
    if (options.resume or ctx.recipe.checkpoint.resume) == "latest" and not ctx.run_dir.exists():
        ckpt_mod.resolve_checkpoint("latest", ckpt_mod.RESUME, ctx.run_dir)  # says there is no such run
    return RunLease.acquire(ctx.run_dir, options.take_over)


class RunGuards:
    """The lease, the heartbeat and the stop request of one worker's run (module doc)."""

    def __init__(self, lease: Optional[RunLease], heartbeat: Heartbeat, stop: StopRequest):
        self.lease, self.heartbeat, self.stop = lease, heartbeat, stop

    def install(self) -> None:
        """From here a SIGTERM is a stop request, not the end of the process (until :meth:`close`)."""
        self.stop.install()

    def step_started(self, step: int) -> None:
        """Before ``step`` writes anything: the lease is still this job's; launch sees the step started."""
        if self.lease is not None:
            self.lease.check()
        self.heartbeat.beat(step, step - 1)

    def step_finished(self, step: int, seconds: Optional[float]) -> None:
        """``step`` is done; ``seconds``: its time for launch's watchdog (None for the compile step)."""
        self.heartbeat.beat(step, step, seconds)

    def before_save(self) -> None:
        """The lease as its file says now: a job that took the folder over stops this one before it saves."""
        if self.lease is not None:
            self.lease.check(read=True)

    @property
    def stop_flag(self) -> float:
        """1.0 once this rank got a stop signal (what it adds to the step's reduction)."""
        return self.stop.flag

    @property
    def stop_name(self) -> str:
        return self.stop.name

    def failed(self, step: int) -> None:
        """``step`` raised: under launch the stacks of the ranks behind are dumped before this worker exits."""
        self.heartbeat.failed(step)

    def close(self) -> None:
        """SIGTERM's handler back, the lease released."""
        self.stop.restore()
        if self.lease is not None:
            self.lease.release()
