"""launch's supervisor (jobs/supervise.py) without msrun: the two races a hung-worker watchdog must not lose.

1. On a busy machine the watchdog's first look can already find several CPU steps finished, so it cannot learn
   the step time from what it sees between two of its own looks, and without it it never fires before the CPU
   ring collective gives up: the workers report their median step time in the heartbeat.
2. When the collective gives up first, msrun SIGKILLs the hung worker within a second of the failed one's
   exit, before anything dumps its stacks: a failed step tells launch (rank_N.failed) and waits for its
   answer, so the stacks of the ranks behind are in their logs before the failed worker exits.
"""

import os
import sys
import time

from repo_paths import REPO


def test_the_watchdog_knows_the_step_time_from_the_first_look(tmp_path):
    from ms_deepseek.jobs.supervise import Watchdog

    beats = tmp_path / ".heartbeat"
    beats.mkdir()
    (beats / "rank_0").write_text("4 3 0.050000\n")  # rank 0 waits in step 4
    (beats / "rank_1").write_text("3 2 0.060000\n")  # rank 1 never finished step 3
    dog = Watchdog(beats, factor=2, min_s=0.3)
    assert dog.check() is None  # the first look: the top step is only being noted
    time.sleep(0.4)  # longer than the limit, with no progress in between
    hung = dog.check()
    assert hung is not None and hung[0] >= 0.3 and hung[1] == {0: (4, 3), 1: (3, 2)}
    assert dog.step_time() == 0.06 and dog.limit() == 0.3  # the slowest rank's median, under min_s here


FAKE_MSRUN = r'''
import os, signal, subprocess, sys, time
# a stand-in for msrun: two workers, each logging into LOGS/worker_N.log; polls them, and when one fails
# prints msrun's line and SIGKILLs the other at once (msrun's join_processes polls every second; this is harsher)
logs, run = sys.argv[1], sys.argv[2]
worker = {
    "0": """
import sys, time
from pathlib import Path
from ms_deepseek.jobs.preempt import Heartbeat
hb = Heartbeat(sys.argv[1], 0)
hb.beat(4, 3)
while not (Path(sys.argv[1]) / ".heartbeat" / "rank_1").exists():
    time.sleep(0.05)
time.sleep(0.3)  # rank 1 is in its sleep
print("[ERROR] DISTRIBUTED(1,2,python):x [collective_ops_impl.cc:152] RunRingAllReduce] Ring ReduceScatter "
      "wait receiving [1,193] failed.", flush=True)
hb.failed(4)
sys.exit(1)
""",
    "1": """
import sys, time
from ms_deepseek.jobs.preempt import Heartbeat
hb = Heartbeat(sys.argv[1], 1)
def stuck_in_save():
    time.sleep(600)
hb.beat(3, 2)
stuck_in_save()
"""}
procs = []
for rank in ("0", "1"):
    log = open(os.path.join(logs, f"worker_{rank}.log"), "w")
    procs.append(subprocess.Popen([sys.executable, "-c", worker[rank], run], stdout=log, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, MS_ROLE="MS_WORKER", RANK_ID=rank), start_new_session=True))
while True:
    for p in procs:
        if p.poll() not in (None, 0):
            print(f"[ERROR] ME(1:2,MainProcess):x [_api.py:364] Worker process {p.pid} exit with exception. "
                  f"Error code: {p.returncode}.", file=sys.stderr, flush=True)
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            time.sleep(600)  # msrun waiting for its scheduler
    time.sleep(0.1)
'''


def test_a_failed_collective_waits_for_the_stacks_of_the_rank_behind(tmp_path):
    from ms_deepseek.jobs.supervise import run_supervised

    script, logs, run = tmp_path / "fake_msrun.py", tmp_path / "logs", tmp_path / "run"
    script.write_text(FAKE_MSRUN)
    logs.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    code, message = run_supervised(
        [sys.executable, str(script), str(logs), str(run)],
        env,
        logs,
        heartbeat_dir=run / ".heartbeat",
        watchdog_factor=0,
    )
    assert code == 1 and "\n" not in message, message
    assert (
        message.startswith("worker rank 0 (pid ")
        and "exited with code 1 in a collective waiting for rank 1, which did not reach step 4" in message
    ), message
    assert f"Python stacks of rank 1 in {logs}/worker_N.log" in message, message
    stacks = (logs / "worker_1.log").read_text()
    assert "(most recent call first)" in stacks and "stuck_in_save" in stacks, stacks


def test_a_launch_clears_only_its_own_nodes_heartbeats(tmp_path):
    """A shared run folder: node 1's launch starts while node 0's job runs. It clears its own ranks' entries and
    a previous job's first failure, never node 0's progress."""
    import json

    from ms_deepseek.jobs.supervise import FIRST_FAILURE, clear_node_entries

    beats = tmp_path / ".heartbeat"
    beats.mkdir()
    # a ".rank_N.partial-<id>" is the temporary sibling of a heartbeat write (core/atomic.py) a killed worker left
    for name in (
        "rank_0",
        "rank_1",
        "rank_2",
        "rank_3",
        "rank_2.failed",
        "rank_3.ack",
        ".rank_0.partial-1a2b3c4d",
        ".rank_3.partial-1a2b3c4d",
    ):
        (beats / name).write_text("7 7\n")
    (beats / FIRST_FAILURE).write_text(json.dumps({"rank": 5, "time": time.time() - 3600}))
    clear_node_entries(beats, range(2, 4), job_start=time.time())
    assert sorted(p.name for p in beats.iterdir()) == [".rank_0.partial-1a2b3c4d", "rank_0", "rank_1"]
    (beats / FIRST_FAILURE).write_text(json.dumps({"rank": 0, "time": time.time()}))  # this job's: kept
    clear_node_entries(beats, range(2, 4), job_start=time.time() - 60)
    assert (beats / FIRST_FAILURE).is_file()


def test_a_heartbeat_is_replaced_whole_and_leaves_no_temporary_file(tmp_path):
    from ms_deepseek.jobs.preempt import Heartbeat
    from ms_deepseek.jobs.supervise import _read_beats

    hb = Heartbeat(tmp_path, 1)
    hb.beat(1, 0)
    hb.beat(2, 1, step_s=0.25)
    beats = tmp_path / ".heartbeat"
    assert sorted(p.name for p in beats.iterdir()) == ["rank_1"]
    step_s = {}
    assert _read_beats(beats, step_s) == {1: (2, 1)} and step_s == {1: 0.25}
