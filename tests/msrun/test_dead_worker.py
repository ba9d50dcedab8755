"""A dead worker fails the job fast: a 2-worker msrun data-parallel run on CPU, one worker SIGKILLed.

The job must exit non-zero within 60 s with one line naming the rank and its log file, the newest
complete checkpoint must be intact, and `launch --resume` must continue exactly (the resumed
steps' losses equal the ones the killed run logged for the same steps).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builders import free_port
from builders import small_recipe as recipe_data
from builders import write_recipe as write
from repo_paths import REPO

ROOT = REPO


def _launch(recipe, run_dir, *extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ms_deepseek.cli",
            "launch",
            str(recipe),
            "--output",
            str(run_dir),
            "--master-port",
            str(free_port()),
            "--cluster-time-out",
            "120",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )


def _steps(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        out[rec["step"]] = rec["loss"]
    return out


def _rank_pid(rank, run_dir):
    """pid of msrun's worker RANK_ID=rank training into run_dir (read from /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"MS_ROLE=MS_WORKER" in env and f"RANK_ID={rank}".encode() in env and str(run_dir).encode() in cmd:
            return int(entry)
    return None


@pytest.mark.msrun
def test_a_killed_worker_stops_the_job_fast_and_resume_continues_exactly(tmp_path):
    from ms_deepseek.checkpoint.training import CheckpointManager, is_complete
    from ms_deepseek.data.prepare import prepare_embedded_default

    data = tmp_path / "corpus"
    prepare_embedded_default(data, seq_len=32, vocab_size=512, max_bytes=100_000, progress=False)
    spec = recipe_data(data, dp=2)
    spec["train"]["steps"] = 2000  # far more than it runs before the kill
    spec["checkpoint"] = {"save_interval": 3, "keep_last": 2}
    recipe = write(tmp_path, spec)
    run_dir = tmp_path / "run"

    proc = _launch(recipe, run_dir)
    deadline = time.time() + 400
    while max(_steps(run_dir), default=0) < 7 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    pid = _rank_pid(1, run_dir)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    detection_s = time.time() - killed_at
    print(f"dead worker: job exited {detection_s:.1f} s after SIGKILL")
    assert proc.returncode != 0
    assert detection_s < 60
    last = err.strip().splitlines()[-1]
    assert last.startswith("ms-deepseek launch: worker rank 1 ") and "was killed by SIGKILL" in last, err[-3000:]
    assert f"its log: {run_dir / 'msrun_logs' / 'worker_1.log'}" in last
    assert _rank_pid(0, run_dir) is None and _rank_pid(1, run_dir) is None, "a worker outlived the job"

    manager = CheckpointManager(run_dir / "checkpoints")
    latest = manager.latest()
    assert latest is not None and is_complete(latest)
    logged = _steps(run_dir)  # what the killed run logged, before resume truncates it
    # The kill can land just after a save (steps are fast on CPU): then the newest checkpoint has no
    # logged step after it to compare with, and the resume starts from the one before (keep_last: 2).
    resume_from = [(step, path) for step, path in manager.complete() if step < max(logged)]
    assert resume_from, (sorted(logged), manager.complete())
    saved_at, start = max(resume_from)
    assert is_complete(start)
    # an older checkpoint than the run's newest: --force sets the newer one aside
    resume_arg = ["--resume"] if start == latest else ["--resume", str(start), "--force"]

    stop = min(max(logged), saved_at + 3)
    proc = _launch(recipe, run_dir, *resume_arg, "--max-steps", str(stop))
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    resumed = _steps(run_dir)
    assert sorted(resumed) == list(range(1, stop + 1))
    for step in range(saved_at + 1, stop + 1):
        assert resumed[step] == logged[step], step  # the same data, weights and RNG: bit-identical losses


FAKE_MSRUN = r"""
import os, signal, subprocess, sys, time
# a stand-in for msrun: one worker (RANK_ID as msrun exports it), then msrun's failure line, then a hang
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                          env=dict(os.environ, MS_ROLE="MS_WORKER", RANK_ID=sys.argv[1]), start_new_session=True)
time.sleep(1.0)  # the supervisor records pid -> rank
os.kill(worker.pid, getattr(signal, sys.argv[2]))
worker.wait()
print(f"[ERROR] ME(1:2,MainProcess):x [_api.py:364] Worker process {worker.pid} exit with exception. "
      f"Error code: {worker.returncode}.", file=sys.stderr, flush=True)
time.sleep(600)  # msrun waiting for its scheduler
"""


@pytest.mark.parametrize("lost_elsewhere", [False, True])
def test_supervisor_names_the_rank_and_stops_a_hanging_job(tmp_path, lost_elsewhere, capsys):
    from ms_deepseek.jobs.supervise import run_supervised

    script = tmp_path / "fake_msrun.py"
    script.write_text(FAKE_MSRUN)
    logs = tmp_path / "logs"
    logs.mkdir()
    if lost_elsewhere:  # node 0's scheduler saw rank 1 (another node) time out; our rank 0 got SIGTERM
        (logs / "scheduler.log").write_text("[ERROR] ... UpdateTopoState] The node: 1 is timed out. It may exit\n")
    t0 = time.time()
    code, message = run_supervised(
        [sys.executable, str(script), "0" if lost_elsewhere else "3", "SIGTERM" if lost_elsewhere else "SIGKILL"],
        dict(os.environ),
        logs,
    )
    assert time.time() - t0 < 15, "the hanging stand-in for msrun was not stopped"
    assert code == 1 and "\n" not in message
    if lost_elsewhere:
        assert message.startswith("worker rank 1 (on another node) stopped answering the scheduler")
        assert "this node's worker rank 0 was killed by SIGTERM" in message
    else:
        assert message.startswith("worker rank 3 (pid ") and "was killed by SIGKILL" in message
        assert f"its log: {logs / 'worker_3.log'}" in message
    assert "Worker process" in capsys.readouterr().err  # msrun's own output is passed through
