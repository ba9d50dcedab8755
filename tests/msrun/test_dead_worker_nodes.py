"""Three 1-worker "nodes" on this host (three `launch --nnodes 3`, one shared run folder as on a cluster with a
shared file system, a log folder per node): node 0's worker is SIGKILLed. Every node must exit non-zero with a
last line naming rank 0, the first rank that died, not its own worker (which a failed collective with rank 0 would
stop later). What is checked is what each node says, not how fast a loaded machine gets there: nodes 1 and 2 stop
their workers as soon as node 0's launch records the death in the shared folder, without waiting for their
collective to fail."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_dead_worker import _rank_pid, _steps

from builders import free_port, small_recipe, write_recipe
from repo_paths import REPO


@pytest.mark.msrun
def test_every_node_names_the_first_dead_rank(tmp_path):
    spec = small_recipe(dp=3)
    spec["train"].update(steps=2000, micro_batch_size=3)  # far more than it runs; 3 x 32 tokens split into 3
    recipe = write_recipe(tmp_path, spec)
    run_dir, port = tmp_path / "run", free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ms_deepseek.cli",
                "launch",
                str(recipe),
                "--output",
                str(run_dir),
                "--nnodes",
                "3",
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--cluster-time-out",
                "120",
                "--log-dir",
                str(tmp_path / f"logs{node}"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for node in range(3)
    ]
    results = {}
    try:
        deadline = time.time() + 300
        while max(_steps(run_dir), default=0) < 2 and time.time() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.2)
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        os.kill(_rank_pid(0, run_dir), signal.SIGKILL)
        killed_at = time.time()

        def wait(node):  # a hang guard, not a bound: a node that never exits fails the test
            _, err = procs[node].communicate(timeout=600)
            results[node] = (time.time() - killed_at, procs[node].returncode, err.strip().splitlines()[-1])

        threads = [threading.Thread(target=wait, args=(node,)) for node in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for p in procs:
            p.kill()
    for node, (after, code, last) in sorted(results.items()):
        print(f"node {node}: exited {code} {after:.1f} s after the kill: {last}")
    for node, (after, code, last) in results.items():
        assert code != 0, (node, after, code)
        assert last.startswith("ms-deepseek launch: worker rank 0 "), (node, last)
        assert "was killed by SIGKILL" in last, (node, last)
    assert "died first" in results[1][2] and "died first" in results[2][2]


@pytest.mark.parametrize("shared", ["before", "after", "stale", "none"])
def test_a_survivor_names_the_rank_another_node_recorded(tmp_path, shared, monkeypatch):
    """Fast, with a stand-in for msrun. ``before``: another node's launch recorded rank 4 as dead first while our
    worker still runs: our workers are stopped at once, naming rank 4 (the first writer wins over a later rank 6).
    ``after``: our worker was SIGTERMed (MindSpore stopping the survivors) before the record appeared (written
    when this launch starts waiting for it): rank 4 is named too. ``stale``: a record older than this job (a previous job in the same run folder) is not named; nor,
    without a shared run folder (``none``), is our own worker blamed: the line says the first dead worker is on
    another node."""
    from test_dead_worker import FAKE_MSRUN

    from ms_deepseek.jobs import supervise
    from ms_deepseek.jobs.supervise import record_first_failure, run_supervised

    script, logs, beats = tmp_path / "fake_msrun.py", tmp_path / "logs", tmp_path / "run" / ".heartbeat"
    script.write_text(FAKE_MSRUN)
    logs.mkdir()
    job_start = time.time()
    if shared in ("before", "stale"):
        record_first_failure(beats, 4, "was killed by SIGKILL", tmp_path / "elsewhere" / "worker_4.log")
        record_first_failure(beats, 6, "exited with code 1", tmp_path / "late.log")  # the first writer wins
    if shared == "stale":
        time.sleep(0.05)
        job_start = time.time()
    if shared == "after":
        read = supervise.read_first_failure

        def recorded_late(folder, wait_s=0.0, since=0.0):
            if wait_s:  # our worker is dead: the other node's launch records its own now
                record_first_failure(beats, 4, "was killed by SIGKILL", tmp_path / "elsewhere" / "worker_4.log")
            return read(folder, wait_s, since)

        monkeypatch.setattr(supervise, "read_first_failure", recorded_late)
    code, message = run_supervised(
        [sys.executable, str(script), "2", "SIGTERM"], dict(os.environ), logs, heartbeat_dir=beats, job_start=job_start
    )
    assert code == 1 and "\n" not in message
    if shared in ("before", "after"):
        assert message.startswith("worker rank 4 (on ") and "died first: it was killed by SIGKILL" in message
    if shared == "before":
        assert "stopped it when that node's launch recorded it" in message, message
    elif shared == "after":
        assert "this node's worker rank 2 then was killed by SIGTERM" in message
    else:
        assert message.startswith("a worker on another node died first") and "worker rank 2" in message
