"""The run folder's lease (jobs/lease.py): one holder, renewed by its heartbeat; a live holder
refuses a second job in one line naming it; a dead one's lease is taken over (its pid gone on this host, a stale
heartbeat, or --take-over); a job whose lease was taken over stops before writing more."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ms_deepseek.core.errors import UserError
from ms_deepseek.jobs import lease as lease_mod
from ms_deepseek.jobs.lease import LEASE_FILE, LeaseHeld, RunLease


def _write_lease(run, host, pid, heartbeat_age=0.0):
    run.mkdir(parents=True, exist_ok=True)
    now = time.time()
    (run / LEASE_FILE).write_text(
        json.dumps({"host": host, "pid": pid, "started": now - 3600, "heartbeat": now - heartbeat_age, "token": "t0"})
    )


def test_a_live_holder_refuses_a_second_job_naming_it(tmp_path):
    run = tmp_path / "run"
    _write_lease(run, "node7", 4242)  # another host: its pid cannot be checked from here
    with pytest.raises(
        LeaseHeld, match=r"held by another job \(host node7 pid 4242 since .* UTC, last heartbeat \d+ s ago\)"
    ):
        RunLease.acquire(run)
    assert json.loads((run / LEASE_FILE).read_text())["token"] == "t0"  # untouched


def test_a_dead_holder_on_this_host_is_taken_over_silently(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)  # a pid that ran and ended
    run = tmp_path / "run"
    _write_lease(run, lease_mod.host_name(), dead)
    said = []
    lease = RunLease.acquire(run, say=said.append)
    try:
        assert said == [] and json.loads((run / LEASE_FILE).read_text())["pid"] == os.getpid()
    finally:
        lease.release()
    assert not (run / LEASE_FILE).exists()


def test_a_zombie_holder_is_dead(tmp_path):
    """A holder killed but not reaped (a job's worker whose parent ended first) still answers kill(pid, 0): its
    lease is taken over all the same (the msrun dead-worker test resumed into a folder held by such a zombie)."""
    import signal

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.send_signal(signal.SIGKILL)
        for _ in range(100):  # killed, not yet reaped by us: a zombie
            if Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z":
                break
            time.sleep(0.05)
        run = tmp_path / "run"
        _write_lease(run, lease_mod.host_name(), child.pid)
        lease = RunLease.acquire(run, say=lambda line: None)
        lease.release()
    finally:
        child.wait()


def test_a_stale_heartbeat_or_take_over_takes_the_lease_with_a_line(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("MS_DEEPSEEK_LEASE_STALE_S", "60")
    _write_lease(run, "node7", 4242, heartbeat_age=120)
    said = []
    RunLease.acquire(run, say=said.append).release()
    assert len(said) == 1 and "host node7 pid 4242" in said[0] and "heartbeat is 120 s old" in said[0]
    _write_lease(run, "node7", 4242, heartbeat_age=1)
    said.clear()
    RunLease.acquire(run, take_over=True, say=said.append).release()
    assert len(said) == 1 and "--take-over" in said[0]


def test_the_heartbeat_renews_and_a_taken_over_job_stops(tmp_path):
    run = tmp_path / "run"
    lease = RunLease.acquire(run)
    try:
        first = json.loads((run / LEASE_FILE).read_text())["heartbeat"]
        time.sleep(0.01)
        lease.renew()
        assert json.loads((run / LEASE_FILE).read_text())["heartbeat"] > first
        lease.check(read=True)  # still ours
        _write_lease(run, "node7", 4242)  # another job took the folder over (--take-over)
        with pytest.raises(UserError, match="taken over by another job .*host node7 pid 4242"):
            lease.check(read=True)
    finally:
        lease.release()
    assert json.loads((run / LEASE_FILE).read_text())["host"] == "node7"  # not ours: left in place
