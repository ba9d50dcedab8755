"""Fail fast when a worker dies: ``launch`` watches msrun and stops the whole job at once.

What really happens on this machine (MindSpore 2.9, msrun on CPU, measured with a 2-worker
data-parallel run and one worker killed by SIGKILL): msrun's own process supervision
(``process_entity/_api.py: join_processes``) polls its local workers every second, logs
``Worker process <pid> exit with exception. Error code: <code>.`` and kills the other local
workers; it then waits for its scheduler process, which only gives up when its heartbeat
timeout for the dead node expires: msrun exited 31.5 s after the kill, with a traceback
and no word of which rank died. Without msrun's supervision the survivors would wait in
the collective until HCCL_EXEC_TIMEOUT (1,800 s in the anchors' recipes).

:func:`run_supervised` builds on msrun's supervision instead of replacing it: it echoes
msrun's output, records which pid is which rank (msrun exports ``RANK_ID`` to each worker
it starts: read from ``/proc/<pid>/environ`` while the workers live), and as soon as msrun
reports a worker exit with an error it kills what is left of the job (scheduler, workers,
msrun) and prints one line naming the rank, how it ended and its log file. Only workers on
this node are watched: on a multi-node job each node's ``launch`` watches its own. Measured with
two "nodes" on this host (two ``launch --nnodes 2`` of one worker each, the node-1 worker
SIGKILLed): node 1's launch exited 1.6 s after the kill, node 0's 31.4 s after (MindSpore's
scheduler times out the lost node's heartbeat and its survivors are stopped with SIGTERM; node
0's line then names the lost rank from ``scheduler.log``). With three such nodes and node 0's worker
SIGKILLed, nodes 1 and 2 exited 35.7-39.1 s after (their all-reduce with rank 0 failed, or MindSpore
SIGTERMed them) and each named its own worker: a worker that dies on its own is now recorded in the shared
run folder (``record_first_failure``), and a node whose worker died of a peer names the recorded rank.

Stop signals: SIGTERM, SIGHUP and SIGINT to ``launch`` (``timeout``, ``kill``, a closed ssh session, a
scheduler's stop) are forwarded to the workers as SIGTERM (they save a checkpoint at the next step and
exit, see train/preempt.py); when they are gone, after ``--stop-grace`` seconds or at a second signal,
every process of the job is SIGKILLed by session: msrun's own and each worker's (msrun starts every
worker with ``os.setsid``), so children a killed worker left to init go too. Measured here (2-worker
CPU job, signal soon after the workers started, tests/msrun/test_launch_signals.py): launch exited 0.6-0.7 s
after each signal with 128 + the signal number and no process of the job left; before, SIGTERM and
SIGHUP left msrun, the scheduler and both workers running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

# msrun's line (mindspore/parallel/cluster/process_entity/_api.py, join_processes)
_WORKER_FAILED = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
# the scheduler's line when a node's heartbeat stops (meta_server_node.cc, UpdateTopoState)
_NODE_TIMED_OUT = re.compile(r"The node: (\d+) is timed out")


def _timed_out_rank(log_dir: Path) -> Optional[int]:
    """The rank the scheduler (on node 0) saw stop answering, if it logged one."""
    try:
        text = (log_dir / "scheduler.log").read_text(errors="replace")
    except OSError:
        return None
    match = _NODE_TIMED_OUT.search(text)
    return int(match.group(1)) if match else None


# A worker that died because a peer did: its collective failed (CPU mccl ring: collective_ops_impl.cc,
# RunRingAllReduce; HCCL's notify-wait / execution timeouts) instead of failing on its own.
_PEER_FAILED = re.compile(r"Ring \w+ wait (?:receiving|sending)[^\n]* failed|HCCL_EXEC_TIMEOUT|EI0002|"
                          r"Notify wait|hcclCommInitRootInfo|The node: \d+ is timed out")
FIRST_FAILURE = "first_failure"  # RUN_DIR/.heartbeat/first_failure: the first worker that died, any node


def _peer_failed(log: Path) -> bool:
    """True when the worker's log shows it failed waiting for another rank."""
    try:
        with open(log, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 1_000_000))  # the end of the log: where the failure is
            return bool(_PEER_FAILED.search(fh.read().decode(errors="replace")))
    except OSError:
        return False


def record_first_failure(folder: Optional[Path], rank: int, how: str, log: Path) -> None:
    """Publish ``rank`` as the job's first dead worker in the run folder every node's launch sees (a shared
    file system); the first node to write wins (a hard link never replaces an existing file)."""
    if folder is None:
        return
    tmp = folder / f".{FIRST_FAILURE}.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"rank": rank, "how": how, "log": str(log), "time": time.time(),
                                   "host": socket.gethostname()}))
        os.link(tmp, folder / FIRST_FAILURE)
    except OSError:  # already written by another node (or no shared folder): nothing to add
        pass
    finally:
        try:
            tmp.unlink()
        except OSError:
            pass


def read_first_failure(folder: Optional[Path], wait_s: float = 0.0) -> Optional[dict]:
    """The first dead worker another node's launch recorded, waiting up to ``wait_s`` for it."""
    if folder is None:
        return None
    deadline = time.time() + wait_s
    while True:
        try:
            rec = json.loads((folder / FIRST_FAILURE).read_text())
            if isinstance(rec, dict) and isinstance(rec.get("rank"), int):
                return rec
        except (OSError, ValueError):
            pass
        if time.time() >= deadline:
            return None
        time.sleep(0.2)


def _children_map() -> Dict[int, List[int]]:
    """ppid -> child pids of every process visible in /proc."""
    out: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1:
            out.setdefault(int(fields[1]), []).append(int(entry))
    return out


def descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (children first found, breadth first)."""
    children, out, todo = _children_map(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _worker_rank(pid: int) -> Optional[int]:
    """RANK_ID of a worker msrun started (MS_ROLE=MS_WORKER), else None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    if env.get(b"MS_ROLE") != b"MS_WORKER" or b"RANK_ID" not in env:
        return None
    try:
        return int(env[b"RANK_ID"])
    except ValueError:
        return None


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stat_fields(pid: int) -> Optional[List[str]]:
    """/proc/<pid>/stat after the command name: [state, ppid, pgrp, session, ...]."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()


def session_members(sessions) -> List[int]:
    """Every live (not zombie) process whose session id is in ``sessions``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields and len(fields) > 3 and fields[0] != "Z" and int(fields[3]) in sessions:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _kill_job(sessions, timeout_s: float = 5.0) -> None:
    """SIGKILL every process of the job's sessions until none is left.

    The job is msrun's session (``launch`` starts msrun with ``start_new_session``, its scheduler stays in it)
    and one session per worker (msrun starts each with ``preexec_fn=os.setsid``: mindspore/parallel/cluster/
    process_entity/_api.py, _ComputeGraphNode.run). A worker's children keep its session id even when a
    SIGKILLed worker leaves them to init, which a walk of parent pids cannot find."""
    deadline = time.time() + timeout_s
    while True:
        members = session_members(sessions)
        if not members or time.time() > deadline:
            return
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _read_beats(folder: Path) -> Dict[int, Tuple[int, int]]:
    """rank -> (steps started, steps finished) from the workers' heartbeat files (train/preempt.py)."""
    out = {}
    try:
        entries = list(folder.iterdir())
    except OSError:
        return out
    for path in entries:
        if path.name.startswith("rank_") and path.name[5:].isdigit():
            try:
                started, finished = (int(v) for v in path.read_text().split())
            except (OSError, ValueError):
                continue
            out[int(path.name[5:])] = (started, finished)
    return out


class Watchdog:
    """No step finished within ``factor`` x the median step time (at least ``min_s``), once a step after the
    first (the compile) has finished: the job is hung."""

    def __init__(self, folder: Optional[Path], factor: float, min_s: float):
        self.folder, self.factor, self.min_s = folder, factor, min_s
        self.top, self.since, self.per_step = None, time.time(), []  # per_step: s per step, each poll

    def limit(self) -> float:
        ordered = sorted(self.per_step)
        return max(self.factor * ordered[len(ordered) // 2], self.min_s)

    def check(self) -> Optional[Tuple[float, Dict[int, Tuple[int, int]]]]:
        """(seconds without progress, heartbeats) when the job is hung, else None."""
        if self.folder is None or self.factor <= 0:
            return None
        beats, now = _read_beats(self.folder), time.time()
        if not beats:
            return None
        top = max(f for _s, f in beats.values())
        if self.top is None or top > self.top:
            if self.top is not None and self.top >= 1:  # not the first step: it includes the compile
                self.per_step.append((now - self.since) / (top - self.top))
            self.top, self.since = top, now
            return None
        if self.per_step and now - self.since > self.limit():
            return now - self.since, beats
        return None


def run_supervised(cmd: List[str], env: Dict[str, str], log_dir: Path, poll_s: float = 0.2,
                   stop_grace_s: float = 30.0, heartbeat_dir: Optional[Path] = None, watchdog_factor: float = 10.0,
                   watchdog_min_s: float = 120.0) -> Tuple[int, Optional[str]]:
    """Run msrun; return (exit code, one-line failure message or None).

    The message names the rank that died first, how it ended, and its msrun log file. SIGTERM, SIGHUP or
    SIGINT to this process are forwarded as SIGTERM to every worker (the trainer saves a checkpoint at the
    next step boundary and exits, see train/preempt.py); once the workers are gone, or ``stop_grace_s``
    after the signal, or at a second signal, every process of the job is killed and the exit code is
    128 + the signal's number."""
    failed: List[Tuple[int, int, float]] = []  # (pid, exit code, when msrun reported it)
    stops: List[Tuple[int, float]] = []  # (signal number, when) of the stop signals received
    previous = {}
    if threading.current_thread() is threading.main_thread():  # before msrun starts: no window without them
        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, lambda signum, _frame: stops.append((signum, time.time())))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    def pump(src, dst):
        for raw in iter(src.readline, b""):
            line = raw.decode(errors="replace")
            match = _WORKER_FAILED.search(line)
            if match and not failed:
                failed.append((int(match.group(1)), int(match.group(2)), time.time()))
            try:
                dst.write(line)
                dst.flush()
            except (OSError, ValueError):  # our own output closed: keep draining msrun's pipe
                pass
        src.close()

    pumps = [threading.Thread(target=pump, args=(proc.stdout, sys.stdout), daemon=True),
             threading.Thread(target=pump, args=(proc.stderr, sys.stderr), daemon=True)]
    for t in pumps:
        t.start()
    ranks: Dict[int, int] = {}  # worker pid -> rank
    sessions = {proc.pid}
    forwarded, workers_exited = False, False
    watchdog, hung = Watchdog(heartbeat_dir, watchdog_factor, watchdog_min_s), None
    try:
        while proc.poll() is None:
            for pid in descendants(proc.pid):
                fields = _stat_fields(pid)
                if fields and len(fields) > 3:
                    sessions.add(int(fields[3]))
                if pid not in ranks:
                    rank = _worker_rank(pid)
                    if rank is not None:
                        ranks[pid] = rank
            if stops:
                if not forwarded:
                    for pid in ranks:
                        try:
                            os.kill(pid, signal.SIGTERM)
                        except OSError:
                            pass
                    forwarded = True
                workers_exited = not any(_alive(pid) for pid in ranks)
                if len(stops) > 1 or workers_exited or time.time() - stops[0][1] > stop_grace_s:
                    break
            elif failed:
                break
            else:
                hung = watchdog.check()
                if hung is not None:
                    for pid in ranks:  # faulthandler.register(SIGUSR1) in every worker: stacks into its log
                        try:
                            os.kill(pid, signal.SIGUSR1)
                        except OSError:
                            pass
                    time.sleep(2.0)
                    break
            time.sleep(poll_s)
        if (failed or stops or hung) and proc.poll() is None:
            _kill_job(sessions)  # the scheduler would otherwise wait out its heartbeat timeout
    except BaseException:  # our own death: never leave workers behind
        _kill_job(sessions)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        code = proc.wait()
        _kill_job(sessions)  # whatever of the job outlived msrun (workers' children)
        for t in pumps:
            t.join(timeout=5)
    if stops:
        signum, when = stops[0]
        name = signal.Signals(signum).name
        saved = "the workers had exited" if workers_exited or not ranks else "the workers were killed"
        how = (f"forwarded SIGTERM to the {len(ranks)} worker(s) (each saves a checkpoint at its next step "
               f"boundary); " if ranks else "")
        return 128 + signum, (f"received {name}: {how}every process of the job stopped "
                              f"{time.time() - when:.1f} s after the signal (grace {stop_grace_s:g} s; {saved})")
    if hung is not None:
        stalled, beats = hung
        reached = max(st for st, _f in beats.values())
        behind = sorted(r for r in set(ranks.values()) | set(beats) if beats.get(r, (-1, -1))[0] < reached)
        who = (f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} did not reach step {reached}"
               if behind else f"every rank is inside step {reached}")
        return 1, (f"watchdog: no step finished for {stalled:.0f} s (limit {watchdog.limit():.0f} s: "
                   f"{watchdog_factor:g} x the median step time, at least {watchdog_min_s:g} s); {who}; "
                   f"every worker's Python stacks are in {log_dir}/worker_N.log; stopped the job")
    if not failed:
        return code, None
    pid, worker_code, when = failed[0]
    rank = ranks.get(pid)
    log = log_dir / f"worker_{rank}.log" if rank is not None else log_dir
    # Our worker died first, or because a peer did: a SIGTERM we did not send (MindSpore stops the survivors
    # when the scheduler loses a node) or a collective that failed waiting for another rank.
    consequence = worker_code == -signal.SIGTERM or (rank is not None and _peer_failed(log))
    if not consequence and rank is not None:
        record_first_failure(heartbeat_dir, rank, _how(worker_code), log)
    first = read_first_failure(heartbeat_dir, wait_s=5.0) if consequence else None
    if first is not None and first["rank"] != rank:
        return 1, (f"worker rank {first['rank']} (on {first.get('host', 'another node')}) died first: it "
                   f"{first.get('how', 'failed')}; its log: {first.get('log')}; this node's worker rank {rank} "
                   f"then {_how(worker_code)} and every other worker of this node was stopped")
    lost = _timed_out_rank(log_dir)
    if lost is not None and lost not in ranks.values():
        # multi-node: a worker of another node died; MindSpore then stops the survivors here (SIGTERM,
        # ~30 s after, when the scheduler's heartbeat for the lost node times out)
        return 1, (f"worker rank {lost} (on another node) stopped answering the scheduler; its log is in that "
                   f"node's msrun log folder (worker_{lost}.log); this node's worker rank {rank} "
                   f"{_how(worker_code)} and every other worker of this node was stopped")
    who = f"worker rank {rank} (pid {pid})" if rank is not None else f"worker pid {pid}"
    beats = _read_beats(heartbeat_dir) if consequence and heartbeat_dir is not None and rank is not None else {}
    reached = beats.get(rank, (-1, -1))[0]
    behind = sorted(r for r, (started, _done) in beats.items() if r != rank and started < reached)
    if behind:  # a peer of this job stopped making progress (hung) and the collective gave up first
        ranks_ = ", ".join(map(str, behind))
        return 1, (f"{who} {_how(worker_code)} in a collective waiting for rank{'s' if len(behind) > 1 else ''} "
                   f"{ranks_}, which did not reach step {reached} (hung: see {log_dir}/worker_N.log); "
                   f"stopped the job")
    if consequence:
        return 1, (f"a worker on another node died first (no node recorded which: the run folder is not shared "
                   f"and this node has no scheduler log naming it; see node 0's launch output); this node's "
                   f"{who} then {_how(worker_code)} waiting for it; its log: {log}")
    return 1, (f"{who} {_how(worker_code)}; its log: {log}; stopped every other worker of this node "
               f"{time.time() - when:.1f} s after msrun reported it")
