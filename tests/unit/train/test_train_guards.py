"""The run's guards (train/guards.py) on their own: rank 0 alone takes the run folder's lease (none under the dry
run); a step starts only while the lease is this job's and a save reads the lease file first; launch's heartbeat
sees every step start and finish; a SIGTERM becomes the stop flag, and closing gives the handler back and the
lease up."""

import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ms_deepseek.core.errors import UserError
from ms_deepseek.jobs.lease import LEASE_FILE
from ms_deepseek.jobs.preempt import HEARTBEAT_DIR, Heartbeat, StopRequest
from ms_deepseek.train.context import RunContext, TrainOptions
from ms_deepseek.train.guards import RunGuards, take_lease


def _ctx(run: Path, rank: int = 0, resume=None) -> RunContext:
    recipe = SimpleNamespace(checkpoint=SimpleNamespace(resume=resume))
    return RunContext(recipe, run, rank, 2)


def _taken_over(run: Path) -> None:
    now = time.time()
    holder = {"host": "node7", "pid": 4242, "started": now, "heartbeat": now, "token": "t0"}
    (run / LEASE_FILE).write_text(json.dumps(holder))


def test_only_rank_0_takes_the_lease_and_not_under_the_dry_run(tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert take_lease(_ctx(run, rank=1), TrainOptions()) is None and not run.exists()
    monkeypatch.setenv("MS_SIMULATION_LEVEL", "0")
    assert take_lease(_ctx(run), TrainOptions()) is None and not run.exists()
    monkeypatch.delenv("MS_SIMULATION_LEVEL")
    with pytest.raises(UserError, match="does not exist"):  # --resume latest of no run: said before the lease
        take_lease(_ctx(run), TrainOptions(resume="latest"))
    lease = take_lease(_ctx(run), TrainOptions())
    try:
        assert (run / LEASE_FILE).is_file()
    finally:
        lease.release()


def test_the_guards_stop_a_taken_over_run_and_tell_launch_each_step(tmp_path):
    run = tmp_path / "run"
    lease = take_lease(_ctx(run), TrainOptions())
    guards = RunGuards(lease, Heartbeat(run, 0), StopRequest())
    beat = run / HEARTBEAT_DIR / "rank_0"
    try:
        guards.step_started(3)
        assert beat.read_text().split() == ["3", "2"]
        guards.step_finished(3, 0.5)
        assert beat.read_text().split() == ["3", "3", "0.500000"]
        guards.before_save()  # still ours
        _taken_over(run)
        with pytest.raises(UserError, match="taken over by another job"):
            guards.before_save()  # read from the file before a save
        with pytest.raises(UserError, match="taken over by another job"):
            guards.step_started(4)  # and remembered: no further step
    finally:
        guards.close()


def test_a_sigterm_is_the_stop_flag_until_the_guards_close(tmp_path):
    run = tmp_path / "run"
    lease = take_lease(_ctx(run), TrainOptions())
    before = signal.getsignal(signal.SIGTERM)
    guards = RunGuards(lease, Heartbeat(run, 0), StopRequest())
    guards.install()
    try:
        assert guards.stop_flag == 0.0
        os.kill(os.getpid(), signal.SIGTERM)
        assert (guards.stop_flag, guards.stop_name) == (1.0, "SIGTERM")
    finally:
        guards.close()
    assert signal.getsignal(signal.SIGTERM) == before
    assert not (run / LEASE_FILE).exists()  # released
