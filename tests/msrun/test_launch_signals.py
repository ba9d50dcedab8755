"""`launch` stops the whole job on SIGTERM, SIGHUP and SIGINT: a timeout, `kill PID`, a closed ssh session or a
scheduler's stop ends msrun and every worker, not only the launcher. A 2-worker CPU msrun job gets each signal soon
after its workers start; within seconds no process of the job may remain and the exit code is 128 + the signal. (The
preemption save on SIGTERM mid-run is tested in tests/unit/train/test_train_preempt.py.)"""

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
from repo_paths import REPO as ROOT


def job_processes(run_dir: Path):
    """pids of every live process of a job training into run_dir (msrun, scheduler, workers, their children)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(run_dir).encode() in cmd and b"ms_deepseek.cli\0launch" not in cmd and state != "Z":
            out.append(int(entry))
    return out


def workers_of(run_dir: Path):
    """The workers msrun started (each leads its own session; their children inherit MS_ROLE too)."""
    out = []
    for pid in job_processes(run_dir):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            session = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
        except (OSError, ValueError, IndexError):
            continue
        if b"MS_ROLE=MS_WORKER" in env and session == pid:
            out.append(pid)
    return out


def start_launch(tmp_path, steps=2000, *extra):
    from ms_deepseek.data.prepare import prepare_embedded_default

    data = tmp_path / "corpus"
    if not data.exists():
        prepare_embedded_default(data, seq_len=32, vocab_size=512, max_bytes=60_000, progress=False)
    spec = recipe_data(data, dp=2)
    spec["train"]["steps"] = steps
    recipe = write(tmp_path, spec)
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
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
    return proc, run_dir


def assert_job_gone(proc, run_dir, signum, sent_at):
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    took = time.time() - sent_at
    left = job_processes(run_dir)
    for pid in left:  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    print(f"{signal.Signals(signum).name}: launch exited {proc.returncode} {took:.1f} s after the signal")
    assert not left, f"processes of the job outlived launch: {left}"
    assert proc.returncode == 128 + signum, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"ms-deepseek launch: received {signal.Signals(signum).name}: "), last
    return took


@pytest.mark.msrun
@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_launch_stops_every_process_of_the_job(tmp_path, signum):
    proc, run_dir = start_launch(tmp_path, 2000, "--stop-grace", "5")
    deadline = time.time() + 120
    while len(workers_of(run_dir)) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    if proc.poll() is not None or len(workers_of(run_dir)) != 2:
        proc.kill()
        pytest.fail(f"the job did not start its 2 workers: {proc.communicate(timeout=30)}")
    time.sleep(1.0)  # the supervisor has seen both workers (it polls every 0.2 s)
    sent = time.time()
    os.kill(proc.pid, signum)
    assert_job_gone(proc, run_dir, signum, sent)


def _logged_steps(run_dir: Path):
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line)["step"])
        except ValueError:
            pass
    return out


@pytest.mark.msrun
def test_sigterm_mid_run_saves_on_every_rank_then_stops_the_job(tmp_path):
    """A scheduler's SIGTERM to launch: both workers save the same next step (the request rides on the
    per-step AllReduce), exit 143, and nothing of the job remains (defects 1 and 6)."""
    from ms_deepseek.checkpoint.training import CheckpointManager, read_state

    proc, run_dir = start_launch(tmp_path, 2000)
    deadline = time.time() + 300
    while max(_logged_steps(run_dir), default=0) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    if proc.poll() is not None or not _logged_steps(run_dir):
        proc.kill()
        pytest.fail(f"the job did not train: {proc.communicate(timeout=30)}")
    sent = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    took = assert_job_gone(proc, run_dir, signal.SIGTERM, sent)
    done = CheckpointManager(run_dir / "checkpoints").complete()
    assert len(done) == 1, done  # periodic saves are off: this is the preemption's
    step, folder = done[0]
    state = read_state(folder)
    assert step >= max(_logged_steps(run_dir)) and len(set(state["replica_sha1"])) == 1
    assert len(state["replica_sha1"]) == 2  # both ranks took part in the save
    log0 = (run_dir / "msrun_logs" / "worker_0.log").read_text()
    assert f"stopped by SIGTERM after step {step}: saved checkpoint" in log0
    print(f"preempted 2-worker job: checkpoint at step {step}, job gone {took:.1f} s after SIGTERM")
